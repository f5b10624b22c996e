"""`vllm-vcr inspect ...`: look at traces and make them from other tools' reports.

Logs go to stderr so `summarize --json` and `perfetto` (stdout by default) stay pipeable.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("inspect", help="summarize, plot and convert traces",
                              description=__doc__)
    sub = p.add_subparsers(dest="inspect_command", metavar="SUBCOMMAND", required=True)

    s = sub.add_parser("summarize", help="per-concurrency TTFT/ITL quantiles and token counts")
    s.add_argument("trace")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.add_argument("--by", choices=("bucket", "exact"), default="bucket",
                   help="group by concurrency range (default) or by each concurrency value")

    pl = sub.add_parser("plot", help="PNG figures: TTFT/ITL CDFs, latency vs concurrency, timeline")
    pl.add_argument("traces", nargs="+", metavar="TRACE")
    pl.add_argument("-o", "--output", default="plots", help="output directory (default ./plots)")
    pl.add_argument("--label", action="append", default=None,
                    help="legend label per trace, in order (default: file names)")
    pl.add_argument("--kind", action="append", choices=("cdf", "concurrency", "timeline"),
                    help="figures to draw (repeatable; default all)")

    pf = sub.add_parser("perfetto", help="Chrome-trace JSON for ui.perfetto.dev")
    pf.add_argument("trace")
    pf.add_argument("-o", "--output", default="-", help="output file (default stdout)")
    pf.add_argument("--step-stats", help="step-stats sidecar JSONL from `record --step-stats-out`")
    pf.add_argument("--name", default="inference trace", help="process name in the UI")
    pf.add_argument("--track-per-request", action="store_true",
                    help="one track per request instead of packed lanes")
    pf.add_argument("--open", action="store_true",
                    help="serve the JSON on 127.0.0.1 and print a ui.perfetto.dev link")
    pf.add_argument("--port", type=int, default=0, help="port for --open (default: any free)")

    g = sub.add_parser("from-guidellm", help="convert a guidellm v0.6 JSON report to a trace")
    g.add_argument("input")
    g.add_argument("-o", "--output", required=True)
    _add_meta_flags(g)

    a = sub.add_parser("from-aiperf", help="convert an aiperf profile_export.jsonl to a trace")
    a.add_argument("input")
    a.add_argument("-o", "--output", required=True)
    _add_meta_flags(a)

    d = sub.add_parser("gen-demo", help="write a synthetic heavy-tailed demo trace")
    d.add_argument("-o", "--output", required=True)
    d.add_argument("--records", type=int, default=200)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--fast", action="store_true", help="short prompts/outputs, fast latencies")
    d.add_argument("--mean-gap-ms", type=float, default=None,
                   help="mean inter-arrival gap (default 100 ms, 20 ms with --fast)")


    from .calibrate import add_parser as add_calibrate_parser

    add_calibrate_parser(sub)


def _calibrate(args: argparse.Namespace) -> int:
    from ..engine.config import ConfigError
    from .calibrate import run as run_calibrate

    try:
        return run_calibrate(args)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _add_meta_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="meta.model (default: taken from the report)")
    p.add_argument("--gpu", help="meta.gpu")
    p.add_argument("--tp", type=int, help="meta.tp")


def run(args: argparse.Namespace) -> int:
    from .convert_guidellm import ConvertError
    from ..trace.io import TraceError

    handler = {
        "summarize": _summarize, "plot": _plot, "perfetto": _perfetto,
        "from-guidellm": _from_guidellm, "from-aiperf": _from_aiperf, "gen-demo": _gen_demo,
        "calibrate": _calibrate,
    }[args.inspect_command]
    try:
        return handler(args)
    except (TraceError, ConvertError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _summarize(args: argparse.Namespace) -> int:
    from ..trace.progress import load_trace
    from .summarize import render, summarize

    trace = load_trace(args.trace)
    summary = summarize(trace, by=args.by)
    if args.json:
        print(json.dumps(_json_safe(summary), indent=2))
        return 0
    if not trace.records:
        print(f"{args.trace}: no records")
        return 0
    from rich.console import Console

    # piped output gets rich's 80 columns, which wraps the headers; tables are ~115 wide
    console = Console() if sys.stdout.isatty() else Console(width=140)
    console.print(render(summary, title=args.trace))
    return 0


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_safe(x) for x in v]
    return v


def _plot(args: argparse.Namespace) -> int:
    from .plot import KINDS, plot_traces
    from ..trace.progress import load_trace

    labels = args.label or []
    if len(labels) > len(args.traces):
        print("error: more --label values than traces", file=sys.stderr)
        return 2
    traces = []
    for i, path in enumerate(args.traces):
        label = labels[i] if i < len(labels) else Path(path).name.split(".")[0]
        traces.append((label, load_trace(path)))
    for p in plot_traces(traces, args.output, kinds=args.kind or KINDS):
        print(p)
    return 0


def _perfetto(args: argparse.Namespace) -> int:
    from .perfetto import read_step_stats, serve_once, to_chrome_trace
    from ..trace.progress import load_trace

    trace = load_trace(args.trace)
    steps = read_step_stats(args.step_stats) if args.step_stats else None
    doc = to_chrome_trace(trace.records, name=args.name,
                          track_per_request=args.track_per_request, step_stats=steps)
    body = json.dumps(doc, separators=(",", ":")).encode()
    if args.output == "-" and not args.open:
        sys.stdout.buffer.write(body + b"\n")
    elif args.output != "-":
        Path(args.output).write_bytes(body)
        print(f"wrote {len(doc['traceEvents'])} events to {args.output}", file=sys.stderr)
    if args.open:
        serve_once(body, args.port)
    return 0


def _write(path: str, meta: Any, records: list[Any], what: str) -> int:
    from ..trace.io import write_trace

    n = write_trace(path, meta, records)
    print(f"wrote {n} records ({what}) to {path}", file=sys.stderr)
    return 0


def _from_guidellm(args: argparse.Namespace) -> int:
    from .convert_guidellm import load_guidellm

    meta, recs = load_guidellm(args.input, model=args.model, gpu=args.gpu, tp=args.tp)
    return _write(args.output, meta, recs, "from guidellm")


def _from_aiperf(args: argparse.Namespace) -> int:
    from .convert_aiperf import load_aiperf

    meta, recs = load_aiperf(args.input, model=args.model, gpu=args.gpu, tp=args.tp)
    return _write(args.output, meta, recs, "from aiperf")


def _gen_demo(args: argparse.Namespace) -> int:
    from .gen_demo import gen_demo

    if args.records < 1:
        print("error: --records must be >= 1", file=sys.stderr)
        return 2
    meta, recs = gen_demo(args.records, seed=args.seed, fast=args.fast,
                          mean_gap_ms=args.mean_gap_ms)
    return _write(args.output, meta, recs, meta.source or "demo")
