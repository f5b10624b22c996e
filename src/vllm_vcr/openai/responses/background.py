"""Background streaming Responses (`background: true, stream: true`), as vLLM 0.32 runs them.

The generation runs detached from the request and its SSE events are kept, one entry per event
in `sequence_number` order. The POST reads them from the first; `GET /v1/responses/{id}?stream=
true&starting_after=N` reads them again from event N+1, following the stream while it runs. A
reader stops after `response.completed` (or the `error` event, or when the response is cancelled:
vLLM's readers would wait forever there).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ...http.serving_base import RequestContext
from ...http.sse import SSEWriter

_END_EVENTS = (b"event: response.completed\n", b"event: error\n")


class EventLog:
    """SSEWriter-shaped sink (write / close) that keeps every event for its readers."""

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.done = False
        self._changed = asyncio.Event()

    async def write(self, data: bytes) -> None:
        self.events += [part + b"\n\n" for part in data.split(b"\n\n") if part]
        self._changed.set()

    async def close(self, data: bytes = b"") -> None:
        if data:
            await self.write(data)
        self.done = True
        self._changed.set()

    async def follow(self, start: int) -> AsyncIterator[bytes]:
        index = max(start, 0)
        while True:
            self._changed.clear()
            while index < len(self.events):
                event = self.events[index]
                yield event
                if event.startswith(_END_EVENTS):
                    return
                index += 1
            if self.done:
                return
            await self._changed.wait()


async def send_events(ctx: RequestContext, log: EventLog, start: int) -> None:
    """Stream the kept events from index `start` to this request's client."""
    w = SSEWriter(ctx.send)
    await w.start()
    async for event in log.follow(start):
        await w.write(event)
    ctx.finishing = True
    await w.close()
