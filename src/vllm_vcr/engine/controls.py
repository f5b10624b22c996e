"""The control surface of an EngineCore: what the control API and the adapters run inside
`core.call()`, between two steps: config patches, the stats window, the prefix cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import LATENCY_FIELDS, EngineConfig
from .stats import EngineStats
from .types import SchedulerStats

if TYPE_CHECKING:
    from .block_pool import BlockPool
    from .latency import LatencyModel
    from .output import OutputProcessor
    from .request import Request
    from .scheduler import Scheduler


class LatencyTraceActive(Exception):
    """A latency knob was patched while a recorded trace paces requests (control API: 409)."""


class EngineControls:
    """Mixed into EngineCore, whose state these read and patch (only ever from inside the loop)."""

    _config: EngineConfig
    latency: LatencyModel
    output: OutputProcessor
    scheduler: Scheduler
    block_pool: BlockPool
    requests: dict[str, Request]
    stats: EngineStats
    step_counter: int
    args: Any

    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def latency_source_is_knob(self) -> bool:
        return self.latency.is_knob

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def check_patch(self, patch: dict[str, Any]) -> EngineConfig:
        """The config a patch would give (ConfigError if invalid; LatencyTraceActive if it sets
        latency knobs while a recorded trace paces requests). Applies nothing."""
        knobs = [k for k in patch if k in LATENCY_FIELDS]
        if knobs and not self.latency.is_knob:
            raise LatencyTraceActive(f"{', '.join(knobs)}: a recorded latency trace (--latency-trace) paces "
                                     "requests, not the latency knobs; patching them would silently do nothing")
        return self._config.patched(patch)

    def patch_config(self, patch: dict[str, Any]) -> EngineConfig:
        """Apply a validated patch at this step boundary; new requests see it, in-flight keep theirs."""
        new = self._config = self.check_patch(patch)
        self.latency = self.latency.with_config(new)
        self.output.max_model_len = new.max_model_len
        self.output.steady.dissolve()
        for req in self.scheduler.running:  # their steady runs were counted against the old length
            req.steady_left = 0
        return new

    def current_stats(self) -> EngineStats:
        s = self.stats
        s.running = len(self.scheduler.running)
        s.waiting = len(self.scheduler.waiting)
        return EngineStats(**{f: getattr(s, f) for f in s.__struct_fields__})

    def reset_stats(self) -> None:
        # requests still in flight finish inside the new window: counting them as received there
        # keeps received == completed + failed + aborted once idle. In place: admission and the
        # output processor count into this one object.
        s, fresh = self.stats, EngineStats(requests_received=len(self.requests))
        for f in fresh.__struct_fields__:
            setattr(s, f, getattr(fresh, f))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def load(self) -> dict[str, Any]:
        """The scheduler's load as routers read it (SGLang's internal_states, gRPC's GetLoads)."""
        pool = self.block_pool
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "token_usage": pool.usage(), "token_capacity": pool.num_blocks * self.args.tokens_per_block}

    def scheduler_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats(self.step_counter, self.block_pool.usage())
