"""Sleep mode in `serve`: vLLM's `/sleep`, `/wake_up` and `/is_sleeping` (dev-mode routes).

vLLM 0.32 serves them only with `VLLM_SERVER_DEV_MODE=1`. `POST /sleep?level=0|1|2&mode=abort|
wait|keep` pauses scheduling first (abort: every request ends with finish_reason "abort"; wait:
running requests finish first; keep: they stay where they are, producing nothing), then at level
>= 1 drops the prefix cache and puts the weights and the KV cache to sleep. New requests queue in
the engine (counted as waiting) until it is awake again. `POST /wake_up[?tags=weights&tags=kv_cache&tags=scheduling]`
wakes the named parts (all without tags); scheduling resumes only once nothing is asleep, and
the answer says whether the engine is fully awake. `vllm:engine_sleep_state` follows.

`--enable-sleep-mode` is what lets vLLM release GPU memory while asleep; here it turns on the
simulated offload time (`--sleep-time` / `--wake-up-time`): without it a sleep takes no time, as
nothing is released.

The engines' side (the paused scheduler, the sleeping tags) is engine/sleep.py's EngineSleep, in
this process or in each engine-core process of `--api-server-count` (reached by RemoteSleep).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal
from urllib.parse import parse_qs

from pydantic import BaseModel, Field, ValidationError

from ..engine.core import EngineDeadError
from ..engine.lifecycle import release_kv_cache_refusal
from ..engine.sleep import EngineSleep, SleepConfig
from ..frontend.errors import validation_error

OPERATION_BUCKETS = (0.01, 0.1, 1, 10, 30, 60, 120, 300, 600)


class SleepQuery(BaseModel):
    level: Annotated[int, Field(ge=0, le=2)] = 1
    mode: Literal["abort", "wait", "keep"] = "abort"


def query_params(scope: dict[str, Any]) -> dict[str, list[str]]:
    return parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)


def parse_sleep_query(scope: dict[str, Any]) -> SleepQuery:
    """FastAPI's reading of the query (the last value of a repeated key) and vLLM's 400 for bad ones."""
    raw = {k: v[-1] for k, v in query_params(scope).items() if k in SleepQuery.model_fields}
    try:
        return SleepQuery.model_validate(raw)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False), where="query") from None


RELEASE_KV_FAILED = "Call to release_kv_cache_memory method failed: "


class RemoteSleep:
    """EngineSleep's interface over vLLM's utility calls, to the engine-core processes of
    `--api-server-count` (each holds its EngineSleep): every call goes to every engine, as vLLM's
    data-parallel client sends it; `wake_up` is fully awake when every engine is, `is_sleeping` and
    `is_paused` when any engine is."""

    def __init__(self, utility: Callable[..., Awaitable[list[Any]]]):
        self.utility = utility  # (method, *args) -> one answer per engine, in rank order

    async def sleep(self, level: int, mode: str) -> None:
        await self.utility("sleep", level, mode)

    async def wake_up(self, tags: list[str] | None) -> bool:
        return all(await self.utility("wake_up", tags))

    async def release_kv_cache_memory(self) -> None:
        """Refused as one process with these engines refuses: for want of a completed pause if any
        engine says so (that check comes first), else the first refusal."""
        answers = await self.utility("release_kv_cache_memory", return_exceptions=True)
        for a in answers:
            if isinstance(a, EngineDeadError):
                raise a
        refusals = [str(a).removeprefix(RELEASE_KV_FAILED) for a in answers if isinstance(a, BaseException)]
        if refusals:
            not_paused = release_kv_cache_refusal(False, True)
            raise RuntimeError(not_paused if not_paused in refusals else refusals[0])

    async def pause(self, mode: str, clear_cache: bool) -> None:
        await self.utility("pause_scheduler", mode, clear_cache)

    async def resume(self) -> None:
        await self.utility("resume_scheduler")

    async def is_sleeping_now(self) -> bool:
        return any(await self.utility("is_sleeping"))

    async def is_paused_now(self) -> bool:
        return any(await self.utility("is_scheduler_paused"))


class SleepControl:
    """The frontend's side of sleep mode: one operation at a time, the operation metrics and
    `vllm:engine_sleep_state` (vLLM's AsyncLLM records them); the engines' state is in an
    EngineSleep, here or (an engine-core client: `utility`) in the engine-core processes."""

    def __init__(self, engine: Any, config: SleepConfig, metrics: Any = None):
        utility = getattr(engine, "utility", None)
        self.engine_side: EngineSleep | RemoteSleep = (RemoteSleep(utility) if utility is not None
                                                       else EngineSleep(engine, config))
        self._registry = getattr(metrics, "registry", None)
        self._op_metrics: _OperationMetrics | None = None
        self.config = config
        self.metrics = metrics
        self._lock = asyncio.Lock()

    def op_metrics(self) -> "_OperationMetrics":
        """The operation series, registered by the first sleep-mode operation (as vLLM's)."""
        if self._op_metrics is None:
            self._op_metrics = _OperationMetrics(self._registry)
        return self._op_metrics

    async def is_sleeping(self) -> bool:
        return await self.engine_side.is_sleeping_now()

    async def is_paused(self) -> bool:
        return await self.engine_side.is_paused_now()

    async def sleep(self, level: int, mode: str) -> None:
        async with self._operation("sleep"):
            await self.engine_side.sleep(level, mode)
            self._set_metric(sleeping=True, level=level)

    async def wake_up(self, tags: list[str] | None) -> bool:
        async with self._operation("wake"):
            fully_awake = await self.engine_side.wake_up(tags)
            if fully_awake:
                self._set_metric(sleeping=False, level=0)
            return fully_awake

    async def release_kv_cache_memory(self) -> None:
        """vLLM's /release_kv_cache_memory; RuntimeError with the engine's words when refused."""
        async with self._operation("release_kv_cache_memory"):
            await self.engine_side.release_kv_cache_memory()
            self._set_metric(sleeping=True, level=0)

    async def pause(self, mode: str, clear_cache: bool) -> None:
        """vLLM's /pause (pause_generation): scheduling stops until /resume; weights stay."""
        async with self._lock:
            await self.engine_side.pause(mode, clear_cache)

    async def resume(self) -> None:
        async with self._lock:
            await self.engine_side.resume()

    def _set_metric(self, *, sleeping: bool, level: int) -> None:
        if self.metrics is not None and hasattr(self.metrics, "set_sleep_state"):
            self.metrics.set_sleep_state(None, level, sleeping=sleeping)

    def _operation(self, name: str) -> "_Operation":
        return _Operation(self, name)


class _OperationMetrics:
    """vLLM's sleep-mode operation series (registered by the first operation, as vLLM does)."""

    def __init__(self, registry: Any):
        self.duration = self.in_flight = None
        if registry is None:
            return
        from prometheus_client import Gauge, Histogram

        self.duration = Histogram("vllm:sleep_mode_operation_duration_seconds",
                                  "Duration of one sleep-mode operation.", ["operation"],
                                  buckets=OPERATION_BUCKETS, registry=registry)
        self.in_flight = Gauge("vllm:sleep_mode_operations_in_flight", "Sleep-mode operations currently awaited.",
                               ["operation"], registry=registry)


class _Operation:
    """One sleep-mode operation: serialized, timed and counted in flight."""

    def __init__(self, control: SleepControl, name: str):
        self.control = control
        self.name = name

    async def __aenter__(self) -> None:
        m = self.control.op_metrics()
        if m.in_flight is not None:
            m.in_flight.labels(self.name).inc()
        self.start = time.perf_counter()
        await self.control._lock.acquire()

    async def __aexit__(self, *exc: Any) -> None:
        self.control._lock.release()
        m = self.control.op_metrics()
        if m.in_flight is not None:
            m.in_flight.labels(self.name).dec()
            m.duration.labels(self.name).observe(time.perf_counter() - self.start)
