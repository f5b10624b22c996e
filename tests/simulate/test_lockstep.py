"""`simulate` with the GPU perf model: the data-parallel ranks of an MoE model step in lockstep
(engine/lockstep.py), a dense model's ranks each at their own pace."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.perf.aic import AicTarget
from vllm_vcr.simulate.disagg import DisaggSimulation
from vllm_vcr.simulate.runner import simulate
from vllm_vcr.simulate.workload import LengthDist, SyntheticWorkload

from ..perf.conftest import needs_aic

pytestmark = needs_aic


def _token_times(model: str, engine_type: str = "vllm", timing_only: bool | None = None, kv_blocks: int = 4000):
    target = AicTarget(model, "h100_sxm", attention_dp_size=2).resolved()
    args = EngineArgs(config=EngineConfig(max_num_batched_tokens=8192), kv_cache_size=kv_blocks, tokens_per_block=16,
                      perf_model=target.to_dict(), advertised_max_model_len=20000, engine_type=engine_type).validate()
    workload = SyntheticWorkload(num_requests=16, isl=LengthDist("uniform", 1000, 4000), osl=LengthDist("fixed", 64),
                                 arrival="closed", concurrency=4, seed=1)
    sim = simulate(args, workload, engines=2, concurrency=4, timing_only=timing_only)
    assert len(sim.done) == 16
    times: list[set[float]] = [set(), set()]
    for rec in sim.done:
        times[rec.engine].add(round(rec.first, 9))
        times[rec.engine].update(np.round(np.frombuffer(rec.times, dtype=np.float64), 9).tolist())
    return sim, times


@pytest.mark.parametrize("engine_type", ["vllm", "sglang"])
def test_an_moe_models_ranks_emit_their_tokens_at_the_same_step_ends(engine_type):
    sim, (t0, t1) = _token_times("Qwen/Qwen3-30B-A3B", engine_type)
    assert all(c.lockstep is sim.cores[0].lockstep is not None for c in sim.cores)
    assert sim.cores[0].lockstep.rule.per_step == (engine_type == "sglang")
    shared = len(t0 & t1) / min(len(t0), len(t1))
    assert shared > 0.9  # (both ranks decode most of the run: their steps are the same steps)


@pytest.mark.parametrize("engine_type", ["vllm", "sglang"])
@pytest.mark.parametrize("kv_blocks", [4000, 300])  # 300: the ranks preempt (retract)
def test_lockstep_ranks_time_their_tokens_alike_on_the_timing_only_path(engine_type, kv_blocks):
    """The timing-only path (simulate's default) against the plain one, ranks tied: the same token
    times on each rank, the same finishes and preemptions."""
    runs = [_token_times("Qwen/Qwen3-30B-A3B", engine_type, t, kv_blocks) for t in (False, True)]
    (plain, plain_times), (fast, fast_times) = runs
    assert fast.timing_only and not plain.timing_only
    assert fast_times == plain_times
    assert {r.request_id: (r.engine, r.first, r.end, r.num_out) for r in fast.done} == \
        {r.request_id: (r.engine, r.first, r.end, r.num_out) for r in plain.done}
    assert fast.timeline.preemptions == plain.timeline.preemptions
    assert kv_blocks == 4000 or sum(plain.timeline.preemptions) > 0


def test_a_dense_models_ranks_step_independently():
    sim, (t0, t1) = _token_times("meta-llama/Llama-3.1-8B-Instruct")
    assert all(c.lockstep is None for c in sim.cores)
    assert len(t0 & t1) / min(len(t0), len(t1)) < 0.1


@pytest.mark.parametrize("model,tied", [("Qwen/Qwen3-30B-A3B", True), ("meta-llama/Llama-3.1-8B-Instruct", False)])
def test_a_disaggregated_workers_attention_dp_ranks_step_together(model, tied):
    """Two prefill workers and one decode worker, each of attention DP 2 (SGLang): an MoE model's
    ranks of one worker are one lockstep group, the workers are not tied to each other; a dense
    model's ranks are independent."""
    target = AicTarget(model, "h100_sxm", attention_dp_size=2).resolved()

    def args(worker: str) -> EngineArgs:
        return EngineArgs(config=EngineConfig(max_num_batched_tokens=8192), kv_cache_size=4000, tokens_per_block=16,
                          perf_model=target.to_dict(), advertised_max_model_len=20000, engine_type="sglang",
                          worker_type=worker, kv_transfer_bandwidth=50.0).validate()

    workload = SyntheticWorkload(num_requests=12, isl=LengthDist("uniform", 500, 3000), osl=LengthDist("fixed", 32),
                                 arrival="closed", concurrency=4, seed=2)
    sim = DisaggSimulation(args("prefill"), args("decode"), 4, 2, workload, concurrency=4,
                           prefill_dp=2, decode_dp=2).run()
    assert len(sim.done) == 12
    groups = [c.lockstep for c in sim.prefill + sim.decode]
    if not tied:
        assert groups == [None] * 6
        return
    p0, p1, d0 = groups[0], groups[2], groups[4]
    assert groups == [p0, p0, p1, p1, d0, d0] and len({id(p0), id(p1), id(d0)}) == 3 and p0.rule.per_step
    # the decode worker's ranks emit their tokens at the same step ends
    times: list[set[float]] = [set(), set()]
    for rec in sim.done:  # (a record's engine: its index among the prefill engines, then the decode ones)
        times[rec.engine - len(sim.prefill)].update(np.round(np.frombuffer(rec.times, dtype=np.float64), 9).tolist())
    assert len(times[0] & times[1]) / min(len(times[0]), len(times[1])) > 0.5


def test_a_decode_rank_takes_its_pulled_kv_at_the_next_round_of_its_workers_steps():
    """A decode worker of attention DP 4 (SGLang, an MoE model) whose ranks keep stepping while
    others pull prompts: every rank picks up its completed pulls when the next round of steps
    forms, as SGLang's decode scheduler polls its transfers every loop, so a request's first
    token follows its prefill by the transfer plus a step or two, not by the rest of the wave."""
    target = AicTarget("Qwen/Qwen3-30B-A3B", "h100_sxm", attention_dp_size=4).resolved()

    def args(worker: str) -> EngineArgs:
        return EngineArgs(config=EngineConfig(max_num_batched_tokens=8192), kv_cache_size=8000, tokens_per_block=16,
                          perf_model=target.to_dict(), advertised_max_model_len=20000, engine_type="sglang",
                          worker_type=worker, kv_transfer_bandwidth=50.0).validate()

    workload = SyntheticWorkload(num_requests=64, isl=LengthDist("fixed", 1000), osl=LengthDist("fixed", 128),
                                 arrival="closed", concurrency=16, seed=3)
    sim = DisaggSimulation(args("prefill"), args("decode"), 4, 4, workload, concurrency=16,
                           prefill_dp=4, decode_dp=4).run()
    assert len(sim.done) == 64 and sim.decode[0].lockstep is not None
    steps = [float(np.max(np.diff(np.frombuffer(r.times, dtype=np.float64), prepend=r.first))) for r in sim.done]
    waits = [r.first - sim.prefill_done[r.request_id] for r in sim.done]
    transfer = 1000 * args("decode").kv_bytes_per_token / 50e9 if args("decode").kv_bytes_per_token else 0.0
    # admitted at the next round, pulled, taken at the round after, its first token a step later
    # (rounds stretched by other ranks' first steps): a few steps; before, the rest of the wave (seconds)
    assert max(waits) < transfer + 5 * max(steps)
