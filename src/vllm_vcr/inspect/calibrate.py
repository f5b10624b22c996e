"""`vllm-vcr inspect calibrate`: replay a trace's arrivals through the simulator and compare.

The recording's requests arrive at their recorded times (same prompt sizes, same shared
prefixes — prompts are rebuilt from the block-hash chains — and the same output lengths) at an
engine running on the virtual clock, paced by a latency model fitted from `--fit` (the trace
itself by default) or by the knob flags. The simulated TTFT and ITL quantiles are compared with
the recording's: the verdict passes when every p50/p90 is within `--tolerance` and every p99
within `--tail-tolerance`, or closer than the two quantiles' sampling noise allows (their 95 %
order-statistic intervals, widened by the tolerance, overlap). It runs offline and deterministically, in seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from ..engine.clock import VirtualClock
from ..engine.config import EngineArgs
from ..engine.core import EngineCore
from ..engine.types import EngineCoreRequest, SamplingParams
from ..trace.schema import TraceMeta, TraceRecord, replay_subset
from ..trace.stats import itl_samples, ttft_samples
from ..replay.inputs import engine_inputs

QUANTILES = (50, 90, 99)


def _prompt(rec: TraceRecord, index: int, block_size: int) -> list[int]:
    """A prompt of the recorded size whose full blocks repeat wherever the recorded hashes do."""
    out: list[int] = []
    for h in rec.block_hashes or []:
        out.extend(((h >> (i % 48)) + i) % 30000 + 1 for i in range(block_size))
    while len(out) < rec.prompt_tokens:  # tail and hash-less prompts: unique to this request
        out.append(30001 + (index * 7919 + len(out)) % 1_000_000)
    return out[:max(rec.prompt_tokens, 1)]


def simulate(records: list[TraceRecord], args: EngineArgs, block_size: int, on_progress=None) -> list[TraceRecord]:
    """Run the recorded arrival schedule through one engine on the virtual clock."""
    timed = replay_subset(records)
    if not timed:
        raise ValueError("the trace has no arrival_ms: it cannot be replayed open-loop")
    emitted: dict[str, list[tuple[float, int]]] = {}

    def sink(_client: int, outs) -> None:
        for o in outs.outputs:
            if o.new_token_ids:
                emitted.setdefault(o.request_id, []).append((outs.timestamp, len(o.new_token_ids)))

    clock = VirtualClock(0.0)
    core = EngineCore(args, clock=clock, output_sink=sink, **engine_inputs(args))
    t0 = timed[0].arrival_ms
    arrivals: dict[str, float] = {}
    concurrency: dict[str, int] = {}
    for i, rec in enumerate(timed):
        t = (rec.arrival_ms - t0) / 1e3
        core.run_until_idle(until=t)
        rid = f"replay-{i}"
        arrivals[rid] = t
        concurrency[rid] = core.num_unfinished + 1
        core.add_request(EngineCoreRequest(
            request_id=rid, prompt_token_ids=_prompt(rec, i, block_size), arrival_time=t,
            sampling_params=SamplingParams(max_tokens=max(rec.output_tokens, 1), ignore_eos=True)))
        if on_progress is not None:
            on_progress(1)
    core.run_until_idle()
    sims: list[TraceRecord] = []
    for i, rec in enumerate(timed):
        rid = f"replay-{i}"
        chunks = emitted.get(rid)
        if not chunks:
            continue
        times = [c[0] for c in chunks]
        sims.append(TraceRecord(
            prompt_tokens=rec.prompt_tokens, output_tokens=sum(k for _, k in chunks),
            ttft_ms=(times[0] - arrivals[rid]) * 1e3, concurrency=concurrency[rid],
            arrival_ms=rec.arrival_ms, itl_ms=[(b - a) * 1e3 for a, b in zip(times, times[1:])],
            itl_tokens=[k for _, k in chunks[1:]]))
    return sims


def compare(recorded: list[TraceRecord], simulated: list[TraceRecord], tolerance: float,
            tail_tolerance: float) -> list[dict[str, Any]]:
    rows = []
    for metric, fn in (("ttft_ms", ttft_samples), ("itl_ms", itl_samples)):
        rec_s, sim_s = fn(recorded), fn(simulated)
        if not len(rec_s) or not len(sim_s):
            continue
        for q in QUANTILES:
            a, b = rec_s.quantile(q), sim_s.quantile(q)
            err = abs(b - a) / a if a else (0.0 if b == 0 else math.inf)
            limit = tail_tolerance if q >= 99 else tolerance
            # both quantiles are estimates from finite samples: a difference their sampling noise
            # explains is no miss (200 heavy-tailed requests pin a p99 to a few %, not to 10 %)
            (a_lo, a_hi), (b_lo, b_hi) = rec_s.quantile_interval(q), sim_s.quantile_interval(q)
            noise = (a_hi - a_lo) / (2 * a) if a else 0.0
            within_noise = b_lo <= a_hi * (1 + limit) and b_hi >= a_lo * (1 - limit)
            rows.append({"metric": metric, "quantile": f"p{q}", "recorded": a, "simulated": b,
                         "error": err, "limit": limit, "noise": noise,
                         "recorded_interval": [a_lo, a_hi], "simulated_interval": [b_lo, b_hi],
                         "ok": err <= limit or within_noise})
    return rows


def add_parser(sub: Any) -> None:
    from ..engine_cli import add_engine_args

    c = sub.add_parser("calibrate", help="replay a trace through the simulator and compare quantiles",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("trace", help="the recording to reproduce")
    c.add_argument("--fit", default=None, metavar="TRACE",
                   help="fit the latency model on this trace (default: the recording itself); "
                        "use --knobs to use the latency flags instead")
    c.add_argument("--knobs", action="store_true", help="pace with the knob flags, not a fitted model")
    c.add_argument("--max-num-seqs", type=int, default=None)
    c.add_argument("--max-num-batched-tokens", type=int, default=None)
    c.add_argument("--block-size", type=int, default=None,
                   help="the simulated engine's KV block size (default: the trace's block size)")
    c.add_argument("--tolerance", type=float, default=0.05, help="relative error allowed at p50/p90")
    c.add_argument("--tail-tolerance", type=float, default=0.10, help="relative error allowed at p99")
    c.add_argument("-o", "--output", default=None, help="directory for the comparison figures")
    c.add_argument("--json", action="store_true", help="print the table as JSON")
    add_engine_args(c)


def run(ns: argparse.Namespace) -> int:
    from ..engine_cli import engine_args_from_cli
    from ..trace.progress import load_trace, task_progress

    trace = load_trace(ns.trace)
    meta = trace.meta or TraceMeta()
    # prompts are rebuilt from the trace's block hashes (its own block size); --block-size is the
    # simulated engine's KV block (128 on vLLM's CPU backend, while a tap hashes 16-token blocks)
    hash_block = meta.block_size or ns.block_size or 16
    block_size = ns.block_size or meta.block_size or 16
    if ns.max_num_seqs is None:
        ns.max_num_seqs = meta.max_num_seqs or 1024
    ns.tokens_per_block = block_size
    if not ns.knobs:
        ns.latency_trace = ns.fit or ns.trace
    ns.log_requests = False
    args = engine_args_from_cli(ns)
    timed = replay_subset(trace.records)
    with task_progress("simulating", len(timed), unit="requests") as advance:
        sims = simulate(trace.records, args, hash_block, on_progress=advance)
    rows = compare(timed, sims, ns.tolerance, ns.tail_tolerance)
    verdict = bool(rows) and all(r["ok"] for r in rows)
    if ns.json:
        json.dump({"verdict": "PASS" if verdict else "FAIL", "rows": rows}, sys.stdout, indent=2)
        print()
    else:
        _print_table(rows, verdict, ns.trace)
    if ns.output:
        from ..trace.io import Trace, write_trace
        from .plot import plot_traces

        out = Path(ns.output)
        out.mkdir(parents=True, exist_ok=True)
        write_trace(out / "simulated.jsonl", TraceMeta(source="calibrate", block_size=block_size), sims)
        paths = plot_traces([("recorded", Trace(meta, timed)), ("simulated", Trace(None, sims))], out,
                            kinds=("cdf", "concurrency"))
        print("figures: " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0 if verdict else 1


def _print_table(rows: list[dict[str, Any]], verdict: bool, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"calibrate {title}")
    for col in ("metric", "quantile", "recorded", "simulated", "error", "limit", "noise ±", ""):
        t.add_column(col, justify="right" if col not in ("metric", "") else "left")
    for r in rows:
        t.add_row(r["metric"], r["quantile"], f"{r['recorded']:.2f}", f"{r['simulated']:.2f}",
                  f"{r['error'] * 100:.1f}%", f"{r['limit'] * 100:.0f}%", f"{r['noise'] * 100:.1f}%",
                  "ok" if r["ok"] else "FAIL")
    console = Console()
    console.print(t)
    console.print(f"verdict: {'PASS' if verdict else 'FAIL'}")
