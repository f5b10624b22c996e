"""The engine's LoRA batch limit and load time, pause (sleep) state and prefill-only pooling
requests, on the virtual clock."""

from __future__ import annotations

from vllm_vcr.engine.types import EngineCoreRequest, FinishReason, LoRARequest, SamplingParams


def _lora_req(h, rid: str, lora: int | None, max_tokens: int = 4, **kw) -> None:
    h.add_req(EngineCoreRequest(request_id=rid, prompt_token_ids=h.prompt_of(rid, 16),
                                sampling_params=SamplingParams(max_tokens=max_tokens),
                                lora_request=LoRARequest(f"a{lora}", lora, f"/a{lora}") if lora else None, **kw))


def test_max_loras_defers_a_third_adapter_until_one_leaves(harness):
    h = harness(max_loras=2, max_cpu_loras=2, inter_token_latency=10.0, time_to_first_token=10.0)
    _lora_req(h, "a", 1, max_tokens=10)
    _lora_req(h, "b", 2, max_tokens=3)
    _lora_req(h, "c", 3, max_tokens=2)  # a third adapter: waits
    _lora_req(h, "base", None, max_tokens=2)  # the base model is never limited
    h.run()
    first = {rid: h.emission_times(rid)[0] for rid in ("a", "b", "c", "base")}
    last_b = h.emission_times("b")[-1]
    assert first["base"] < last_b and first["c"] > last_b  # c started only after b (adapter 2) finished
    assert all(h.finish(r) is FinishReason.LENGTH for r in first)
    deferred = [o.scheduler_stats.num_skipped_waiting_reqs for _, o in h.batches if o.scheduler_stats]
    assert 1 in deferred and deferred[-1] == 0


def test_adapter_load_and_swap_in_delay_the_first_token(harness):
    h = harness(max_loras=1, max_cpu_loras=2, lora_load_time=0.5, lora_swap_in_time=0.1,
                inter_token_latency=1.0, time_to_first_token=10.0)
    ttft = []
    for i, lora in enumerate([1, 1, 2, 1]):
        start = h.clock.now()
        _lora_req(h, f"r{i}", lora, max_tokens=1)
        h.run()
        ttft.append(h.emission_times(f"r{i}")[0] - start)
    base = 0.010
    assert abs(ttft[0] - (base + 0.6)) < 1e-6  # disk, then into the slot
    assert abs(ttft[1] - base) < 1e-6  # resident
    assert abs(ttft[2] - (base + 0.6)) < 1e-6  # a new adapter takes the only slot
    assert abs(ttft[3] - (base + 0.1)) < 1e-6  # adapter 1 comes back from the CPU pool


def test_paused_engine_queues_new_requests_and_keeps_running_ones(harness):
    h = harness(inter_token_latency=10.0, time_to_first_token=10.0)
    h.add("running", max_tokens=5)
    h.run(until=0.015)
    h.core.set_paused(True)
    h.add("new", max_tokens=2)
    h.run(until=1.0)
    assert h.finish("running") is FinishReason.LENGTH and h.tokens("new") == []
    assert h.stats().waiting == 1
    h.core.set_paused(False)
    h.run()
    assert h.finish("new") is FinishReason.LENGTH and h.emission_times("new")[0] >= 1.0


def test_abort_all_ends_everything_with_abort(harness):
    h = harness(inter_token_latency=10.0, time_to_first_token=10.0)
    h.add("a", max_tokens=50)
    h.add("b", max_tokens=50)
    h.run(until=0.05)
    h.core.abort_all()
    h.run()
    assert h.finish("a") is FinishReason.ABORT and h.finish("b") is FinishReason.ABORT
    assert h.stats().requests_aborted == 2


def test_pooling_request_finishes_after_prefill_without_a_token(harness):
    h = harness(inter_token_latency=10.0, time_to_first_token=10.0)
    h.add_req(EngineCoreRequest(request_id="p", prompt_token_ids=list(range(1, 40)),
                                sampling_params=SamplingParams(max_tokens=1), pooling_params={"task": "embed"}))
    h.run()
    (_, out), = [(t, o) for t, o in h.outputs("p") if o.finish_reason is not None]
    assert out.finish_reason is FinishReason.STOP and h.tokens("p") == []
    assert out.prefill_stats.num_prompt_tokens == 39
    assert h.stats().requests_completed == 1
