"""Steps priced by the estimator, in the engine on the virtual clock."""

from __future__ import annotations

import random

import pytest

from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.engine.latency import StepBatch
from vllm_vcr.simulate.runner import simulate
from vllm_vcr.simulate.workload import LengthDist, SyntheticWorkload

from .conftest import LLAMA_8B, needs_aic

pytestmark = needs_aic


@pytest.fixture(scope="module")
def model():
    from vllm_vcr.perf.aic import AicTarget, step_latency

    # the estimator's own times: no host overhead
    return step_latency(AicTarget(LLAMA_8B, "h100_sxm", step_overhead_ms=0.0, per_seq_overhead_ms=0.0))


def test_served_names_map_onto_the_estimators_models():
    from vllm_vcr.perf.catalog import resolve_model

    assert resolve_model("meta-llama/Llama-3.1-70B") == ("meta-llama/Meta-Llama-3.1-70B", None)
    assert resolve_model("nvidia/Llama-3.1-8B-Instruct-FP8") == ("meta-llama/Meta-Llama-3.1-8B", "fp8")
    assert resolve_model("Qwen/Qwen3-32B") == ("Qwen/Qwen3-32B", None)


def test_a_decode_step_is_the_estimators_generation_step(model):
    handle = model.pricer._h
    for n in (1, 64, 256):
        ms = model.step_ms(StepBatch(n, 0, 0, 0, n * 1024))
        assert ms == pytest.approx(handle.decode_step_latency(n, 1024, 2), rel=1e-6)
    assert model.step_ms(StepBatch(1, 0, 0, 0, 1024)) < model.step_ms(StepBatch(256, 0, 0, 0, 256 * 1024))


def test_prefill_context_and_decodes_make_a_step_longer(model):
    chunk = model.step_ms(StepBatch(0, 2048, 1, 1, 0))
    late_chunk = model.step_ms(StepBatch(0, 2048, 1, 1, 0, prefill_context=6144))
    mixed = model.step_ms(StepBatch(64, 2048, 1, 1, 64 * 2000))
    assert chunk < late_chunk  # the same chunk attends to more context
    assert chunk < mixed  # decodes ride along a prefill chunk, and cost


def test_host_overhead_is_added_to_every_step(model):
    from vllm_vcr.perf.aic import DEFAULT_PER_SEQ_OVERHEAD_MS, DEFAULT_STEP_OVERHEAD_MS, AicTarget, step_latency

    default = step_latency(AicTarget(LLAMA_8B, "h100_sxm"))
    b = StepBatch(8, 0, 0, 0, 8 * 512)
    host = DEFAULT_STEP_OVERHEAD_MS + 8 * DEFAULT_PER_SEQ_OVERHEAD_MS  # the fitted a + b x running sequences
    assert default.step_ms(b) == pytest.approx(model.step_ms(b) + host)


def test_time_scale_divides_the_step(model):
    from vllm_vcr.engine.latency import AicStepLatency

    fast = AicStepLatency(model.pricer, time_scale=10.0)
    b = StepBatch(8, 0, 0, 0, 8 * 512)
    assert fast.step_duration(b, random.Random(0)) == pytest.approx(model.step_duration(b, random.Random(0)) / 10)


def _closed_loop(concurrency: int, isl: int = 512, osl: int = 64, n: int | None = None, ramp_up: float = 0.0,
                 **engine):
    from vllm_vcr.perf.aic import AicTarget

    target = AicTarget(LLAMA_8B, "h100_sxm", step_overhead_ms=0.0, per_seq_overhead_ms=0.0).resolved().to_dict()
    args = EngineArgs(config=EngineConfig(max_num_seqs=engine.pop("max_num_seqs", 256), max_num_batched_tokens=8192),
                      perf_model=target, advertised_max_model_len=isl + osl + 16, **engine).validate()
    wl = SyntheticWorkload(num_requests=n or 2 * concurrency, isl=LengthDist("fixed", isl),
                           osl=LengthDist("fixed", osl), arrival="closed", concurrency=concurrency, ramp_up=ramp_up)
    return simulate(args, wl, concurrency=concurrency)


def _mean_tpot_ms(sim) -> float:
    tpots = [(r.end - r.first) * 1e3 / (r.num_out - 1) for r in sim.done]
    return sum(tpots) / len(tpots)


def test_tpot_rises_with_concurrency_as_the_estimator_says(model):
    handle = model.pricer._h
    decode = {c: handle.decode_step_latency(c, 512 + 64, 2) for c in (1, 16, 64)}
    # users start spread over one request's lifetime: a steady state, not waves of prefills
    tpot = {c: _mean_tpot_ms(_closed_loop(c, osl=128, ramp_up=128 * decode[c] / 1e3, kv_cache_size=20000))
            for c in (1, 16, 64)}
    assert tpot[1] < tpot[16] < tpot[64]
    # a decode-bound closed loop: TPOT is the estimator's decode step at that batch, plus the
    # share of the prefill chunks of the requests that join meanwhile
    for c, t in tpot.items():
        assert decode[c] * 0.97 <= t <= decode[c] * 1.35, (c, t, decode[c])


def test_kv_capacity_from_the_gpu_makes_requests_queue_where_it_runs_out():
    from vllm_vcr.perf.aic import AicTarget
    from vllm_vcr.perf.kv_sizing import estimate_kv_capacity

    target = AicTarget(LLAMA_8B, "l40s")
    cap = estimate_kv_capacity(target, block_size=16, gpu_memory_utilization=0.6, max_num_batched_tokens=8192,
                               max_num_seqs=256)
    isl, osl = 3000, 32
    fits = cap.num_blocks // ((isl + osl) // 16 + 1)  # requests whose KV fits at once
    assert 4 <= fits <= 64, fits
    under = _closed_loop(max(fits // 2, 1), isl, osl, kv_cache_size=cap.num_blocks)
    over = _closed_loop(fits * 2, isl, osl, kv_cache_size=cap.num_blocks)
    # below the capacity every user runs at once (waiting only for the prefill budget), never preempted
    assert max(under.timeline.running) == max(fits // 2, 1) and sum(under.timeline.preemptions) == 0
    # above it the KV cache caps the running set and the rest queue
    assert max(over.timeline.running) <= fits + 1
    assert max(over.timeline.waiting) >= fits - 1
