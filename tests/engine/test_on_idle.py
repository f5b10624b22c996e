"""`on_idle`: the engine's loop says how long it is about to sleep, before it sleeps (serve and
play collect garbage then, gc_tuning.collect_while_idle)."""

from __future__ import annotations

import asyncio
import math

from vllm_vcr.engine.clock import RealClock
from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.engine.core import EngineCore
from vllm_vcr.engine.types import EngineCoreRequest, SamplingParams


def _core(gaps: list[float], ttft_ms: float) -> EngineCore:
    cfg = EngineConfig(time_to_first_token=ttft_ms, inter_token_latency=10.0, log_requests=False)
    core: EngineCore

    def on_idle(gap: float) -> None:
        gaps.append(gap)
        # (once the loop waits) the wait returns at once: the test never sleeps
        asyncio.get_running_loop().call_soon(core.shutdown, 0)

    core = EngineCore(EngineArgs(config=cfg).validate(), clock=RealClock(), on_idle=on_idle)
    return core


async def test_the_sleep_until_the_next_step_is_announced():
    gaps: list[float] = []
    core = _core(gaps, ttft_ms=1_000_000.0)
    core.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=[1] * 16,
                                       sampling_params=SamplingParams(max_tokens=4)))
    await core.run()
    assert len(gaps) == 1 and 990.0 < gaps[0] <= 1000.0  # the first token is due in ~1000 s


async def test_an_engine_with_nothing_to_do_announces_an_endless_sleep():
    gaps: list[float] = []
    core = _core(gaps, ttft_ms=10.0)
    await core.run()
    assert gaps == [math.inf]
