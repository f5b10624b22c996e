"""Timing-only engines extend a synthetic workload's prompt lists instead of copying them (nothing
reads a prompt after delivery); a trace's prompts, which a workload keeps and may replay, are
copied as before and stay intact."""

from __future__ import annotations

import copy

from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.simulate import driver as driver_mod
from vllm_vcr.simulate.driver import Simulation
from vllm_vcr.simulate.router import make_router
from vllm_vcr.simulate.workload import LengthDist, SimRequest, SyntheticWorkload, TraceWorkload

from ..engine.test_decode_cohort import _latency


def _args() -> EngineArgs:
    return EngineArgs(config=EngineConfig(max_num_seqs=8, max_num_batched_tokens=256), kv_cache_size=200,
                      tokens_per_block=16, advertised_max_model_len=1 << 16).validate()


def _run(monkeypatch, workload, timing_only=True) -> Simulation:
    monkeypatch.setattr(driver_mod, "engine_inputs", lambda a: {"latency": _latency()})
    return Simulation(_args(), 1, make_router("round_robin", 1, block_size=16, capacity_blocks=200), workload, concurrency=4,
                      timing_only=timing_only).run()


def test_synthetic_prompts_are_adopted_by_timing_only_engines(monkeypatch):
    wl = SyntheticWorkload(num_requests=6, isl=LengthDist("fixed", 40), osl=LengthDist("fixed", 9),
                           concurrency=4, seed=1)
    sim = _run(monkeypatch, wl)
    assert all(core.admission.adopt_prompts for core in sim.cores)
    assert len(sim.done) == 6 and all(r.num_out == 9 for r in sim.done)
    plain = _run(monkeypatch, SyntheticWorkload(num_requests=6, isl=LengthDist("fixed", 40),
                                                 osl=LengthDist("fixed", 9), concurrency=4, seed=1), False)
    assert not any(core.admission.adopt_prompts for core in plain.cores)
    assert [(r.first, r.end) for r in sim.done] == [(r.first, r.end) for r in plain.done]


def test_a_trace_keeps_its_prompts(monkeypatch):
    reqs = [SimRequest(f"t{i}", [i + 1] * 40, 7, arrival=0.01 * i) for i in range(5)]
    before = copy.deepcopy(reqs)
    sim = _run(monkeypatch, TraceWorkload(reqs))
    assert not any(core.admission.adopt_prompts for core in sim.cores)
    assert len(sim.done) == 5 and [r.prompt for r in reqs] == [r.prompt for r in before]
