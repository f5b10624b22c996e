"""`vllm-vcr pd-proxy`: the two-step prefill/decode router (see pd/proxy.py)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "pd-proxy", help="route requests through a prefill and a decode instance (two-step P/D flow)",
        description="A small reverse proxy doing vLLM's disaggregated-serving flow: a prefill instance "
                    "computes the prompt (max_tokens=1, do_remote_decode), a decode instance pulls its KV "
                    "and streams the answer. With --bootstrap it drives Dynamo's bootstrap handoff instead.")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill instance(s), e.g. http://127.0.0.1:8100 (round-robin)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode instance(s), e.g. http://127.0.0.1:8200 (round-robin)")
    p.add_argument("--bootstrap", nargs="+", default=None, metavar="HOST:PORT",
                   help="bootstrap server of each prefill instance (its --side-channel-host and "
                        "--bootstrap-port): use the Dynamo bootstrap flow")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="listen port (default %(default)s)")
    return p


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    from .proxy import PDProxy, parse_bootstrap

    try:
        bootstrap = [parse_bootstrap(b) for b in args.bootstrap] if args.bootstrap else None
        proxy = PDProxy(args.prefill, args.decode, bootstrap)
    except ValueError as e:
        print(f"vllm-vcr pd-proxy: error: {e}", file=sys.stderr)
        return 2
    print(f"vllm-vcr pd-proxy on http://{args.host}:{args.port}: prefill {' '.join(proxy.prefill)} -> "
          f"decode {' '.join(proxy.decode)} ({'bootstrap' if bootstrap else 'kv_transfer_params'} flow)",
          file=sys.stderr, flush=True)
    try:
        web.run_app(proxy.app(), host=args.host, port=args.port, print=None, access_log=None)
    except OSError as e:
        print(f"vllm-vcr pd-proxy: error: {e}", file=sys.stderr)
        return 1
    return 0
