"""The knob model: TTFT / ITL / prefill knobs of the config (llm-d-inference-sim's semantics, float
milliseconds: sub-millisecond values work, nothing is truncated to whole ms)."""

from __future__ import annotations

import random

from ..config import EngineConfig
from .base import LatencyModel, RequestPacing, truncnorm


class KnobLatency(LatencyModel):
    """TTFT / ITL / prefill knobs in milliseconds, scaled by load and divided by time_scale."""

    is_knob = True

    def __init__(self, config: EngineConfig, time_scale: float = 1.0) -> None:
        self.config = config
        self.time_scale = time_scale
        self._ms = 1e-3 / time_scale

    def with_config(self, config: EngineConfig) -> KnobLatency:
        return KnobLatency(config, self.time_scale)

    def load_factor(self, num_running: int) -> float:
        c = self.config
        if c.max_num_seqs <= 1 or c.time_factor_under_load == 1.0:
            return 1.0
        n = min(max(num_running - 1, 0), c.max_num_seqs - 1)
        return 1.0 + (c.time_factor_under_load - 1.0) * n / (c.max_num_seqs - 1)

    def pacing(self, num_prompt_tokens: int, num_cached_tokens: int, num_running: int,
               rng: random.Random) -> RequestPacing:
        c = self.config
        load = self.load_factor(num_running)
        if c.time_to_first_token == 0.0 and c.time_to_first_token_std_dev == 0.0:
            uncached = max(num_prompt_tokens - num_cached_tokens, 0)
            mean = (c.prefill_overhead + uncached * c.prefill_time_per_token) * load
            ttft = truncnorm(rng, mean, c.prefill_time_std_dev)
        else:
            ttft = truncnorm(rng, c.time_to_first_token * load, c.time_to_first_token_std_dev)
        ms = self._ms
        return RequestPacing(ttft * ms, c.inter_token_latency * load * ms,
                             c.inter_token_latency_std_dev * ms, rng)
