"""How long the event loop keeps a posted callback waiting, in CPU time of the loop's own thread.

A helper thread posts a callback to the loop every `interval` seconds (the next one once the last
has run) and notes the loop thread's CPU clock when it posts; the callback reads that clock when
it runs. The difference is how long the loop thread *ran* before it came back to the loop's queue:
one callback holding the loop for 60 ms shows as about 60 ms, whereas a process the OS left
waiting for a core (a loaded machine) shows near zero. The wall time from post to run is kept
too; it includes that waiting.

The watch costs nothing until it is started: GET /stats/loop on the control API starts it on its
first call (control/server.py), so a harness arms it, runs its load, and reads the figures.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

STALL_MS = 50.0  # a wait this long or longer is counted in `stalls_over_50ms`


class LoopWatch:
    """Watches the loop it is created in (create it from the loop's thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float = 0.005) -> None:
        self._loop = loop
        self._interval = interval
        self._clock = time.pthread_getcpuclockid(threading.get_ident())
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reset_figures()

    def _reset_figures(self) -> None:
        self._since = time.monotonic()
        self._probes = 0
        self._longest_cpu = 0.0
        self._longest_wall = 0.0
        self._stalls = 0

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        self._stop = threading.Event()  # a thread of its own: one stopped earlier may still be ending
        with self._lock:
            self._reset_figures()
        self._thread = threading.Thread(target=self._run, args=(self._stop,), name="vllm-vcr-loop-watch",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ends the thread at its next turn (not waited for: it may be waiting on this loop)."""
        self._stop.set()
        self._thread = None

    def reset(self) -> None:
        with self._lock:
            self._reset_figures()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "watching": self.running,
                "seconds": round(time.monotonic() - self._since, 3),
                "probes": self._probes,
                "longest_stall_ms": round(self._longest_cpu * 1000, 3),
                "longest_wait_ms": round(self._longest_wall * 1000, 3),
                "stalls_over_50ms": self._stalls,
            }

    def _record(self, cpu0: float, wall0: float, done: threading.Event) -> None:
        # runs in the loop's thread: its own CPU clock
        cpu = time.clock_gettime(self._clock) - cpu0
        wall = time.monotonic() - wall0
        with self._lock:
            self._probes += 1
            self._longest_cpu = max(self._longest_cpu, cpu)
            self._longest_wall = max(self._longest_wall, wall)
            self._stalls += cpu * 1000 >= STALL_MS
        done.set()

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self._interval):
            done = threading.Event()
            try:
                cpu0 = time.clock_gettime(self._clock)
            except OSError:  # the loop's thread has ended
                return
            wall0 = time.monotonic()
            try:
                self._loop.call_soon_threadsafe(self._record, cpu0, wall0, done)
            except RuntimeError:  # the loop is closed
                return
            while not done.wait(0.5):
                if stop.is_set() or self._loop.is_closed():
                    return
