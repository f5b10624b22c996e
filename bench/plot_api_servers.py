"""Draw how `serve`'s figures grow with N (`--api-server-count`) from `run_bench.py` results.

The servers `vllm-vcr` (N = 1) and `vllm-vcr-api2` (N = 2) of one `run_bench.py` run, beside the
floors of the same run: server CPU per request (`requests`), server CPU per SSE event and the
one-token ITL p99 at W2's C = 1000, W1's output tokens per second.

  python bench/run_bench.py --servers vllm-vcr,vllm-vcr-api2,uvicorn-floor,null --workloads requests,w1,w2 \\
      --w2-concurrency 1000 --w2-rounds 3 --quiet-threshold 30 --out-dir OUT
  python bench/plot_api_servers.py OUT/results.json [--distinct OUT2/results.json] --out docs/api-servers-growth.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

N_OF = {"vllm-vcr": 1, "vllm-vcr-api2": 2}
FLOORS = ("uvicorn-floor", "null")


def rows(results: dict, workload: str) -> dict[str, dict]:
    return {r["label"]: r for r in results.get(workload) or []}


def per_request_us(r: dict) -> float:
    return r["server_cpu_s"] / max(1, r["ok"]) * 1e6


def figures(results: dict, distinct: dict | None) -> list[tuple[str, dict[str, float]]]:
    """[(panel title, {server label: value})], each panel's servers in N_OF then FLOORS order."""
    req, w1 = rows(results, "requests"), rows(results, "w1")
    w2 = {r["label"]: r for r in results.get("w2") or [] if r["concurrency"] == 1000}
    panels = [
        ("requests: server CPU µs per request", {k: per_request_us(r) for k, r in req.items()}),
        ("W2 C = 1000: server CPU µs per SSE event", {k: r["server_cpu_us_per_event"] for k, r in w2.items()}),
        ("W2 C = 1000: one-token ITL p99 (ms)", {k: r["itl_1tok_ms"]["p99"] for k, r in w2.items()}),
        ("W1: output tokens per second (thousands)", {k: r["output_tok_per_s"] / 1e3 for k, r in w1.items()}),
    ]
    if distinct:
        panels.insert(1, ("requests, every body new: CPU µs per request",
                          {k: per_request_us(r) for k, r in rows(distinct, "requests").items()}))
    order = [*N_OF, *FLOORS]
    return [(t, {k: v[k] for k in order if k in v}) for t, v in panels if any(k in v for k in N_OF)]


def plot(panels: list[tuple[str, dict[str, float]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.6))
    for ax, (title, values) in zip(axes, panels):
        labels = [f"N = {N_OF[k]}" if k in N_OF else k for k in values]
        colors = ["tab:blue" if k in N_OF else "tab:gray" for k in values]
        bars = ax.bar(labels, list(values.values()), color=colors)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=8, rotation=20)
    fig.suptitle("vllm-vcr serve --api-server-count N on 2 cores (one sitting; grey: the floors)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="run_bench.py's results.json")
    ap.add_argument("--distinct", type=Path, help="a second results.json: `requests` with every body new")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    a = ap.parse_args()
    panels = figures(json.loads(a.results.read_text()),
                     json.loads(a.distinct.read_text()) if a.distinct else None)
    if not panels:
        ap.error(f"{a.results}: no vllm-vcr or vllm-vcr-api2 rows")
    plot(panels, a.out)
    for title, values in panels:
        print(title + ": " + ", ".join(f"{k} {v:.1f}" for k, v in values.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
