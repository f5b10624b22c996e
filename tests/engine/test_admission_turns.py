"""A burst of arrivals is admitted in one run of the engine's loop: steps that emit nothing (a
token budget admitting a few requests per step) do not each wait behind the rest of the loop."""

from __future__ import annotations

import asyncio

from vllm_vcr.engine.clock import VirtualClock
from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.engine.core import EngineCore
from vllm_vcr.engine.types import EngineCoreRequest, SamplingParams

N = 20


def _core(stream_interval: int = 1) -> tuple[EngineCore, list]:
    batches: list = []
    # a budget of one 16-token prompt per step, and a first token far away: N admission steps, no output
    cfg = EngineConfig(time_to_first_token=1000.0, inter_token_latency=10.0, max_num_batched_tokens=16,
                       log_requests=False)
    args = EngineArgs(config=cfg, max_burst=stream_interval, enable_chunked_prefill=False).validate()
    core = EngineCore(args, clock=VirtualClock(0.0), output_sink=lambda c, o: batches.append(o))
    for i in range(N):
        core.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=[i + 1] * 16,
                                           sampling_params=SamplingParams(max_tokens=4)))
    return core, batches


async def _turns_until_admitted(core: EngineCore, batches: list) -> tuple[int, int]:
    """Turns of the loop the test task takes until every request is running, and the outputs
    sent meanwhile."""
    task = asyncio.get_running_loop().create_task(core.run())
    turns = 0
    while len(core.scheduler.running) < N and turns < 10 * N:
        await asyncio.sleep(0)
        turns += 1
    sent = sum(len(b.outputs) for b in batches)
    core.shutdown(0)
    await task
    return turns, sent


async def test_a_burst_is_admitted_without_yielding_between_silent_steps():
    core, batches = _core()
    turns, sent = await _turns_until_admitted(core, batches)
    assert core.step_counter >= N  # one admission per step: the budget did split them
    assert turns <= 2  # ... yet the loop did not go round once per step
    assert sent == 0


async def test_steps_with_outputs_still_yield_after_each_at_one_token_per_event():
    """The other half of the rule: a step that emitted lets its readers in before the next one."""
    batches: list = []
    cfg = EngineConfig(time_to_first_token=0.0, inter_token_latency=0.0, log_requests=False)
    core = EngineCore(EngineArgs(config=cfg).validate(), clock=VirtualClock(0.0),
                      output_sink=lambda c, o: batches.append(o))
    core.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=[1] * 8,
                                       sampling_params=SamplingParams(max_tokens=50)))
    task = asyncio.get_running_loop().create_task(core.run())
    seen = []
    for _ in range(5):
        await asyncio.sleep(0)
        seen.append(sum(len(o.new_token_ids) for b in batches for o in b.outputs))
    core.shutdown(0)
    await task
    assert seen[-1] < 50  # not the whole answer in one turn of the loop
    assert all(b - a <= 1 for a, b in zip(seen, seen[1:]))  # at most one step per turn
