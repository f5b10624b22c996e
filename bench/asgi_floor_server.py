#!/usr/bin/env python3
"""uvicorn's own floor: a streaming ASGI app that does nothing but send pre-built chunks.

Served as `serve` serves (uvicorn, httptools, uvloop), each POST gets `max_tokens` chat chunks,
then `[DONE]`; no engine, validation, template or metrics. Next to the null server (no HTTP
framework at all) and `serve`, it splits a request's cost into the kernel's, uvicorn's and ours.

Without --ttft-ms / --itl-ms the chunks go out at once, each through ASGI `send`. With them (W2)
a request takes uvicorn's whole request path (parse, scope, task, `receive`, response start and
end through `send`) and its chunks are timed and written by null_sse_server.py's `Streams` (one
heap of absolute deadlines, one timer task, straight to the connection's transport, as serve's
steady streams write): the per-event work is null's, the per-request work is uvicorn's
floor. Its W2 timing against null's is what uvicorn alone costs a server's ITL tail.

usage: python bench/asgi_floor_server.py --port 18400 [--ttft-ms 100 --itl-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json

import uvicorn
from null_sse_server import CHUNK, DONE, Streams, framed  # (this directory: run as a script)

from vllm_vcr.gc_tuning import tune_for_serving

MODELS = b'{"object":"list","data":[{"id":"tiny","object":"model"}]}'


class TimedStream:
    """One response's stream in null's heap: its chunks go straight to uvicorn's transport, and
    `done` lets the app end the response through uvicorn after the last one (or the client left)."""

    __slots__ = ("transport", "done")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.done = asyncio.get_running_loop().create_future()

    def last_chunk(self, body: bytes) -> None:
        self.transport.write(framed(body))
        self.gone()

    def gone(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


STREAMS: Streams | None = None
_timer: asyncio.Task | None = None


async def timed(transport: asyncio.Transport, n: int) -> None:
    global _timer
    if _timer is None:
        _timer = asyncio.get_running_loop().create_task(STREAMS.run())
    stream = TimedStream(transport)
    STREAMS.add(stream, n)
    await stream.done


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    if scope["method"] == "GET":  # /v1/models: the harness's readiness probe
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": MODELS})
        return
    body = b""
    more = True
    while more:
        msg = await receive()
        body += msg.get("body", b"")
        more = msg.get("more_body", False)
    n = int(json.loads(body).get("max_tokens") or 16)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    if STREAMS is not None:
        # (uvicorn's `send` is its request cycle's bound method; the cycle holds the transport)
        await timed(send.__self__.transport, n)
    else:
        for i in range(1, n + 1):
            await send({"type": "http.response.body", "body": CHUNK % (b"null", 128 + i, i), "more_body": True})
    await send({"type": "http.response.body", "body": DONE, "more_body": False})


def main() -> None:
    global STREAMS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=18400)
    ap.add_argument("--ttft-ms", type=float, default=0.0)
    ap.add_argument("--itl-ms", type=float, default=0.0)
    a = ap.parse_args()
    if a.ttft_ms > 0 or a.itl_ms > 0:
        STREAMS = Streams(a.ttft_ms / 1e3, a.itl_ms / 1e3)
    # serve's collector settings (a frozen start-up heap, rare young collections): free for any
    # server, and without them a young collection over 1,000 open streams' state holds the loop
    tune_for_serving()
    uvicorn.run(app, host=a.host, port=a.port, loop="uvloop", http="httptools", log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
