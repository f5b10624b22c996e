"""Fitting the step-time model (engine/latency/steps.py) from an engine-side trace.

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

The fit: a least-absolute-deviation line (IRLS), so the stalls do not drag it; slopes are kept
non-negative. What the line does not explain stays as residuals per step class, drawn by
inverse CDF so the replayed steps keep the recorded spread, tails included.

The input path: a request that reaches the tap while a step runs is not always in the next step.
The engine sees it some time later (its input thread, deserialization; ~1.5-2 ms on the CPU box),
so one that arrives within that time of the step's end waits for one more step. From the busy
arrivals of the trace (arrived during a step, the next step back to back and not full), the
chance that a request missed the next step as a function of the time it had until the step
ended is the survival function of that delay (current-status data; a decreasing isotonic fit).
A delay is only felt when the next step runs anyway: at an idle engine the wake-up step's
duration already holds it.

Limits: a step that emitted nothing (a chunk of a prompt longer than the token budget with no
decode running) is invisible, and its time lands in the next visible step; the fit attributes a
request's whole uncached prompt to the step that emitted its first token.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...engine.latency.steps import CLASSES, DECODE_STEP, PREFILL_AFTER_IDLE, InputDelay, Residuals, StepLatency, step_class
from ...trace.schema import TraceRecord, replay_subset

SAME_MESSAGE_MS = 0.005  # token times closer than this are one output message (rounding only)
MIN_CLASS_STEPS = 20  # residuals of a class with fewer steps fall back to all steps'
MIN_BUSY_ARRIVALS = 20  # fewer busy arrivals than this: no input delay is fitted
PLATEAU_FACTOR = 3.0  # misses beyond this × the half-miss lead are the tap's bursts, not the input path


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


def fit_input_delay(samples: Sequence[tuple[float, bool]]) -> InputDelay:
    """The input delay's survival function from busy arrivals (`busy_arrivals`): P(delay > lead) =
    the isotonic fit of "missed" on the lead.

    The fit levels off at a few % for long leads (6-8 % on the CPU traces): requests that missed
    the next step although it ended 5-200 ms after they arrived. Those are the tap's message
    bursts (a step's output stamped late, just before the next one's, so the step in flight seems
    to end later than it did), not a delay, so the plateau is taken out: the survival function
    less the plateau (the miss rate of the leads beyond PLATEAU_FACTOR times the lead where half
    the requests missed), rescaled, and 0 beyond that horizon."""
    samples = sorted(samples)
    fit = _decreasing_isotonic([1.0 if m else 0.0 for _, m in samples])
    leads = [d for d, _ in samples]
    half = next((d for d, v in zip(leads, fit) if v < 0.5), leads[-1] if leads else 0.0)
    horizon = PLATEAU_FACTOR * half
    far = [m for d, m in samples if d > horizon]
    plateau = sum(far) / len(far) if far else 0.0
    top = (fit[0] - plateau) if fit else 0.0
    keep = [k for k, d in enumerate(leads) if d <= horizon]
    survival = [max(fit[k] - plateau, 0.0) / top if top > 0 else 0.0 for k in keep]
    if survival:
        survival[-1] = 0.0  # no delay beyond the horizon
    return InputDelay([leads[k] for k in keep], survival, horizon, plateau)


def fit_residuals(y: np.ndarray, line: np.ndarray) -> Residuals:
    below = y < line
    return Residuals(float(below.mean()) if len(y) else 0.0, sorted((y[below] / line[below]).tolist()),
                     sorted((y[~below] - line[~below]).tolist()))


def fit_step_model(records: Sequence[TraceRecord], time_scale: float = 1.0) -> StepLatency:
    """The step-time model of a trace (ValueError when it has too few steps to fit one)."""
    steps = reconstruct_steps(records)
    if len(steps) < 2:
        raise ValueError("latency trace has too few steps to fit a step-time model "
                         "(it needs records with arrival_ms and inter-token gaps, e.g. an engine tap trace)")
    x = _design(steps)
    y = np.array([s.duration_ms for s in steps])
    coef = lad_fit(x, y)
    line = np.maximum(x @ coef, 1e-3)
    classes = np.array([step_class(s.has_prefill, s.after_idle) for s in steps])
    residuals = {}
    pooled = fit_residuals(y, line)
    for cls in CLASSES:
        sel = classes == cls
        if sel.sum() < MIN_CLASS_STEPS and cls == PREFILL_AFTER_IDLE:
            sel = classes != DECODE_STEP  # few idle wake-ups: every prefill step's spread
        residuals[cls] = fit_residuals(y[sel], line[sel]) if sel.sum() >= MIN_CLASS_STEPS else pooled
    busy = busy_arrivals(records, steps)
    delay = fit_input_delay(busy) if len(busy) >= MIN_BUSY_ARRIVALS else None
    return StepLatency(coef.tolist(), residuals, [r.output_tokens for r in records if r.output_tokens > 0],
                       delay, time_scale)
