"""The trace-fitted latency model (vllm-vcr.md §3.2): a capture's latencies, as a model.

Fitted from a trace's records:

1. service curve  T(u) = a + b·u + c·u² (ms; u = uncached prompt tokens) through the p10 TTFT of
   sliding u-windows at the trace's lowest concurrency: the cost of a prefill with no queueing;
2. per-bucket TTFT samples, the fallback when no curve fits;
3. decode donors: each record's clean decode steps (gap, chunk tokens), in a grid keyed by the
   record's prompt bucket (calm | churn half) and concurrency bucket; a request replays the steps
   of one donor, pinned per concurrency bucket;
4. the chunk cost law  cost(t, d0) = c0·t + c1·(d1² − d0²)/2  (d1 = d0 + t) from isolated
   prefill marks, and the full-budget step floor;
5. speculative width K, the output-length distribution and pooled ITL per concurrency bucket.

All times are milliseconds here; `pacing()` adapts the model to the engine's LatencyModel
protocol (seconds, divided by time_scale), so `TraceLatency.from_path(path, time_scale)` is a
drop-in for latency_model.TraceLatency. The extra hooks for a step-composing engine are
`prefill_chunk_cost`, `budget_full_chunk_floor`, `first_token_overhead` and `spec_tokens`.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .schema import TraceRecord
from .stats import CONCURRENCY_BUCKETS, concurrency_bucket

PROMPT_EDGES = (0, 65, 129, 257, 513, 1025, 2049, 4097, 8193, 16385, 32769)
N_PROMPT = len(PROMPT_EDGES)
N_CONC = len(CONCURRENCY_BUCKETS)
BIG_CHUNK_TOKENS = 4096
CHURN_FRACTION = 0.06
WINDOW_WIDTH, WINDOW_STRIDE, WINDOW_MIN_OBS = 600, 400, 5
MIN_LAW_OBS = 30
MIN_FINAL_CHUNK = 256


def prompt_bucket(tokens: int) -> int:
    return max(bisect.bisect_right(PROMPT_EDGES, tokens) - 1, 0)


def inverse_cdf(sorted_samples: Sequence[float], u: float) -> float:
    """Linear interpolation between order statistics at position u·(n−1)."""
    n = len(sorted_samples)
    if n == 1:
        return float(sorted_samples[0])
    pos = u * (n - 1)
    i = min(int(pos), n - 2)
    frac = pos - i
    return float(sorted_samples[i] + (sorted_samples[i + 1] - sorted_samples[i]) * frac)


@dataclass(frozen=True)
class FirstTokenCtx:
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    do_remote_prefill: bool = False
    num_running: int = 1


# -- 1. service curve ----------------------------------------------------------------------------


@dataclass
class ServiceCurve:
    coef: tuple[float, float, float] | None  # (a, b, c); None: no fit
    floor_ms: float = 0.0  # lowest window p10
    windows: list[tuple[float, float, int]] = field(default_factory=list)

    def __call__(self, u: float) -> float | None:
        if self.coef is None:
            return None
        a, b, c = self.coef
        return max(a + b * u + c * u * u, self.floor_ms)


def _wls(x: np.ndarray, y: np.ndarray, w: np.ndarray, degree: int) -> np.ndarray:
    cols = [np.ones_like(x), x] + ([x * x] if degree == 2 else [])
    a = np.stack(cols, axis=1) * w[:, None]
    coef, *_ = np.linalg.lstsq(a, y * w, rcond=None)
    return coef


def fit_service_curve(records: Sequence[TraceRecord]) -> ServiceCurve:
    if not records:
        return ServiceCurve(None)
    min_conc = min(r.concurrency for r in records)
    obs = sorted((max(r.uncached_prompt_tokens(), 1), r.ttft_ms)
                 for r in records if r.concurrency == min_conc)
    us = [u for u, _ in obs]
    windows: list[tuple[float, float, int]] = []
    start = us[0]
    while start <= us[-1]:
        lo, hi = bisect.bisect_left(us, start), bisect.bisect_left(us, start + WINDOW_WIDTH)
        if hi - lo >= WINDOW_MIN_OBS:
            ttfts = sorted(t for _, t in obs[lo:hi])
            windows.append((float(np.median(us[lo:hi])), ttfts[len(ttfts) // 10], hi - lo))
        start += WINDOW_STRIDE
    if not windows:
        return ServiceCurve(None)
    floor = min(p for _, p, _ in windows)
    x = np.array([u for u, _, _ in windows], float)
    y = np.array([p for _, p, _ in windows], float)
    w = np.sqrt(np.array([n for _, _, n in windows], float))
    u_max = float(x.max())
    if len(windows) >= 4:
        a, b, c = _wls(x, y, w, 2)
        if c >= 0 and b + 2 * c * u_max >= 0:
            return ServiceCurve((float(a), float(b), float(c)), floor, windows)
    if len(windows) >= 2:
        a, b = _wls(x, y, w, 1)
        if b >= 0:
            return ServiceCurve((float(a), float(b), 0.0), floor, windows)
    return ServiceCurve(None, floor, windows)


# -- 2. per-bucket fallback ----------------------------------------------------------------------


@dataclass
class _Bucket:
    samples: list[float]
    median_u: float


def fit_fallback(records: Sequence[TraceRecord]) -> list[_Bucket | None]:
    by_bucket: dict[int, list[TraceRecord]] = {}
    for r in records:
        by_bucket.setdefault(prompt_bucket(r.uncached_prompt_tokens()), []).append(r)
    out: list[_Bucket | None] = [None] * N_PROMPT
    for b, recs in by_bucket.items():
        lowest = min(concurrency_bucket(r.concurrency) for r in recs)
        chosen = [r for r in recs if concurrency_bucket(r.concurrency) == lowest]
        out[b] = _Bucket(sorted(r.ttft_ms for r in chosen),
                         float(np.median([max(r.uncached_prompt_tokens(), 1) for r in chosen])))
    return out


# -- 3. decode donors ----------------------------------------------------------------------------


@dataclass
class Donor:
    steps: list[tuple[float, int]]  # (gap_ms, chunk tokens), sorted by gap
    weight: float

    def draw(self, u: float) -> tuple[float, int]:
        n = len(self.steps)
        if n == 1:
            return self.steps[0]
        pos = u * (n - 1)
        i = min(int(pos), n - 2)
        frac = pos - i
        (g0, t0), (g1, t1) = self.steps[i], self.steps[i + 1]
        return g0 + (g1 - g0) * frac, (t0 if frac < 0.5 else t1)


def _is_churn(r: TraceRecord) -> bool:
    if r.itl_ctx is None or not r.itl_ctx.prefill_tokens:
        return False
    big = sum(1 for p in r.itl_ctx.prefill_tokens if p > BIG_CHUNK_TOKENS)
    return big > CHURN_FRACTION * len(r.itl_ctx.prefill_tokens)


def _donor(r: TraceRecord) -> Donor | None:
    if r.itl_ms:
        pairs = list(zip(r.itl_ms, r.gap_tokens()))
        if r.itl_ctx is not None:
            med = float(np.median(r.itl_ms))
            pairs = [(g, n) for (g, n), p in zip(pairs, r.itl_ctx.prefill_tokens)
                     if p == 0 and g <= 4 * med]
        if not pairs:
            return None
        pairs.sort()
        return Donor(pairs, float(sum(n for _, n in pairs)))
    if r.itl_summary is not None and r.itl_summary.count > 0:
        return Donor([(r.itl_summary.mean_ms, 1)], float(r.itl_summary.count))
    return None


def fit_donors(records: Sequence[TraceRecord]) -> list[list[list[Donor]]]:
    grid: list[list[list[Donor]]] = [[[] for _ in range(N_CONC)] for _ in range(2 * N_PROMPT)]
    for r in records:
        d = _donor(r)
        if d is not None:
            ctx = prompt_bucket(r.prompt_tokens) + (N_PROMPT if _is_churn(r) else 0)
            grid[ctx][concurrency_bucket(r.concurrency)].append(d)
    return grid


# -- 4. chunk cost law and full-step floor -------------------------------------------------------


@dataclass(frozen=True)
class ChunkLaw:
    c0: float = 0.0  # ms per chunk token
    c1: float = 0.0  # ms per token of attended context, integrated over the chunk

    def cost(self, t: float, d0: float) -> float:
        if t <= 0:
            return 0.0
        d1 = d0 + t
        return self.c0 * t + self.c1 * (d1 * d1 - d0 * d0) / 2.0


def _clean_records(records: Sequence[TraceRecord]) -> list[tuple[TraceRecord, float]]:
    """(record, base = median clean gap) for records with >= 5 clean gaps and step context."""
    out = []
    for r in records:
        if r.itl_ctx is None or not r.itl_ms:
            continue
        clean = [g for g, p in zip(r.itl_ms, r.itl_ctx.prefill_tokens) if p == 0]
        if len(clean) >= 5:
            out.append((r, float(np.median(clean))))
    return out


def fit_chunk_law(records: Sequence[TraceRecord], budget: int) -> ChunkLaw:
    xs: list[tuple[float, float]] = []
    ys: list[float] = []
    for r, base in _clean_records(records):
        marks = r.itl_ctx.prefill_tokens
        for i, p in enumerate(marks):
            if p <= 0:
                continue
            neighbours = marks[max(i - 2, 0):i] + marks[i + 1:i + 3]
            if any(q > 0 for q in neighbours):
                continue  # not isolated: two prefills share the surcharge
            t = ((p - 1) % budget) + 1  # the mark's final chunk
            if t < MIN_FINAL_CHUNK:
                continue
            d0 = float(p - t)
            xs.append((float(t), ((d0 + t) ** 2 - d0 * d0) / 2.0))
            ys.append(max(r.itl_ms[i] - base, 0.0))
    if len(ys) < MIN_LAW_OBS:
        return ChunkLaw()
    x, y = np.array(xs, float), np.array(ys, float)
    keep = np.arange(len(y))
    coef = np.zeros(2)
    for _ in range(4):  # refit on the best-fitting 80%, four times: marks hit by noise drop out
        coef, *_ = np.linalg.lstsq(x[keep], y[keep], rcond=None)
        resid = np.abs(x @ coef - y)
        keep = np.argsort(resid)[: max(int(0.8 * len(y)), 2)]
    if coef[0] < 0 or coef[1] < 0:
        return ChunkLaw()
    return ChunkLaw(float(coef[0]), float(coef[1]))


def fit_full_step_floor(records: Sequence[TraceRecord], law: ChunkLaw, budget: int) -> float:
    full = law.cost(budget, 0)
    if full <= 0:
        return 0.0
    sur = []
    for r, base in _clean_records(records):
        for g, p in zip(r.itl_ms, r.itl_ctx.prefill_tokens):
            s = g - base
            if p == 0 and 0.8 * full <= s <= 2.5 * full:
                sur.append(s)
    return float(np.median(sur)) if len(sur) >= MIN_LAW_OBS else 0.0


# -- the model ----------------------------------------------------------------------------------


@dataclass
class TracePacing:
    """Per-request timing for the engine (seconds): TTFT, then one donor's decode steps."""

    ttft: float
    _model: TraceLatency
    _ctx: int
    _conc: int
    _rng: random.Random
    _scale: float
    first_chunk: int = 1
    _donor: Donor | None = None
    itl_std: float = -1.0  # tells the engine's fast path to call next_step() every step
    itl_mean: float = 0.0

    def next_step(self) -> tuple[float, int]:
        if self._donor is None:
            self._donor = self._model.pick_donor(self._ctx, self._conc, self._rng)
        gap, tokens = self._donor.draw(self._rng.random())
        return gap * self._scale, max(int(tokens), 1)

    def next_gap(self) -> float:
        return self.next_step()[0]


class TraceLatency:
    is_knob = False
    config = None  # the engine assigns its config to every latency model; the knobs do not apply

    @classmethod
    def from_path(cls, path: str, time_scale: float = 1.0, budget: int = 8192) -> TraceLatency:
        from .io import read_trace

        return cls(read_trace(path).records, budget=budget, time_scale=time_scale)

    def __init__(self, records: Sequence[TraceRecord], budget: int = 8192,
                 kv_fallback: Callable[[FirstTokenCtx], float] | None = None,
                 time_scale: float = 1.0):
        recs = list(records)
        if not recs:
            raise ValueError("cannot fit a latency model to an empty trace")
        if not any(r.itl_ms or (r.itl_summary and r.itl_summary.count) for r in recs):
            raise ValueError("the trace has no inter-token latency data (all single-token requests)")
        self.budget = budget
        self.time_scale = time_scale
        self.kv_fallback = kv_fallback or (lambda ctx: 0.0)
        self.curve = fit_service_curve(recs)
        self.fallback = fit_fallback(recs)
        self.donors = fit_donors(recs)
        self.law = fit_chunk_law(recs, budget)
        self.floor = fit_full_step_floor(recs, self.law, budget)
        widest = max((max(r.itl_tokens) for r in recs if r.itl_tokens), default=1)
        self.spec_k = widest - 1 if widest > 1 else None
        self.output_lengths = sorted(r.output_tokens for r in recs)
        self.pooled_itl: list[list[float]] = [[] for _ in range(N_CONC)]
        for r in recs:
            b = concurrency_bucket(r.concurrency)
            if r.itl_ms:
                self.pooled_itl[b].extend(g / n for g, n in zip(r.itl_ms, r.gap_tokens()))
            elif r.itl_summary is not None and r.itl_summary.count:
                self.pooled_itl[b].append(r.itl_summary.mean_ms)
        for s in self.pooled_itl:
            s.sort()

    # -- TTFT -----------------------------------------------------------------------------------

    def _fallback_draw(self, u: float, rng: random.Random) -> float:
        b = prompt_bucket(int(u))
        for dist in range(N_PROMPT):
            for cand in (b - dist, b + dist):
                if 0 <= cand < N_PROMPT and self.fallback[cand] is not None:
                    bucket = self.fallback[cand]
                    v = inverse_cdf(bucket.samples, rng.random())
                    if cand != b:  # borrowed from another size: scale by the size ratio
                        v *= min(max(u / bucket.median_u, 0.25), 8.0)
                    return v
        return 0.0

    def first_token_delay(self, ctx: FirstTokenCtx, rng: random.Random | None = None) -> float:
        if ctx.do_remote_prefill:
            return self.kv_fallback(ctx)
        u = max(ctx.num_prompt_tokens - ctx.num_cached_tokens, 1)
        t = self.curve(u)
        return t if t is not None else self._fallback_draw(u, rng or random.Random())

    def prefill_chunk_cost(self, chunk_tokens: int, kv_depth: int) -> float:
        return self.law.cost(chunk_tokens, kv_depth)

    def budget_full_chunk_floor(self) -> float:
        return self.floor

    def first_token_overhead(self, ctx: FirstTokenCtx, rng: random.Random | None = None) -> float:
        """What the engine must add after its own chunk charging so an isolated request's TTFT
        is the fitted T(u) (the chunks are charged as if the request ran alone)."""
        total = self.first_token_delay(ctx, rng)
        if ctx.do_remote_prefill:
            return total
        left = max(ctx.num_prompt_tokens - ctx.num_cached_tokens, 0)
        depth = ctx.num_cached_tokens
        charged = 0.0
        while left > self.budget:
            charged += max(self.law.cost(self.budget, depth), self.floor)
            depth += self.budget
            left -= self.budget
        charged += self.law.cost(left, depth)
        return max(total - charged, 0.0)

    # -- decode ---------------------------------------------------------------------------------

    def pick_donor(self, ctx: int, conc: int, rng: random.Random) -> Donor:
        """Nearest non-empty cell (Manhattan over (context, concurrency); ties keep the context
        bucket), then a token-weighted donor from it."""
        best: tuple[int, int, int, int] | None = None
        for c in range(2 * N_PROMPT):
            for k in range(N_CONC):
                if self.donors[c][k]:
                    key = (abs(c - ctx) + abs(k - conc), 0 if c == ctx else 1, c, k)
                    if best is None or key < best:
                        best = key
        assert best is not None  # the constructor refused traces without ITL data
        cell = self.donors[best[2]][best[3]]
        total = sum(d.weight for d in cell)
        x = rng.random() * total
        for d in cell:
            x -= d.weight
            if x <= 0:
                return d
        return cell[-1]

    def paced_step(self, pacing: TracePacing) -> tuple[float, int]:
        """(gap ms, tokens) of the next decode step of a request."""
        gap_s, tokens = pacing.next_step()
        return gap_s / pacing._scale, tokens

    def inter_token_delay(self, num_running: int, rng: random.Random | None = None) -> float:
        """Marginal per-token ITL at this concurrency (nearest bucket with data)."""
        b = concurrency_bucket(num_running)
        rng = rng or random.Random()
        for dist in range(N_CONC):
            for cand in (b - dist, b + dist):
                if 0 <= cand < N_CONC and self.pooled_itl[cand]:
                    return inverse_cdf(self.pooled_itl[cand], rng.random())
        return 0.0

    def spec_tokens(self) -> int | None:
        return self.spec_k

    def sample_output_len(self, rng: random.Random | None = None) -> int:
        v = inverse_cdf(self.output_lengths, (rng or random.Random()).random())
        return max(round(v), 1)

    # -- the engine's LatencyModel protocol -----------------------------------------------------

    def pacing(self, num_prompt_tokens: int, num_cached_tokens: int, num_running: int,
               rng: random.Random) -> TracePacing:
        ctx = FirstTokenCtx(num_prompt_tokens, num_cached_tokens, False, num_running)
        scale = 1e-3 / self.time_scale
        return TracePacing(
            ttft=self.first_token_delay(ctx, rng) * scale, _model=self,
            _ctx=prompt_bucket(num_prompt_tokens), _conc=concurrency_bucket(num_running),
            _rng=rng, _scale=scale,
        )

