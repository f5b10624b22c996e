"""The step-time model: a step's duration from its composition (fitted by replay/latency_fit/steps.py).

duration (ms) = a + b·decodes + c·prefill tokens + d·first tokens + e·decode context/1000, times
a residual drawn by inverse CDF from the recorded spread of the step's class (decode-only;
prefill back to back with the previous step; prefill that woke an idle engine, which also pays
the wake-up): below the line as a ratio (the near-zero gaps of a message burst scale with the
step), above it as the excess time (a stall of the box does not grow with the batch it hits).

The input path: a request that arrives while a step runs is seen by the engine after a delay
drawn from the fitted survival function (`InputDelay`), so one arriving just before the step
ends waits for one more step.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from .base import LatencyModel, RequestPacing, StepBatch, inverse_cdf, zero_pacing

FEATURES = ("intercept", "decodes", "prefill_tokens", "first_tokens", "decode_kilotokens")
DECODE_STEP, PREFILL_STEP, PREFILL_AFTER_IDLE = 0, 1, 2
CLASSES = (DECODE_STEP, PREFILL_STEP, PREFILL_AFTER_IDLE)


def step_class(has_prefill: bool, after_idle: bool) -> int:
    if not has_prefill:
        return DECODE_STEP
    return PREFILL_AFTER_IDLE if after_idle else PREFILL_STEP


class Residuals:
    """What the line does not explain, for one class of steps: the share of steps below the line,
    their sorted ratios to it, and the sorted excess times of the others (ms)."""

    __slots__ = ("excess", "p_below", "ratios")

    def __init__(self, p_below: float, ratios: list[float], excess: list[float]) -> None:
        self.p_below = p_below
        self.ratios = ratios or [1.0]
        self.excess = excess or [0.0]

    def apply(self, line: float, u: float) -> float:
        if u < self.p_below:
            return line * inverse_cdf(self.ratios, u / self.p_below)
        return line + inverse_cdf(self.excess, (u - self.p_below) / (1 - self.p_below))


class InputDelay:
    """The engine's input delay: P(delay > leads[k]) = survival[k] (non-increasing, ending at 0)."""

    __slots__ = ("horizon", "leads", "plateau", "survival")

    def __init__(self, leads: list[float], survival: list[float], horizon: float = 0.0, plateau: float = 0.0) -> None:
        self.leads = leads
        self.survival = survival
        self.horizon = horizon  # no delay beyond this lead (ms)
        self.plateau = plateau  # the late-miss rate taken out of the fit (tap bursts, not a delay)

    def draw_ms(self, u: float) -> float:
        """The delay with P(delay > leads[k]) = survival[k]: up to the first lead whose survival is <= u."""
        surv = self.survival
        if not surv:
            return 0.0
        lo, hi = 0, len(surv) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if surv[mid] <= u:
                hi = mid
            else:
                lo = mid + 1
        # the delay lies between the last lead it exceeded and this one: the midpoint
        leads = self.leads
        return (leads[lo - 1] + leads[lo]) / 2 if lo else leads[0] / 2

    def median_ms(self) -> float:
        return self.draw_ms(0.5)


class StepLatency(LatencyModel):
    """The fitted step-time model: it times steps, so every request's own pacing is zero."""

    times_steps = True

    def __init__(self, coef: Sequence[float], residuals: dict[int, Residuals], output_lengths: list[int],
                 input_delay_model: InputDelay | None, time_scale: float = 1.0) -> None:
        self.coef = tuple(float(c) for c in coef)
        self.residuals = residuals
        self.output_lengths = sorted(output_lengths)
        self.input_delay_model = input_delay_model
        self._scale = 1e-3 / time_scale

    def coefficients(self) -> dict[str, float]:
        return dict(zip(FEATURES, self.coef))

    def line_ms(self, batch: StepBatch) -> float:
        c = self.coef
        return (c[0] + c[1] * batch.num_decodes + c[2] * batch.num_prefill_tokens + c[3] * batch.num_first_tokens
                + c[4] * batch.decode_context / 1000)

    def step_duration(self, batch: StepBatch, rng: random.Random) -> float:
        line = max(self.line_ms(batch), 0.0)
        cls = step_class(batch.num_first_tokens > 0, batch.after_idle)
        return self.residuals[cls].apply(line, rng.random()) * self._scale

    def input_delay(self, rng: random.Random) -> float:
        if self.input_delay_model is None:
            return 0.0
        return self.input_delay_model.draw_ms(rng.random()) * self._scale

    def pacing(self, num_prompt_tokens: int, num_cached_tokens: int, num_running: int,
               rng: random.Random) -> RequestPacing:
        return zero_pacing(rng)

    def sample_output_len(self, rng: random.Random) -> int | None:
        if not self.output_lengths:
            return None
        return max(int(round(inverse_cdf(self.output_lengths, rng.random()))), 1)
