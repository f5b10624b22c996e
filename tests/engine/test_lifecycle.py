"""Arrival checks, failure injection, aborts at every stage, shutdown, and the counters."""

import pytest

from vllm_vcr.engine.config import EngineConfig, FailureType
from vllm_vcr.engine.types import EngineCoreRequest, FinishReason, SamplingParams


def test_max_model_len_caps_the_output(harness):
    h = harness(max_model_len=20)
    h.add("capped", prompt_len=16, max_tokens=100)
    h.add("none", prompt_len=16, max_tokens=None)
    h.add("full", prompt_len=20, max_tokens=5)
    h.run()
    assert len(h.tokens("capped")) == 4 and h.finish("capped") is FinishReason.LENGTH
    assert len(h.tokens("none")) == 4
    # no room at all is vLLM's context error: the request fails, it does not complete empty
    assert h.tokens("full") == [] and h.finish("full") is FinishReason.ERROR
    s = h.stats()
    assert (s.requests_completed, s.requests_failed) == (2, 1)


def test_without_max_tokens_a_request_gets_the_advertised_room(harness):
    h = harness(advertised_max_model_len=40)
    h.add("r", prompt_len=30, max_tokens=None)
    h.run()
    assert len(h.tokens("r")) == 10


@pytest.mark.parametrize("ftype,reason", [("error", FinishReason.ERROR), ("length", FinishReason.LENGTH),
                                          ("repetition", FinishReason.REPETITION)])
def test_failure_injection_at_rate_one(harness, ftype, reason):
    h = harness(failure_injection_rate=1.0, failure_types=[FailureType(ftype)])
    h.add("r", max_tokens=5)
    h.run()
    assert h.tokens("r") == [] and h.finish("r") is reason
    s = h.stats()
    assert s.requests_failed == 1 and s.requests_received == 1


def test_failure_injection_rate_is_respected(harness):
    h = harness(failure_injection_rate=0.3, failure_types=[FailureType.ERROR, FailureType.LENGTH])
    for i in range(1000):
        h.add(f"r{i}", prompt_len=4, max_tokens=1)
    h.run()
    s = h.stats()
    assert 240 <= s.requests_failed <= 360
    assert s.requests_failed + s.requests_completed == 1000
    reasons = {h.finish(f"r{i}") for i in range(1000)}
    assert FinishReason.ERROR in reasons and FinishReason.LENGTH in reasons


def test_abort_at_every_stage(harness):
    h = harness(max_num_seqs=1, time_to_first_token=50, inter_token_latency=10, max_num_batched_tokens=16)
    h.add("decoding", prompt_len=8, max_tokens=100)
    h.add("waiting", prompt_len=8, max_tokens=100)
    h.run(until=0.080)
    h.core.abort_requests(["waiting", "decoding", "unknown", "decoding"])
    h.run()
    assert h.finish("decoding") is None and h.finish("waiting") is None  # client aborts emit nothing
    finished = [rid for _, b in h.batches for rid in (b.finished_requests or [])]
    assert finished.count("decoding") == 1 and finished.count("waiting") == 1
    # prefilling (chunked over several steps) and first-token-pending stages
    h.add("prefilling", prompt_len=200, max_tokens=5)
    h.core.run_until_idle(until=h.clock.now())  # one instant: prefill spans chunks, first token not due
    h.core.abort_requests(["prefilling"])
    h.add("finished", prompt_len=4, max_tokens=1)
    h.run()
    h.core.abort_requests(["finished"])
    h.run()
    s = h.stats()
    assert (s.requests_received, s.requests_completed, s.requests_aborted, s.requests_failed) == (4, 1, 3, 0)
    assert h.core.block_pool.num_free_blocks == h.core.block_pool.num_blocks


def test_abort_immediately_produces_no_tokens(harness):
    h = harness()
    h.add_req(EngineCoreRequest(request_id="x", prompt_token_ids=[1, 2, 3], abort_immediately=True,
                                sampling_params=SamplingParams(max_tokens=3)))
    h.run()
    assert h.tokens("x") == [] and h.stats().requests_aborted == 1


def test_duplicate_request_id_is_rejected_without_disturbing_the_original(harness):
    h = harness(inter_token_latency=5)
    h.add("dup", max_tokens=3)
    h.add("dup", max_tokens=3)
    h.run()
    assert len(h.tokens("dup")) == 3
    s = h.stats()
    assert (s.requests_received, s.requests_completed, s.requests_failed) == (2, 1, 1)


def test_missing_prompt_is_an_error(harness):
    h = harness()
    h.add_req(EngineCoreRequest(request_id="e", prompt_token_ids=None, sampling_params=SamplingParams()))
    h.run()
    assert h.finish("e") is FinishReason.ERROR


def test_shutdown_zero_aborts_everything_with_outputs(harness):
    h = harness(inter_token_latency=10)
    h.add("a", max_tokens=50)
    h.add("b", max_tokens=50)
    h.run(until=0.05)
    h.core.shutdown(0)
    h.run()
    assert h.finish("a") is FinishReason.ABORT and h.finish("b") is FinishReason.ABORT
    assert h.stats().requests_aborted == 2


def test_shutdown_with_timeout_drains_then_aborts(harness):
    h = harness(inter_token_latency=10)
    h.add("short", max_tokens=3)
    h.add("long", max_tokens=1000)
    h.run(until=0.001)
    h.core.shutdown(1.0)
    h.add("late", max_tokens=3)
    h.run()
    assert h.finish("short") is FinishReason.LENGTH
    assert h.finish("late") is FinishReason.ABORT
    assert h.finish("long") is FinishReason.ABORT
    assert h.outputs("long")[-1][0] == pytest.approx(1.001, abs=0.011)
    s = h.stats()
    assert s.requests_received == s.requests_completed + s.requests_aborted + s.requests_failed


def test_config_patch_applies_to_new_requests_only(harness):
    h = harness(time_to_first_token=10, inter_token_latency=10)
    h.add("old", max_tokens=20)
    h.run(until=0.05)
    h.core.patch_config({"inter_token_latency": 30})
    h.add("new", max_tokens=5)
    h.run()
    t_old, t_new = h.emission_times("old"), h.emission_times("new")
    assert t_old[-1] - t_old[-2] == pytest.approx(0.010)
    assert t_new[1] - t_new[0] == pytest.approx(0.030)


def test_raising_max_num_seqs_admits_waiting_requests_in_the_same_step(harness):
    h = harness(max_num_seqs=1, inter_token_latency=100)
    for i in range(3):
        h.add(f"r{i}", max_tokens=5)
    h.run(until=0.01)
    assert h.stats().waiting == 2
    h.core.patch_config({"max_num_seqs": 8})
    h.core.step(h.clock.now())
    assert h.stats().waiting == 0 and h.stats().running == 3


def test_freeze_keeps_requests_in_place_and_resumes_at_their_pace(harness):
    h = harness(time_to_first_token=10, inter_token_latency=10)
    h.add("a", max_tokens=6)
    h.run(until=0.025)  # two tokens out (10 ms, 20 ms)
    h.core.set_frozen(True)
    h.run(until=1.0)
    assert len(h.tokens("a")) == 2 and h.stats().running == 1
    h.add("b", max_tokens=2)  # arrives while paused: queued, not scheduled
    h.run(until=1.5)
    assert h.tokens("b") == []
    h.core.set_frozen(False)
    h.run()
    t = h.emission_times("a")
    assert len(t) == 6 and t[2] - t[1] == pytest.approx(0.010 + 1.5 - 0.025, abs=1e-6)
    assert t[3] - t[2] == pytest.approx(0.010)
    assert h.finish("b") is FinishReason.LENGTH
