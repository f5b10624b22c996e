"""uvicorn servers that wait for their exit instead of polling for it.

uvicorn's `Server.main_loop` wakes every 100 ms to refresh the Date header (once a second) and to
look at `should_exit`. One server does not notice; a fleet of a thousand workers in one process
(two servers each: the API and the control API) would wake 20,000 times a second doing nothing.
`EventServer` sleeps on an event that setting `should_exit` sets, and the Date headers of every
such server in the event loop are refreshed by one shared one-second tick, which runs only while
at least one server is up.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from email.utils import formatdate
import uvicorn

TICK_S = 1.0  # the Date header's resolution, as uvicorn's own refresh
clock = time.time  # (tests move it)


class _Ticker:
    """The one tick of an event loop: `on_tick` of every registered server, once a second."""

    def __init__(self) -> None:
        self.servers: set[EventServer] = set()
        self.task: asyncio.Task | None = None

    def add(self, server: EventServer) -> None:
        self.servers.add(server)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run(), name="uvicorn-date-tick")

    def discard(self, server: EventServer) -> None:
        self.servers.discard(server)
        if not self.servers and self.task is not None:
            self.task.cancel()
            self.task = None

    async def _run(self) -> None:
        while self.servers:
            await asyncio.sleep(TICK_S)
            # what uvicorn's on_tick does once a second, with the date formatted once for all servers
            date = [(b"date", formatdate(clock(), usegmt=True).encode())]
            for server in list(self.servers):
                config = server.config
                server.server_state.default_headers = (date if config.date_header else []) + config.encoded_headers
                limit = server.limit_max_requests
                if limit is not None and server.server_state.total_requests >= limit:
                    server.should_exit = True


_TICKERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Ticker] = weakref.WeakKeyDictionary()


def _ticker() -> _Ticker:
    loop = asyncio.get_running_loop()
    ticker = _TICKERS.get(loop)
    if ticker is None:
        ticker = _TICKERS[loop] = _Ticker()
    return ticker


def ticking_servers() -> int:
    """How many servers the running loop's tick serves (for tests)."""
    ticker = _TICKERS.get(asyncio.get_running_loop())
    return 0 if ticker is None else len(ticker.servers)


class EventServer(uvicorn.Server):
    """uvicorn.Server whose main loop waits for `should_exit` to be set (no 100 ms poll)."""

    _exit_event: asyncio.Event | None = None
    _should_exit = False

    @property  # type: ignore[override]
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        if value and self._exit_event is not None:
            self._exit_event.set()

    async def main_loop(self) -> None:
        self._exit_event = event = asyncio.Event()
        if await self.on_tick(0):  # the Date header now, as uvicorn's first tick
            return
        ticker = _ticker()
        ticker.add(self)
        try:
            await event.wait()
        finally:
            ticker.discard(self)
