"""The engine side of sleep and pause, as vLLM's engine core keeps it: the paused scheduler, the
executor's sleeping tags (weights, kv_cache) and 0.33's refusal of new requests during a user
pause. One model for every process that runs engines: `serve` (its engines in process, or each
engine-core process of `--api-server-count`) and `play` behind a real vLLM frontend, whose
utility calls (wire/utility.py) act on it. vllm/sleep.py is the HTTP side.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from .lifecycle import release_kv_cache_refusal

logger = logging.getLogger("vllm_vcr.engine.sleep")

SLEEP_TAGS = frozenset({"weights", "kv_cache"})
DRAIN_POLL_S = 0.02
PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."  # vLLM 0.33's retryable refusal


@dataclass
class SleepConfig:
    enabled: bool = False
    sleep_time_ms: float = 0.0
    wake_up_time_ms: float = 0.0

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> "SleepConfig":
        cfg = cls(bool(getattr(args, "enable_sleep_mode", False)), float(getattr(args, "sleep_time", 0.0) or 0.0),
                  float(getattr(args, "wake_up_time", 0.0) or 0.0))
        for flag, v in (("--sleep-time", cfg.sleep_time_ms), ("--wake-up-time", cfg.wake_up_time_ms)):
            if v < 0:
                raise ValueError(f"{flag} must be >= 0, got {v}")
        return cfg


class EngineSleep:
    """vLLM's engine core's `sleep`, `wake_up`, `pause_scheduler`, `pause_generation` (0.33),
    `resume_scheduler`, `release_kv_cache_memory` and `is_sleeping` over `engine`'s engines, driven
    through their public inbox (`set_paused`, `abort_all`, `set_frozen`, `call`). `reject_new` is
    0.33's user pause in mode abort or wait: the caller that admits requests refuses new ones
    (retryable, PAUSED_MESSAGE) until the engine resumes."""

    def __init__(self, engine: Any, config: SleepConfig):
        self.engine = engine  # AsyncEngine-shaped: `engines`, `call_all`
        self.config = config
        self.paused = False
        self.reject_new = False
        self.sleeping_tags: set[str] = set()
        self.level = 0
        self._frozen = False
        # one operation at a time, whoever asks (behind --api-server-count, several API servers do)
        self._lock = asyncio.Lock()

    @property
    def is_sleeping(self) -> bool:
        return self.paused or bool(self.sleeping_tags)

    async def is_sleeping_now(self) -> bool:  # (RemoteSleep's interface)
        return self.is_sleeping

    async def is_paused_now(self) -> bool:
        return self.paused

    async def sleep(self, level: int, mode: str) -> None:
        async with self._lock:
            await self._sleep(level, mode)

    async def wake_up(self, tags: list[str] | None) -> bool:
        async with self._lock:
            return await self._wake_up(tags)

    async def release_kv_cache_memory(self) -> None:
        """After a completed pause, drop the KV cache (waking the `kv_cache` tag brings it back);
        RuntimeError with vLLM's words otherwise."""
        async with self._lock:
            await self._release_kv_cache_memory()

    async def pause(self, mode: str, clear_cache: bool, *, reject_new: bool = False) -> None:
        """pause_scheduler: scheduling stops until resume; weights stay. `reject_new` (0.33's
        pause_generation, modes abort and wait) refuses new requests from the start of the pause."""
        async with self._lock:
            await self._pause(mode, clear_cache=clear_cache and mode != "keep", reject_new=reject_new)

    async def resume(self) -> None:
        async with self._lock:
            self._resume()

    async def _sleep(self, level: int, mode: str) -> None:
        await self._pause(mode, clear_cache=level >= 1)
        if level >= 1:
            if "weights" in self.sleeping_tags:
                logger.warning("Executor is already sleeping.")
            else:
                await self._simulated(self.config.sleep_time_ms)
                self.sleeping_tags = set(SLEEP_TAGS)
        self.level = level
        logger.info("engine asleep (level %d, mode %s)", level, mode)

    async def _wake_up(self, tags: list[str] | None) -> bool:
        if tags is not None and "scheduling" in tags:
            tags = [t for t in tags if t != "scheduling"]
        if tags is None or tags:
            await self._wake_executor(tags)
        fully_awake = not self.sleeping_tags
        if fully_awake:
            self._resume()
            self.level = 0
        return fully_awake

    async def _release_kv_cache_memory(self) -> None:
        counts = await self.engine.call_all(lambda core: core.num_unfinished)
        refusal = release_kv_cache_refusal(self.paused and not any(counts), not self.sleeping_tags)
        if refusal is not None:
            raise RuntimeError(refusal)
        await self.engine.call_all(lambda core: core.reset_prefix_cache())
        self.sleeping_tags = {"kv_cache"}

    async def _pause(self, mode: str, *, clear_cache: bool, reject_new: bool = False) -> None:
        self.paused = True
        if reject_new:
            self.reject_new = True
        cores = list(self.engine.engines)
        for core in cores:  # from here new requests queue in the engine (and count as waiting)
            core.set_paused(True)
        if mode == "abort":
            for core in cores:
                core.abort_all()
        elif mode == "keep":
            for core in cores:
                core.set_frozen(True)
            self._frozen = True
        else:
            await self._drained()
        if clear_cache:
            await self.engine.call_all(lambda core: core.reset_prefix_cache())

    def _resume(self) -> None:
        for core in self.engine.engines:
            if self._frozen:
                core.set_frozen(False)
            core.set_paused(False)
        self._frozen = False
        self.paused = False
        self.reject_new = False

    async def _wake_executor(self, tags: list[str] | None) -> None:
        if not self.sleeping_tags:
            logger.warning("Executor is not sleeping.")
            return
        if tags and any(t not in self.sleeping_tags for t in tags):
            bad = next(t for t in tags if t not in self.sleeping_tags)
            logger.warning("Tag %s is not in sleeping tags %s", bad, self.sleeping_tags)
            return
        await self._simulated(self.config.wake_up_time_ms)
        if tags:
            self.sleeping_tags.difference_update(tags)
        else:
            self.sleeping_tags.clear()

    async def _simulated(self, ms: float) -> None:
        if self.config.enabled and ms > 0:
            await asyncio.sleep(ms / 1000.0)

    async def _drained(self) -> None:
        """mode=wait: until no engine runs a request (new ones already queue, unadmitted)."""
        while True:
            counts = await self.engine.call_all(lambda core: len(core.scheduler.running))
            if not any(counts):
                return
            await asyncio.sleep(DRAIN_POLL_S)
