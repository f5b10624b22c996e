"""One simulation end to end: engines, router, progress bar, report files (also the Python API)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..engine.config import LATENCY_FIELDS, EngineArgs
from .driver import Simulation
from .report import build_report, write_figures, write_json
from .router import make_router


def simulate(args: EngineArgs, workload, *, engines: int = 1, router: str = "round_robin",
             concurrency: int = 1, progress=None, timing_only: bool | None = None) -> Simulation:
    """Run `workload` through `engines` EngineCores with `router`; returns the finished Simulation.
    `timing_only` (default: whenever the engines time their steps) runs decodes without token
    outputs (engine/decode_cohort.py); False runs the plain path, token by token."""
    r = make_router(router, engines, block_size=args.tokens_per_block, capacity_blocks=args.kv_cache_size)
    return Simulation(args, engines, r, workload, concurrency=concurrency, progress=progress,
                      timing_only=timing_only).run()


def _meta(args: EngineArgs, workload, engines: int, router: str, concurrency: int) -> dict[str, Any]:
    perf = args.perf_model
    model = f"{perf['model']} on {perf['gpu']} tp={perf['tensor_parallel_size']}" if perf else "knob latency"
    shape = "trace" if not hasattr(workload, "arrival") else workload.arrival
    load = f"concurrency {concurrency}" if workload.closed_loop else shape
    return {"title": f"{model}, {engines} engine(s), {router}, {load}", "perf_model": perf, "engines": engines,
            "router": router, "workload": shape, "concurrency": concurrency if workload.closed_loop else None,
            "latency_knobs": None if perf else {f: getattr(args.config, f) for f in LATENCY_FIELDS},
            "kv_cache_blocks": args.kv_cache_size, "block_size": args.tokens_per_block,
            "max_num_seqs": args.config.max_num_seqs, "max_num_batched_tokens": args.config.max_num_batched_tokens}


def run_simulation(args: EngineArgs, workload, *, engines: int, router: str, concurrency: int,
                   out_dir: Path | None, figures: bool = True, progress: bool = True) -> dict[str, Any]:
    total = workload.num_requests
    if progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        task = bar.add_task("requests", total=total)
        step = max(total // 200, 1)

        def tick(done: int) -> None:
            if done % step == 0 or done == total:
                bar.update(task, completed=done)

        with bar:
            sim = simulate(args, workload, engines=engines, router=router, concurrency=concurrency, progress=tick)
    else:
        sim = simulate(args, workload, engines=engines, router=router, concurrency=concurrency)
    report = build_report(sim, _meta(args, workload, engines, router, concurrency))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        if figures:
            report["figures"] = [str(p) for p in write_figures(sim, report, out_dir)]
        write_json(report, out_dir / "report.json")
    return report
