#!/usr/bin/env python3
"""`vllm-vcr serve`, logging when each request arrived (its arrival stamp, vLLM's `arrival_time`)
and when it reached the engine: the server side of `arrival_lag.py`.

At exit (Ctrl-C / SIGINT) it writes one JSON line per request, `[arrival, in_engine]`, on
`time.perf_counter()`'s clock (the one `stream_bench.py` stamps with; both are CLOCK_MONOTONIC on
Linux, so the two processes' times compare). Diagnostic only: the server's engine is a subclass
that notes each request it is handed (the start-up warm-up's engine is not).

usage: python bench/serve_arrival_log.py --log FILE -- MODEL_DIR [serve flags ...]
"""

from __future__ import annotations

import argparse
import atexit
import json
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--log", required=True, help="where to write the JSON lines at exit")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: what `vllm-vcr serve` takes")
    a = ap.parse_args()
    serve_args = a.serve_args[1:] if a.serve_args[:1] == ["--"] else a.serve_args

    from vllm_vcr.cli import main as cli_main
    from vllm_vcr.engine.async_engine import AsyncEngine
    from vllm_vcr.serve import server

    offset = time.time() - time.perf_counter()  # wall clock -> perf_counter's
    seen: list[tuple[float, float]] = []

    class LoggedAsyncEngine(AsyncEngine):
        def _submit(self, idx, request, col, token_sink=None):  # noqa: ANN001
            seen.append((request.arrival_time - offset, time.perf_counter()))
            return super()._submit(idx, request, col, token_sink)

    server.AsyncEngine = LoggedAsyncEngine

    def dump() -> None:
        with open(a.log, "w") as f:
            f.writelines(json.dumps([round(x, 6), round(y, 6)]) + "\n" for x, y in seen)

    atexit.register(dump)
    return cli_main(["serve", *serve_args])


if __name__ == "__main__":
    sys.exit(main())
