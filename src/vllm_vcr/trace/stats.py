"""Latency samples and quantiles of a trace (nearest-rank, like the Rust tool's reports)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from .schema import TraceRecord

# Concurrency ranges of the trace-fitted latency model (5-8 is split at 6|7 on purpose there).
CONCURRENCY_BUCKETS: tuple[tuple[int, int | None], ...] = (
    (1, 1), (2, 4), (5, 6), (7, 8), (9, 16), (17, 32), (33, 64), (65, None),
)


def concurrency_bucket(c: int) -> int:
    for i, (_lo, hi) in enumerate(CONCURRENCY_BUCKETS):
        if hi is None or c <= hi:
            return i
    return len(CONCURRENCY_BUCKETS) - 1


def bucket_label(i: int) -> str:
    lo, hi = CONCURRENCY_BUCKETS[i]
    if hi is None:
        return f"{lo}+"
    return str(lo) if lo == hi else f"{lo}-{hi}"


def nearest_rank(sorted_values: Sequence[float] | np.ndarray, p: float) -> float:
    """The p-th percentile by nearest rank: element ceil(p/100 * n) - 1 of the sorted values."""
    n = len(sorted_values)
    if n == 0:
        return math.nan
    idx = min(max(math.ceil(p / 100.0 * n) - 1, 0), n - 1)
    return float(sorted_values[idx])


def weighted_nearest_rank(values: np.ndarray, weights: np.ndarray, p: float) -> float:
    """Nearest-rank percentile of `values` where value i occurs `weights[i]` times."""
    if len(values) == 0:
        return math.nan
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order]
    cum = np.cumsum(w)
    total = cum[-1]
    if total <= 0:
        return math.nan
    rank = max(math.ceil(p / 100.0 * total), 1)
    return float(v[min(int(np.searchsorted(cum, rank, side="left")), len(v) - 1)])


class Samples:
    """A weighted sample set: (value, weight) pairs, weight = how many observations it stands for."""

    def __init__(self) -> None:
        self._v: list[float] = []
        self._w: list[float] = []
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None  # (values, cumulative weights)

    def add(self, value: float, weight: float = 1.0) -> None:
        if weight > 0:
            self._v.append(value)
            self._w.append(weight)
            self._sorted = None

    def extend(self, values: Sequence[float]) -> None:
        """Unit-weight values in bulk (the per-gap hot path)."""
        self._v.extend(values)
        self._w.extend([1.0] * len(values))
        self._sorted = None

    def __len__(self) -> int:
        return len(self._v)

    @property
    def count(self) -> float:
        return float(sum(self._w))

    def _prepared(self) -> tuple[np.ndarray, np.ndarray]:
        if self._sorted is None:
            v = np.asarray(self._v, float)
            w = np.asarray(self._w, float)
            order = np.argsort(v, kind="stable")
            self._sorted = (v[order], np.cumsum(w[order]))
        return self._sorted

    def quantile(self, p: float) -> float:
        """Nearest-rank percentile, counting each value `weight` times."""
        v, cum = self._prepared()
        if len(v) == 0 or cum[-1] <= 0:
            return math.nan
        rank = max(math.ceil(p / 100.0 * cum[-1]), 1)
        return float(v[min(int(np.searchsorted(cum, rank, side="left")), len(v) - 1)])

    def quantile_interval(self, p: float, z: float = 1.96) -> tuple[float, float]:
        """A distribution-free confidence interval of the p-th percentile: the order statistics
        whose ranks are z binomial standard deviations either side of p % of the count."""
        n = self.count
        if n <= 0:
            return math.nan, math.nan
        q = p / 100.0
        half = z * math.sqrt(n * q * (1.0 - q))
        lo = max(math.floor(n * q - half), 1)
        hi = min(math.ceil(n * q + half) + 1, n)
        return self.quantile(100.0 * lo / n), self.quantile(100.0 * hi / n)

    def mean(self) -> float:
        if not self._v:
            return math.nan
        w = np.asarray(self._w, float)
        return float(np.dot(np.asarray(self._v, float), w) / w.sum())

    def cdf(self) -> tuple[np.ndarray, np.ndarray]:
        """Sorted values and their cumulative fraction, for plotting."""
        v, cum = self._prepared()
        return v, cum / cum[-1] if len(cum) else cum


def add_itl_samples(samples: Samples, rec: TraceRecord) -> None:
    """Per-token ITL: each gap divided by the tokens its chunk delivered (one sample per gap);
    an `itl_summary` stands for `count` gaps of its mean."""
    if rec.itl_ms is not None:
        if rec.itl_tokens is None:
            samples.extend(rec.itl_ms)
        else:
            samples.extend([g / max(n, 1) for g, n in zip(rec.itl_ms, rec.itl_tokens)])
    elif rec.itl_summary is not None and rec.itl_summary.count > 0:
        samples.add(rec.itl_summary.mean_ms, rec.itl_summary.count)


def itl_samples(records: Iterable[TraceRecord]) -> Samples:
    s = Samples()
    for r in records:
        add_itl_samples(s, r)
    return s


def ttft_samples(records: Iterable[TraceRecord]) -> Samples:
    s = Samples()
    for r in records:
        s.add(r.ttft_ms)
    return s
