"""The perf model's frontend time: the API server's work before the engine core sees a request
(fixed + per prompt token + per request in flight), in the engine on the virtual clock."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.simulate.runner import simulate
from vllm_vcr.simulate.workload import LengthDist, SyntheticWorkload

from .conftest import LLAMA_8B, needs_aic

pytestmark = needs_aic


def _run(n: int, concurrency: int, isl: int = 1000, **frontend):
    from vllm_vcr.perf.aic import AicTarget

    target = AicTarget(LLAMA_8B, "h100_sxm", step_overhead_ms=0.0, per_seq_overhead_ms=0.0,
                       frontend_ms=frontend.get("ms", 0.0),
                       frontend_ms_per_1k_tokens=frontend.get("per_1k", 0.0),
                       frontend_ms_per_request=frontend.get("per_request", 0.0)).resolved().to_dict()
    args = EngineArgs(config=EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192), perf_model=target,
                      kv_cache_size=20000, advertised_max_model_len=isl + 64).validate()
    wl = SyntheticWorkload(num_requests=n, isl=LengthDist("fixed", isl), osl=LengthDist("fixed", 16),
                           arrival="closed", concurrency=concurrency)
    return simulate(args, wl, concurrency=concurrency)


def _ttfts_ms(sim) -> list[float]:
    return [(r.first - r.arrival) * 1e3 for r in sorted(sim.done, key=lambda r: r.arrival)]


def test_a_lone_request_waits_for_the_frontend_before_its_prefill():
    bare = _ttfts_ms(_run(1, 1))[0]
    fe = _ttfts_ms(_run(1, 1, ms=4.0, per_1k=8.5))[0]
    assert fe == pytest.approx(bare + 4.0 + 8.5, abs=1e-6)  # 1000 prompt tokens


def test_the_frontend_time_grows_with_the_requests_in_flight_and_keeps_their_order():
    from vllm_vcr.perf.aic import AicTarget, step_latency

    from ..engine.conftest import Harness

    h = Harness(latency=step_latency(AicTarget(LLAMA_8B, "h100_sxm", frontend_ms=0.0, frontend_ms_per_1k_tokens=0.0,
                                               frontend_ms_per_request=10.0)), kv_cache_size=1000)
    for rid in "abc":  # all at t = 0: c waits behind the server's work for a and b
        h.add(rid, 100, 2)
    h.run()
    first = {rid: h.emission_times(rid)[0] for rid in "abc"}
    assert first["a"] < 0.01 <= first["b"] < first["c"] and first["c"] >= 0.02


def test_a_request_aborted_in_the_frontend_never_reaches_the_scheduler():
    from vllm_vcr.perf.aic import AicTarget, step_latency

    from ..engine.conftest import Harness

    h = Harness(latency=step_latency(AicTarget(LLAMA_8B, "h100_sxm", frontend_ms=50.0)), kv_cache_size=1000)
    h.add("a", 100, 4)
    h.add("b", 100, 4)
    h.run(until=0.01)
    sched = h.core.scheduler
    assert not sched.waiting and not sched.running  # both still in the frontend
    h.core.abort_requests(["a"])
    h.run()
    assert not h.core.requests and not h.core.timed.arriving
    assert h.finish("b") is not None and len(h.tokens("b")) == 4  # b ran to its end
    assert not h.tokens("a")  # a was aborted before the engine saw it
    assert h.emission_times("b")[0] >= 0.05  # b entered the scheduler after its 50 ms in the frontend


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(st.tuples(st.integers(1, 600), st.integers(1, 6), st.floats(0.0, 0.2), st.booleans()),
                     min_size=1, max_size=8),
       per_request=st.floats(0.0, 20.0))
def test_every_request_ends_whatever_the_frontend_holds_and_aborts(reqs, per_request):
    """Requests arriving at random times, held by the frontend time, some aborted while held or
    running: each ends exactly once (finished or aborted) and nothing stays held."""
    from vllm_vcr.perf.aic import AicTarget, step_latency

    from ..engine.conftest import Harness

    h = Harness(latency=step_latency(AicTarget(LLAMA_8B, "h100_sxm", frontend_ms_per_request=per_request)),
                kv_cache_size=200)
    events = sorted((at, i) for i, (_, _, at, _) in enumerate(reqs))
    for at, i in events:
        h.run(until=at)
        prompt, out, _, abort = reqs[i]
        h.add(f"r{i}", prompt, out)
        if abort:
            h.run(until=at + 0.004)  # maybe still in the frontend, maybe running
            h.core.abort_requests([f"r{i}"])
    h.run()
    assert not h.core.requests and not h.core.timed.arriving and not h.core.scheduler.waiting
    for i, (_, out, _, abort) in enumerate(reqs):
        ends = [o for _, o in h.outputs(f"r{i}") if o.finish_reason is not None]
        assert len(ends) <= 1
        if not abort:
            assert len(ends) == 1 and len(h.tokens(f"r{i}")) == out
