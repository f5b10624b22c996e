"""What a control call does inside the engine, on the virtual clock (exact, no sleeping)."""

from __future__ import annotations

import pytest

from vllm_vcr.engine.types import FinishReason


async def test_patch_lands_at_a_step_boundary_in_flight_keeps_its_pacing(virtual_engine):
    eng = virtual_engine(inter_token_latency=10.0)
    eng.add("old", max_tokens=20)
    eng.run(until=0.045)
    assert 3 <= len(eng.token_times("old")) < 20  # mid-flight

    cfg = eng.call(lambda c: c.patch_config({"inter_token_latency": 100.0}).to_dict())
    assert cfg["inter_token_latency"] == 100.0
    eng.add("new", max_tokens=5)
    eng.run()

    old, new = eng.token_times("old"), eng.token_times("new")
    assert len(old) == 20 and len(new) == 5
    assert all(b - a == pytest.approx(0.010) for a, b in zip(old, old[1:]))  # admitted at 10 ms
    assert all(b - a == pytest.approx(0.100) for a, b in zip(new, new[1:]))  # arrived after the patch


async def test_patching_ttft_rebuilds_the_knob_model(virtual_engine):
    eng = virtual_engine(time_to_first_token=0.0)
    eng.call(lambda c: c.patch_config({"time_to_first_token": 250.0}))
    eng.add("r", max_tokens=1)
    eng.run()
    assert eng.token_times("r") == [pytest.approx(0.250)]


async def test_raising_max_num_seqs_admits_waiting_requests_in_the_same_step(virtual_engine):
    eng = virtual_engine(max_num_seqs=1, inter_token_latency=10.0)
    for rid in ("a", "b", "c"):
        eng.add(rid, max_tokens=50)
    eng.run(until=0.1)
    s = eng.call(lambda c: c.current_stats())
    assert (s.running, s.waiting) == (1, 2)
    assert eng.token_times("b") == []

    t_patch = eng.clock.now()
    fut = eng.core.call(lambda c: c.patch_config({"max_num_seqs": 8}))
    eng.run(until=t_patch)  # one boundary, no time passes
    assert fut.result().max_num_seqs == 8
    s = eng.core.current_stats()
    assert (s.running, s.waiting) == (3, 0)
    # TTFT is 0, so both waiting requests emitted their first token in the patch's step
    assert eng.token_times("b")[0] == t_patch and eng.token_times("c")[0] == t_patch


async def test_lowering_max_model_len_changes_the_arrival_check_only(virtual_engine):
    eng = virtual_engine(inter_token_latency=1.0)
    eng.add("long", prompt_len=8, max_tokens=100)
    eng.run(until=0.0105)
    eng.call(lambda c: c.patch_config({"max_model_len": 12}))
    eng.add("capped", prompt_len=8, max_tokens=100)
    eng.run()
    assert len(eng.token_times("capped")) == 4  # 8 prompt + 4 output = max_model_len
    assert eng.finish_reason("capped") == FinishReason.LENGTH
    assert eng.core.args.advertised_max_model_len == 4096  # what the frontend was told is unchanged


async def test_failure_injection_on_then_off(virtual_engine):
    eng = virtual_engine()
    eng.call(lambda c: c.patch_config({"failure_injection_rate": 1.0, "failure_types": ["error"]}))
    for i in range(5):
        eng.add(f"f{i}")
    eng.run()
    assert all(eng.finish_reason(f"f{i}") == FinishReason.ERROR for i in range(5))
    eng.call(lambda c: c.patch_config({"failure_injection_rate": 0.0}))
    eng.add("ok")
    eng.run()
    assert eng.finish_reason("ok") == FinishReason.LENGTH
    s = eng.core.current_stats()
    assert (s.requests_received, s.requests_failed, s.requests_completed) == (6, 5, 1)


async def test_injected_failure_types(virtual_engine):
    eng = virtual_engine(failure_injection_rate=1.0, failure_types=["length"])
    eng.add("l")
    eng.call(lambda c: c.patch_config({"failure_types": ["repetition"]}))
    eng.add("r")
    eng.run()
    assert eng.finish_reason("l") == FinishReason.LENGTH
    assert eng.finish_reason("r") == FinishReason.REPETITION


async def test_calls_fail_once_the_loop_is_gone(virtual_engine):
    from vllm_vcr.engine.core import EngineDeadError

    eng = virtual_engine()
    eng.core.shutdown(0)
    eng.run()
    fut = eng.core.call(lambda c: c.config)
    with pytest.raises(EngineDeadError):
        fut.result()
