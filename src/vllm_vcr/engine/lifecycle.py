"""Pause in place and drain on shutdown: the two ways an EngineCore stops scheduling.

Paused (vLLM's pause "keep"), every request stays where it is and nothing is scheduled; on
resume every deadline moves by the paused time, so requests go on at their own pace without a
burst. Shut down with a timeout, the engine refuses new requests and lets the running ones
finish until the deadline, then aborts the rest and stops.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Mapping

if TYPE_CHECKING:
    from .clock import Clock
    from .request import Request

logger = logging.getLogger("vllm_vcr.engine")


def release_kv_cache_refusal(paused_and_idle: bool, memory_resident: bool) -> str | None:
    """Why an engine refuses vLLM's `release_kv_cache_memory` (its engine core's words), or None:
    it needs a completed pause (scheduling paused, nothing unfinished) and every part of the
    model's memory awake."""
    if not paused_and_idle:
        return "release_kv_cache_memory() requires a completed pause first"
    if not memory_resident:
        return "release_kv_cache_memory() requires all executor memory to be resident"
    return None
# (outputs, finished): every live request aborted, each with a finish output
AbortAll = Callable[[list, list], None]
# (outputs, finished, with_stats): a batch of outputs sent (OutputProcessor.emit)
Emit = Callable[[list, list, bool], None]


class EngineLifecycle:
    """Frozen, draining or stopped: the state the core's loop and step read (plain attributes).

    What it acts on: the engine's clock and live requests (by id), and three callbacks of the
    core: `abort_all`, `emit`, and `resume(paused_seconds)` (every deadline moves that much)."""

    def __init__(self, engine_index: int, clock: Clock, requests: Mapping[str, Request], *, abort_all: AbortAll,
                 emit: Emit, resume: Callable[[float], None]) -> None:
        self._engine_index = engine_index
        self._clock = clock
        self._requests = requests
        self._abort_all = abort_all
        self._emit = emit
        self._resume = resume
        self.frozen_at: float | None = None
        self.draining_deadline: float | None = None
        self.stopped = False

    def set_frozen(self, frozen: bool) -> None:
        now = self._clock.now()
        if frozen:
            if self.frozen_at is None:
                self.frozen_at = now
            return
        if self.frozen_at is None:
            return
        delta, self.frozen_at = now - self.frozen_at, None
        self._resume(delta)

    def begin_shutdown(self, timeout: float, outputs: list, finished: list) -> None:
        """Drain for up to `timeout` seconds (stop at once when idle); without one, abort everything."""
        requests = self._requests
        if timeout > 0 and self.draining_deadline is None:
            self.draining_deadline = self._clock.now() + timeout
            logger.info("engine %d draining %d requests for up to %.1fs", self._engine_index, len(requests),
                        timeout)
            if not requests:
                self.stopped = True
            return
        self._abort_all(outputs, finished)
        self.stopped = True

    def drain_expired(self, now: float) -> bool:
        """At the draining deadline the requests still in flight are aborted and the engine stops."""
        if now < self.draining_deadline:
            return False
        outputs: list = []
        finished: list = []
        self._abort_all(outputs, finished)
        self._emit(outputs, finished, True)
        self.stopped = True
        return True

    def drained(self) -> bool:
        """Draining and nothing left: the engine stops. True once stopped."""
        if self.draining_deadline is not None and not self._requests:
            self.stopped = True
        return self.stopped
