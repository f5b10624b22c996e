"""`vllm-vcr replay-arrivals TRACE --target URL`: re-send a trace's requests at their recorded
arrival times against any OpenAI-compatible server and record what the client sees."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from .. import event_loop

from ..trace.schema import SOURCE_REPLAY_ARRIVALS


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "replay-arrivals", help="open-loop load generator replaying a trace's arrivals",
        description=__doc__,
    )
    p.add_argument("trace", help="trace to replay (records need arrival_ms)")
    p.add_argument("--target", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to request (default: the server's first model, "
                                   "else the trace's meta.model)")
    p.add_argument("--api", choices=("completions", "chat"), default="completions",
                   help="completions sends token-id prompts (exact lengths and shared prefixes); "
                        "chat sends word prompts of about the same length")
    p.add_argument("--trace-out", help="write the client-side measurements as a trace (.gz ok)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="replay this many times faster than recorded (arrival offsets / scale)")
    p.add_argument("--max-requests", type=int, help="replay only the first N arrivals")
    p.add_argument("--duration", type=float, help="stop sending after this many seconds")
    p.add_argument("--max-in-flight", type=int, default=256,
                   help="bound on concurrent requests; beyond it sends are late (see max lag)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="per request, seconds")
    p.add_argument("--no-sessions", dest="sessions", action="store_false",
                   help="do not hold a turn back until its previous turn (shared prefix) finished")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send vLLM's ignore_eos (outputs may end before the recorded length)")
    p.add_argument("--no-token-ids", dest="token_ids", action="store_false",
                   help="do not send vLLM's return_token_ids (multi-token chunks count as one)")
    p.add_argument("--max-tokens-cap", type=int, help="clamp every request's max_tokens")
    p.add_argument("--block-size", type=int, help="prompt block size (default: trace meta or 16)")
    p.add_argument("--vocab-size", type=int, default=4000,
                   help="synthetic prompt token ids stay below this (default 4000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default $OPENAI_API_KEY)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    from ..trace.io import TraceError
    from .loadgen import ReplayConfig
    from ..trace.progress import load_trace, task_progress
    from ..trace.schema import TraceMeta, replay_subset

    if args.time_scale <= 0:
        print("error: --time-scale must be > 0", file=sys.stderr)
        return 2
    try:
        trace = load_trace(args.trace)
    except (TraceError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    records = replay_subset(trace.records)
    if not records:
        print(f"error: {args.trace}: no record has arrival_ms; nothing to replay", file=sys.stderr)
        return 1
    meta = trace.meta or TraceMeta()
    cfg = ReplayConfig(
        target=args.target, model=args.model, api=args.api, time_scale=args.time_scale,
        max_requests=args.max_requests, duration_s=args.duration,
        max_in_flight=args.max_in_flight, request_timeout_s=args.request_timeout,
        sessions=args.sessions, ignore_eos=args.ignore_eos, token_ids=args.token_ids,
        max_tokens_cap=args.max_tokens_cap, block_size=args.block_size or meta.block_size or 16,
        vocab_size=args.vocab_size, seed=args.seed, api_key=args.api_key,
    )
    n = min(len(records), args.max_requests or len(records))
    try:
        with task_progress("sending", n, unit="items") as advance:
            result = event_loop.run(_replay(records, cfg, meta, args.trace, args.trace_out, advance))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    summary = build_summary(records, result, cfg)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary, args.trace_out)
    return 0 if result.ok else 1


async def _replay(records: list[Any], cfg: Any, meta: Any, source_path: str,
                  trace_out: str | None, advance: Any) -> Any:
    from ..trace.io import TraceWriter
    from .loadgen import Replayer, resolve_model

    await resolve_model(cfg, meta.model)
    writer = TraceWriter(trace_out, _out_meta(meta, cfg, source_path)) if trace_out else None
    try:
        return await Replayer(records, cfg, writer=writer, on_done=advance).run()
    finally:
        if writer is not None:
            writer.close()  # also on Ctrl-C: the gzip trailer is written


def _out_meta(meta: Any, cfg: Any, source_path: str) -> Any:
    from ..trace.schema import TraceMeta

    extra = {"replay_of": os.path.basename(source_path), "replay_target": cfg.target,
             "replay_api": cfg.api, "replay_time_scale": cfg.time_scale}
    return TraceMeta(model=cfg.model or meta.model, gpu=meta.gpu, tp=meta.tp,
                     max_num_seqs=meta.max_num_seqs, source=SOURCE_REPLAY_ARRIVALS,
                     block_size=cfg.block_size, extra=extra)


def _q(samples: Any, p: float) -> float | None:
    v = samples.quantile(p) if len(samples) else math.nan
    return None if math.isnan(v) else round(v, 3)


def build_summary(source: list[Any], result: Any, cfg: Any) -> dict[str, Any]:
    from ..trace.stats import itl_samples, ttft_samples

    src = source[: result.scheduled]
    out: dict[str, Any] = {
        "target": cfg.target, "model": cfg.model, "scheduled": result.scheduled,
        "sent": result.sent, "ok": result.ok, "errors": result.errors,
        "timeouts": result.timeouts, "no_tokens": result.no_tokens,
        "wall_s": round(result.wall_s, 3), "max_send_lag_ms": round(result.max_lag_ms, 3),
        "error_samples": result.error_samples, "compare": [],
    }
    for name, fn in (("ttft_ms", ttft_samples), ("itl_ms_per_token", itl_samples)):
        a, b = fn(src), fn(result.records)
        for p in (50, 90, 99):
            sv, rv = _q(a, p), _q(b, p)
            err = None
            if sv is not None and rv is not None and max(sv, rv) > 0:
                err = round(abs(sv - rv) / max(sv, rv), 4)
            out["compare"].append({"metric": f"{name} p{p}", "source": sv, "replay": rv,
                                   "rel_err": err})
    return out


def _print_summary(s: dict[str, Any], trace_out: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=120)
    console.print(
        f"replayed {s['sent']}/{s['scheduled']} requests to {s['target']} (model {s['model']}) "
        f"in {s['wall_s']:.1f} s: {s['ok']} ok, {s['errors']} errors, {s['timeouts']} timeouts; "
        f"max send lag {s['max_send_lag_ms']:.1f} ms"
    )
    for e in s["error_samples"]:
        console.print(f"  [red]{e}[/red]")
    t = Table(title="source vs replay (client-side)", title_justify="left")
    t.add_column("metric")
    t.add_column("source", justify="right")
    t.add_column("replay", justify="right")
    t.add_column("rel err", justify="right")
    for row in s["compare"]:
        fmt = lambda v: "-" if v is None else f"{v:.2f}"
        err = "-" if row["rel_err"] is None else f"{100 * row['rel_err']:.1f}%"
        t.add_row(row["metric"], fmt(row["source"]), fmt(row["replay"]), err)
    console.print(t)
    if trace_out:
        console.print(f"measurements written to {trace_out}")
