"""The engine type as a scheduling policy (engine/policy.py): the same engine, vLLM's or SGLang's
decisions. Engines run on the virtual clock with timed steps (a step observer records each batch)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.engine.clock import VirtualClock
from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.engine.core import EngineCore
from vllm_vcr.engine.latency import LatencyModel, StepBatch, zero_pacing
from vllm_vcr.engine.policy import NEW_TOKEN_RATIO_DECAY_STEPS, SGLangPolicy, VLLMPolicy, policy_for
from vllm_vcr.engine.types import EngineCoreRequest, FinishReason, SamplingParams

ENGINE_TYPES = ("vllm", "sglang")


class FixedSteps(LatencyModel):
    times_steps = True

    def step_duration(self, b: StepBatch, rng: random.Random) -> float:
        return 0.001

    def pacing(self, num_prompt_tokens, num_cached_tokens, num_running, rng):
        return zero_pacing(rng)


class Harness:
    def __init__(self, engine_type: str, kv: int = 1024, **cfg) -> None:
        self.finished: dict[str, FinishReason] = {}
        self.tokens: dict[str, int] = {}
        args = EngineArgs(config=EngineConfig(**cfg), kv_cache_size=kv, engine_type=engine_type).validate()
        self.core = EngineCore(args, clock=VirtualClock(0.0), latency=FixedSteps(), output_sink=self._sink)
        self.batches: list[StepBatch] = []
        self.core.add_step_observer(lambda rec: self.batches.append(rec.batch))

    def _sink(self, _client, outs) -> None:
        for o in outs.outputs:
            self.tokens[o.request_id] = self.tokens.get(o.request_id, 0) + len(o.new_token_ids)
            if o.finish_reason is not None:
                self.finished[o.request_id] = o.finish_reason

    def add(self, rid: str, prompt_len: int, max_tokens: int) -> None:
        base = sum(map(ord, rid)) * 1009
        self.core.add_request(EngineCoreRequest(
            request_id=rid, prompt_token_ids=[(base + i) % 30000 + 1 for i in range(prompt_len)],
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True)))

    def run(self, until: float | None = None) -> None:
        self.core.run_until_idle(until=until)


def test_policy_for_engine_type():
    assert type(policy_for("vllm")) is VLLMPolicy and type(policy_for("sglang")) is SGLangPolicy
    h = Harness("sglang")
    assert isinstance(h.core.scheduler.engine_policy, SGLangPolicy)


@pytest.mark.parametrize("engine_type", ENGINE_TYPES)
def test_prefill_beside_running_decodes(engine_type):
    """vLLM mixes a new prefill into the decodes' step; SGLang runs the extend alone."""
    h = Harness(engine_type)
    h.add("a", 32, 50)
    h.run(until=0.0105)  # a is decoding
    h.add("b", 64, 2)
    h.run()
    with_prefill = [b for b in h.batches[1:] if b.num_prefills]
    assert len(with_prefill) == 1
    assert with_prefill[0].num_decodes == (1 if engine_type == "vllm" else 0)
    assert h.tokens == {"a": 50, "b": 2}


def test_sglang_chunks_are_page_aligned():
    h = Harness("sglang", max_num_batched_tokens=100)
    h.add("long", 250, 1)
    h.run()
    chunks = [b.prefill_chunk_lens for b in h.batches if b.num_prefills]
    assert chunks == [(96,), (96,), (58,)]  # floor(100 / 16) * 16, then the rest
    v = Harness("vllm", max_num_batched_tokens=100)
    v.add("long", 250, 1)
    v.run()
    assert [b.prefill_chunk_lens for b in v.batches if b.num_prefills] == [(100,), (100,), (50,)]


def test_sglang_new_token_ratio_admission_holds_back_what_vllm_admits():
    """64 blocks x 16 = 1024 tokens. Running: 100-token prompt expecting 1000 more tokens. vLLM admits a
    200-token prompt (its blocks are free); SGLang keeps it waiting: 0.7 x 1000 + 0.7 x 200 reserved."""
    for engine_type, admitted in (("vllm", True), ("sglang", False)):
        h = Harness(engine_type, kv=64, max_num_batched_tokens=4096)
        h.add("a", 100, 1000)
        h.run(until=0.0015)
        h.add("b", 200, 200)
        h.run(until=0.0035)
        assert (h.core.requests["b"] in h.core.scheduler.running) is admitted, engine_type


def test_new_token_ratio_decays_per_step_and_resets_on_retraction():
    p = SGLangPolicy()
    assert p.new_token_ratio == pytest.approx(0.7)
    for _ in range(NEW_TOKEN_RATIO_DECAY_STEPS * 2):
        p.on_step()
    assert p.new_token_ratio == pytest.approx(0.7 * 0.14)
    p.on_retract()
    assert p.new_token_ratio == pytest.approx(0.7)


def test_victims():
    class R:
        def __init__(self, out, prompt, seq):
            self.num_output_tokens, self.num_prompt_tokens, self.seq = out, prompt, seq

    running = [R(5, 10, 0), R(2, 10, 1), R(2, 40, 2), R(9, 1, 3)]
    assert VLLMPolicy().pick_victim(running) is running[-1]  # LIFO
    assert SGLangPolicy().pick_victim(running) is running[2]  # fewest outputs, then longest prompt


def test_a_decode_retracted_in_its_step_is_not_in_the_step():
    """SGLang retracts before its forward: a decode scheduled earlier in the step and then retracted
    to make room for a later one is not computed (nor priced) in that step, as vLLM drops its victims."""
    h = Harness("sglang", kv=4)  # 4 blocks of 16: a's 2 and b's 1, one free
    h.add("a", 32, 3)  # scheduled first in each decode step (admitted first); the victim (longer prompt)
    h.add("b", 16, 3)
    h.run()
    assert h.batches[0].num_prefills == 2  # both prompts in one step
    # the first decode step: each needs a new block; a gets the free one, then b's allocation retracts a
    assert h.batches[1].num_prefills == 0 and h.batches[1].num_decodes == 1
    assert h.finished == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH} and h.tokens == {"a": 3, "b": 3}


@settings(max_examples=25, deadline=None)
@given(engine_type=st.sampled_from(ENGINE_TYPES), kv=st.integers(8, 64),
       reqs=st.lists(st.tuples(st.integers(1, 120), st.integers(1, 40)), min_size=1, max_size=12))
def test_every_request_ends_with_its_tokens(engine_type, kv, reqs):
    """Under KV pressure (retraction/preemption) nothing is lost, for both engine types."""
    h = Harness(engine_type, kv=kv, max_num_seqs=4, max_num_batched_tokens=64)
    for i, (prompt, out) in enumerate(reqs):
        h.add(f"r{i}", prompt, out)
    h.run()
    assert set(h.finished) == {f"r{i}" for i in range(len(reqs))}
    for i, (prompt, out) in enumerate(reqs):
        if h.finished[f"r{i}"] == FinishReason.LENGTH:
            # the output is capped where the whole cache could not hold the sequence
            assert h.tokens[f"r{i}"] == min(out, kv * 16 - prompt)


def test_sglang_admits_into_an_idle_engine_whatever_the_reserve():
    h = Harness("sglang", kv=8)  # 128 tokens: 100 + 0.7 x 40 reserved would not fit beside anything
    h.add("r", 100, 28)
    h.run()
    assert h.finished == {"r": FinishReason.LENGTH} and h.tokens["r"] == 28


@pytest.mark.parametrize("engine_type", ENGINE_TYPES)
def test_kv_events_are_published_when_the_step_ends(engine_type):
    """A prompt's BlockStored events become visible at the end of the step that computed it (SGLang's
    pass-end visibility), never while the step is in flight."""
    from vllm_vcr.kv_events.events import KVEventCollector

    h = Harness(engine_type)
    published: list[tuple[float, int]] = []
    h.core.attach_kv_events(KVEventCollector(), lambda events, t: published.append((t, len(events))))
    h.add("a", 64, 2)
    h.run(until=0.0005)  # the prefill step (1 ms) is in flight
    assert published == []
    h.run()
    assert published[0] == (pytest.approx(0.001), 1)  # one BlockStored for the prompt's 4 full blocks
