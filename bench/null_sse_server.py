#!/usr/bin/env python3
"""The machine's floor: an SSE "server" that does nothing but write pre-built chunks.

Each POST gets `max_tokens` chat chunks (with continuous usage, like W2's), the first after
--ttft-ms and then one every --itl-ms, on absolute deadlines from one heap; no engine, no JSON
parsing beyond `max_tokens`, no tokenizer, no metrics. Whatever timing error W2 shows against it
is the client's and the kernel's (one loopback write per chunk), not a server's: no real server can
do better on the same cores. At --itl-ms 0 (W1) each pass over the heap sends one chunk per
stream and then yields to the loop, as an engine step gives every running request one token.

`--request-cpu-us N` spins N µs of CPU for every request as its bytes are parsed (nothing else
changes): what a server's own per-request work, done on the loop that writes the tokens, costs
W2's ITL tail and TTFT (docs/benchmarks.md).

usage: python bench/null_sse_server.py --port 18400 --ttft-ms 100 --itl-ms 20 [--request-cpu-us 0]
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import re
import time

HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"transfer-encoding: chunked\r\n\r\n")
MODELS = b'{"object":"list","data":[{"id":"tiny","object":"model"}]}'
CHUNK = (b'data: {"id":"chatcmpl-null","object":"chat.completion.chunk","created":0,"model":"tiny",'
         b'"choices":[{"index":0,"delta":{"content":" tok"},"logprobs":null,"finish_reason":%b,'
         b'"token_ids":null}],"usage":{"prompt_tokens":128,"total_tokens":%d,"completion_tokens":%d}}\n\n')
DONE = b"data: [DONE]\n\n"
CONTENT_LENGTH = re.compile(rb"(?i)\r\ncontent-length: *(\d+)")
SLACK = 0.0002  # serve deadlines this close together in one pass (as the engine does)


def _set(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def framed(body: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(body), body)


class Streams:
    """Every open stream's next deadline, in one heap, served by one timer task. A stream is its
    connection (`transport`, and `last_chunk` / `gone` for its end: asgi_floor_server.py's streams
    end their responses through uvicorn instead)."""

    def __init__(self, ttft: float, itl: float) -> None:
        self.ttft, self.itl = ttft, itl
        self.heap: list[tuple[float, int, Conn, int, int]] = []
        self.seq = 0
        self.wake: asyncio.Future | None = None

    def add(self, conn: Conn, n: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (time.monotonic() + self.ttft, self.seq, conn, 1, n))
        if self.wake is not None:
            _set(self.wake)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        heap = self.heap
        while True:
            horizon = time.monotonic() + SLACK
            later = []  # a stream's next chunk waits for the next pass, even when it is due already
            while heap and heap[0][0] <= horizon:
                due, seq, conn, i, n = heapq.heappop(heap)
                if conn.transport.is_closing():
                    conn.gone()
                    continue
                if i >= n:
                    conn.last_chunk(CHUNK % (b'"length"', 128 + i, i))
                    continue
                conn.transport.write(framed(CHUNK % (b"null", 128 + i, i)))
                later.append((due + self.itl, seq, conn, i + 1, n))
            for item in later:
                heapq.heappush(heap, item)
            self.wake = wake = loop.create_future()
            timer = loop.call_later(max(heap[0][0] - time.monotonic(), 0), _set, wake) if heap else None
            await wake
            if timer is not None:
                timer.cancel()


class Conn(asyncio.Protocol):
    streams: Streams
    request_cpu = 0.0  # seconds of CPU spun per request (--request-cpu-us)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport
        self.buf = b""

    def last_chunk(self, body: bytes) -> None:
        self.transport.write(framed(body + DONE) + b"0\r\n\r\n")

    def gone(self) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        m = CONTENT_LENGTH.search(self.buf, 0, end + 2)
        length = int(m.group(1)) if m else 0
        if len(self.buf) < end + 4 + length:
            return
        request_line, body = self.buf[:self.buf.find(b"\r\n")], self.buf[end + 4:end + 4 + length]
        self.buf = self.buf[end + 4 + length:]
        if request_line.startswith(b"GET"):  # /v1/models: the harness's readiness probe
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                                 % (len(MODELS), MODELS))
            return
        if self.request_cpu:
            until = time.thread_time() + self.request_cpu
            while time.thread_time() < until:
                pass
        self.transport.write(HEAD)
        self.streams.add(self, int(json.loads(body).get("max_tokens") or 16))


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=18400)
    ap.add_argument("--ttft-ms", type=float, default=100.0)
    ap.add_argument("--itl-ms", type=float, default=20.0)
    ap.add_argument("--request-cpu-us", type=float, default=0.0,
                    help="CPU to spin per request as it is parsed (a server's own per-request work)")
    a = ap.parse_args()
    Conn.streams = streams = Streams(a.ttft_ms / 1e3, a.itl_ms / 1e3)
    Conn.request_cpu = a.request_cpu_us / 1e6
    server = await asyncio.get_running_loop().create_server(Conn, a.host, a.port, backlog=4096)
    async with server:
        await streams.run()


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
