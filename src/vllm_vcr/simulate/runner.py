"""One simulation end to end: engines, router, progress bar, report files (also the Python API)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from ..engine.config import LATENCY_FIELDS, EngineArgs
from .disagg import Disaggregation, DisaggSimulation
from .driver import Simulation
from .report import build_report, write_figures, write_json
from .router import make_router


def simulate(args: EngineArgs, workload, *, engines: int = 1, router: str = "round_robin",
             concurrency: int = 1, progress=None, timing_only: bool | None = None,
             disagg: Disaggregation | None = None) -> Simulation | DisaggSimulation:
    """Run `workload` through `engines` EngineCores with `router`; returns the finished Simulation.
    `timing_only` (default: whenever the engines time their steps) runs decodes without token
    outputs (engine/decode_cohort.py); False runs the plain path, token by token. With `disagg`
    the engines of `args` are a disaggregated deployment's decode workers' (`engines` ranks each),
    behind its prefill workers; `router` picks the engine on each side."""
    if disagg is not None:
        return DisaggSimulation(disagg.prefill_args, args, disagg.prefill_workers * disagg.prefill_ranks,
                                disagg.decode_workers * engines, workload, concurrency=concurrency,
                                prefill_dp=disagg.prefill_ranks, decode_dp=engines, timing_only=timing_only,
                                progress=progress, router=router).run()
    r = make_router(router, engines, block_size=args.tokens_per_block, capacity_blocks=args.kv_cache_size)
    return Simulation(args, engines, r, workload, concurrency=concurrency, progress=progress,
                      timing_only=timing_only).run()


def _meta(args: EngineArgs, workload, engines: int, router: str, concurrency: int,
          disagg: Disaggregation | None) -> dict[str, Any]:
    perf = args.perf_model
    model = f"{perf['model']} on {perf['gpu']} tp={perf['tensor_parallel_size']}" if perf else "knob latency"
    shape = "trace" if not hasattr(workload, "arrival") else workload.arrival
    load = f"concurrency {concurrency}" if workload.closed_loop else shape
    meta = {"title": f"{model}, {engines} engine(s), {router}, {load}", "perf_model": perf, "engines": engines,
            "router": router, "workload": shape, "concurrency": concurrency if workload.closed_loop else None,
            "latency_knobs": None if perf else {f: getattr(args.config, f) for f in LATENCY_FIELDS},
            "kv_cache_blocks": args.kv_cache_size, "block_size": args.tokens_per_block,
            "max_num_seqs": args.config.max_num_seqs, "max_num_batched_tokens": args.config.max_num_batched_tokens}
    if disagg is not None:
        p_perf = disagg.prefill_args.perf_model
        p_model = f"tp={p_perf['tensor_parallel_size']}" if p_perf else "knob latency"
        meta["title"] = (f"{model}: {disagg.decode_workers} decode worker(s) of {engines} rank(s), "
                         f"{disagg.prefill_workers} prefill worker(s) ({p_model}) of {disagg.prefill_ranks} "
                         f"rank(s), {load}")
        meta["disaggregated"] = {
            "prefill_workers": disagg.prefill_workers, "prefill_ranks": disagg.prefill_ranks,
            "decode_workers": disagg.decode_workers, "decode_ranks": engines, "prefill_perf_model": p_perf,
            "prefill_kv_cache_blocks": disagg.prefill_args.kv_cache_size,
            "kv_bytes_per_token": args.kv_bytes_per_token, "kv_transfer_gb_s": args.kv_transfer_bandwidth}
    return meta


def run_simulation(args: EngineArgs, workload, *, engines: int, router: str, concurrency: int,
                   out_dir: Path | None, figures: bool = True, progress: bool = True,
                   disagg: Disaggregation | None = None) -> dict[str, Any]:
    total = workload.num_requests
    run = functools.partial(simulate, args, workload, engines=engines, router=router, concurrency=concurrency,
                            disagg=disagg)
    if progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        task = bar.add_task("requests", total=total)
        step = max(total // 200, 1)

        def tick(done: int) -> None:
            if done % step == 0 or done == total:
                bar.update(task, completed=done)

        with bar:
            sim = run(progress=tick)
    else:
        sim = run()
    report = build_report(sim, _meta(args, workload, engines, router, concurrency, disagg))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        if figures:
            report["figures"] = [str(p) for p in write_figures(sim, report, out_dir)]
        write_json(report, out_dir / "report.json")
    return report
