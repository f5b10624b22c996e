"""Give freed heap memory back to the OS when the engines go idle (serve, play).

Under streaming load the process frees almost everything it allocates, but glibc's malloc keeps
the freed chunks inside its arenas, so RSS creeps up over tens of thousands of requests
(85 -> 112 MB over 30,000 soak requests) while the Python heap stays flat (tracemalloc: 34 -> 33 MB
between 7,000 and 17,000 requests). `malloc_trim(0)` hands those pages back: trimmed after each
batch, RSS stays at 96-98 MB from 7,000 to 27,000 requests (docs/reliability.md).

A trim walks every free chunk and can take tens of milliseconds on a fragmented heap, so it runs
only once the engines have been idle for a poll interval after a busy period: never between two
tokens of a stream. Without glibc (musl, macOS) this does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

POLL_S = 1.0


class _Core(Protocol):
    step_counter: int

    @property
    def num_unfinished(self) -> int: ...


def _load_malloc_trim():
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def trim_heap() -> bool:
    """One trim; False where the C library has no malloc_trim."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


async def trim_after_busy_periods(cores: Callable[[], Sequence[_Core]], poll_s: float = POLL_S,
                                  sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
    """Trim once per busy period, when no engine has stepped for `poll_s` and none holds a request."""
    last_steps: int | None = None
    trimmed = True
    while True:
        await sleep(poll_s)
        now = cores()
        steps = sum(c.step_counter for c in now)
        if steps != last_steps:
            trimmed = last_steps is None  # the first poll only takes the count
            last_steps = steps
        elif not trimmed and all(c.num_unfinished == 0 for c in now):
            trim_heap()
            trimmed = True


class _SharedTrimmer:
    """The one trimmer of an event loop, over the engines of every server in it (a fleet hosts
    many in one process: one poll a second in all, not one per server)."""

    def __init__(self) -> None:
        self.sources: list[Callable[[], Sequence[_Core]]] = []
        self.task: asyncio.Task | None = None

    def cores(self) -> list[_Core]:
        return [c for source in self.sources for c in source()]

    def add(self, source: Callable[[], Sequence[_Core]]) -> None:
        self.sources.append(source)
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(trim_after_busy_periods(self.cores), name="heap-trim")

    def remove(self, source: Callable[[], Sequence[_Core]]) -> None:
        self.sources.remove(source)
        if not self.sources and self.task is not None:
            self.task.cancel()
            self.task = None


_TRIMMERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _SharedTrimmer] = weakref.WeakKeyDictionary()


def start_idle_trimming(stack: contextlib.AsyncExitStack, cores: Callable[[], Sequence[_Core]]) -> None:
    """Trim while `stack` is open (nothing where the C library cannot trim); the servers of one
    event loop share one trimmer."""
    if _MALLOC_TRIM is None:
        return
    loop = asyncio.get_running_loop()
    trimmer = _TRIMMERS.get(loop)
    if trimmer is None:
        trimmer = _TRIMMERS[loop] = _SharedTrimmer()
    trimmer.add(cores)
    stack.callback(trimmer.remove, cores)
