"""Request plans from recordings: verbatim tokens, finish reasons, TTFT and chunked steps."""

import pytest

from vllm_vcr.engine.plan import RequestPlan
from vllm_vcr.engine.types import FinishReason


def with_planner(h, plans):
    h.core.planner = lambda ecr: plans.get(ecr.request_id)


def test_planned_tokens_and_recorded_finish_reason(harness):
    h = harness()
    with_planner(h, {"a": RequestPlan(token_ids=[4, 5, 6], finish_reason=FinishReason.STOP)})
    h.add("a", max_tokens=100)
    h.add("b", max_tokens=2)
    h.run()
    assert h.tokens("a") == [4, 5, 6] and h.finish("a") is FinishReason.STOP
    assert len(h.tokens("b")) == 2 and h.finish("b") is FinishReason.LENGTH


def test_client_max_tokens_still_caps_a_plan(harness):
    h = harness()
    with_planner(h, {"a": RequestPlan(token_ids=[4, 5, 6, 7], finish_reason=FinishReason.STOP)})
    h.add("a", max_tokens=2)
    h.run()
    assert h.tokens("a") == [4, 5] and h.finish("a") is FinishReason.LENGTH


def test_recorded_timing_and_chunking_replay_verbatim(harness):
    h = harness(inter_token_latency=50, time_scale=2.0)
    plan = RequestPlan(ttft=0.100, first_chunk_tokens=2, steps=[(0.010, 1), (0.030, 3), (0.020, 1)])
    with_planner(h, {"a": plan})
    h.add("a", max_tokens=100)
    h.run()
    outs = [(t, len(o.new_token_ids)) for t, o in h.outputs("a")]
    assert [k for _, k in outs] == [2, 1, 3, 1]
    times = [t for t, _ in outs]
    assert times[0] == pytest.approx(0.050)
    assert [b - a for a, b in zip(times, times[1:])] == pytest.approx([0.005, 0.015, 0.010])
    assert h.finish("a") is FinishReason.LENGTH and len(h.tokens("a")) == 7


def test_chunked_steps_keep_kv_accounting_consistent(harness):
    h = harness(tokens_per_block=4, kv_cache_size=8)
    with_planner(h, {f"r{i}": RequestPlan(ttft=0.001, first_chunk_tokens=3, steps=[(0.001, 5)] * 2) for i in range(2)})
    h.add("r0", prompt_len=6, max_tokens=100)
    h.add("r1", prompt_len=6, max_tokens=100)
    h.run()
    assert len(h.tokens("r0")) == 13 and len(h.tokens("r1")) == 13
    assert h.core.block_pool.num_free_blocks == 8
