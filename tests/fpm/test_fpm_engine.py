"""FPM records from the engine's step observer (virtual clock): one per step, sums that match the
steps' work, Dynamo's wire encoding, and acceptance by aiconfigurator-core."""

from __future__ import annotations

import random

import msgspec
import pytest

from vllm_vcr.engine.clock import VirtualClock
from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.engine.core import EngineCore
from vllm_vcr.engine.latency import LatencyModel, StepBatch, zero_pacing
from vllm_vcr.engine.types import EngineCoreRequest, SamplingParams
from vllm_vcr.fpm import ForwardPassMetrics, decode, encode
from vllm_vcr.fpm.collector import FpmCollector
from vllm_vcr.fpm.record import count_sum_var


class LinearSteps(LatencyModel):
    """Timed steps: 2 ms + 0.05 ms per prefill token + 0.5 ms per decode."""

    times_steps = True

    def step_duration(self, b: StepBatch, rng: random.Random) -> float:
        return (2.0 + 0.05 * b.num_prefill_tokens + 0.5 * b.num_decodes) * 1e-3

    def pacing(self, num_prompt_tokens, num_cached_tokens, num_running, rng):
        return zero_pacing(rng)


def run_engine(n: int = 12, seed: int = 1) -> tuple[list[ForwardPassMetrics], EngineCore, dict]:
    rng = random.Random(seed)
    records: list[ForwardPassMetrics] = []
    generated: dict[str, int] = {}

    def sink(_c, outs):
        for o in outs.outputs:
            generated[o.request_id] = generated.get(o.request_id, 0) + len(o.new_token_ids)

    args = EngineArgs(config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=256)).validate()
    core = EngineCore(args, clock=VirtualClock(0.0), latency=LinearSteps(), output_sink=sink)
    core.add_step_observer(FpmCollector(core, "w0", "vllm", [records.append]))
    prompts = {}
    for i in range(n):
        prompt = rng.randint(20, 600)
        prompts[f"r{i}"] = prompt
        core.add_request(EngineCoreRequest(
            request_id=f"r{i}", prompt_token_ids=[rng.randint(1, 30000) for _ in range(prompt)],
            sampling_params=SamplingParams(max_tokens=rng.randint(3, 12), ignore_eos=True)))
    core.run_until_idle()
    return records, core, {"prompts": prompts, "generated": generated}


def test_one_record_per_step_with_consistent_sums():
    records, core, seen = run_engine()
    assert [r.step for r in records] == list(range(1, core.step_counter + 1))
    assert [r.counter_id for r in records] == list(range(1, len(records) + 1))
    # every prompt token is computed by exactly one prefill chunk (no prefix hits: random prompts)
    assert sum(r.scheduled_requests.sum_prefill_tokens for r in records) == sum(seen["prompts"].values())
    # a decode step per token after the first one of each request
    assert sum(r.scheduled_requests.num_decode_requests for r in records) == \
        sum(g - 1 for g in seen["generated"].values())
    for r in records:
        s = r.scheduled_requests
        assert r.wall_time == pytest.approx((2.0 + 0.05 * s.sum_prefill_tokens + 0.5 * s.num_decode_requests) * 1e-3)
        assert r.sim_duration == r.wall_time and 0.0 <= r.kv_usage <= 1.0
    # the queue drains: the first step leaves requests waiting (max_num_seqs=4), the last none
    assert records[0].queued_requests.num_prefill_requests > 0
    assert records[-1].queued_requests.num_prefill_requests == 0


def test_wire_encoding_is_dynamo_msgpack_map():
    records, _, _ = run_engine(n=3)
    raw = msgspec.msgpack.decode(encode(records[0]))
    assert list(raw)[:7] == ["version", "worker_id", "dp_rank", "counter_id", "wall_time",
                             "scheduled_requests", "queued_requests"]
    assert set(raw["scheduled_requests"]) == {"num_prefill_requests", "sum_prefill_tokens", "var_prefill_length",
                                              "sum_prefill_kv_tokens", "num_decode_requests",
                                              "sum_decode_kv_tokens", "var_decode_kv_tokens"}
    assert raw["version"] == 1
    assert decode(encode(records[0])) == records[0]


def test_population_variance():
    assert count_sum_var([2, 4, 4, 4, 5, 5, 7, 9]) == (8, 40, 4.0)
    assert count_sum_var([]) == (0, 0, 0.0)


def test_records_accepted_by_aiconfigurator_core():
    rust = pytest.importorskip("aiconfigurator_core.sdk.rust_engine_step",
                               reason="the aic extra is not installed: pip install 'vllm-vcr[aic]'")
    records, _, _ = run_engine(n=40, seed=5)
    dicts = [msgspec.to_builtins(r) for r in records]
    model = rust.RustForwardPassPerfModel.from_regression()
    model.tune_with_fpms([[d] for d in dicts])
    diag = model.diagnostics()
    assert diag["retained_observations"] > 0, diag
    decode_only = next(d for d in dicts if d["scheduled_requests"]["num_decode_requests"]
                       and not d["scheduled_requests"]["sum_prefill_tokens"])
    estimate = model.estimate_forward_pass_time_ms(decode_only)
    assert estimate is None or estimate >= 0.0
