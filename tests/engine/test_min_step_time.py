"""The minimum step time (`EngineArgs.min_step_time`, play's `--min-step-time`) on the virtual clock.

At latency 0 an engine without a floor runs every step at the same instant; a real vLLM frontend
then finds them all queued and merges them into one SSE event. With the floor each step still
carries one token per request, but steps start at least `min_step_time` apart; it changes when
outputs leave, never which tokens, how requests end or how steps are batched.
"""

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_vcr.engine.clock import VirtualClock
from vllm_vcr.engine.config import ConfigError, EngineArgs, EngineConfig
from vllm_vcr.engine.core import EngineCore
from vllm_vcr.engine.types import EngineCoreRequest, SamplingParams

from .conftest import Harness

FLOOR = 0.005


def _step_times(h: Harness) -> list[float]:
    """Timestamps of the batches that carried tokens, in order."""
    return [b.timestamp for _, b in h.batches if any(o.new_token_ids for o in b.outputs)]


def test_a_zero_latency_stream_leaves_one_token_per_step_floor_apart(harness):
    h = harness(min_step_time=FLOOR)
    h.add("r", max_tokens=12)
    h.run()
    outs = h.outputs("r")
    assert [len(o.new_token_ids) for _, o in outs] == [1] * 12
    assert [t for t, _ in outs] == pytest.approx([i * FLOOR for i in range(12)])
    assert h.finish("r") is not None and len(_step_times(h)) == 12  # one message per step


def test_without_a_floor_the_steps_share_one_instant(harness):
    h = harness()
    h.add("r", max_tokens=12)
    h.run()
    assert [len(o.new_token_ids) for _, o in h.outputs("r")] == [1] * 12
    assert set(_step_times(h)) == {0.0}


def test_concurrent_requests_share_each_step(harness):
    h = harness(min_step_time=FLOOR)
    for i in range(3):
        h.add(f"r{i}", max_tokens=12)
    h.run()
    steps = [b for _, b in h.batches if b.outputs]
    assert len(steps) == 12
    assert all(len(b.outputs) == 3 and all(len(o.new_token_ids) == 1 for o in b.outputs) for b in steps)
    assert [b.timestamp for b in steps] == pytest.approx([i * FLOOR for i in range(12)])


def test_a_request_arriving_mid_step_joins_the_next_one(harness):
    h = harness(min_step_time=FLOOR)
    h.add("first", max_tokens=12)
    h.run(until=0.001)
    h.add("late", max_tokens=2)
    h.run()
    assert h.emission_times("late") == pytest.approx([FLOOR, 2 * FLOOR])


def test_an_idle_engine_answers_at_once(harness):
    """The floor spaces steps; it is not a TTFT: an arrival at an idle engine is stepped at once."""
    h = harness(min_step_time=FLOOR)
    h.add("a", max_tokens=1)
    h.run(until=1.0)
    h.add("b", max_tokens=3)
    h.run()
    assert h.emission_times("b") == pytest.approx([1.0, 1.0 + FLOOR, 1.0 + 2 * FLOOR])


@pytest.mark.parametrize("latency, expected", [
    ({"time_to_first_token": 50.0, "inter_token_latency": 20.0}, [0.05, 0.07, 0.09, 0.11]),  # kept exactly
    ({"inter_token_latency": 1.0}, [0.0, FLOOR, 2 * FLOOR, 3 * FLOOR]),  # below the floor: raised to it
])
def test_configured_latency_and_the_floor(harness, latency, expected):
    h = harness(min_step_time=FLOOR, **latency)
    h.add("r", max_tokens=4)
    h.run()
    assert h.emission_times("r") == pytest.approx(expected)


def test_time_scale_divides_the_floor(harness):
    h = harness(min_step_time=FLOOR, time_scale=5.0)
    h.add("r", max_tokens=3)
    h.run()
    assert h.emission_times("r") == pytest.approx([0.0, 0.001, 0.002])


def test_a_negative_floor_is_refused():
    with pytest.raises(ConfigError, match="--min-step-time"):
        EngineArgs(config=EngineConfig(), min_step_time=-0.001).validate()


async def test_the_event_loop_driver_keeps_the_floor():
    """core.run() (the loop serve and play use), here on the virtual clock."""
    clock = VirtualClock(0.0)
    batches = []
    args = EngineArgs(config=EngineConfig(), min_step_time=FLOOR).validate()
    core = EngineCore(args, clock=clock, output_sink=lambda c, o: batches.append(o))
    task = asyncio.ensure_future(core.run())
    core.add_request(EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                                       sampling_params=SamplingParams(max_tokens=6)))
    for _ in range(1000):
        await asyncio.sleep(0)
        if any(o.finish_reason is not None for b in batches for o in b.outputs):
            break
    core.shutdown(0.0)
    await task
    stamps = [b.timestamp for b in batches if b.outputs]
    assert stamps == pytest.approx([i * FLOOR for i in range(6)])


request_st = st.tuples(
    st.integers(1, 40),  # prompt length
    st.integers(1, 30),  # max tokens
    st.sampled_from([0.0, 0.0, 0.002, 0.013]),  # arrival
    st.booleans(),  # a stop token id from the prompt (ends echo mode early)
)


def _run(reqs, floor: float, **engine):
    h = Harness(min_step_time=floor, **engine)
    for i, (plen, max_tokens, at, stop) in sorted(enumerate(reqs), key=lambda e: e[1][2]):
        h.run(until=at)
        prompt = Harness.prompt_of(f"r{i}", plen)
        sp = {"seed": i}
        if stop:
            sp["stop_token_ids"] = [prompt[len(prompt) // 2]]
        h.add(f"r{i}", prompt=prompt, max_tokens=max_tokens, **sp)
    h.run()
    return h, {f"r{i}": (h.tokens(f"r{i}"), h.finish(f"r{i}")) for i in range(len(reqs))}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request_st, min_size=1, max_size=10), seqs=st.integers(1, 6),
       budget=st.integers(16, 256), mode=st.sampled_from(["random", "echo"]))
def test_the_floor_changes_timing_only(reqs, seqs, budget, mode):
    engine = dict(max_num_seqs=seqs, max_num_batched_tokens=budget, mode=mode, kv_cache_size=256)
    _, expected = _run(reqs, 0.0, **engine)
    h, got = _run(reqs, FLOOR, **engine)
    assert got == expected
    # every output is one step's worth (one token per request), and steps are at least FLOOR apart
    assert all(len(o.new_token_ids) <= 1 for _, b in h.batches for o in b.outputs)
    stamps = sorted(set(_step_times(h)))
    assert all(b - a >= FLOOR - 1e-9 for a, b in zip(stamps, stamps[1:]))
