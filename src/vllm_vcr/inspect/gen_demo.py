"""`inspect gen-demo`: a synthetic trace with heavy-tailed (lognormal) TTFT and ITL.

Same request groups as the Rust tool's demo generator, so calibration thresholds carry over:
each group is (prompt tokens, ln-TTFT mu/sigma, ln-ITL mu/sigma, output range); a record's
concurrency is what its arrival schedule implies.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from ..trace.schema import SOURCE_GEN_DEMO, SOURCE_GEN_DEMO_FAST, TraceMeta, TraceRecord


@dataclass(frozen=True)
class Group:
    prompt: int
    ttft_mu: float
    ttft_sigma: float
    itl_mu: float
    itl_sigma: float
    out_lo: int
    out_hi: int


REALISTIC = (
    Group(64, 3.2, 0.9, 1.8, 0.8, 8, 24),
    Group(256, 3.8, 0.9, 2.0, 0.8, 10, 32),
    Group(512, 4.0, 0.85, 2.2, 0.75, 12, 28),
    Group(1024, 4.3, 0.95, 2.3, 0.8, 8, 20),
)
FAST = (
    Group(32, 2.7, 0.5, 1.1, 0.5, 4, 8),
    Group(64, 3.0, 0.5, 1.4, 0.5, 4, 8),
    Group(128, 3.2, 0.4, 1.6, 0.4, 4, 8),
    Group(256, 3.5, 0.5, 1.8, 0.5, 4, 8),
)
MIN_TTFT_MS = 1.0
MIN_ITL_MS = 0.5


def _in_flight_at_arrival(records: list[TraceRecord]) -> None:
    """Each record's `concurrency`: the requests in flight when it arrived, itself included, as
    its own arrival and end times say (what a replay of the arrivals sees, and what a recording
    would have measured)."""
    starts = sorted(r.arrival_ms for r in records)
    ends = sorted(r.arrival_ms + r.ttft_ms + sum(r.itl_ms) for r in records)  # in flight until its last token
    for r in records:
        r.concurrency = bisect.bisect_right(starts, r.arrival_ms) - bisect.bisect_right(ends, r.arrival_ms)


def gen_demo(records: int = 200, seed: int = 0, fast: bool = False,
             mean_gap_ms: float | None = None) -> tuple[TraceMeta, list[TraceRecord]]:
    rng = np.random.default_rng(seed)
    groups = FAST if fast else REALISTIC
    gap = mean_gap_ms if mean_gap_ms is not None else (20.0 if fast else 100.0)
    out: list[TraceRecord] = []
    t = 0.0
    for i in range(records):
        g = groups[int(rng.integers(len(groups)))]
        n_out = int(rng.integers(g.out_lo, g.out_hi + 1))
        ttft = max(float(rng.lognormal(g.ttft_mu, g.ttft_sigma)), MIN_TTFT_MS)
        itl = [round(max(float(x), MIN_ITL_MS), 3)
               for x in rng.lognormal(g.itl_mu, g.itl_sigma, size=n_out - 1)]
        out.append(TraceRecord(
            prompt_tokens=g.prompt, output_tokens=n_out, ttft_ms=round(ttft, 3), itl_ms=itl,
            arrival_ms=round(t, 3), finish_reason="length",
        ))
        t += float(rng.exponential(gap)) if i + 1 < records else 0.0
    _in_flight_at_arrival(out)
    meta = TraceMeta(model="gen-demo", source=SOURCE_GEN_DEMO_FAST if fast else SOURCE_GEN_DEMO,
                     max_num_seqs=64)
    return meta, out
