"""A step-time model fitted from an engine-side trace (`--latency-trace`, step mode).

The engine tap stamps every output message of the real engine; every request that got a token
in one engine step got it in the same message. So the records of a tap trace (arrival, TTFT and
the gaps after it, all on one clock) give back the engine's step timeline:

1. every token's time is arrival + TTFT + the gaps so far; tokens stamped together (within
   `SAME_MESSAGE_MS`) came from one step;
2. a step's composition: the requests that got their *first* token in it (their uncached prompt
   tokens were its prefill), and the ones that got a later token (its decodes, with their context
   lengths);
3. its duration: from the previous message if the engine still had work then (back-to-back
   steps), else from the arrival that woke the idle engine.

The fit: duration (ms) ≈ a + b·decodes + c·prefill tokens + d·first tokens + e·decode context/1000,
a least-absolute-deviation fit (IRLS), so the stalls do not drag the line; slopes are kept
non-negative. What the line does not explain stays as residuals per step class (decode-only;
prefill back to back with the previous step; prefill that woke an idle engine, which also pays
the wake-up), drawn by inverse CDF so the replayed steps keep the recorded spread, tails
included: below the line as a ratio (the near-zero gaps of a message burst, when the engine's
output thread catches up, scale with the step), above it as the excess time (a stall of the box
does not grow with the batch it hits).

The input path: a request that reaches the tap while a step runs is not always in the next step.
The engine sees it some time later (its input thread, deserialization; ~1.5-2 ms on the CPU box),
so one that arrives within that time of the step's end waits for one more step. From the busy
arrivals of the trace (arrived during a step, the next step back to back and not full), the
chance that a request missed the next step as a function of the time it had until the step
ended is the survival function of that delay (current-status data; a decreasing isotonic fit);
the engine draws each arrival's delay from it (`input_delay`). A delay is only felt when the
next step runs anyway: at an idle engine the wake-up step's duration already holds it.

Limits: a step that emitted nothing (a chunk of a prompt longer than the token budget with no
decode running) is invisible, and its time lands in the next visible step; the fit attributes a
request's whole uncached prompt to the step that emitted its first token.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..engine.step_timing import StepBatch, zero_pacing
from .io import read_trace
from .schema import TraceRecord, replay_subset

SAME_MESSAGE_MS = 0.005  # token times closer than this are one output message (rounding only)
FEATURES = ("intercept", "decodes", "prefill_tokens", "first_tokens", "decode_kilotokens")
MIN_CLASS_STEPS = 20  # residuals of a class with fewer steps fall back to all steps'
MIN_BUSY_ARRIVALS = 20  # fewer busy arrivals than this: no input delay is fitted
PLATEAU_FACTOR = 3.0  # misses beyond this × the half-miss lead are the tap's bursts, not the input path
# Residual classes: decode-only steps; steps with a prefill, back to back with the previous step
# or started by an arrival at an idle engine (those carry the wake-up: the input path and the
# engine process being scheduled again, which a busy engine does not pay).
DECODE_STEP, PREFILL_STEP, PREFILL_AFTER_IDLE = 0, 1, 2
CLASSES = (DECODE_STEP, PREFILL_STEP, PREFILL_AFTER_IDLE)


def step_class(has_prefill: bool, after_idle: bool) -> int:
    if not has_prefill:
        return DECODE_STEP
    return PREFILL_AFTER_IDLE if after_idle else PREFILL_STEP


@dataclass(frozen=True)
class RecordedStep:
    start_ms: float
    end_ms: float
    num_decodes: int
    num_prefill_tokens: int
    num_first_tokens: int
    decode_context: int
    after_idle: bool  # the step started when a request woke an idle engine

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms

    @property
    def has_prefill(self) -> bool:
        return self.num_first_tokens > 0


def reconstruct_steps(records: Sequence[TraceRecord]) -> list[RecordedStep]:
    """The engine's steps as the tap saw them, from records with arrival times."""
    timed = replay_subset(list(records))
    events: list[tuple[float, int, int, int]] = []  # (time ms, request, 0 first | 1 decode, tokens)
    spans: list[tuple[float, float]] = []
    for i, r in enumerate(timed):
        t = r.arrival_ms + r.ttft_ms
        events.append((t, i, 0, r.uncached_prompt_tokens()))
        ctx = r.prompt_tokens + r.first_chunk_tokens()
        for gap, k in zip(r.itl_ms or (), r.gap_tokens()):
            t += gap
            events.append((t, i, 1, ctx))
            ctx += k
        spans.append((r.arrival_ms, t))
    if not events:
        return []
    events.sort()
    groups: list[list[tuple[float, int, int, int]]] = [[events[0]]]
    for e in events[1:]:
        if e[0] - groups[-1][0][0] <= SAME_MESSAGE_MS:
            groups[-1].append(e)
        else:
            groups.append([e])
    # the engine is busy just after a message if any request that arrived by then has a token
    # still to come (a request's own tokens are its work)
    arrivals = sorted(a for a, _ in spans)
    by_arrival = sorted(spans)
    ends_prefix_max = np.maximum.accumulate(np.array([end for _, end in by_arrival]))
    steps: list[RecordedStep] = []
    prev_end: float | None = None
    for g in groups:
        t = g[0][0]
        first = [e for e in g if e[2] == 0]
        decodes = [e for e in g if e[2] == 1]
        start: float | None = None
        after_idle = False
        if prev_end is not None:
            n = bisect.bisect_right(arrivals, prev_end)
            busy = n > 0 and ends_prefix_max[n - 1] > prev_end + SAME_MESSAGE_MS
            if busy:
                start = prev_end
            else:
                k = bisect.bisect_right(arrivals, prev_end)
                if k < len(arrivals) and arrivals[k] <= t:
                    start, after_idle = arrivals[k], True
        else:
            k = bisect.bisect_right(arrivals, t) - 1
            if k >= 0 and first:
                start, after_idle = arrivals[0], True
        prev_end = t
        if start is None or t - start < 0:
            continue
        steps.append(RecordedStep(start, t, len(decodes), sum(e[3] for e in first), len(first),
                                  sum(e[3] for e in decodes), after_idle))
    return steps


def _decreasing_isotonic(y: Sequence[float]) -> list[float]:
    """Least-squares non-increasing fit (pool adjacent violators)."""
    vals: list[float] = []
    weights: list[int] = []
    for v in y:
        vals.append(float(v))
        weights.append(1)
        while len(vals) > 1 and vals[-2] < vals[-1]:
            v2, w2 = vals.pop(), weights.pop()
            vals[-1] = (vals[-1] * weights[-1] + v2 * w2) / (weights[-1] + w2)
            weights[-1] += w2
    out: list[float] = []
    for v, w in zip(vals, weights):
        out += [v] * w
    return out


def busy_arrivals(records: Sequence[TraceRecord], steps: Sequence[RecordedStep],
                  max_num_seqs: int | None = None) -> list[tuple[float, bool]]:
    """(time the request had until the step in flight ended, whether it missed the next step) for
    every request that arrived during a step whose successor ran back to back with room for it
    and with other work (a step that only computes the request waits for it: no information)."""
    starts = [s.start_ms for s in steps]
    ends = [s.end_ms for s in steps]
    cap = max_num_seqs or max((s.num_decodes + s.num_first_tokens for s in steps), default=0)
    out: list[tuple[float, bool]] = []
    for r in replay_subset(list(records)):
        a = r.arrival_ms
        first = a + r.ttft_ms
        i = bisect.bisect_right(ends, a)  # the step in flight when it arrived
        if i + 1 >= len(steps) or starts[i] >= a - SAME_MESSAGE_MS or first < ends[i] - SAME_MESSAGE_MS:
            continue  # the engine was idle (or the request woke it)
        nxt = steps[i + 1]
        if nxt.start_ms > ends[i] + SAME_MESSAGE_MS or nxt.num_decodes + nxt.num_first_tokens >= cap:
            continue  # no step back to back, or the next one had no room for it anyway
        missed = first > nxt.end_ms + SAME_MESSAGE_MS
        if not missed and nxt.num_decodes + nxt.num_first_tokens == 1:
            continue  # it was all the next step did: that step waited for it, whatever the delay
        out.append((ends[i] - a, missed))
    return out


class InputDelay:
    """The engine's input delay, drawn by inverse CDF from the survival function fitted on the
    busy arrivals (`busy_arrivals`): P(delay > lead) = the isotonic fit of "missed" on the lead.

    The fit levels off at a few % for long leads (6-8 % on the CPU traces): requests that missed
    the next step although it ended 5-200 ms after they arrived. Those are the tap's message
    bursts (a step's output stamped late, just before the next one's, so the step in flight seems
    to end later than it did), not a delay, so the plateau is taken out: the delay is drawn from
    the survival function less the plateau (the miss rate of the leads beyond PLATEAU_FACTOR times the
lead where half the requests missed), rescaled, and 0 beyond that horizon."""

    __slots__ = ("horizon", "leads", "plateau", "survival")

    def __init__(self, samples: Sequence[tuple[float, bool]]) -> None:
        samples = sorted(samples)
        fit = _decreasing_isotonic([1.0 if m else 0.0 for _, m in samples])
        leads = [d for d, _ in samples]
        # the plateau: the miss rate beyond PLATEAU_FACTOR x the lead where the fit drops below 1/2
        half = next((d for d, v in zip(leads, fit) if v < 0.5), leads[-1] if leads else 0.0)
        self.horizon = PLATEAU_FACTOR * half
        far = [m for d, m in samples if d > self.horizon]
        self.plateau = sum(far) / len(far) if far else 0.0
        top = (fit[0] - self.plateau) if fit else 0.0
        keep = [k for k, d in enumerate(leads) if d <= self.horizon]
        self.leads = [leads[k] for k in keep]
        self.survival = [max(fit[k] - self.plateau, 0.0) / top if top > 0 else 0.0 for k in keep]
        if self.survival:
            self.survival[-1] = 0.0  # no delay beyond the horizon

    def draw_ms(self, u: float) -> float:
        """The delay with P(delay > leads[k]) = survival[k]: up to the first lead whose survival is <= u."""
        surv = self.survival
        if not surv:
            return 0.0
        lo, hi = 0, len(surv) - 1  # survival is non-increasing and ends at 0
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


def _design(steps: Sequence[RecordedStep]) -> np.ndarray:
    return np.array([[1.0, s.num_decodes, s.num_prefill_tokens, s.num_first_tokens, s.decode_context / 1000]
                     for s in steps])


def lad_fit(x: np.ndarray, y: np.ndarray, iters: int = 100) -> np.ndarray:
    """Least absolute deviations by iteratively reweighted least squares, slopes >= 0.

    Non-negative because every feature adds work to a step: a column the data cannot resolve
    (e.g. no step ever had a prefill) gets 0 instead of noise. A slope that comes out negative is
    dropped (the most negative first) and the rest refitted."""
    active = [j for j in range(x.shape[1]) if j == 0 or np.any(x[:, j] != 0)]
    while True:
        sol = _irls(x[:, active], y, iters)
        neg = [(v, j) for v, j in zip(sol, active) if v < 0 and j != 0]
        if not neg:
            break
        active.remove(min(neg)[1])
    coef = np.zeros(x.shape[1])
    coef[active] = sol
    return coef


def _irls(x: np.ndarray, y: np.ndarray, iters: int) -> np.ndarray:
    w = np.ones(len(y))
    coef = np.zeros(x.shape[1])
    for _ in range(iters):
        new, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
        if np.allclose(new, coef, rtol=1e-7, atol=1e-9):
            return new
        coef = new
        # weight 1/|residual| on the squares: the L1 objective
        w = 1.0 / np.sqrt(np.maximum(np.abs(y - x @ coef), 1e-4))
    return coef


def _draw(sorted_samples: Sequence[float], u: float) -> float:
    n = len(sorted_samples)
    if n == 1:
        return sorted_samples[0]
    pos = u * (n - 1)
    i = min(int(pos), n - 2)
    f = pos - i
    return sorted_samples[i] * (1 - f) + sorted_samples[i + 1] * f


class _Residuals:
    """What the line does not explain, for one class of steps.

    Below the line a recorded step is kept as a ratio (a step that came out in a burst, or a
    lighter one, scales with the work); above it as the time in excess (a stall of the box does
    not grow with the batch it hits: scaled, one stall at low load turns into a huge one at high
    load and feeds back into the queue)."""

    __slots__ = ("excess", "p_below", "ratios")

    def __init__(self, y: np.ndarray, line: np.ndarray) -> None:
        below = y < line
        self.p_below = float(below.mean()) if len(y) else 0.0
        self.ratios = sorted((y[below] / line[below]).tolist()) or [1.0]
        self.excess = sorted((y[~below] - line[~below]).tolist()) or [0.0]

    def apply(self, line: float, u: float) -> float:
        if u < self.p_below:
            return line * _draw(self.ratios, u / self.p_below)
        return line + _draw(self.excess, (u - self.p_below) / (1 - self.p_below))


class StepLatency:
    """The fitted step-time model, as the engine's latency source (it puts the engine in step mode)."""

    is_knob = False

    def __init__(self, records: Sequence[TraceRecord], time_scale: float = 1.0) -> None:
        self.config = None  # set by the engine; the knobs do not apply
        self._scale = 1e-3 / time_scale
        steps = reconstruct_steps(records)
        if len(steps) < 2:
            raise ValueError("latency trace has too few steps to fit a step-time model "
                             "(it needs records with arrival_ms and inter-token gaps, e.g. an engine tap trace)")
        self.steps = steps
        x = _design(steps)
        y = np.array([s.duration_ms for s in steps])
        self.coef = lad_fit(x, y)
        line = np.maximum(x @ self.coef, 1e-3)
        classes = np.array([step_class(s.has_prefill, s.after_idle) for s in steps])
        self.residuals: dict[int, _Residuals] = {}
        pooled = _Residuals(y, line)
        for cls in CLASSES:
            sel = classes == cls
            if sel.sum() < MIN_CLASS_STEPS and cls == PREFILL_AFTER_IDLE:
                sel = classes != DECODE_STEP  # few idle wake-ups: every prefill step's spread
            self.residuals[cls] = _Residuals(y[sel], line[sel]) if sel.sum() >= MIN_CLASS_STEPS else pooled
        self.output_lengths = sorted(r.output_tokens for r in records if r.output_tokens > 0)
        busy = busy_arrivals(records, steps)
        self.input_delay_model = InputDelay(busy) if len(busy) >= MIN_BUSY_ARRIVALS else None

    @classmethod
    def from_path(cls, path: str, time_scale: float = 1.0) -> StepLatency:
        return cls(read_trace(path).records, time_scale)

    def coefficients(self) -> dict[str, float]:
        return dict(zip(FEATURES, (float(c) for c in self.coef)))

    def line_ms(self, batch: StepBatch) -> float:
        c = self.coef
        return (c[0] + c[1] * batch.num_decodes + c[2] * batch.num_prefill_tokens + c[3] * batch.num_first_tokens
                + c[4] * batch.decode_context / 1000)

    # --- the engine's hooks --------------------------------------------------------------------
    def step_duration(self, batch: StepBatch, rng: random.Random) -> float:
        line = max(self.line_ms(batch), 0.0)
        cls = step_class(batch.num_first_tokens > 0, batch.after_idle)
        return self.residuals[cls].apply(line, rng.random()) * self._scale

    def input_delay(self, rng: random.Random) -> float:
        """Seconds before the engine sees a request that arrived during a step."""
        if self.input_delay_model is None:
            return 0.0
        return self.input_delay_model.draw_ms(rng.random()) * self._scale

    def pacing(self, num_prompt_tokens: int, num_cached_tokens: int, num_running: int, rng: random.Random):
        return zero_pacing(rng)

    def sample_output_len(self, rng: random.Random) -> int | None:
        if not self.output_lengths:
            return None
        return max(int(round(_draw(self.output_lengths, rng.random()))), 1)
