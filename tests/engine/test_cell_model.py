"""The cell model (engine/latency/cells.py, filled by replay/latency_fit/cells.py): TTFT follows the prompt size at the median and keeps
the cell's rare stalls in its tail (bench/fidelity found p99 lost when drawing from the nearest
sizes only)."""

from __future__ import annotations

import random

from vllm_vcr.replay.latency_fit.cells import fit_cell_model
from vllm_vcr.trace.schema import TraceRecord
from vllm_vcr.trace.stats import nearest_rank


def _records(n=600, seed=3):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        u = rng.randint(65, 128)  # one prompt bucket, so one cell
        ttft = 10 + 0.2 * u + rng.random() * 2
        if rng.random() < 0.03:
            ttft += 300  # a stall (CPU contention), independent of the size
        out.append(TraceRecord(prompt_tokens=u, output_tokens=3, ttft_ms=ttft, concurrency=1,
                               itl_ms=[5.0, 5.0]))
    return out


def _ttfts(model, u, n=4000):
    rng = random.Random(0)
    return sorted(model.pacing(u, 0, 1, rng).ttft * 1e3 for _ in range(n))


def test_ttft_median_follows_the_prompt_size():
    model = fit_cell_model(_records())
    small, large = _ttfts(model, 70), _ttfts(model, 125)
    assert abs(nearest_rank(small, 50) - (10 + 0.2 * 70 + 1)) < 3
    assert abs(nearest_rank(large, 50) - (10 + 0.2 * 125 + 1)) < 3


def test_ttft_tail_keeps_the_cells_stalls_at_every_size():
    recs = _records()
    model = fit_cell_model(recs)
    stall_share = sum(r.ttft_ms > 200 for r in recs) / len(recs)
    for u in (70, 100, 125):
        drawn = _ttfts(model, u)
        share = sum(t > 200 for t in drawn) / len(drawn)
        assert abs(share - stall_share) < 0.015, (u, share, stall_share)
        assert nearest_rank(drawn, 99) > 250


def test_ttft_is_never_below_a_fraction_of_the_local_median():
    model = fit_cell_model(_records())
    assert min(_ttfts(model, 65)) > 0.25 * (10 + 0.2 * 65)


def test_decode_replays_runs_of_recorded_gaps_with_the_pooled_marginal():
    # every stall is followed by a catch-up burst, as a starved process delivers a backlog
    pattern = [5.0] * 6 + [50.0, 0.1, 0.1, 0.1]
    recs = [TraceRecord(prompt_tokens=100, output_tokens=len(pattern) * 3 + 1, ttft_ms=20.0, concurrency=1,
                        itl_ms=pattern * 3) for _ in range(20)]
    model = fit_cell_model(recs)
    rng = random.Random(1)
    gaps = []
    for _ in range(200):
        p = model.pacing(100, 0, 1, rng)
        gaps.append([p.next_step()[0] * 1e3 for _ in range(40)])
    flat = [g for seq in gaps for g in seq]
    assert abs(sum(g == 50.0 for g in flat) / len(flat) - 0.1) < 0.02
    followed = [seq[i + 1] for seq in gaps for i in range(len(seq) - 1) if seq[i] == 50.0]
    # within a run the burst follows; only at a run's end (re-drawn start) may it not
    assert sum(g == 0.1 for g in followed) / len(followed) > 0.9


def test_decode_runs_keep_early_gaps_as_likely_as_late_ones():
    # the stall is each record's first gap: runs must not under-sample the start of records
    seq = [40.0] + [5.0] * 9
    recs = [TraceRecord(prompt_tokens=100, output_tokens=len(seq) + 1, ttft_ms=20.0, concurrency=1,
                        itl_ms=list(seq)) for _ in range(10)]
    model = fit_cell_model(recs)
    rng = random.Random(2)
    flat = []
    for _ in range(300):
        p = model.pacing(100, 0, 1, rng)
        flat += [p.next_step()[0] * 1e3 for _ in range(7)]
    assert abs(sum(g == 40.0 for g in flat) / len(flat) - 0.1) < 0.02
