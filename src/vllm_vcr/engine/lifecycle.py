"""Pause in place and drain on shutdown: the two ways an EngineCore stops scheduling.

Paused (vLLM's pause "keep"), every request stays where it is and nothing is scheduled; on
resume every deadline moves by the paused time, so requests go on at their own pace without a
burst. Shut down with a timeout, the engine refuses new requests and lets the running ones
finish until the deadline, then aborts the rest and stops.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .core import EngineCore

logger = logging.getLogger("vllm_vcr.engine")


class EngineLifecycle:
    """Frozen, draining or stopped: the state the core's loop and step read (plain attributes)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.frozen_at: float | None = None
        self.draining_deadline: float | None = None
        self.stopped = False

    def set_frozen(self, frozen: bool) -> None:
        core = self.core
        now = core.clock.now()
        if frozen:
            if self.frozen_at is None:
                self.frozen_at = now
            return
        if self.frozen_at is None:
            return
        delta, self.frozen_at = now - self.frozen_at, None
        core.scheduler.shift_deadlines(delta)
        core.timed.shift(delta)
        for req in core.requests.values():
            if not req.output_token_ids:
                req.first_due += delta

    def begin_shutdown(self, timeout: float, outputs: list, finished: list) -> None:
        """Drain for up to `timeout` seconds (stop at once when idle); without one, abort everything."""
        core = self.core
        if timeout > 0 and self.draining_deadline is None:
            self.draining_deadline = core.clock.now() + timeout
            logger.info("engine %d draining %d requests for up to %.1fs", core.engine_index, len(core.requests),
                        timeout)
            if not core.requests:
                self.stopped = True
            return
        core.finish_requests(list(core.requests), finished, outputs)
        self.stopped = True

    def drain_expired(self, now: float) -> bool:
        """At the draining deadline the requests still in flight are aborted and the engine stops."""
        if now < self.draining_deadline:
            return False
        core = self.core
        outputs: list = []
        finished: list = []
        core.finish_requests(list(core.requests), finished, outputs)
        core.output.emit(outputs, finished, with_stats=True)
        self.stopped = True
        return True

    def drained(self) -> bool:
        """Draining and nothing left: the engine stops. True once stopped."""
        if self.draining_deadline is not None and not self.core.requests:
            self.stopped = True
        return self.stopped
