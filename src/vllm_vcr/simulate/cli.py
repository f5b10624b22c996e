"""`vllm-vcr simulate`: a workload through N simulated engines and a router, offline, on the
virtual clock; a JSON report and PNG figures."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..engine_cli import add_engine_args, add_running_limit_args
from ..perf.cli import add_perf_args
from .router import ROUTERS

logger = logging.getLogger(__name__)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate", help="run a workload through N simulated engines and a router offline (no HTTP)",
        description="Simulate a workload (closed loop, Poisson, bursty, a recorded or Mooncake trace) through N "
                    "engines on the virtual clock with a router in the loop; report TTFT/ITL/TPOT/E2E, "
                    "throughput, queue and KV usage, preemptions.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="model name (selects the perf model's model, e.g. meta-llama/Llama-3.1-8B-Instruct)")
    w = p.add_argument_group("workload")
    w.add_argument("--arrival", choices=["closed", "poisson", "bursty"], default="closed",
                   help="closed loop at --concurrency, or open-loop arrivals at --request-rate")
    w.add_argument("--num-requests", type=int, default=1000)
    w.add_argument("--concurrency", type=int, default=64, help="closed loop: users sending back to back")
    w.add_argument("--ramp-up", type=float, default=0.0,
                   help="closed loop: start the users evenly over this many seconds (0: all at once)")
    w.add_argument("--request-rate", type=float, default=10.0, help="open loop: requests per second")
    w.add_argument("--burstiness", type=float, default=4.0,
                   help="bursty: squared coefficient of variation of the gaps (1 = Poisson)")
    w.add_argument("--isl", default="1024", help="input length: N, uniform:LO:HI, normal:MEAN:SD, lognormal:MEAN:SD")
    w.add_argument("--osl", default="256", help="output length (same forms as --isl)")
    w.add_argument("--num-prefixes", type=int, default=0, help="shared-prefix groups")
    w.add_argument("--prefix-len", type=int, default=0, help="tokens of each shared prefix")
    w.add_argument("--trace", default=None, help="replay a trace: vllm-vcr JSONL or Mooncake-style JSONL")
    w.add_argument("--trace-speedup", type=float, default=1.0, help="divide the trace's arrival times by this")
    w.add_argument("--workload-seed", type=int, default=0)
    e = p.add_argument_group("engines")
    e.add_argument("--router", choices=ROUTERS, default="round_robin")
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=8192)
    add_running_limit_args(e)
    e.add_argument("--max-model-len", type=int, default=0, help="0: no limit")
    e.add_argument("--block-size", type=int, default=None)
    d = p.add_argument_group(
        "disaggregated deployment",
        "With --num-prefill-workers, the engines are a disaggregated deployment: each request is prefilled "
        "on a prefill worker, whose KV a decode worker pulls over the KV link before it decodes (--router "
        "picks the engine on each side). The engine flags apply to both sides; --engine-count is a decode "
        "worker's ranks. With --perf-model, --kv-bytes-per-token defaults to a prefill GPU's KV bytes per token and "
        "--kv-transfer-bandwidth to the GPU's link (NVLink within a node, else its NIC).")
    d.add_argument("--num-prefill-workers", type=int, default=0, metavar="N",
                   help="prefill workers (0: aggregated engines, the default)")
    d.add_argument("--num-decode-workers", type=int, default=1, metavar="N", help="decode workers (default 1)")
    d.add_argument("--prefill-engine-count", type=int, default=1, metavar="N",
                   help="a prefill worker's engines (attention-DP ranks; default 1)")
    d.add_argument("--prefill-tensor-parallel-size", type=int, default=None, metavar="TP",
                   help="(--perf-model) a prefill worker's tensor parallelism (default: the decode side's -tp)")
    o = p.add_argument_group("output")
    o.add_argument("-o", "--output-dir", default="simulate-out", help="report.json and PNG figures go here")
    o.add_argument("--no-figures", action="store_true")
    o.add_argument("--no-progress", action="store_true")
    add_engine_args(p)
    add_perf_args(p, vllm_gpu_flags=True)
    # (unset: the GPU's link in a disaggregated deployment with the perf model, else the engine's default)
    p.set_defaults(kv_transfer_bandwidth=None)
    return p


def _workload(args: argparse.Namespace):
    from .workload import LengthDist, SyntheticWorkload, TraceWorkload

    if args.trace:
        return TraceWorkload.from_path(args.trace, limit=args.num_requests, speedup=args.trace_speedup)
    if args.num_requests < 1 or args.concurrency < 1 or args.request_rate <= 0:
        raise ValueError("--num-requests and --concurrency must be >= 1, --request-rate > 0")
    return SyntheticWorkload(
        num_requests=args.num_requests, isl=LengthDist.parse(args.isl, "--isl"),
        osl=LengthDist.parse(args.osl, "--osl"), arrival=args.arrival, concurrency=args.concurrency, ramp_up=args.ramp_up,
        request_rate=args.request_rate, burstiness=args.burstiness, num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len, seed=args.workload_seed)


def run(args: argparse.Namespace) -> int:
    from ..engine.config import ConfigError
    from .runner import run_simulation

    try:
        eargs, disagg = _deployment(args)
        workload = _workload(args)
    except (ConfigError, ValueError, OSError) as e:
        print(f"vllm-vcr simulate: error: {e}", file=sys.stderr)
        return 2
    _say_latency_model(eargs)
    report = run_simulation(eargs, workload, engines=args.engine_count, router=args.router,
                            concurrency=args.concurrency, out_dir=Path(args.output_dir),
                            figures=not args.no_figures, progress=not args.no_progress, disagg=disagg)
    _print_summary(report, Path(args.output_dir))
    return 0


def _deployment(ns: argparse.Namespace):
    """The engines' args and, for a disaggregated deployment (--num-prefill-workers), its prefill side
    (disagg.Disaggregation; the engine args are then the decode workers'). With the perf model, the
    KV a decode worker pulls is the prefill workers' KV bytes per token per GPU, over the GPU's link
    (the node's NVLink when every GPU of the deployment fits in one node, else its NICs), unless
    --kv-bytes-per-token / --kv-transfer-bandwidth say otherwise."""
    from argparse import Namespace

    from ..engine.config import ConfigError
    from ..engine_cli import engine_args_from_cli
    from .disagg import Disaggregation

    max_len = ns.max_model_len or 1 << 20
    prefill = ns.num_prefill_workers
    if prefill < 0 or ns.num_decode_workers < 1 or ns.prefill_engine_count < 1:
        flag = "--num-prefill-workers" if prefill < 0 else \
            "--num-decode-workers" if ns.num_decode_workers < 1 else "--prefill-engine-count"
        raise ConfigError(f"{flag}: must be >= {0 if prefill < 0 else 1}")
    if not prefill:
        for flag, dest, default in (("--num-decode-workers", "num_decode_workers", 1),
                                    ("--prefill-engine-count", "prefill_engine_count", 1),
                                    ("--prefill-tensor-parallel-size", "prefill_tensor_parallel_size", None)):
            if getattr(ns, dest) != default:
                raise ConfigError(f"{flag}: only for a disaggregated deployment (give --num-prefill-workers)")
        return engine_args_from_cli(ns, advertised_max_model_len=max_len), None
    if ns.worker_type != "aggregated":
        raise ConfigError("--worker-type: a disaggregated simulation sets each side's (--num-prefill-workers, "
                          "--num-decode-workers)")
    p_ns, d_ns = Namespace(**{**vars(ns), "worker_type": "prefill"}), Namespace(**{**vars(ns), "worker_type": "decode"})
    if ns.prefill_tensor_parallel_size is not None:
        if ns.prefill_tensor_parallel_size < 1:
            raise ConfigError("--prefill-tensor-parallel-size: must be >= 1")
        p_ns.perf_tp = ns.prefill_tensor_parallel_size
    p_args = engine_args_from_cli(p_ns, advertised_max_model_len=max_len)
    d_args = engine_args_from_cli(d_ns, advertised_max_model_len=max_len)
    if p_args.perf_model:
        from ..perf.catalog import kv_link, pull_bytes_per_token

        if ns.kv_bytes_per_token is None:  # (each side has its GPU's; a pull moves the busier end's)
            d_args.kv_bytes_per_token = pull_bytes_per_token(p_args.kv_bytes_per_token, d_args.kv_bytes_per_token)
        if ns.kv_transfer_bandwidth is None:
            p, d = p_args.perf_model, d_args.perf_model
            gpus = (prefill * ns.prefill_engine_count * p["tensor_parallel_size"]
                    + ns.num_decode_workers * ns.engine_count * d["tensor_parallel_size"])
            bandwidth, link = kv_link(d["gpu"], gpus)
            p_args.kv_transfer_bandwidth = d_args.kv_transfer_bandwidth = bandwidth / 1e9
            logger.info("KV link: %s of %s, %.0f GB/s per GPU (%d GPUs); %d KV bytes per token", link, d["gpu"],
                        bandwidth / 1e9, gpus, d_args.kv_bytes_per_token)
    elif ns.prefill_tensor_parallel_size is not None:
        raise ConfigError("--prefill-tensor-parallel-size: only with --perf-model (it prices the prefill workers' "
                          "steps)")
    return d_args.validate(), Disaggregation(p_args.validate(), prefill, ns.prefill_engine_count,
                                             ns.num_decode_workers)


def _say_latency_model(eargs) -> None:
    """Without a perf model (or a latency trace) the latency knobs pace the engines, at `serve`'s
    defaults unless given: one line saying which, and a warning when they are all zero (every step
    takes no simulated time)."""
    if eargs.perf_model or eargs.latency_trace or eargs.replay_steps:
        return
    from ..engine_cli import latency_knobs_line

    c = eargs.config
    knobs = latency_knobs_line(c)
    if not (c.time_to_first_token or c.inter_token_latency or c.prefill_overhead or c.prefill_time_per_token):
        logger.warning("no perf model: the latency knobs pace the engines (%s): every step takes 0 s of simulated "
                       "time, so every latency is 0 and the throughput is undefined (null in report.json); for a "
                       "GPU's step times give --perf-model aic --gpu GPU, or set the knobs, e.g. "
                       "--time-to-first-token 150 --inter-token-latency 20", knobs)
    else:
        logger.info("no perf model: the latency knobs pace the engines: %s", knobs)


def _print_summary(report: dict, out_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report['requests']} requests, {report['meta'].get('title', '')}")
    table.add_column("ms")
    for q in ("mean", "p50", "p90", "p99"):
        table.add_column(q, justify="right")
    for key, stats in report["latency_ms"].items():
        if stats:
            table.add_row(key.upper(), *(f"{stats[q]:.1f}" for q in ("mean", "p50", "p90", "p99")))
    console = Console(stderr=False)
    console.print(table)
    th = report["throughput"]
    rate = (f"throughput {th['output_tokens_per_s']:.0f} output tok/s, {th['requests_per_s']:.2f} req/s over "
            f"{th['duration_s']:.1f} s simulated" if th["duration_s"] > 0 else
            "throughput n/a: no simulated time passed (every step took 0 s)")
    console.print(f"{rate}; preemptions {report['preemptions']['total']}; "
                  f"prefix-cache hit rate {report['prefix_cache_hit_rate']:.1%}")
    console.print(f"simulated in {report['wall_s']:.2f} s wall ({report['simulated_requests_per_wall_s'] or 0:.0f} "
                  f"requests/s); report: {out_dir / 'report.json'}")
