"""The single way into an EngineCore: messages (add, abort, control call, shutdown, ...) posted
from anywhere in the loop and applied by the core between two steps, and the loop's sleep until
one arrives (or its next step is due). asyncio is imported where the loop waits (an offline
simulation steps its engines synchronously and never loads it)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import asyncio


class Inbox:
    def __init__(self) -> None:
        self.messages: deque[tuple] = deque()
        self._waiter: asyncio.Future | None = None

    def post(self, msg: tuple) -> None:
        self.messages.append(msg)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, timeout: float | None) -> None:
        """Sleep until a message is posted or `timeout` seconds pass (None: no timeout)."""
        import asyncio

        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        handle = loop.call_later(timeout, _wake_up, waiter) if timeout is not None else None
        await waiter
        if handle is not None:
            handle.cancel()
        self._waiter = None

    def fail_calls(self, error: Callable[[], BaseException]) -> None:
        """The loop is gone: every pending control call gets `error()`; other messages are dropped."""
        messages = self.messages
        while messages:
            msg = messages.popleft()
            if msg[0] == "call" and not msg[2].done():
                msg[2].set_exception(error())


def run_call(target: Any, fn: Callable[[Any], Any], fut: asyncio.Future) -> None:
    """A control call: fn(target); its result or exception goes to `fut`, never to the loop."""
    try:
        result = fn(target)
    except Exception as e:  # the caller gets the error; the engine goes on
        if not fut.done():
            fut.set_exception(e)
    else:
        if not fut.done():
            fut.set_result(result)


def _wake_up(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
