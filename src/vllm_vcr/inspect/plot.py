"""`inspect plot`: PNG figures of one or several traces (matplotlib, Agg backend, imported lazily).

* `ttft_cdf.png` / `itl_cdf.png`: CDFs of TTFT and per-token ITL, traces overlaid (log x axis).
* `latency_vs_concurrency.png`: TTFT and ITL p50/p99 per concurrency range, one line per trace.
* `timeline.png` (`timeline-<label>.png` with several traces): one bar per request (prefill then
  decode) packed into lanes, with the number of requests in flight underneath.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..trace.io import Trace
from .perfetto import _assign_lanes
from ..trace.schema import replay_subset
from ..trace.stats import (
    CONCURRENCY_BUCKETS,
    Samples,
    add_itl_samples,
    bucket_label,
    concurrency_bucket,
)

KINDS = ("cdf", "concurrency", "timeline")
_MAX_TIMELINE_REQUESTS = 5000  # beyond this the bars are sub-pixel; keep the first ones


def _pyplot() -> Any:
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise SystemExit("plotting needs matplotlib: pip install 'vllm-vcr[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain_log_ticks(axis: Any) -> None:
    """Log axes labelled 20, 50, 100 rather than 2x10^1."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def _cdf_plot(plt: Any, traces: Sequence[tuple[str, Trace]], metric: str, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for label, trace in traces:
        s = Samples()
        for r in trace.records:
            if metric == "ttft":
                s.add(r.ttft_ms)
            else:
                add_itl_samples(s, r)
        if not len(s):
            continue
        x, y = s.cdf()
        ax.step(x, y, where="post", label=f"{label} (p50 {s.quantile(50):.1f}, "
                f"p99 {s.quantile(99):.1f} ms)", linewidth=1.6)
    name = "TTFT" if metric == "ttft" else "ITL per token"
    ax.set_xscale("log")
    _plain_log_ticks(ax.xaxis)
    ax.set_xlabel(f"{name} (ms, log scale)")
    ax.set_ylabel("fraction of samples")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{name} CDF")
    ax.grid(True, which="both", alpha=0.3)
    for q in (0.5, 0.9, 0.99):
        ax.axhline(q, color="grey", linewidth=0.6, linestyle=":")
    ax.legend(loc="lower right", fontsize=9)
    fig.tight_layout()
    path = out / f"{metric}_cdf.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def _concurrency_plot(plt: Any, traces: Sequence[tuple[str, Trace]], out: Path) -> Path:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5), dpi=110)
    labels = [bucket_label(i) for i in range(len(CONCURRENCY_BUCKETS))]
    for ti, (label, trace) in enumerate(traces):
        ttft: dict[int, Samples] = {}
        itl: dict[int, Samples] = {}
        for r in trace.records:
            b = concurrency_bucket(r.concurrency)
            ttft.setdefault(b, Samples()).add(r.ttft_ms)
            add_itl_samples(itl.setdefault(b, Samples()), r)
        color = f"C{ti % 10}"
        for ax, groups in ((ax1, ttft), (ax2, itl)):
            xs = sorted(b for b, s in groups.items() if len(s))
            if not xs:
                continue
            for p, style in ((50, "-o"), (99, "--^")):
                ax.plot(xs, [groups[b].quantile(p) for b in xs], style, color=color,
                        label=f"{label} p{p}", linewidth=1.5, markersize=5)
    for ax, name in ((ax1, "TTFT"), (ax2, "ITL per token")):
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel("concurrency at arrival")
        ax.set_ylabel(f"{name} (ms, log scale)")
        ax.set_yscale("log")
        _plain_log_ticks(ax.yaxis)
        ax.set_title(f"{name} vs concurrency")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "latency_vs_concurrency.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def _timeline_plot(plt: Any, label: str, trace: Trace, path: Path) -> Path | None:
    recs = replay_subset(trace.records)[:_MAX_TIMELINE_REQUESTS]
    if not recs:
        return None
    start = np.array([r.arrival_ms for r in recs], float) / 1e3
    first = start + np.array([r.ttft_ms for r in recs], float) / 1e3
    end = start + np.array([r.latency_ms() for r in recs], float) / 1e3
    lanes = np.array(_assign_lanes(list(zip(start, end))), float)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(12, 6.5), dpi=110, sharex=True,
                                  gridspec_kw={"height_ratios": [3, 1]})
    lw = max(0.5, min(6.0, 250.0 / max(lanes.max() + 1, 1)))
    ax.hlines(lanes, start, first, colors="#e4572e", linewidth=lw, label="waiting + prefill (TTFT)")
    ax.hlines(lanes, first, end, colors="#2e86ab", linewidth=lw, label="decode")
    ax.set_ylabel("lane")
    ax.set_title(f"request timeline: {label} ({len(recs)} requests)", loc="left")
    # above the axes, so it never hides the top lane
    ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=2, fontsize=8, frameon=False)
    ax.grid(True, axis="x", alpha=0.3)
    ts = np.concatenate([start, end])
    d = np.concatenate([np.ones_like(start), -np.ones_like(end)])
    order = np.lexsort((d, ts))
    ax2.step(ts[order], np.cumsum(d[order]), where="post", color="#444", linewidth=1.0)
    ax2.set_ylabel("in flight")
    ax2.yaxis.get_major_locator().set_params(integer=True)
    ax2.set_xlabel("time since first arrival (s)")
    ax2.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_traces(traces: Sequence[tuple[str, Trace]], out_dir: str | Path,
                kinds: Sequence[str] = KINDS) -> list[Path]:
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    if "cdf" in kinds:
        paths.append(_cdf_plot(plt, traces, "ttft", out))
        if any(r.itl_ms is not None or r.itl_summary is not None
               for _, t in traces for r in t.records):
            paths.append(_cdf_plot(plt, traces, "itl", out))
    if "concurrency" in kinds:
        paths.append(_concurrency_plot(plt, traces, out))
    if "timeline" in kinds:
        for label, trace in traces:
            name = "timeline.png" if len(traces) == 1 else f"timeline-{_slug(label)}.png"
            p = _timeline_plot(plt, label, trace, out / name)
            if p is not None:
                paths.append(p)
    return paths


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in s)
