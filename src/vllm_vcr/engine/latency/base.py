"""The timing interface: how the engine asks a latency model for time.

One interface, two ways to spend it (the core calls both, every model answers both):

- per-request deadlines (`pacing`): at admission a request gets its TTFT and token gaps; the
  step itself takes no time (`step_duration` is 0) and each token is due at its own deadline.
  The knob model and the cell model time requests this way.
- step durations (`times_steps` True): every request's pacing is zero and a step's duration
  comes from its composition (`StepBatch`); its tokens arrive when it ends. The step-time model
  fitted from an engine tap trace does this, and so would a GPU performance model.

Delays are seconds already divided by time_scale.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import NamedTuple


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


def zero_pacing(rng: random.Random) -> RequestPacing:
    """A request's pacing when steps are timed: no delay of its own, every decode due at every step."""
    return RequestPacing(0.0, 0.0, 0.0, rng)


def truncnorm(rng: random.Random, mean: float, std: float) -> float:
    """Normal draw clamped to [0.3, 1.7] x mean (llm-d-inference-sim's bounds)."""
    if std == 0.0 or mean == 0.0:
        return mean
    v = rng.gauss(mean, std)
    return min(max(v, 0.3 * mean), 1.7 * mean)


def inverse_cdf(sorted_samples: Sequence[float], u: float) -> float:
    """The u-quantile of sorted samples, interpolated between neighbours (inverse-CDF draw)."""
    n = len(sorted_samples)
    if n == 1:
        return sorted_samples[0]
    pos = u * (n - 1)
    i = min(int(pos), n - 2)
    f = pos - i
    return sorted_samples[i] * (1 - f) + sorted_samples[i + 1] * f


class StepBatch(NamedTuple):
    """What one step computes: its scheduled composition, the features a step-time model may use
    (and what a per-step observer records)."""

    num_decodes: int  # requests computing one (decode) token, incl. first tokens after a KV pull
    num_prefill_tokens: int  # prompt tokens computed by prefill chunks in this step
    num_prefills: int  # requests with a prefill chunk in this step
    num_first_tokens: int  # of those, the ones whose prefill completes (they sample a token)
    decode_context: int  # tokens of context the decodes attend to (sum of their lengths)
    after_idle: bool = False  # the engine had nothing to do before this step (it was woken up)
    prefill_context: int = 0  # tokens already computed before this step's prefill chunks (sum)
    num_prefix_hit_tokens: int = 0  # prompt tokens found in the prefix cache by requests starting here
    decode_context_lens: tuple[int, ...] = ()  # each decode's context length
    prefill_chunk_lens: tuple[int, ...] = ()  # each prefill chunk's length (forward-pass metrics)


_DUMMY_BATCH = StepBatch(1, 0, 0, 0, 1, decode_context_lens=(1,))


class StepRecord(NamedTuple):
    """One executed step, as a step observer sees it (`EngineCore.add_step_observer`)."""

    step: int  # the engine's step counter
    start: float  # engine clock (seconds)
    duration: float  # seconds (0 when requests are paced by their own deadlines)
    batch: StepBatch


class LatencyModel:
    """The timing interface every latency model implements (defaults: per-request deadlines)."""

    is_knob = False  # the latency knobs of the config drive it (the control API may patch them)
    times_steps = False  # True: `step_duration` times every step and `pacing` is zero
    # True: the engine schedules step n+1 while step n runs (vLLM's async scheduling), so a request
    # the engine core receives during step n joins step n+2 at the earliest (engine/step.py)
    schedules_ahead = False
    # True: the model is an MoE one, whose data-parallel ranks vLLM and SGLang step in lockstep, each
    # by its engine type's rule (engine/lockstep.py, `EnginePolicy.dp_lockstep`)
    data_parallel_lockstep = False

    def pacing(self, num_prompt_tokens: int, num_cached_tokens: int, num_running: int,
               rng: random.Random) -> RequestPacing:
        raise NotImplementedError

    def step_duration(self, batch: StepBatch, rng: random.Random) -> float:
        """Seconds the step computing `batch` takes."""
        return 0.0

    def dummy_step_duration(self, rng: random.Random) -> float:
        """Seconds a data-parallel rank's dummy step takes (vLLM's `execute_dummy_batch`: a
        forward pass of one decode token)."""
        return self.step_duration(_DUMMY_BATCH, rng)

    def input_delay(self, rng: random.Random) -> float:
        """Seconds before the engine sees a request that arrived while a step ran."""
        return 0.0

    def frontend_delay(self, num_prompt_tokens: int, num_in_flight: int) -> float:
        """Seconds the serving frontend spends on a request before the engine core sees it
        (tokenising the prompt, scheduling it behind the work for the `num_in_flight` requests it
        already serves), as a deployment's host has it; 0: none modelled (the engine sees a
        request when it arrives)."""
        return 0.0

    def sample_output_len(self, rng: random.Random) -> int | None:
        """An output length the recording says a request would stop at (EOS), or None."""
        return None

    def with_config(self, config) -> "LatencyModel":
        """The model after a config patch (only knob models read the config)."""
        return self
