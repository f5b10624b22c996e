"""The engine core's public interfaces: the timing interface, the per-step observer, check_patch,
and the P/D hooks adapters register on `core.kv_transfer`."""

from __future__ import annotations

import pytest

from vllm_vcr.engine.config import ConfigError
from vllm_vcr.engine.core import LatencyTraceActive
from vllm_vcr.engine.latency import KnobLatency, LatencyModel, StepBatch, StepRecord, zero_pacing

from .test_disaggregation import pd_request


def test_every_step_is_observed_with_its_composition(harness):
    h = harness(inter_token_latency=1.0, tokens_per_block=16)
    records: list[StepRecord] = []
    h.core.add_step_observer(records.append)
    h.add("a", prompt_len=40, max_tokens=3)
    h.core.run_until_idle()
    h.add("b", prompt=h.prompt_of("a", 40), max_tokens=2)  # the same prompt: a prefix-cache hit
    h.core.run_until_idle()
    assert [r.step for r in records] == list(range(1, len(records) + 1))
    first = records[0].batch
    assert (first.num_prefills, first.num_prefill_tokens, first.num_first_tokens, first.num_decodes) == (1, 40, 1, 0)
    decode = records[1].batch
    assert decode.num_decodes == 1 and decode.decode_context_lens == (41,) and decode.decode_context == 41
    hit = [r.batch for r in records if r.batch.num_prefills][-1]
    assert hit.num_prefix_hit_tokens == 32 and hit.num_prefill_tokens == 8 and hit.prefill_context == 32
    assert all(r.duration == 0.0 for r in records)  # per-request deadlines: steps take no time


class FixedSteps(LatencyModel):
    times_steps = True

    def step_duration(self, batch: StepBatch, rng) -> float:
        return 0.005

    def pacing(self, num_prompt_tokens, num_cached_tokens, num_running, rng):
        return zero_pacing(rng)


def test_a_timed_step_reports_its_duration_and_emits_at_its_end(harness):
    h = harness(latency=FixedSteps())
    records: list[StepRecord] = []
    h.core.add_step_observer(records.append)
    h.add("a", prompt_len=16, max_tokens=2)
    h.core.run_until_idle()
    assert [(r.start, r.duration) for r in records] == [(0.0, 0.005), (0.005, 0.005)]
    assert [round(b.timestamp, 9) for _, b in h.batches if any(o.new_token_ids for o in b.outputs)] == [0.005, 0.01]


def test_check_patch_validates_without_applying(harness):
    h = harness()
    new = h.core.check_patch({"inter_token_latency": 7.0})
    assert new.inter_token_latency == 7.0 and h.core.config.inter_token_latency == 0.0
    with pytest.raises(ConfigError):
        h.core.check_patch({"max_num_seqs": 0})
    h.core.patch_config({"inter_token_latency": 7.0})
    assert isinstance(h.core.latency, KnobLatency) and h.core.latency.config.inter_token_latency == 7.0


def test_check_patch_refuses_latency_knobs_under_a_trace_model(harness):
    h = harness(latency=FixedSteps())
    with pytest.raises(LatencyTraceActive, match="time_to_first_token"):
        h.core.check_patch({"time_to_first_token": 5.0})
    assert h.core.check_patch({"max_num_seqs": 4}).max_num_seqs == 4  # other fields stay patchable


def test_pulled_listeners_can_be_removed(harness):
    h = harness(kv_cache_size=64)
    heard: list[dict] = []
    h.core.kv_transfer.add_pulled_listener(heard.append)
    params = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "x",
              "remote_block_ids": [1], "remote_host": "127.0.0.1", "remote_port": 1}
    h.add_req(pd_request("d1", h.prompt_of("d1", 32), params, max_tokens=2))
    h.core.run_until_idle()
    h.core.kv_transfer.remove_pulled_listener(heard.append)
    h.add_req(pd_request("d2", h.prompt_of("d2", 32), dict(params), max_tokens=2))
    h.core.run_until_idle()
    assert heard == [params]
