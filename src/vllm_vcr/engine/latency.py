"""Latency models.

A model turns a request's shape and the engine load into delays (seconds). The engine fixes a
request's pacing when it is admitted (`RequestPacing`): later config patches only affect requests
admitted afterwards. The knob model follows llm-d-inference-sim's semantics, with float
milliseconds (sub-millisecond values work; nothing is truncated to whole ms).
"""

from __future__ import annotations

import random
from typing import Protocol

from .config import EngineConfig


class RequestPacing:
    """Per-request timing drawn at admission."""

    __slots__ = ("ttft", "itl_mean", "itl_std", "_rng")

    def __init__(self, ttft: float, itl_mean: float, itl_std: float, rng: random.Random) -> None:
        self.ttft = ttft
        self.itl_mean = itl_mean
        self.itl_std = itl_std
        self._rng = rng

    first_chunk = 1

    def next_gap(self) -> float:
        if self.itl_std == 0.0:
            return self.itl_mean
        return truncnorm(self._rng, self.itl_mean, self.itl_std)

    def next_step(self) -> tuple[float, int]:
        """Gap to the next chunk and its size (always one token for model-drawn pacing)."""
        return self.next_gap(), 1


class LatencyModel(Protocol):
    is_knob: bool

    def pacing(self, num_prompt_tokens: int, num_cached_tokens: int, num_running: int,
               rng: random.Random) -> RequestPacing: ...


def truncnorm(rng: random.Random, mean: float, std: float) -> float:
    """Normal draw clamped to [0.3, 1.7] x mean (llm-d-inference-sim's bounds)."""
    if std == 0.0 or mean == 0.0:
        return mean
    v = rng.gauss(mean, std)
    return min(max(v, 0.3 * mean), 1.7 * mean)


class KnobLatency:
    """TTFT / ITL / prefill knobs in milliseconds, scaled by load and divided by time_scale."""

    is_knob = True

    def __init__(self, config: EngineConfig, time_scale: float = 1.0) -> None:
        self.config = config
        self._ms = 1e-3 / time_scale

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
