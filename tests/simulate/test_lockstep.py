"""`simulate` with the GPU perf model: the data-parallel ranks of an MoE model step in lockstep
(engine/lockstep.py), a dense model's ranks each at their own pace."""

from __future__ import annotations

import numpy as np

from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.perf.aic import AicTarget
from vllm_vcr.simulate.runner import simulate
from vllm_vcr.simulate.workload import LengthDist, SyntheticWorkload


def _token_times(model: str):
    target = AicTarget(model, "h100_sxm", attention_dp_size=2).resolved()
    args = EngineArgs(config=EngineConfig(max_num_batched_tokens=8192), kv_cache_size=4000, tokens_per_block=16,
                      perf_model=target.to_dict(), advertised_max_model_len=20000).validate()
    workload = SyntheticWorkload(num_requests=16, isl=LengthDist("uniform", 1000, 4000), osl=LengthDist("fixed", 64),
                                 arrival="closed", concurrency=4, seed=1)
    sim = simulate(args, workload, engines=2, concurrency=4)
    assert len(sim.done) == 16
    times: list[set[float]] = [set(), set()]
    for rec in sim.done:
        times[rec.engine].add(round(rec.first, 9))
        times[rec.engine].update(np.round(np.frombuffer(rec.times, dtype=np.float64), 9).tolist())
    return sim, times


def test_an_moe_models_ranks_emit_their_tokens_at_the_same_step_ends():
    sim, (t0, t1) = _token_times("Qwen/Qwen3-30B-A3B")
    assert all(c.lockstep is sim.cores[0].lockstep is not None for c in sim.cores)
    shared = len(t0 & t1) / min(len(t0), len(t1))
    assert shared > 0.9  # (both ranks decode most of the run: their steps are the same steps)


def test_a_dense_models_ranks_step_independently():
    sim, (t0, t1) = _token_times("meta-llama/Llama-3.1-8B-Instruct")
    assert all(c.lockstep is None for c in sim.cores)
    assert len(t0 & t1) / min(len(t0), len(t1)) < 0.1
