"""Arrival schedules for the fidelity benchmark: traces that carry only what `replay-arrivals`
needs (arrival_ms, prompt_tokens, output_tokens, block_hashes for shared prefixes).

- poisson: independent requests, exponential inter-arrival gaps, unique prompts;
- sessions: multi-turn conversations. Every session starts with one of a few shared system
  prompts; turn k+1's prompt is turn k's prompt plus new blocks, so its block-hash chain extends
  its parent's and `replay-arrivals` holds it until the parent finished plus the think time.
"""

from __future__ import annotations

import random
from pathlib import Path

from vllm_vcr.trace.io import TraceWriter
from vllm_vcr.trace.schema import ItlSummary, TraceMeta, TraceRecord

BLOCK = 16


def _nominal(n_out: int) -> ItlSummary:
    # the trace format wants timing on every multi-token record; a schedule has none yet
    return ItlSummary(mean_ms=0.0, count=n_out - 1)


def poisson(rate: float, duration_s: float, isl: tuple[int, int], osl: tuple[int, int],
            seed: int) -> list[TraceRecord]:
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > duration_s:
            return out
        n_out = rng.randint(*osl)
        out.append(TraceRecord(prompt_tokens=rng.randint(*isl), output_tokens=n_out, ttft_ms=0.0,
                               itl_summary=_nominal(n_out), arrival_ms=round(t * 1e3, 3)))


def sessions(n_sessions: int, turns: tuple[int, int], start_rate: float, think_s: float,
             system_blocks: int, turn_blocks: tuple[int, int], osl: tuple[int, int], n_systems: int,
             seed: int) -> list[TraceRecord]:
    rng = random.Random(seed)
    out: list[TraceRecord] = []
    next_hash = [1 << 40]

    def fresh(n: int) -> list[int]:
        hs = list(range(next_hash[0], next_hash[0] + n))
        next_hash[0] += n
        return hs

    systems = [fresh(system_blocks) for _ in range(n_systems)]
    t0 = 0.0
    for s in range(n_sessions):
        t0 += rng.expovariate(start_rate)
        chain = list(systems[s % n_systems])
        t = t0
        for _ in range(rng.randint(*turns)):
            chain = chain + fresh(rng.randint(*turn_blocks))
            out_tokens = rng.randint(*osl)
            # a nominal arrival; replay-arrivals also waits for the parent turn + think time
            out.append(TraceRecord(prompt_tokens=len(chain) * BLOCK, output_tokens=out_tokens,
                                   ttft_ms=0.0, itl_summary=_nominal(out_tokens),
                                   arrival_ms=round(t * 1e3, 3), block_hashes=list(chain)))
            t += 0.05 + out_tokens * 0.015 + rng.expovariate(1.0 / think_s)
    out.sort(key=lambda r: r.arrival_ms)
    return out


WORKLOADS = {
    # ISL/OSL modest: the CPU engine shares 2 cores with the frontend, the tap and the client
    "poisson_lo": lambda: poisson(rate=2.0, duration_s=75, isl=(32, 256), osl=(16, 64), seed=1),
    "poisson_hi": lambda: poisson(rate=6.0, duration_s=50, isl=(32, 256), osl=(16, 64), seed=2),
    # the same schedule as poisson_lo, recorded again: how much the real engine differs from itself
    "poisson_lo_repeat": lambda: poisson(rate=2.0, duration_s=75, isl=(32, 256), osl=(16, 64), seed=1),
    "sessions": lambda: sessions(n_sessions=36, turns=(3, 5), start_rate=0.6, think_s=2.0,
                                 system_blocks=8, turn_blocks=(2, 6), osl=(16, 48), n_systems=3, seed=3),
}


def write(name: str, path: Path) -> int:
    recs = WORKLOADS[name]()
    with TraceWriter(str(path), TraceMeta(model="tinymodel", source="schedule", block_size=BLOCK,
                                          max_num_seqs=8)) as w:
        for r in recs:
            w.write(r)
    return len(recs)


if __name__ == "__main__":
    import sys

    for name in WORKLOADS:
        recs = WORKLOADS[name]()
        print(name, len(recs), "requests over", round(recs[-1].arrival_ms / 1e3, 1), "s",
              "max prompt", max(r.prompt_tokens for r in recs), file=sys.stderr)
