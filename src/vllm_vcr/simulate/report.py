"""What a simulation measured: latency quantiles, throughput, queue/KV over time; JSON + PNGs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from .driver import Simulation

QUANTILES = (50, 90, 95, 99)
_TIMELINE_POINTS = 400


def _summary(values: np.ndarray) -> dict[str, float] | None:
    values = values[np.isfinite(values)]
    if not len(values):
        return None
    out = {"mean": float(values.mean())}
    for q, v in zip(QUANTILES, np.percentile(values, QUANTILES)):
        out[f"p{q}"] = float(v)
    return out


def request_metrics(sim: Simulation) -> dict[str, np.ndarray]:
    """Per-request arrays in milliseconds: ttft, tpot, e2e (and itl: every gap)."""
    done = sim.done
    arrival = np.array([r.arrival for r in done])
    first = np.array([r.first for r in done])
    end = np.array([r.end for r in done])
    n_out = np.array([r.num_out for r in done])
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(n_out > 1, (end - first) / np.maximum(n_out - 1, 1), np.nan) * 1e3
    itl = np.concatenate([r.gaps() for r in done]) * 1e3 if done else np.array([])
    out = {"ttft": (first - arrival) * 1e3, "tpot": tpot, "e2e": (end - arrival) * 1e3, "itl": itl}
    prefilled = getattr(sim, "prefill_done", None)
    if prefilled is not None:  # a disaggregated run: TTFT's two sides
        answered = np.array([prefilled.get(r.request_id, np.nan) for r in done])
        out["prefill"] = (answered - arrival) * 1e3  # queue and prefill on a prefill worker
        out["handoff"] = (first - answered) * 1e3  # queue, KV pull and first step on a decode worker
    return out


def build_report(sim: Simulation, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    done = sim.done
    m = request_metrics(sim)
    start = min((r.arrival for r in done), default=0.0)
    stop = max((r.end for r in done), default=0.0)
    makespan = max(stop - start, 0.0)
    out_tokens = sum(r.num_out for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    cached = sum(r.cached for r in done)
    tl = sim.timeline
    report = {
        "meta": meta or {},
        "requests": len(done),
        "finish_reasons": _count(r.finish for r in done),
        "latency_ms": {k: _summary(v) for k, v in m.items()},
        "throughput": _throughput(makespan, len(done), out_tokens, in_tokens),
        "prefix_cache_hit_rate": cached / in_tokens if in_tokens else 0.0,
        "preemptions": {"total": int(sum(tl.preemptions)), "per_engine": list(tl.preemptions)},
        "engines": _engine_summary(sim),
        "timeline": _timeline(sim),
        "wall_s": sim.wall_s,
        "simulated_requests_per_wall_s": len(done) / sim.wall_s if sim.wall_s > 0 else None,
    }
    return report


def _throughput(makespan: float, requests: int, out_tokens: int, in_tokens: int) -> dict[str, Any]:
    """Rates over the makespan; None when no simulated time passed (every step took 0 s: the latency
    knobs at zero), where a rate has no meaning."""
    if makespan <= 0.0:
        return {"duration_s": 0.0, "requests_per_s": None, "output_tokens_per_s": None,
                "input_tokens_per_s": None}
    return {"duration_s": makespan, "requests_per_s": requests / makespan,
            "output_tokens_per_s": out_tokens / makespan, "input_tokens_per_s": in_tokens / makespan}


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def _engine_summary(sim: Simulation) -> list[dict[str, Any]]:
    tl = sim.timeline
    eng = np.frombuffer(tl.engine, dtype=np.int32) if len(tl.engine) else np.array([], dtype=np.int32)
    rows = []
    served = getattr(sim, "served", None)  # (a disaggregated run: requests per engine, prefill ones too)
    for i, core in enumerate(sim.cores):
        sel = eng == i
        kv = np.frombuffer(tl.kv_usage, dtype=np.float64)[sel] if sel.any() else np.array([0.0])
        wait = np.frombuffer(tl.waiting, dtype=np.int32)[sel] if sel.any() else np.array([0])
        rows.append({"engine": i, "worker_type": core.args.worker_type,
                     "requests": served[i] if served is not None else sum(1 for r in sim.done if r.engine == i),
                     "kv_cache_blocks": core.args.kv_cache_size, "max_kv_usage": float(kv.max()),
                     "max_waiting": int(wait.max()), "preemptions": tl.preemptions[i],
                     "steps": tl.steps[i]})
    return rows


def _timeline(sim: Simulation) -> dict[str, list[float]]:
    """Running/waiting summed over engines and mean KV usage, on an even grid."""
    tl = sim.timeline
    if not len(tl.t):
        return {"t_s": [], "running": [], "waiting": [], "kv_usage": []}
    t = np.frombuffer(tl.t, dtype=np.float64)
    eng = np.frombuffer(tl.engine, dtype=np.int32)
    n = len(sim.cores)
    grid = np.linspace(0.0, float(t.max()), _TIMELINE_POINTS)
    series = {"running": np.zeros_like(grid), "waiting": np.zeros_like(grid), "kv_usage": np.zeros_like(grid)}
    for i in range(n):
        sel = eng == i
        if not sel.any():
            continue
        ti = t[sel]
        pos = np.clip(np.searchsorted(ti, grid, side="right") - 1, 0, len(ti) - 1)
        for name, arr, dtype in (("running", tl.running, np.int32), ("waiting", tl.waiting, np.int32),
                                 ("kv_usage", tl.kv_usage, np.float64)):
            series[name] += np.frombuffer(arr, dtype=dtype)[sel][pos]
    series["kv_usage"] /= n
    return {"t_s": grid.round(4).tolist(), **{k: v.round(4).tolist() for k, v in series.items()}}


def write_json(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=1, default=_json_default))


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    raise TypeError(type(o))


def write_figures(sim: Simulation, report: dict[str, Any], out_dir: Path) -> list[Path]:
    """latency.png (CDFs of TTFT, TPOT, ITL, E2E) and timeline.png (queue, running, KV usage)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    m = request_metrics(sim)
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, key in zip(axes, ("ttft", "tpot", "itl", "e2e")):
        v = np.sort(m[key][np.isfinite(m[key])])
        if len(v):
            ax.plot(v, np.arange(1, len(v) + 1) / len(v))
        ax.set_xlabel(f"{key.upper()} (ms)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    fig.suptitle(report["meta"].get("title", "vllm-vcr simulate"))
    fig.tight_layout()
    lat = out_dir / "latency.png"
    fig.savefig(lat, dpi=110)
    plt.close(fig)
    tl = report["timeline"]
    fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    for ax, key, label in zip(axes, ("running", "waiting", "kv_usage"),
                              ("running requests", "waiting requests", "KV cache usage (mean)")):
        ax.plot(tl["t_s"], tl[key])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("simulated time (s)")
    fig.tight_layout()
    tpath = out_dir / "timeline.png"
    fig.savefig(tpath, dpi=110)
    plt.close(fig)
    return [lat, tpath]
