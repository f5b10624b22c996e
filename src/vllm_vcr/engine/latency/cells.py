"""The cell model: request pacing drawn from a recording cut into cells (`--latency-trace`).

The recording is cut into cells by prompt size and by how many requests were in flight, and the
engine draws from the cell that matches each request:

- first-token delay: the median recorded TTFT of the requests nearest in *uncached* prompt size
  at a similar concurrency (a cell borrowed from another prompt size is scaled by the size ratio),
  plus a residual drawn from the whole cell's spread around those local medians, so the rare
  stalls of a cell reach every prompt size (the nearest sizes alone are too few to hold p99);
- decode: recorded (gap, tokens-in-chunk) pairs of requests with a similar *full* context at a
  similar concurrency, replayed as runs of consecutive recorded gaps from a random starting point,
  so spec-decode bursts, stalls and the catch-up bursts after them replay with their shape;
- output length: for requests that may stop on EOS (or that set no max_tokens), a length drawn
  from the recorded output lengths.

Draws are inverse-CDF draws of the sorted samples (with interpolation), so the replay reproduces
the recorded quantiles rather than just means. Delays are divided by time_scale. The model is
filled request by request (`add_request`); reading a trace into it is replay/latency_fit/cells.py's job.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence

from .base import LatencyModel, inverse_cdf

PROMPT_EDGES = [0, 65, 129, 257, 513, 1025, 2049, 4097, 8193, 16385, 32769]
CONC_EDGES = [1, 2, 5, 9, 17, 33, 65, 129]
MIN_CELL = 5  # samples a cell needs before it stands on its own
Cell = tuple[int, int]  # (prompt bucket, concurrency bucket)


def bucket(edges: Sequence[int], v: int) -> int:
    return max(bisect.bisect_right(edges, v) - 1, 0)


class _Cells:
    """Samples keyed by (prompt bucket, concurrency bucket), with nearest-cell lookup."""

    def __init__(self) -> None:
        self.cells: dict[Cell, list] = {}
        self._cache: dict[Cell, Cell] = {}

    def add(self, key: Cell, sample) -> None:
        self.cells.setdefault(key, []).append(sample)

    def finish(self) -> None:
        for v in self.cells.values():
            v.sort()
        self._cache = {}

    def nearest(self, key: Cell) -> Cell | None:
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        best, best_d = None, None
        for k, v in self.cells.items():
            # prefer cells with enough samples; ties prefer the same prompt bucket
            d = (abs(k[0] - key[0]) + abs(k[1] - key[1]) + (0 if len(v) >= MIN_CELL else 100),
                 k[0] != key[0])
            if best_d is None or d < best_d:
                best, best_d = k, d
        if best is not None:
            self._cache[key] = best
        return best


class _Runs:
    """A cell's decode gaps in recorded order, one record after another, to replay *runs* of
    consecutive gaps: a stall and the burst of tokens that follows it stay together (drawn
    independently they turn into isolated long gaps, which a client sees as long per-token ITLs)."""

    __slots__ = ("ends", "flat")

    def __init__(self) -> None:
        self.flat: list[tuple[float, int]] = []
        self.ends: list[int] = []  # exclusive end index of each record's run in flat

    def add(self, seq: list[tuple[float, int]]) -> None:
        if seq:
            self.flat.extend(seq)
            self.ends.append(len(self.flat))


class TracePacing:
    __slots__ = ("_end", "_left", "_pos", "_rng", "_runs", "_scale", "_start", "first_chunk", "itl_mean",
                 "itl_std", "ttft")

    def __init__(self, ttft: float, gaps: list[tuple[float, int]], rng: random.Random, scale: float,
                 runs: _Runs) -> None:
        self.ttft = ttft
        self._rng = rng
        self._scale = scale
        self._runs = runs
        self._pos = self._start = self._end = self._left = 0
        self.itl_std = -1.0  # the engine must call next_step()
        self.itl_mean = gaps[len(gaps) // 2][0] * scale if gaps else 0.0
        self.first_chunk = 1

    def next_step(self) -> tuple[float, int]:
        runs = self._runs
        if not runs.flat:
            return 0.0, 1
        if self._left <= 0:
            # a uniform position over all the cell's gaps, then once around that record's run
            # (wrapping to its start): every position is equally likely, so the marginal stays
            # the pooled one (walking only to the end would favour late gaps)
            self._pos = int(self._rng.random() * len(runs.flat))
            i = bisect.bisect_right(runs.ends, self._pos)
            self._start = runs.ends[i - 1] if i else 0
            self._end = runs.ends[i]
            self._left = self._end - self._start
        if self._pos >= self._end:
            self._pos = self._start
        gap, tokens = runs.flat[self._pos]
        self._pos += 1
        self._left -= 1
        return gap * self._scale, tokens


class CellLatency(LatencyModel):
    """Per-request pacing drawn from the recording's cells (filled by `add_request`, then `finish`)."""

    def __init__(self, time_scale: float = 1.0) -> None:
        self._scale = 1e-3 / time_scale
        self.ttft = _Cells()
        self.decode = _Cells()
        self.runs: dict[Cell, _Runs] = {}
        self.output_lengths: list[int] = []

    def add_request(self, concurrency: int, uncached_prompt_tokens: int, ttft_ms: float, prompt_tokens: int,
                    decode_steps: list[tuple[float, int]], output_tokens: int) -> None:
        """One recorded request: its TTFT and its decode (gap ms, tokens) steps in order."""
        conc = bucket(CONC_EDGES, max(concurrency, 1))
        u = uncached_prompt_tokens
        self.ttft.add((bucket(PROMPT_EDGES, u), conc), (ttft_ms, max(u, 1)))
        ctx = (bucket(PROMPT_EDGES, prompt_tokens), conc)
        for sample in decode_steps:
            self.decode.add(ctx, sample)
        if decode_steps:
            self.runs.setdefault(ctx, _Runs()).add(decode_steps)
        if output_tokens > 0:
            self.output_lengths.append(output_tokens)

    def finish(self) -> CellLatency:
        if not self.ttft.cells:
            raise ValueError("latency trace has no records")
        if not self.decode.cells:
            raise ValueError("latency trace has no inter-token data (every request produced one token)")
        self.ttft.finish()
        self.decode.finish()
        self.output_lengths.sort()
        # per cell: (uncached size, ttft) sorted by size, to draw among the nearest sizes
        self._ttft_by_u = {k: sorted(((u, t) for t, u in v)) for k, v in self.ttft.cells.items()}
        self._ttft_median_u = {k: v[len(v) // 2][0] for k, v in self._ttft_by_u.items()}
        self._near_cache: dict[tuple[Cell, int], list[float]] = {}
        self._ttft_resid = {}
        for k, cell in self._ttft_by_u.items():
            res = []
            for cu, t in cell:
                near = self._nearest_sizes(k, cu)
                res.append(t - near[len(near) // 2])
            self._ttft_resid[k] = sorted(res)
        return self

    def pacing(self, num_prompt_tokens: int, num_cached_tokens: int, num_running: int,
               rng: random.Random) -> TracePacing:
        u = max(num_prompt_tokens - num_cached_tokens, 1)
        conc = bucket(CONC_EDGES, max(num_running, 1))
        want = (bucket(PROMPT_EDGES, u), conc)
        key = self.ttft.nearest(want)
        near = self._nearest_sizes(key, u)
        base = near[len(near) // 2]
        if key[0] != want[0]:  # borrowed from another prompt size: scale by the size ratio
            base *= min(max(u / self._ttft_median_u[key], 0.25), 8.0)
        # size-dependent median + the whole cell's spread around its own local medians: the
        # nearest sizes alone are too few to carry the rare long stalls that make p99
        ttft_ms = max(base + inverse_cdf(self._ttft_resid[key], rng.random()), base * 0.25)
        dkey = self.decode.nearest((bucket(PROMPT_EDGES, num_prompt_tokens), conc))
        return TracePacing(ttft_ms * self._scale, self.decode.cells[dkey], rng, self._scale, self.runs[dkey])

    def _nearest_sizes(self, key: Cell, u: int) -> list[float]:
        """Sorted TTFTs of the cell's requests closest in uncached size: the nearest eighth of the
        cell, ties included (so a cell of equal sizes keeps its whole distribution)."""
        cached = self._near_cache.get((key, u))
        if cached is not None:
            return cached
        cell = self._ttft_by_u[key]
        k = min(len(cell), max(MIN_CELL, len(cell) // 8))
        dists = sorted(abs(cu - u) for cu, _ in cell)
        limit = dists[k - 1]
        out = sorted(t for cu, t in cell if abs(cu - u) <= limit)
        if len(self._near_cache) < 100_000:
            self._near_cache[(key, u)] = out
        return out

    def sample_output_len(self, rng: random.Random) -> int | None:
        if not self.output_lengths:
            return None
        return max(int(round(inverse_cdf(self.output_lengths, rng.random()))), 1)
