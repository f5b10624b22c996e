"""Workloads for `vllm-vcr simulate`: what arrives, when, with which prompt and output length.

Open-loop workloads give every request an arrival time (Poisson; bursty: gamma-distributed gaps
with a coefficient of variation above 1; a recorded trace; a Mooncake-style trace). A
closed-loop workload has no arrival times: `concurrency` users each send their next request
when the previous one finishes (the driver asks `next_closed()`).

Prompts are token ids. Requests of one shared-prefix group start with the same prefix; a
Mooncake trace's `hash_ids` (one per 512-token block) become the same token blocks wherever the
same id appears, so its prefix reuse reaches the engines' prefix caches as it was recorded.
"""

from __future__ import annotations

import functools
import json
import math
import random
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

MOONCAKE_BLOCK = 512  # tokens per hash id in Mooncake traces
_VOCAB = 30000  # prompt token ids are drawn from [1, _VOCAB]
_SUFFIX_POOL = 1 << 16  # random ids a synthetic workload cuts its prompt suffixes from


@dataclass(slots=True)
class SimRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    arrival: float | None = None  # seconds after the start; None: closed loop (sent when a user is free)


@dataclass(frozen=True)
class LengthDist:
    """`N` | `uniform:LO:HI` | `normal:MEAN:SD` | `lognormal:MEAN:SD` | `exp:MEAN` (tokens, >= 1)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str, flag: str) -> "LengthDist":
        parts = str(text).split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", float(int(parts[0])))
            kind, *nums = parts
            vals = [float(x) for x in nums]
        except ValueError:
            raise ValueError(f"{flag}: cannot parse {text!r}; use N, uniform:LO:HI, normal:MEAN:SD, "
                             f"lognormal:MEAN:SD or exp:MEAN") from None
        need = {"uniform": 2, "normal": 2, "lognormal": 2, "exp": 1}
        if kind not in need or len(vals) != need[kind]:
            raise ValueError(f"{flag}: unknown distribution {text!r}; use N, uniform:LO:HI, normal:MEAN:SD, "
                             f"lognormal:MEAN:SD or exp:MEAN")
        return cls(kind, *vals)

    def draw(self, rng: random.Random) -> int:
        k = self.kind
        if k == "fixed":
            return self._fixed
        if k == "uniform":
            v = rng.uniform(self.a, self.b)
        elif k == "normal":
            v = rng.gauss(self.a, self.b)
        elif k == "exp":
            v = rng.expovariate(1 / self.a)
        else:  # lognormal with the given mean and standard deviation of the length itself
            v = rng.lognormvariate(*self._lognormal)
        return max(int(round(v)), 1)

    @functools.cached_property
    def _fixed(self) -> int:
        return max(int(round(self.a)), 1)

    @functools.cached_property
    def _lognormal(self) -> tuple[float, float]:
        """mu and sigma of the underlying normal, for the length's mean `a` and deviation `b`."""
        s2 = math.log(1 + (self.b / self.a) ** 2)
        return math.log(self.a) - s2 / 2, math.sqrt(s2)


@dataclass
class SyntheticWorkload:
    """Poisson / bursty / closed-loop requests with drawn lengths and optional shared prefixes."""

    fresh_prompts = True  # (not a field) every request's prompt is a new list, kept by no one

    num_requests: int
    isl: LengthDist
    osl: LengthDist
    arrival: str = "closed"  # closed | poisson | bursty
    concurrency: int = 1  # closed loop
    ramp_up: float = 0.0  # closed loop: users start evenly over this many seconds (steady state sooner)
    request_rate: float = 1.0  # poisson / bursty, requests per second
    burstiness: float = 4.0  # bursty: squared coefficient of variation of the gaps (1 = Poisson)
    num_prefixes: int = 0  # shared-prefix groups (0: none)
    prefix_len: int = 0  # tokens of the shared prefix (part of the drawn ISL when it fits)
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)
    _made: int = field(init=False, default=0)
    _t: float = field(init=False, default=0.0)
    _prefixes: list[list[int]] = field(init=False, default_factory=list)
    _ids: list[int] = field(init=False, repr=False)  # random ids that suffixes are cut from
    _place: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._prefixes = [_block_tokens(-(self.seed + 1) * 1000 - g, self.prefix_len)
                          for g in range(self.num_prefixes)]
        self._ids = _random_ids(self.seed)
        self._place = random.Random(self.seed * 2 + 1)  # where each suffix is cut from the ids

    @property
    def closed_loop(self) -> bool:
        return self.arrival == "closed"

    def _make(self, arrival: float | None) -> SimRequest:
        rng = self._rng
        isl = self.isl.draw(rng)
        i = self._made
        if self._prefixes:
            prompt = self._prefixes[rng.randrange(len(self._prefixes))][:max(isl - 1, 0)]
            prompt += self._suffix(i, isl - len(prompt))
        else:
            prompt = self._suffix(i, isl)
        self._made += 1
        return SimRequest(f"sim-{i}", prompt, self.osl.draw(rng), arrival)

    def _suffix(self, i: int, n: int) -> list[int]:
        """`n` ids of request `i`'s own: a run of random ids from a random place, its first two
        replaced by its index (the index makes every block from there on differ from any other
        request's, at the cost of one slice rather than n random draws)."""
        ids = self._ids
        while len(ids) < n:
            ids = ids + ids
        at = self._place.randrange(len(ids) - n + 1)  # (not self._rng: the lengths a seed draws stay)
        # cut two ids longer and drop them: the list keeps room for them, so the engine that adopts it
        # (timing-only, `fresh_prompts`) appends a request's first and last tokens without regrowing
        # it (a copy of the whole prompt); its tokens in between are counted, never appended
        out = ids[at:at + n + 2]
        del out[n:]
        out[:2] = [i // _VOCAB + 1, i % _VOCAB + 1][:n]
        return out

    def open_arrivals(self) -> Iterator[SimRequest]:
        """Requests in arrival order (open loop)."""
        rng = self._rng
        shape = 1.0 / self.burstiness if self.arrival == "bursty" else 1.0
        while self._made < self.num_requests:
            # gamma gaps with mean 1/rate; shape 1 is Poisson, shape < 1 clusters arrivals
            self._t += rng.gammavariate(shape, 1.0 / (shape * self.request_rate))
            yield self._make(self._t)

    def next_closed(self) -> SimRequest | None:
        return self._make(None) if self._made < self.num_requests else None


class TraceWorkload:
    """A recorded trace (vllm-vcr JSONL: arrival_ms, prompt_tokens, output_tokens, block_hashes)
    or a Mooncake-style trace (timestamp ms, input_length, output_length, hash_ids)."""

    closed_loop = False

    def __init__(self, requests: list[SimRequest]) -> None:
        self.requests = requests
        self.num_requests = len(requests)

    @classmethod
    def from_path(cls, path: str, *, limit: int | None = None, speedup: float = 1.0,
                  block_size: int = 16) -> "TraceWorkload":
        rows = list(_read_rows(path, limit))
        if not rows:
            raise ValueError(f"--trace {path}: no requests")
        if "input_length" in rows[0]:
            reqs = [_mooncake_request(i, r) for i, r in enumerate(rows)]
        else:
            reqs = [_recorded_request(i, r, block_size) for i, r in enumerate(rows)]
        t0 = min(r.arrival for r in reqs)
        for r in reqs:
            r.arrival = (r.arrival - t0) / speedup
        reqs.sort(key=lambda r: r.arrival)
        return cls(reqs)

    def open_arrivals(self) -> Iterator[SimRequest]:
        return iter(self.requests)

    def next_closed(self) -> SimRequest | None:
        return None


def _read_rows(path: str, limit: int | None) -> Iterator[dict]:
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    n = 0
    with opener(path, "rt") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            row = json.loads(line)
            if "meta" in row and "prompt_tokens" not in row and "input_length" not in row:
                continue  # a vllm-vcr trace header
            yield row
            n += 1
            if limit is not None and n >= limit:
                return


_KEY_IDS = 4  # leading ids of a keyed run that spell its key (in base _VOCAB: distinct below _VOCAB**4)


@functools.lru_cache(maxsize=8)
def _random_ids(seed: int) -> list[int]:
    """The pool of random ids a seed gives, that runs are cut from (callers slice it, never change it)."""
    return np.random.default_rng(seed).integers(1, _VOCAB + 1, size=_SUFFIX_POOL).tolist()


@functools.lru_cache(maxsize=1)
def _ring() -> list[int]:
    """Random ids that keyed runs are cut from: a fixed pool, twice over (a run may wrap)."""
    return _random_ids(0x5EED) * 2


def _block_tokens(key: int, n: int) -> list[int]:
    """The same `n` token ids for the same block key, everywhere (a longer run for the key starts
    with a shorter one), and different ones for a different key: a run of a fixed pool of random
    ids from a place the key picks, its first ids spelling the key. One slice per block, not a
    random generator seeded per block (the trace loaders call this for every block)."""
    k = abs(key) * 2 + (key < 0)
    ring = _ring()
    at = (k * 0x9E3779B97F4A7C15 >> 17) % _SUFFIX_POOL
    if n <= _SUFFIX_POOL:
        out = ring[at:at + n]
    else:  # (longer than the pool: it repeats)
        out = (ring[at:_SUFFIX_POOL] + ring[:_SUFFIX_POOL] * (n // _SUFFIX_POOL + 1))[:n]
    spelled = min(_KEY_IDS, n)
    for j in range(spelled):
        out[j] = k % _VOCAB + 1
        k //= _VOCAB
    return out


def _mooncake_request(i: int, row: dict) -> SimRequest:
    isl = max(int(row["input_length"]), 1)
    prompt: list[int] = []
    for h in row.get("hash_ids") or []:
        prompt.extend(_block_tokens(int(h), MOONCAKE_BLOCK))
        if len(prompt) >= isl:
            break
    prompt = prompt[:isl]
    prompt.extend(_block_tokens(-(i + 1), isl - len(prompt)))
    return SimRequest(f"trace-{i}", prompt, max(int(row["output_length"]), 1), float(row["timestamp"]) / 1000)


def _recorded_request(i: int, row: dict, block_size: int) -> SimRequest:
    isl = max(int(row["prompt_tokens"]), 1)
    prompt: list[int] = []
    for h in row.get("block_hashes") or []:
        prompt.extend(_block_tokens(int(h) & 0xFFFFFFFFFFFF, block_size))
    prompt = prompt[:isl]
    prompt.extend(_block_tokens(-(i + 1), isl - len(prompt)))
    arrival = row.get("arrival_ms")
    return SimRequest(f"trace-{i}", prompt, max(int(row.get("output_tokens") or 1), 1),
                      float(arrival if arrival is not None else i) / 1000)
