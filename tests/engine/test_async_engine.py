"""AsyncEngine on the real loop: routing, merging, cancellation, control calls, dead engines."""

import asyncio

import pytest

from tests.conftest import async_wait_until
from vllm_vcr.engine.async_engine import AsyncEngine, DataParallelRankError
from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.engine.core import EngineDeadError
from vllm_vcr.engine.types import EngineCoreOutput, EngineCoreRequest, FinishReason, SamplingParams


def req(rid, max_tokens=5, rank=None, prompt_len=8):
    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(range(1, prompt_len + 1)),
                             sampling_params=SamplingParams(max_tokens=max_tokens), data_parallel_rank=rank)


async def collect(engine, r):
    return [o async for o in engine.generate(r)]


@pytest.fixture(params=["vllm", "sglang"])
async def engine(request):
    e = AsyncEngine(EngineArgs(config=EngineConfig(inter_token_latency=0.5, log_requests=False),
                               engine_type=request.param), engine_count=2)
    await e.start()
    yield e
    await e.stop(0)


async def test_generate_yields_every_token_then_finishes(engine):
    outs = await collect(engine, req("a", 7))
    assert sum(len(o.new_token_ids) for o in outs) == 7
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert outs[0].prefill_stats.num_prompt_tokens == 8


async def _settled(engine) -> list:
    """The engines' stats once every request they received has ended (aborts land on a later step)."""
    async def ended():
        stats = await engine.call_all(lambda c: c.current_stats())
        done = sum(s.requests_completed + s.requests_failed + s.requests_aborted for s in stats)
        return stats if done == sum(s.requests_received for s in stats) else None

    return await async_wait_until(ended, 10, "every request to end")


async def test_a_lagging_reader_gets_merged_outputs(engine):
    agen = engine.generate(req("slow", 20))
    first = await agen.__anext__()
    await asyncio.sleep(0.05)  # the engine runs ahead while we do not read
    rest = [o async for o in agen]
    assert len(first.new_token_ids) + sum(len(o.new_token_ids) for o in rest) == 20
    assert len(rest) < 19


async def test_closing_the_stream_aborts_in_the_engine(engine):
    agen = engine.generate(req("gone", 10_000))
    await agen.__anext__()
    await agen.aclose()
    stats = await _settled(engine)
    assert sum(s.requests_aborted for s in stats) == 1
    assert sum(s.running for s in stats) == 0


async def test_requests_spread_over_engines_and_ranks_pin(engine):
    await asyncio.gather(*(collect(engine, req(f"r{i}", 20)) for i in range(6)))
    await collect(engine, req("pinned", 2, rank=1))
    stats = await engine.call_all(lambda c: c.current_stats())
    assert [s.requests_received for s in stats] in ([3, 4], [4, 3])
    with pytest.raises(DataParallelRankError, match="out of range"):
        await collect(engine, req("bad", rank=2))


async def test_call_all_runs_in_engine_order(engine):
    assert await engine.call_all(lambda c: c.engine_index) == [0, 1]


async def test_a_stopped_engine_fails_waiting_requests_and_calls():
    e = AsyncEngine(EngineArgs(config=EngineConfig(inter_token_latency=50, log_requests=False)))
    await e.start()
    agen = e.generate(req("x", 100))
    await agen.__anext__()
    await e.stop(0)
    outs = [o async for o in agen]
    assert outs[-1].finish_reason is FinishReason.ABORT
    with pytest.raises(EngineDeadError):
        await e.engines[0].call(lambda c: 1)


async def test_requests_wait_for_startup_time():
    e = AsyncEngine(EngineArgs(config=EngineConfig(log_requests=False), startup_time=0.2))
    await e.start()
    assert not e.is_ready
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    outs = await collect(e, req("early", 2))
    assert loop.time() - t0 >= 0.19 and e.is_ready
    assert outs[-1].finish_reason is FinishReason.LENGTH
    await e.stop(0)


async def test_a_startup_failure_wakes_every_waiting_request():
    from vllm_vcr.engine.async_engine import EngineStartupError

    e = AsyncEngine(EngineArgs(config=EngineConfig(log_requests=False), startup_time=0.05,
                               startup_failure="weights are corrupt"))
    await e.start()
    results = await asyncio.gather(*(collect(e, req(f"w{i}")) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, EngineStartupError) and "weights are corrupt" in str(r) for r in results)
    assert not e.is_ready
    await e.stop(0)


async def test_a_dropped_stream_frees_its_id_for_immediate_reuse(engine):
    agen = engine.generate(req("same-id", 10_000, rank=0))
    await agen.__anext__()
    await agen.aclose()  # cancels in the engine at once
    outs = await collect(engine, req("same-id", 5, rank=0))  # same id, right away
    assert sum(len(o.new_token_ids) for o in outs) == 5 and outs[-1].finish_reason is FinishReason.LENGTH
    stats = (await engine.call_all(lambda c: c.current_stats()))[0]
    assert (stats.requests_aborted, stats.requests_completed, stats.requests_failed) == (1, 1, 0)


# --- push(): outputs handed to a callback while the reader stays parked ----------------------------

@pytest.mark.parametrize("max_burst", [1, 8])
async def test_push_delivers_every_token_and_merges_back_to_back_steps(max_burst):
    e = AsyncEngine(EngineArgs(config=EngineConfig(inter_token_latency=0, time_to_first_token=0,
                                                   log_requests=False), max_burst=max_burst))
    await e.start()
    got: list[EngineCoreOutput] = []

    def deliver(out):
        got.append(out)
        return False

    wakes = 0
    async for _ in e.push(req("p", 300), deliver):
        wakes += 1
    assert sum(len(o.new_token_ids) for o in got) == 300
    assert got[-1].finish_reason is FinishReason.LENGTH and wakes == 1  # only the end wakes the reader
    if max_burst == 1:  # the default: every step's output is delivered before the next step runs
        assert [len(o.new_token_ids) for o in got] == [1] * 300
    else:  # bursts allowed (serve with --stream-interval > 1): back-to-back steps merge
        assert len(got) < 300
    stats = (await e.call_all(lambda c: c.current_stats()))[0]
    assert (stats.requests_completed, stats.requests_aborted) == (1, 0)
    await e.stop(0)


async def test_push_wakes_the_reader_when_the_callback_asks(engine):
    seen = []

    def deliver(out):
        seen.append(len(out.new_token_ids))
        return True  # e.g. the socket is full: the reader must write through ASGI

    n = 0
    async for _ in engine.push(req("w", 6), deliver):  # ends after the final output
        n += 1
    assert sum(seen) == 6 and n == len(seen)


async def test_a_failing_callback_fails_its_request_and_aborts_it(engine):
    def deliver(out):
        raise ValueError("renderer bug")

    with pytest.raises(ValueError, match="renderer bug"):
        async for _ in engine.push(req("bad", 10_000, rank=0), deliver):
            pass
    stats = (await _settled(engine))[0]
    assert stats.requests_aborted == 1 and stats.running == 0


async def test_leaving_a_push_stream_early_aborts_in_the_engine(engine):
    agen = engine.push(req("early", 10_000, rank=0), lambda out: True)
    await agen.__anext__()
    await agen.aclose()
    stats = (await _settled(engine))[0]
    assert (stats.requests_aborted, stats.requests_completed) == (1, 0)


async def test_ttft_counts_from_the_frontends_arrival_time():
    """vLLM's arrival_time: time the frontend spent before the engine got the request is inside the
    configured TTFT (2 s here; the request arrived 1.9 s before the engine saw it)."""
    import time

    from tests.conftest import scaled

    e = AsyncEngine(EngineArgs(config=EngineConfig(time_to_first_token=2000, log_requests=False)))
    await e.start()
    try:
        late = req("late", 2)
        late.arrival_time = time.time() - 1.9
        t0 = time.monotonic()
        outs = [o async for o in e.generate(late)]
        assert sum(len(o.new_token_ids) for o in outs) == 2
        # not the full 2 s again (any bound below 2 s tells the two apart; below 1 s on an idle machine)
        assert time.monotonic() - t0 < min(scaled(1.0), 1.9)
    finally:
        await e.stop(0)
