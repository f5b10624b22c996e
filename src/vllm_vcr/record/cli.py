"""`vllm-vcr record`: capture a trace from a real server.

`--http`: a recording reverse proxy in front of any OpenAI-compatible server (client-side chunk
timing). Without `--http`: the engine-core ZMQ tap between a vLLM frontend and its engine
(engine-side timing, with the step context `itl_ctx` and an optional step-stats sidecar).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

from .. import event_loop

log = logging.getLogger(__name__)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("record", help="record a trace from a real server",
                              description=__doc__)
    p.add_argument("--trace-out", required=True, help="trace file to write (.gz: gzip)")
    p.add_argument("--model", help="meta.model (with --http, default: the first request's model)")
    p.add_argument("--gpu", help="meta.gpu")
    p.add_argument("--tp", type=int, help="meta.tp")
    p.add_argument("--max-num-seqs", type=int, help="meta.max_num_seqs")
    p.add_argument("--block-size", type=int, default=16,
                   help="block size of block_hashes (token-id prompts only; default 16)")

    h = p.add_argument_group("HTTP proxy mode")
    h.add_argument("--http", action="store_true",
                   help="record as a reverse proxy in front of an OpenAI-compatible server")
    h.add_argument("--upstream", help="the real server, e.g. http://127.0.0.1:8000")
    h.add_argument("--listen", default="127.0.0.1:8001", help="HOST:PORT to accept clients on")
    h.add_argument("--tokenizer", help="tokenizer.json to count text prompts when the response "
                                       "carries no usage (else ~4 characters per token)")
    h.add_argument("--upstream-timeout", type=float, default=3600.0,
                   help="seconds a proxied request may take (default 3600)")

    z = p.add_argument_group("engine-core tap mode (the default)")
    z.add_argument("--frontend-handshake", default="tcp://127.0.0.1:5570",
                   help="the real frontend's handshake address; the tap joins it as engine 0 "
                        "(vllm serve ... --data-parallel-size-local 0 --data-parallel-rpc-port)")
    z.add_argument("--engine-handshake", default="tcp://127.0.0.1:5580",
                   help="the tap binds here; the real engine connects to it as to its frontend "
                        "(vllm serve --headless --data-parallel-rpc-port 5580)")
    z.add_argument("--input-address", default="tcp://127.0.0.1:29560",
                   help="the tap binds this ROUTER for the engine's requests")
    z.add_argument("--output-address", default="tcp://127.0.0.1:29561",
                   help="the tap binds this PULL for the engine's outputs")
    z.add_argument("--step-stats-out", help="sidecar JSONL of every scheduler-stats report")
    z.add_argument("--config-hash", help="meta.config_hash (default: computed from --gpu, the "
                                         "vLLM version and --engine-config)")
    z.add_argument("--vllm-version", help="expected vLLM version (e.g. v0.33.0): the capture "
                                          "stops if the engine reports another major.minor")
    z.add_argument("--engine-config", default="",
                   help="the engine's behavioural flags as one string (config-hash input)")
    z.add_argument("--record-tokens", action="store_true",
                   help="record output_token_ids (the trace then carries user content)")
    z.add_argument("--handshake-timeout", type=float, default=3600.0,
                   help="seconds to wait for the engine and the frontend (default 3600)")


def _parse_listen(s: str) -> tuple[str, int]:
    host, sep, port = s.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--listen must be HOST:PORT, got {s!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def run(args: argparse.Namespace) -> int:
    if not args.http:
        return _run_zmq(args)
    if not args.upstream:
        print("error: --http needs --upstream URL", file=sys.stderr)
        return 2
    try:
        host, port = _parse_listen(args.listen)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .http_tap import TapConfig

    upstream = args.upstream if "://" in args.upstream else "http://" + args.upstream
    cfg = TapConfig(upstream=upstream, trace_out=args.trace_out, model=args.model, gpu=args.gpu,
                    tp=args.tp, max_num_seqs=args.max_num_seqs, block_size=args.block_size,
                    tokenizer=args.tokenizer, timeout_s=args.upstream_timeout)
    try:
        stats = event_loop.run(_main(cfg, host, port))
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"recorded {stats.recorded} requests to {args.trace_out} "
          f"({stats.forwarded} forwarded, {stats.unstreamed} not streamed, {stats.failed} failed, "
          f"{stats.aborted} aborted; {stats.prompt_estimated} prompt lengths estimated)",
          file=sys.stderr)
    return 0


def _run_zmq(args: argparse.Namespace) -> int:
    from .zmq_tap import TapError, ZmqTap, ZmqTapConfig

    addrs = (args.frontend_handshake, args.engine_handshake, args.input_address,
             args.output_address)
    if not all(a.startswith(("tcp://", "ipc://")) for a in addrs):
        print("error: ZMQ addresses must be tcp://HOST:PORT or ipc://PATH", file=sys.stderr)
        return 2
    cfg = ZmqTapConfig(
        frontend_handshake=args.frontend_handshake, engine_handshake=args.engine_handshake,
        input_address=args.input_address, output_address=args.output_address,
        trace_out=args.trace_out, step_stats_out=args.step_stats_out, model=args.model or "",
        gpu=args.gpu, tp=args.tp, max_num_seqs=args.max_num_seqs, config_hash=args.config_hash,
        vllm_version=args.vllm_version, engine_config=args.engine_config,
        block_size=args.block_size, record_tokens=args.record_tokens,
        handshake_timeout_s=args.handshake_timeout,
    )
    tap = ZmqTap(cfg)

    async def main() -> None:
        stop = asyncio.Event()
        _install_stop(stop)
        await tap.run(stop)

    try:
        event_loop.run(main())
    except (TapError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # zmq.ZMQError (address in use, ...)
        if type(e).__module__.startswith("zmq"):
            print(f"error: {e}", file=sys.stderr)
            return 1
        raise
    print(f"recorded {tap.recorded} requests to {args.trace_out} ({tap.rec.dropped} aborted "
          f"or failed, {len(tap.rec.tracked)} unfinished at stop)", file=sys.stderr)
    return 0


def _install_stop(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)  # finalize the trace on Ctrl-C / kill
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            pass


async def _main(cfg: Any, host: str, port: int) -> Any:
    from .http_tap import serve_tap

    stop = asyncio.Event()
    _install_stop(stop)

    def ready(addresses: list[Any]) -> None:
        for a in addresses:
            print(f"recording proxy listening on http://{a[0]}:{a[1]} -> {cfg.upstream}",
                  file=sys.stderr, flush=True)

    return await serve_tap(cfg, host, port, stop, ready=ready)
