"""The trace-fitted latency model: each fitted component recovers what was put in."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from vllm_vcr.inspect.gen_demo import gen_demo
from vllm_vcr.trace.io import read_trace
from vllm_vcr.trace.latency_fit import (
    ChunkLaw,
    FirstTokenCtx,
    TraceLatency,
    fit_chunk_law,
    fit_service_curve,
    inverse_cdf,
    prompt_bucket,
)
from vllm_vcr.trace.schema import ItlCtx, TraceRecord

FIXTURES = Path(__file__).parent / "fixtures"


def test_buckets_and_inverse_cdf():
    assert [prompt_bucket(v) for v in (0, 64, 65, 128, 129, 8192, 8193, 40000)] == [0, 0, 1, 1, 2, 7, 8, 10]
    assert inverse_cdf([5.0], 0.7) == 5.0
    assert inverse_cdf([1.0, 3.0], 0.5) == 2.0 and inverse_cdf([1.0, 3.0], 1.0) == 3.0


def test_service_curve_recovers_a_quadratic():
    rng = np.random.default_rng(0)
    recs = []
    for _ in range(600):
        u = int(rng.integers(1, 8000))
        ttft = 20 + 0.01 * u + 1e-6 * u * u + float(rng.exponential(2.0))  # noise only upward
        recs.append(TraceRecord(prompt_tokens=u, output_tokens=1, ttft_ms=ttft, concurrency=1))
    recs.append(TraceRecord(prompt_tokens=100, output_tokens=1, ttft_ms=900.0, concurrency=8))
    curve = fit_service_curve(recs)
    assert curve.coef is not None
    for u in (500, 2000, 6000):
        truth = 20 + 0.01 * u + 1e-6 * u * u
        assert curve(u) == pytest.approx(truth, rel=0.08)


def test_service_curve_needs_windows():
    recs = [TraceRecord(prompt_tokens=10, output_tokens=1, ttft_ms=5.0) for _ in range(3)]
    assert fit_service_curve(recs).coef is None


def test_chunk_law_recovers_its_coefficients():
    law = ChunkLaw(0.02, 2e-6)
    rng = np.random.default_rng(1)
    recs = []
    for _ in range(60):
        p = int(rng.integers(300, 6000))
        gaps = [10.0] * 12
        marks = [0] * 12
        gaps[6] += law.cost(p, 0)
        marks[6] = p
        recs.append(TraceRecord(prompt_tokens=64, output_tokens=13, ttft_ms=5.0, itl_ms=gaps,
                                itl_ctx=ItlCtx(num_running=[2] * 12, prefill_tokens=marks)))
    fitted = fit_chunk_law(recs, budget=8192)
    assert fitted.c0 == pytest.approx(0.02, rel=0.01) and fitted.c1 == pytest.approx(2e-6, rel=0.01)
    assert fit_chunk_law(recs[:10], budget=8192) == ChunkLaw()  # too few marks


def test_model_on_gen_demo_is_deterministic_and_in_range():
    _, recs = gen_demo(400, seed=5)
    m = TraceLatency(recs, budget=8192)
    assert m.pacing(64, 0, 1, random.Random(0)).itl_std == -1.0
    rng1, rng2 = random.Random(3), random.Random(3)
    p1, p2 = m.pacing(512, 0, 4, rng1), m.pacing(512, 0, 4, rng2)
    assert p1.ttft == p2.ttft and p1.ttft > 0
    steps = [p1.next_step() for _ in range(50)]
    assert steps == [p2.next_step() for _ in range(50)]
    all_gaps = sorted(g for r in recs for g in r.itl_ms)
    assert all(all_gaps[0] / 1e3 <= g <= all_gaps[-1] / 1e3 for g, _ in steps)
    lengths = {m.sample_output_len(random.Random(i)) for i in range(200)}
    assert min(lengths) >= 8 and max(lengths) <= 32
    assert m.spec_tokens() is None
    assert m.inter_token_delay(3, random.Random(0)) > 0
    ctx = FirstTokenCtx(1024, 0, False, 16)
    assert m.first_token_overhead(ctx, random.Random(0)) <= m.first_token_delay(ctx, random.Random(0))
    assert m.first_token_delay(FirstTokenCtx(10, 0, True)) == 0.0  # remote prefill: knob fallback


def test_model_from_fixtures():
    spec = TraceLatency(read_trace(FIXTURES / "spec_decode_trace.jsonl").records)
    assert spec.spec_tokens() == 4
    p = spec.pacing(32, 0, 1, random.Random(0))
    assert {p.next_step()[1] for _ in range(200)} <= {1, 2, 3, 4, 5}
    guide = TraceLatency(read_trace(FIXTURES / "edge_cases_trace.jsonl").records)
    assert guide.pacing(600, 0, 1, random.Random(0)).next_step()[0] > 0
    with pytest.raises(ValueError, match="empty"):
        TraceLatency([])
    with pytest.raises(ValueError, match="inter-token"):
        TraceLatency([TraceRecord(prompt_tokens=1, output_tokens=1, ttft_ms=1.0)])
