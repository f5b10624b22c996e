"""Prefill/decode disaggregation on the engine: holds, pulls, shared bandwidth."""

import pytest

from vllm_vcr.engine.types import EngineCoreRequest, FinishReason, SamplingParams


def pd_request(rid, prompt, params, max_tokens=5):
    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=max_tokens, extra_args={"kv_transfer_params": params}))


def test_prefill_finishes_after_first_token_and_holds_its_blocks(harness):
    h = harness(tokens_per_block=16, kv_cache_size=64, engine_id="prefill-0", side_channel_port=7000)
    h.add_req(pd_request("p", h.prompt_of("p", 64), {"do_remote_decode": True}, max_tokens=50))
    h.run(until=1.0)  # well before the hold times out
    outs = h.outputs("p")
    assert len(h.tokens("p")) == 1 and outs[-1][1].finish_reason is FinishReason.LENGTH
    params = outs[-1][1].kv_transfer_params
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "prefill-0"
    assert params["remote_request_id"] == "p" and params["remote_port"] == 7000
    assert len(params["remote_block_ids"]) == 4
    pool = h.core.block_pool
    assert pool.num_free_blocks == 60  # held for the decode side
    h.core.release_kv_hold("p")
    h.run(until=1.1)
    assert pool.num_free_blocks == 64 and not h.core.kv_holds


def test_held_blocks_are_freed_after_the_timeout(harness):
    h = harness(kv_cache_size=64, kv_hold_timeout=2.0)
    h.add_req(pd_request("p", h.prompt_of("p", 64), {"do_remote_decode": True}))
    h.run(until=1.0)
    assert h.core.block_pool.num_free_blocks < 64
    h.run()
    assert h.core.block_pool.num_free_blocks == 64 and h.clock.now() == pytest.approx(2.0, abs=0.01)


def test_decode_pulls_the_prompt_and_ttft_includes_the_transfer(harness):
    # 1000 tokens x 1 MB per token at 1 GB/s = 1 s of transfer
    h = harness(kv_bytes_per_token=1_000_000, kv_transfer_bandwidth=1.0, kv_cache_size=200,
                inter_token_latency=10, max_num_batched_tokens=64)
    pulled = []
    h.core.on_kv_pulled = pulled.append
    params = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_request_id": "p",
              "remote_block_ids": [1, 2, 3], "remote_host": "127.0.0.1", "remote_port": 7000}
    h.add_req(pd_request("d", h.prompt_of("d", 1000), params, max_tokens=3))
    h.run()
    times = h.emission_times("d")
    assert times[0] == pytest.approx(1.0)
    assert times[2] - times[0] == pytest.approx(0.020)
    first = h.outputs("d")[0][1]
    assert first.prefill_stats.num_external_cached_tokens == 1000
    assert first.prefill_stats.num_cached_tokens == 1000
    assert pulled == [params]


def test_concurrent_transfers_share_the_bandwidth(harness):
    h = harness(kv_bytes_per_token=1_000_000, kv_transfer_bandwidth=1.0, kv_cache_size=400)
    params = {"do_remote_prefill": True, "remote_request_id": "x"}
    h.add_req(pd_request("a", h.prompt_of("a", 1000), params, max_tokens=1))
    h.add_req(pd_request("b", h.prompt_of("b", 1000), params, max_tokens=1))
    h.run()
    assert h.emission_times("a")[0] == pytest.approx(2.0)
    assert h.emission_times("b")[0] == pytest.approx(2.0)


def test_transfer_time_is_scaled_by_time_scale(harness):
    h = harness(kv_bytes_per_token=1_000_000, kv_transfer_bandwidth=1.0, time_scale=10.0, kv_cache_size=200)
    h.add_req(pd_request("d", h.prompt_of("d", 1000), {"do_remote_prefill": True}, max_tokens=1))
    h.run()
    assert h.emission_times("d")[0] == pytest.approx(0.1)


def test_prefill_worker_type_serves_only_the_first_token(harness):
    h = harness(worker_type="prefill")
    h.add("r", max_tokens=20)
    h.run(until=1.0)
    assert len(h.tokens("r")) == 1 and h.outputs("r")[-1][1].kv_transfer_params is not None
