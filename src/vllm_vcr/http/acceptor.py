"""Accept every pending connection in one turn of the event loop, stamp each request's arrival
when its first bytes are parsed, and report a client that leaves mid-request.

uvloop's servers accept one connection per turn of the loop. A `serve` loop that is streaming to
a thousand clients takes milliseconds per turn, so a burst of new connections (a load generator
opening 1000 at once) waited seconds in the listen backlog before their first byte was read: a
TTFT tail that no engine setting explains. Here a reader on the listening socket drains the
backlog (up to `batch` per turn) and hands each connection to uvicorn's protocol.

The same burst, once connected, sends its requests together: uvicorn parses all of them in one
turn and queues one task per request, and each task runs its request up to the engine (body,
templating, tokenizing) before the next one starts. A stamp taken when the task starts would hide
that queue from the engine, so the configured TTFT would come on top of it; `stamping_arrival`
takes the stamp (vLLM's `arrival_time`) in the parser's message-begin callback instead, and a
request whose bytes were already waiting when the loop polled its sockets takes the time that read
phase began (`ReadPhase`): parsing the 255 requests read before it is the server's delay too.

That stamp is only as early as the loop's next look at the sockets, and the loop looks only
between two turns: a turn that runs a hundred new requests up to the engine (0.3-0.5 ms each)
leaves the requests that arrive meanwhile unstamped for tens of milliseconds, and the engine's
deadlines (and the first tokens' writes) wait as long. `TurnSlices` lets new requests start only
for about `slice` seconds of each turn (or as long as the rest of a busy turn took); the rest
start in the next turns, in arrival order, after the loop has stamped new arrivals and run what
is due.

The protocol (http/uvicorn_internals.py) also counts changes of any connection's write side
(`WriteSide`): a steady batch of streams then checks one number per step instead of every
stream's socket. A client that leaves must cancel its request's handler (and so abort its engine
request). An ASGI app learns of it only by awaiting `receive`, which takes a second task per
request; serve's protocol instead calls the handler's hook (`scope[ON_DISCONNECT]`) from
`connection_lost`.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("vllm_vcr.http")

# Out of descriptors or buffers: accepting again at once would fail again (and spin a core), so
# the reader is paused for ACCEPT_RETRY_DELAY seconds, as asyncio's own accept loop does under uvicorn.
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_RETRY_DELAY = 1.0
LOG_INTERVAL = 10.0  # at most one "accept failed" line per interval; the next one says how many were not logged


class TurnSlices:
    """An ASGI app in front of `app` that gives new requests about `slice` seconds of each turn of
    the event loop. Requests start at once while the turn's first one started less than `slice`
    ago; the others queue, in arrival order, and a pump releases some each turn: as many as fit
    in its budget at what the last ones it released took each (at least one). The requests it
    releases run back to back just before its next call (their wake-ups and its own are queued
    in that order), so that measure holds their own work only, not the rest of the turn (the
    streams' tokens). The budget is `slice`, or as long as the rest of the last turn took if
    that is longer: new requests get at least half of a loop that is busy with streams (at 1,000
    open streams a fixed 1 ms of a 10 ms turn admitted fewer requests than finished, and the
    queue grew without end), and short turns under a burst. Queued requests cost nothing per turn."""

    def __init__(self, app: Callable, slice: float = 0.001) -> None:
        self.app = app
        self.slice = slice
        self._turn_start: float | None = None  # when this turn's first direct start happened
        self._waiting: deque[asyncio.Future] = deque()
        self._pumping = False
        self._released = 0  # requests the pump released last turn ...
        self._batch_start: float | None = None  # ... and when the first of them started
        self._last_pump: float | None = None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and not self._may_start():
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()
            self._waiting.append(waiter)
            if not self._pumping:
                self._pumping, self._released = True, 0
                loop.call_soon(self._pump)
            await waiter
            if self._batch_start is None:
                self._batch_start = time.perf_counter()
        await self.app(scope, receive, send)

    def _may_start(self) -> bool:
        if self._waiting:
            return False  # first come, first served
        now = time.perf_counter()
        if self._turn_start is None:
            self._turn_start = now
            asyncio.get_running_loop().call_soon(self._end_turn)  # runs early in the next turn
            return True
        return now - self._turn_start < self.slice

    def _end_turn(self) -> None:
        self._turn_start = None

    def _pump(self) -> None:
        """Once per turn while requests wait (it runs after the ones it released last turn)."""
        n = 1
        now = time.perf_counter()
        if self._released and self._batch_start is not None and self._last_pump is not None:
            took = max(now - self._batch_start, 1e-6)
            rest_of_turn = now - self._last_pump - took
            n = max(1, int(max(self.slice, rest_of_turn) * self._released / took))
        self._batch_start = None
        self._last_pump = now
        released = 0
        while self._waiting and released < n:
            waiter = self._waiting.popleft()
            if not waiter.done():  # (cancelled while it waited)
                waiter.set_result(None)
                released += 1
        self._released = released
        if self._waiting:
            asyncio.get_running_loop().call_soon(self._pump)
        else:
            self._pumping, self._last_pump = False, None


class BurstAcceptor:
    """Stands in for the asyncio Server uvicorn would create on `sock` (it only needs `close()`)."""

    def __init__(self, sock: socket.socket, protocol_factory: Callable[[], asyncio.Protocol],
                 batch: int = 512, ssl: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._ssl = ssl  # an ssl.SSLContext: every connection is TLS (a failed handshake is logged)
        self._sock = sock
        self._factory = protocol_factory
        self._batch = batch
        self._closed = False
        self._paused: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()
        self._last_log = float("-inf")
        self._unlogged = 0
        sock.setblocking(False)
        self._loop.add_reader(sock.fileno(), self._accept)

    def _accept_failed(self, e: OSError) -> None:
        now = time.monotonic()
        if now - self._last_log >= LOG_INTERVAL:
            more = f" ({self._unlogged} more since the last report)" if self._unlogged else ""
            logger.warning("accept failed: %s%s", e, more)
            self._last_log, self._unlogged = now, 0
        else:
            self._unlogged += 1
        if e.errno in _RESOURCE_ERRNOS and not self._closed and self._paused is None:
            self._loop.remove_reader(self._sock.fileno())
            self._paused = self._loop.call_later(ACCEPT_RETRY_DELAY, self._resume)

    def _resume(self) -> None:
        self._paused = None
        if not self._closed:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    def _accept(self) -> None:
        tcp = self._sock.family in (socket.AF_INET, socket.AF_INET6)
        for _ in range(self._batch):  # bounded: one turn of accepting cannot starve the streams
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. out of file descriptors: keep serving, retry after a pause
                self._accept_failed(e)
                return
            conn.setblocking(False)
            if tcp:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = self._loop.create_task(self._loop.connect_accepted_socket(self._factory, conn, ssl=self._ssl))
            self._tasks.add(task)
            task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("could not set up an accepted connection: %s", task.exception())

    def close(self) -> None:
        """Stop accepting (uvicorn's shutdown calls this); the socket itself stays the caller's."""
        if not self._closed:
            self._closed = True
            if self._paused is not None:
                self._paused.cancel()
                self._paused = None
            else:
                self._loop.remove_reader(self._sock.fileno())

    async def wait_closed(self) -> None:
        return None
