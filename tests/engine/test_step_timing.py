"""Timed steps (a step-time model, engine/step.py): one batch at a time, outputs at the step's end."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_vcr.engine.clock import VirtualClock
from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.engine.core import EngineCore
from vllm_vcr.engine.latency import LatencyModel, StepBatch, zero_pacing
from vllm_vcr.engine.types import EngineCoreRequest, SamplingParams

MS = 1e-3


class LinearSteps(LatencyModel):
    """A deterministic step-time model: 10 ms + 1 ms per decode + 0.1 ms per prefill token."""

    times_steps = True

    def __init__(self, base=10.0, per_decode=1.0, per_prefill_token=0.1) -> None:
        self.base, self.per_decode, self.per_token = base, per_decode, per_prefill_token
        self.batches: list[StepBatch] = []

    def step_duration(self, batch: StepBatch, rng: random.Random) -> float:
        self.batches.append(batch)
        return (self.base + self.per_decode * batch.num_decodes + self.per_token * batch.num_prefill_tokens) * MS

    def pacing(self, num_prompt_tokens, num_cached_tokens, num_running, rng):
        return zero_pacing(rng)


class DelayedInput(LinearSteps):
    """LinearSteps plus a constant input delay: the engine sees a mid-step arrival `delay_ms` late."""

    def __init__(self, delay_ms: float) -> None:
        super().__init__()
        self.delay = delay_ms * MS

    def input_delay(self, rng: random.Random) -> float:
        return self.delay


class StepHarness:
    """An engine on a virtual clock with a linear step model; `cfg`: EngineConfig fields, `kv` the
    KV cache size, `engine`: other EngineArgs fields (engine_type, ...)."""

    def __init__(self, model: LinearSteps | None = None, engine: dict | None = None, **cfg) -> None:
        self.model = model or LinearSteps()
        kv = cfg.pop("kv", None)
        args = EngineArgs(config=EngineConfig(**cfg), **({"kv_cache_size": kv} if kv else {}), **(engine or {}))
        self.clock = VirtualClock(0.0)
        self.batches = []
        self.core = EngineCore(args.validate(), clock=self.clock, latency=self.model,
                               output_sink=lambda c, o: self.batches.append(o))

    def add(self, rid: str, prompt_len: int = 20, max_tokens: int = 3) -> None:
        base = sum(map(ord, rid)) * 1009
        self.core.add_request(EngineCoreRequest(
            request_id=rid, prompt_token_ids=[(base + i) % 30000 + 1 for i in range(prompt_len)],
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True)))

    def times(self, rid: str) -> list[float]:
        return [round(b.timestamp, 9) for b in self.batches for o in b.outputs
                if o.request_id == rid and o.new_token_ids]


def test_a_step_emits_every_token_of_its_batch_at_its_end():
    h = StepHarness()
    h.add("a", prompt_len=20)
    h.add("b", prompt_len=30)
    h.core.run_until_idle()
    assert h.core.latency.times_steps
    # step 1: both prefills (50 tokens): 10 + 5 ms; then two decodes per step: 12 ms each
    first = round(0.015, 9)
    assert h.times("a") == h.times("b") == [first, round(first + 0.012, 9), round(first + 0.024, 9)]
    assert h.model.batches[0] == StepBatch(0, 50, 2, 2, 0, after_idle=True, prefill_chunk_lens=(20, 30))
    assert h.model.batches[1].num_decodes == 2 and not h.model.batches[1].after_idle
    # one output batch per step, holding both requests
    assert [len(b.outputs) for b in h.batches] == [2, 2, 2]


def test_a_long_prefill_stalls_the_decodes_in_its_step():
    h = StepHarness()
    h.add("a", prompt_len=10, max_tokens=5)
    h.core.run_until_idle(until=0.0115)  # a's first token at 11 ms; its first decode step runs
    h.add("long", prompt_len=1000, max_tokens=1)
    h.core.run_until_idle()
    t = h.times("a")
    gaps = [round(y - x, 6) for x, y in zip(t, t[1:])]
    # 11 → 22 ms: the decode step in flight when "long" arrived; then decode + 1000-token prefill
    # (10 + 1 + 100 ms) stalls a's next token; then plain decode steps again
    assert gaps == [0.011, 0.111, 0.011, 0.011]
    assert h.times("long") == [t[2]]


def test_an_arrival_mid_step_waits_for_the_next_step():
    h = StepHarness()
    h.add("a", prompt_len=10, max_tokens=4)
    h.core.run_until_idle(until=0.015)  # step 2 (a's first decode) runs 11 → 22 ms
    h.add("b", prompt_len=10, max_tokens=1)
    h.core.run_until_idle()
    # b is scheduled at 22 ms, with a's decode: 10 + 1 + 1 ms
    assert h.times("b") == [round(0.022 + 0.012, 9)]
    assert h.core.stats.requests_completed == 2


def test_an_arrival_the_engine_has_not_seen_yet_misses_the_next_step():
    h = StepHarness(DelayedInput(2.0))
    h.add("a", prompt_len=10, max_tokens=4)
    h.core.run_until_idle(until=0.0215)  # step 2 (a's first decode) runs 11 → 22 ms
    h.add("b", prompt_len=10, max_tokens=1)  # 0.5 ms before it ends: seen at 23.5 ms
    h.core.run_until_idle()
    # step 3 (22 → 33 ms) is a's decode alone; b is in step 4 (33 → 45 ms, with a's decode)
    assert h.times("a") == [0.011, 0.022, 0.033, 0.045]
    assert h.times("b") == [0.045]


def test_an_input_delay_holds_nothing_back_when_the_request_is_all_the_work():
    h = StepHarness(DelayedInput(2.0))
    h.add("a", prompt_len=10, max_tokens=1)  # an idle engine: scheduled at once, no delay
    h.core.run_until_idle(until=0.0105)
    assert h.times("a") == []
    h.add("b", prompt_len=10, max_tokens=1)  # mid-step, and a has nothing left to decode
    h.core.run_until_idle()
    assert h.times("a") == [0.011]
    assert h.times("b") == [0.022]  # scheduled when a's step ended, not when the engine saw it


def test_an_arrival_far_from_the_step_end_still_makes_the_next_step():
    h = StepHarness(DelayedInput(2.0))
    h.add("a", prompt_len=10, max_tokens=4)
    h.core.run_until_idle(until=0.015)  # 7 ms before the step ends: seen in time
    h.add("b", prompt_len=10, max_tokens=1)
    h.core.run_until_idle()
    assert h.times("b") == [round(0.022 + 0.012, 9)]


def test_abort_mid_step_drops_the_request_and_counters_balance():
    h = StepHarness()
    h.add("a", max_tokens=50)
    h.add("b", max_tokens=5)
    h.core.run_until_idle(until=0.020)
    n = len(h.times("a"))
    h.core.abort_requests(["a"])
    h.core.run_until_idle()
    assert len(h.times("a")) == n  # nothing after the abort, not even the step in flight
    assert len(h.times("b")) == 5
    s = h.core.current_stats()
    assert s.requests_received == s.requests_completed + s.requests_failed + s.requests_aborted == 2
    assert s.requests_aborted == 1
    assert h.core.block_pool.num_free_blocks == h.core.block_pool.num_blocks


def test_a_pause_moves_the_step_end():
    h = StepHarness()
    h.add("a", prompt_len=10, max_tokens=2)
    h.core.run_until_idle(until=0.005)
    h.core.set_frozen(True)
    h.core.run_until_idle(until=0.105)
    assert h.times("a") == []
    h.core.set_frozen(False)
    h.core.run_until_idle()
    assert h.times("a") == [round(0.111, 9), round(0.122, 9)]


def test_preemption_in_step_mode_finishes_everything():
    h = StepHarness(max_num_seqs=8, kv=6)
    for i in range(4):
        h.add(f"r{i}", prompt_len=30, max_tokens=40)
    h.core.run_until_idle()
    s = h.core.current_stats()
    assert s.requests_completed == 4
    assert all(len(h.times(f"r{i}")) == 40 for i in range(4))
    assert h.core.scheduler.total_preemptions > 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 300), st.integers(1, 12), st.booleans()),
                min_size=1, max_size=12),
       st.integers(2, 8), st.sampled_from([64, 256, 2048]), st.sampled_from([None, 0.5, 3.0]))
def test_step_mode_property(reqs, seqs, budget, delay_ms):
    """Counters balance, blocks come back, and every token leaves at the end of a modeled step
    (with or without an input delay)."""
    model = DelayedInput(delay_ms) if delay_ms is not None else None
    h = StepHarness(model, max_num_seqs=seqs, max_num_batched_tokens=budget)
    ends = []
    h.core.add_step_observer(lambda step: ends.append(round(step.start + step.duration, 9)))
    for i, (t_ms, prompt, out, abort) in enumerate(sorted(reqs)):
        h.core.run_until_idle(until=t_ms * MS)
        h.add(f"r{i}", prompt_len=prompt, max_tokens=out)
        if abort:
            h.core.run_until_idle(until=t_ms * MS + 0.02)
            h.core.abort_requests([f"r{i}"])
    h.core.run_until_idle()
    s = h.core.current_stats()
    assert s.requests_received == s.requests_completed + s.requests_failed + s.requests_aborted == len(reqs)
    pool = h.core.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    emitted = {round(b.timestamp, 9) for b in h.batches if any(o.new_token_ids for o in b.outputs)}
    assert emitted <= set(ends)
    for i, (_, _, out, abort) in enumerate(sorted(reqs)):
        if not abort:
            assert len(h.times(f"r{i}")) == out
