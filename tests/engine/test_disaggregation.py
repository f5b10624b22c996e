"""Prefill/decode disaggregation on the engine: holds, pulls, shared bandwidth."""

import pytest

from vllm_vcr.engine.request import RequestStatus
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
    assert pool.num_free_blocks == 64 and not h.core.kv_transfer.holds


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
    h.core.kv_transfer.add_pulled_listener(pulled.append)
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


class RecordingObserver:
    """A stand-in for pd/'s bootstrap side: records the engine's handoff calls."""

    def __init__(self, reject=None):
        self.calls = []
        self.reject = reject

    def arrived(self, rid, params):
        self.calls.append(("arrived", rid))
        return self.reject

    def prefilled(self, rid, params):
        self.calls.append(("prefilled", rid, params.get("bootstrap_room")))

    def ended(self, rid):
        self.calls.append(("ended", rid))


HANDOFF = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 9000, "bootstrap_room": 7, "handoff_id": "h7"}


def test_handoff_decode_waits_for_kv_ready_before_pulling(harness):
    # 1000 tokens x 1 MB at 1 GB/s = 1 s of pull, starting only when the prefill side says ready
    h = harness(worker_type="decode", kv_bytes_per_token=1_000_000, kv_transfer_bandwidth=1.0, kv_cache_size=200)
    obs = RecordingObserver()
    h.core.kv_transfer.set_handoff_observer(obs)
    pulled = []
    h.core.kv_transfer.add_pulled_listener(pulled.append)
    h.add_req(pd_request("d", h.prompt_of("d", 1000), dict(HANDOFF), max_tokens=2))
    h.run(until=5.0)
    assert h.tokens("d") == [] and obs.calls == [("arrived", "d")]
    assert h.core.block_pool.num_free_blocks < 200  # admitted: its blocks are reserved
    h.core.kv_ready("d")
    h.run()
    assert h.emission_times("d")[0] == pytest.approx(6.0)
    assert pulled == [HANDOFF] and obs.calls[-1] == ("ended", "d")
    assert h.outputs("d")[0][1].prefill_stats.num_external_cached_tokens == 1000


def test_handoff_kv_ready_before_admission_starts_the_pull_at_admission(harness):
    h = harness(worker_type="decode", kv_bytes_per_token=1_000_000, kv_transfer_bandwidth=1.0, kv_cache_size=200)
    h.core.kv_transfer.set_handoff_observer(RecordingObserver())
    h.add_req(pd_request("d", h.prompt_of("d", 1000), dict(HANDOFF), max_tokens=1))
    h.core.kv_ready("d")  # processed in the same inbox batch, before the first step admits it
    h.run()
    assert h.emission_times("d")[0] == pytest.approx(1.0)


def test_handoff_kv_ready_error_fails_the_request_and_frees_its_blocks(harness):
    h = harness(worker_type="decode", kv_cache_size=200)
    obs = RecordingObserver()
    h.core.kv_transfer.set_handoff_observer(obs)
    h.add_req(pd_request("d", h.prompt_of("d", 100), dict(HANDOFF)))
    h.run(until=1.0)
    h.core.kv_ready("d", error="bootstrap connection failed: refused")
    h.run()
    last = h.outputs("d")[-1][1]
    assert last.finish_reason is FinishReason.ERROR and last.error.message == "bootstrap connection failed: refused"
    assert h.core.block_pool.num_free_blocks == 200 and obs.calls == [("arrived", "d"), ("ended", "d")]
    h.core.kv_ready("d")  # late or duplicate signals are ignored
    h.run()


def test_handoff_prefill_reports_prefilled_and_ends_when_the_hold_is_released(harness):
    h = harness(worker_type="prefill", kv_cache_size=64)
    obs = RecordingObserver()
    h.core.kv_transfer.set_handoff_observer(obs)
    h.add_req(pd_request("p", h.prompt_of("p", 64), dict(HANDOFF), max_tokens=8))
    h.run(until=1.0)
    token = h.outputs("p")[-1][1]  # the token is out, the finish waits for the handoff
    assert token.new_token_ids and token.finish_reason is None and token.kv_transfer_params is None
    assert obs.calls == [("arrived", "p"), ("prefilled", "p", 7)]
    assert h.core.num_unfinished == 1 and h.core.requests["p"].status is RequestStatus.HANDING_OFF
    h.core.release_kv_hold("p")
    h.run(until=1.1)
    assert obs.calls[-1] == ("ended", "p") and h.core.block_pool.num_free_blocks == 64
    final = h.outputs("p")[-1][1]
    assert final.finish_reason is FinishReason.LENGTH and not final.new_token_ids and final.error is None
    params = final.kv_transfer_params
    assert params["bootstrap_room"] == 7 and params["handoff_id"] == "h7"  # identity echoed back
    assert h.core.num_unfinished == 0 and h.core.stats.requests_completed == 1


def test_a_failed_handoff_fails_the_waiting_prefill(harness):
    h = harness(worker_type="prefill", kv_cache_size=64)
    obs = RecordingObserver()
    h.core.kv_transfer.set_handoff_observer(obs)
    h.add_req(pd_request("p", h.prompt_of("p", 64), dict(HANDOFF), max_tokens=8))
    h.run(until=1.0)
    h.core.release_kv_hold("p", "handoff session timed out after 5000 ms waiting for the decode worker")
    h.run(until=1.1)
    final = h.outputs("p")[-1][1]
    assert final.finish_reason is FinishReason.ERROR
    assert final.error.message == "handoff session timed out after 5000 ms waiting for the decode worker"
    assert obs.calls[-1] == ("ended", "p") and h.core.block_pool.num_free_blocks == 64 and not h.core.requests


def test_aborting_a_waiting_prefill_ends_its_handoff_and_frees_its_kv(harness):
    h = harness(worker_type="prefill", kv_cache_size=64)
    obs = RecordingObserver()
    h.core.kv_transfer.set_handoff_observer(obs)
    h.add_req(pd_request("p", h.prompt_of("p", 64), dict(HANDOFF), max_tokens=8))
    h.run(until=1.0)
    h.core.abort_requests(["p"])
    h.run(until=1.1)
    assert obs.calls == [("arrived", "p"), ("prefilled", "p", 7), ("ended", "p")]
    assert h.core.block_pool.num_free_blocks == 64 and not h.core.requests and not h.core.kv_transfer.holds
    h.core.release_kv_hold("p")  # a late release changes nothing
    h.run()
    assert h.core.stats.requests_aborted == 1 and h.core.stats.requests_completed == 0


def test_an_expired_hold_fails_the_waiting_prefill(harness):
    h = harness(worker_type="prefill", kv_cache_size=64, kv_hold_timeout=2.0)
    h.core.kv_transfer.set_handoff_observer(RecordingObserver())
    h.add_req(pd_request("p", h.prompt_of("p", 64), dict(HANDOFF), max_tokens=8))
    h.run()
    final = h.outputs("p")[-1][1]
    assert final.finish_reason is FinishReason.ERROR
    assert final.error.message == "KV hold expired before the decode side pulled it"
    assert h.core.block_pool.num_free_blocks == 64 and not h.core.requests


def test_handoff_abort_ends_the_session_once(harness):
    h = harness(worker_type="decode")
    obs = RecordingObserver()
    h.core.kv_transfer.set_handoff_observer(obs)
    h.add_req(pd_request("d", h.prompt_of("d", 32), dict(HANDOFF)))
    h.run(until=1.0)
    h.core.abort_requests(["d"])
    h.core.abort_requests(["d"])
    h.run()
    assert obs.calls == [("arrived", "d"), ("ended", "d")]


@pytest.mark.parametrize("worker_type,params,message", [
    ("decode", {"bootstrap_room": 1, "bootstrap_host": "h", "bootstrap_port": 1},
     "disaggregated mocker requires a handoff ID"),
    ("prefill", {"bootstrap_room": 1}, "disaggregated mocker requires a handoff ID"),
    ("aggregated", dict(HANDOFF), "aggregated mocker request cannot carry handoff metadata"),
    ("decode", {"handoff_id": "x", "bootstrap_room": 1},
     "decode handoff metadata requires bootstrap_host and bootstrap_port"),
    ("decode", {"handoff_id": "x", "bootstrap_room": 1, "bootstrap_host": "h", "bootstrap_port": "80"},
     "decode handoff metadata requires bootstrap_host and bootstrap_port"),
    ("prefill", {"handoff_id": "x"}, "handoff metadata requires an unsigned 64-bit bootstrap_room, got None"),
])
def test_handoff_metadata_errors(harness, worker_type, params, message):
    h = harness(worker_type=worker_type)
    obs = RecordingObserver()
    h.core.kv_transfer.set_handoff_observer(obs)
    h.add_req(pd_request("r", h.prompt_of("r", 16), params))
    h.run()
    last = h.outputs("r")[-1][1]
    assert last.finish_reason is FinishReason.ERROR and last.error.message == message
    assert obs.calls == []


def test_handoff_without_the_network_side_or_rejected_by_it(harness):
    h = harness(worker_type="prefill")
    h.add_req(pd_request("a", h.prompt_of("a", 16), dict(HANDOFF)))
    h.core.kv_transfer.set_handoff_observer(None)
    h.run()
    assert h.outputs("a")[-1][1].error.message == "source handoff manager is not initialized"
    h.core.kv_transfer.set_handoff_observer(RecordingObserver(reject="mocker handoff session limit reached for DP rank 0"))
    h.add_req(pd_request("b", h.prompt_of("b", 16), dict(HANDOFF)))
    h.run()
    assert h.outputs("b")[-1][1].error.message == "mocker handoff session limit reached for DP rank 0"
    assert h.core.kv_transfer.handoff_observer.calls == [("arrived", "b")]  # rejected: no `ended` owed


def test_bootstrap_info_without_handoff_id_is_a_plain_request_on_an_aggregated_worker(harness):
    h = harness()
    h.add_req(pd_request("r", h.prompt_of("r", 16), {"bootstrap_room": 3}, max_tokens=3))
    h.run()
    assert len(h.tokens("r")) == 3


def test_freeing_a_hold_reports_the_lower_kv_usage(harness):
    h = harness(kv_cache_size=64, kv_hold_timeout=2.0)
    h.add_req(pd_request("a", h.prompt_of("a", 64), {"do_remote_decode": True}))
    h.add_req(pd_request("b", h.prompt_of("b", 64), {"do_remote_decode": True}))
    h.run(until=1.0)
    assert h.batches[-1][1].scheduler_stats.kv_cache_usage == pytest.approx(8 / 64)
    h.core.release_kv_hold("a")  # released by the decode side: a stats-only batch
    h.run(until=1.5)
    assert h.batches[-1][1].outputs == [] and h.batches[-1][1].scheduler_stats.kv_cache_usage == pytest.approx(4 / 64)
    h.run()  # b's hold expires
    assert h.batches[-1][1].scheduler_stats.kv_cache_usage == 0.0


def test_a_fast_links_last_bytes_complete_late_in_a_long_run():
    """At a clock far from zero a fast link's last bytes take less time than the clock resolves: the
    pull still completes (it used to wait forever at the same instant)."""
    from vllm_vcr.engine.kv_transfer import TransferQueue

    q = TransferQueue(900e9)  # NVLink: 900 GB/s
    q.start("r", 35_136 * 1024, 1000.0)
    t = q.next_completion()
    assert t is not None and q.pop_done(t) == ["r"]
    q.start("s", 1e9, 1000.0)
    q.remaining["s"] = 0.02  # bytes left whose time (2e-14 s) vanishes against a clock of 1000 s
    assert 1000.0 + 0.02 / 900e9 == 1000.0 and q.pop_done(1000.0) == ["s"]
