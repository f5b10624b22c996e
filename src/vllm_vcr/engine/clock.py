"""Engine clocks.

The engine never calls time functions directly: it asks its clock. `RealClock` is the
monotonic clock (vLLM stamps events with time.monotonic()). `VirtualClock` jumps straight to the
next deadline instead of sleeping, so engine tests run instantly and deterministically and a whole
workload can be simulated offline.

asyncio is imported where a clock sleeps, not here: an offline simulation (`simulate`) steps its
engines synchronously and never loads it.
"""

from __future__ import annotations

import time


class RealClock:
    virtual = False

    def now(self) -> float:
        return time.monotonic()

    async def sleep_until(self, deadline: float) -> None:
        delay = deadline - time.monotonic()
        if delay > 0:
            import asyncio

            await asyncio.sleep(delay)


class VirtualClock:
    virtual = True

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        if t > self._now:
            self._now = t

    async def sleep_until(self, deadline: float) -> None:
        self.advance_to(deadline)
        import asyncio

        await asyncio.sleep(0)


Clock = RealClock | VirtualClock
