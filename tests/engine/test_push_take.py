"""AsyncEngine.push with `take`: a steady decode's token goes straight from the step to the reader.

The reader must see exactly the tokens `generate()` gives (same ids, same order), token observers
must count the taken ones, and a reader that cannot take a token (not ready, an output still
waiting for it, or a failure) must cost nothing but that token's trip through the normal outputs.
"""

import asyncio

import pytest

from vllm_vcr.engine.async_engine import AsyncEngine
from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.engine.types import EngineCoreRequest, FinishReason, SamplingParams

ITL_MS = 2.0


def req(rid, max_tokens=12):
    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(range(1, 9)),
                             sampling_params=SamplingParams(max_tokens=max_tokens))


@pytest.fixture
async def engine():
    e = AsyncEngine(EngineArgs(config=EngineConfig(inter_token_latency=ITL_MS, log_requests=False)))
    await e.start()
    yield e
    await e.stop(0)


async def reference_ids(engine, rid, max_tokens=12):
    """The ids generate() gives for this request id (the engine's seed makes them the same)."""
    return [t async for o in engine.generate(req(rid, max_tokens)) for t in o.new_token_ids]


async def pushed(engine, rid, take, max_tokens=12, deliver_returns=False):
    """(every id in arrival order, the outputs deliver got, how often the reader woke)"""
    ids, outs = [], []

    def deliver(out):
        outs.append(out)
        ids.extend(out.new_token_ids)
        return deliver_returns

    def taking(token):
        r = take(token)
        if r:
            ids.append(token)
        return r

    wakes = 0
    async for _ in engine.push(req(rid, max_tokens), deliver, taking):
        wakes += 1
    return ids, outs, wakes


async def test_taken_tokens_are_generates_tokens_and_skip_the_outputs(engine):
    want = await reference_ids(engine, "same")
    ids, outs, _ = await pushed(engine, "same", lambda t: 1)
    assert ids == want
    # the first token (prefill stats, events) and the last (finish) come as outputs; the steady
    # ones between never do
    assert [len(o.new_token_ids) for o in outs] == [1, 1]
    assert outs[0].prefill_stats is not None and outs[-1].finish_reason is FinishReason.LENGTH


async def test_token_observers_count_each_taken_token_once(engine):
    seen: list[float] = []
    batches: list[int] = []
    engine.add_output_listener(lambda i, outs: batches.append(len(outs.outputs)),
                               lambda i, rid: seen.append if rid == "counted" else None)
    ids, outs, _ = await pushed(engine, "counted", lambda t: 1, max_tokens=10)
    assert len(ids) == 10 and len(seen) == 10 - len(outs) == 8
    assert seen == sorted(seen)  # the steps' clock times, in order
    assert batches.count(0) >= 8  # each step with taken tokens still sends its batch (its stats)
    # a request a token observer cannot follow is never taken
    ids, outs, _ = await pushed(engine, "other", lambda t: 1, max_tokens=6)
    assert sum(len(o.new_token_ids) for o in outs) == len(ids) == 6


async def test_a_declined_token_travels_as_an_output(engine):
    want = await reference_ids(engine, "declined")
    ids, outs, _ = await pushed(engine, "declined", lambda t: 0)
    assert ids == want and sum(len(o.new_token_ids) for o in outs) == 12


async def test_a_take_that_asks_for_the_reader_wakes_it(engine):
    ids, outs, wakes = await pushed(engine, "wake", lambda t: 2)
    assert len(ids) == 12
    assert wakes >= 2  # not only at the end: a take that returns 2 woke it


async def test_a_busy_reader_keeps_the_order(engine):
    """The reader is awake (not parked) for a while after the first output: tokens of that spell
    are taken all the same (take writes; the reader only writes what the socket refused)."""
    want = await reference_ids(engine, "busy", 20)
    ids, outs = [], []

    def deliver(out):
        outs.append(out)
        ids.extend(out.new_token_ids)
        return len(outs) == 1  # wake the reader after the first output

    def take(token):
        ids.append(token)
        return 1

    async for _ in engine.push(req("busy", 20), deliver, take):
        if len(outs) == 1:
            await asyncio.sleep(8 * ITL_MS / 1e3)  # busy while the engine goes on
    assert ids == want


async def test_tokens_behind_an_undelivered_output_wait_for_it(engine):
    """An output the reader has not been handed yet (it waits for the loop's flush, or for the
    reader to park again): a token after it must not overtake it through take."""
    from vllm_vcr.engine.async_engine import _Collector
    from vllm_vcr.engine.types import EngineCoreOutput

    taken = []
    col = _Collector(lambda out: False, None)
    sink, _ = engine._token_sink(0, "r", col, lambda t: taken.append(t) or 1, None)
    col.pending = EngineCoreOutput(request_id="r", new_token_ids=[5])
    assert sink(7, 0.0) is False and taken == []  # the engine sends 7 as an output: it merges
    col.pending = None
    assert sink(8, 0.0) is True and taken == [8]


async def test_a_failing_take_fails_its_request_not_the_engine(engine):
    def take(token):
        raise ValueError("renderer bug")

    with pytest.raises(ValueError, match="renderer bug"):
        await pushed(engine, "bad", take, max_tokens=1000)
    # (the abort is in the engine's inbox ahead of this call)
    stats = (await engine.call_all(lambda c: c.current_stats()))[0]
    assert stats.requests_aborted == 1 and stats.running == 0
    assert len(await reference_ids(engine, "after", 5)) == 5  # the engine goes on


async def test_a_failing_batch_fails_its_requests_not_the_engine(engine):
    """A steady batch whose readers raise: its streams fail (each reader's request is aborted),
    the engine goes on."""

    class Columns:
        def add(self, reader):
            pass

        def drop(self, index):
            pass

        def take(self, tokens, ts):
            raise ValueError("batch renderer bug")

    class Reader:
        kind = "failing"

        def ready(self):
            return True

        def new_columns(self):
            return Columns()

    async def stream(rid):
        def take(token):
            return 1
        async for _ in engine.push(req(rid, 50), lambda out: False, take, Reader()):
            pass

    results = await asyncio.gather(*(stream(f"b{i}") for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, ValueError) and "batch renderer bug" in str(r) for r in results)
    stats = (await engine.call_all(lambda c: c.current_stats()))[0]
    assert stats.requests_aborted == 3 and stats.running == 0
    assert len(await reference_ids(engine, "after-batch", 5)) == 5
