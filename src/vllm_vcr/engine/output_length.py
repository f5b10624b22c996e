"""Output lengths: where a random output's EOS falls, drawn once per request at arrival.

A real model ends most answers with its EOS long before `max_tokens`. The engine models that with
a length distribution (the config's `output_length_*` fields, flags `--output-length-*`): each
request that may end on EOS (not `ignore_eos`) draws one length; if it is shorter than the
request's budget the request ends there with the EOS token and finish reason `stop`, otherwise
`max_tokens` (or the context) ends it with `length`, as before.
"""

from __future__ import annotations

import bisect
import math
import random
from typing import Protocol

DISTRIBUTIONS = ("lognormal", "normal", "histogram", "off")
DEFAULT_DISTRIBUTION = "lognormal"
DEFAULT_MEAN = 256.0
DEFAULT_STD_DEV = 128.0


class LengthError(ValueError):
    """A distribution that cannot be built (the caller names the flag or field)."""


class OutputLengthModel(Protocol):
    mean: float

    def draw(self, rng: random.Random) -> int: ...


class LognormalLengths:
    """Lengths whose logarithm is normal, with the given mean and standard deviation in tokens
    (a right-skewed shape like real answer lengths); std dev 0 gives the mean every time."""

    __slots__ = ("mean", "_mu", "_sigma")

    def __init__(self, mean: float, std_dev: float) -> None:
        self.mean = mean
        var = math.log1p((std_dev / mean) ** 2)
        self._sigma = math.sqrt(var)
        self._mu = math.log(mean) - var / 2

    def draw(self, rng: random.Random) -> int:
        return max(1, round(rng.lognormvariate(self._mu, self._sigma)))


class NormalLengths:
    """Normal lengths with the given mean and std dev, drawn again while below 1 (then 1)."""

    __slots__ = ("mean", "_std")

    def __init__(self, mean: float, std_dev: float) -> None:
        self.mean, self._std = mean, std_dev

    def draw(self, rng: random.Random) -> int:
        for _ in range(16):
            n = round(rng.gauss(self.mean, self._std))
            if n >= 1:
                return n
        return 1


class HistogramLengths:
    """`LO-HI:WEIGHT,...` buckets (`N:WEIGHT` is one length): a bucket by weight, then a length
    uniformly inside it."""

    __slots__ = ("mean", "_buckets", "_cum")

    def __init__(self, buckets: list[tuple[int, int, float]]) -> None:
        self._buckets = buckets
        total = 0.0
        self._cum: list[float] = []
        for _, _, w in buckets:
            total += w
            self._cum.append(total)
        self.mean = sum(w * (lo + hi) / 2 for lo, hi, w in buckets) / total

    @classmethod
    def parse(cls, spec: str) -> "HistogramLengths":
        buckets = []
        for part in (p.strip() for p in spec.split(",")):
            span, sep, weight = part.partition(":")
            lo_s, dash, hi_s = span.partition("-")
            try:
                if not sep:
                    raise ValueError
                lo = int(lo_s)
                hi = int(hi_s) if dash else lo
                w = float(weight)
            except ValueError:
                raise LengthError(f"bucket {part!r}, not LO-HI:WEIGHT or N:WEIGHT") from None
            if not 1 <= lo <= hi:
                raise LengthError(f"bucket {part!r}: lengths must satisfy 1 <= LO <= HI")
            if not (math.isfinite(w) and w >= 0):
                raise LengthError(f"bucket {part!r}: WEIGHT must be a number >= 0")
            buckets.append((lo, hi, w))
        if not any(w > 0 for _, _, w in buckets):
            raise LengthError(f"no bucket with a positive weight in {spec!r}")
        return cls(buckets)

    def draw(self, rng: random.Random) -> int:
        i = bisect.bisect_right(self._cum, rng.random() * self._cum[-1])
        lo, hi, _ = self._buckets[min(i, len(self._buckets) - 1)]
        return lo if lo == hi else rng.randint(lo, hi)


def build_length_model(distribution: str, mean: float, std_dev: float,
                       histogram: str) -> OutputLengthModel | None:
    """The model the config's `output_length_*` fields describe; None for `off`.

    Raises LengthError with a message that starts with the field at fault."""
    if distribution not in DISTRIBUTIONS:
        raise LengthError(f"output_length_distribution must be one of {', '.join(DISTRIBUTIONS)}, "
                          f"got {distribution!r}")
    if not (math.isfinite(mean) and mean >= 1):
        raise LengthError(f"output_length_mean must be a number >= 1, got {mean}")
    if not (math.isfinite(std_dev) and std_dev >= 0):
        raise LengthError(f"output_length_std_dev must be a number >= 0, got {std_dev}")
    if distribution == "histogram" and not histogram:
        raise LengthError("output_length_histogram must be set when output_length_distribution is histogram")
    parsed = None
    if histogram:
        try:
            parsed = HistogramLengths.parse(histogram)
        except LengthError as e:
            raise LengthError(f"output_length_histogram has {e}") from None
    if distribution == "off":
        return None
    if distribution == "histogram":
        return parsed
    if distribution == "normal":
        return NormalLengths(mean, std_dev)
    return LognormalLengths(mean, std_dev)


def modeled_eos_at(drawn: int | None, min_tokens: int, max_tokens: int) -> int | None:
    """The output length at which a request ends on EOS, or None when its budget ends it first
    (`min_tokens` holds the EOS back, as vLLM's min-tokens logits processor does)."""
    if drawn is None:
        return None
    n = max(drawn, min_tokens, 1)
    return n if n < max_tokens else None
