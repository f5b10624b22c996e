"""The engine-core client of `serve --api-server-count N` (wire/client.py) against a scripted
engine core on real ZMQ sockets: what it sends is what the engine-core server decodes, outputs
reach the reader, utility calls are answered, and ENGINE_CORE_DEAD fails what is in flight with
vLLM's EngineDeadError."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from vllm_vcr.engine.config import EngineArgs
from vllm_vcr.engine.core import EngineDeadError
from vllm_vcr.engine.types import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SamplingParams,
    SchedulerStats,
)
from vllm_vcr.wire.client import EngineCoreClient
from vllm_vcr.wire.codec import ABORT, ADD, ENGINE_CORE_DEAD, UTILITY, Codec, utility_success
from vllm_vcr.wire.reader import DRAIN_MAX
from vllm_vcr.testing.waits import scaled

DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."


def request(rid: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=[1, 2, 3],
                             sampling_params=SamplingParams(max_tokens=2), arrival_time=1.0)


class ScriptedEngine:
    """Engine core rank 0, as wire/handshake.py connects one: a DEALER to the client's input
    (announcing itself with its ready payload) and a PUSH to its output."""

    def __init__(self, ctx: zmq.asyncio.Context, client: EngineCoreClient) -> None:
        self.codec = Codec()
        self.inp = ctx.socket(zmq.DEALER)
        self.inp.setsockopt(zmq.IDENTITY, (0).to_bytes(2, "little"))
        self.inp.connect(client.input_address)
        self.out = ctx.socket(zmq.PUSH)
        self.out.connect(client.output_address)

    async def announce(self) -> None:
        await self.inp.send(msgspec.msgpack.encode({"kv_events_config": None, "data_parallel_rank": 0}))

    async def recv(self) -> list[bytes]:
        return await asyncio.wait_for(self.inp.recv_multipart(), 10)

    async def send(self, outs: EngineCoreOutputs) -> None:
        await self.out.send(self.codec.encode(outs))

    def close(self) -> None:
        self.inp.close(0)
        self.out.close(0)


@pytest.fixture
async def pair(tmp_path):
    client = EngineCoreClient(EngineArgs(), input_address=f"ipc://{tmp_path}/in",
                              output_address=f"ipc://{tmp_path}/out", ready_timeout=10)
    client.bind()
    ctx = zmq.asyncio.Context()
    engine = ScriptedEngine(ctx, client)
    await engine.announce()
    await client.start()
    yield client, engine
    engine.close()
    client.close()
    ctx.term()


async def test_requests_round_trip_and_dead_engine_fails_them(pair):
    client, engine = pair
    assert client.is_running and client.ready_payloads == {0: {"kv_events_config": None, "data_parallel_rank": 0}}
    seen: list = []
    client.add_output_listener(lambda idx, outs: seen.append((idx, len(outs.outputs))))

    async def read(rid: str) -> list:
        return [o async for o in client.generate(request(rid))]

    first = asyncio.ensure_future(read("a"))
    kind, body = (await engine.recv())[0:2]
    assert kind == ADD
    got = engine.codec.decode_add([body])  # what the engine-core server decodes
    assert (got.request_id, got.prompt_token_ids, got.sampling_params.max_tokens) == ("a", [1, 2, 3], 2)
    await engine.send(EngineCoreOutputs(outputs=[EngineCoreOutput(request_id="a", new_token_ids=[5])]))
    await engine.send(EngineCoreOutputs(outputs=[EngineCoreOutput(request_id="a", new_token_ids=[6],
                                                                  finish_reason=FinishReason.LENGTH)]))
    outs = await asyncio.wait_for(first, 10)
    assert [t for o in outs for t in o.new_token_ids] == [5, 6] and outs[-1].finish_reason == FinishReason.LENGTH
    assert seen and client.num_unfinished_requests == 0

    # a utility call goes to the engine and its answer comes back
    call = asyncio.ensure_future(client.reset_prefix_cache())
    kind, body = (await engine.recv())[0:2]
    assert kind == UTILITY
    index, call_id, method, args = engine.codec.decode_utility([body])
    assert method == "reset_prefix_cache" and index == 0
    await engine.send(utility_success(0, call_id, False, 0.0))
    assert await asyncio.wait_for(call, 10) == [False]

    # a reader that leaves early aborts its request in the engine
    gen = client.generate(request("b"))
    reading = asyncio.ensure_future(gen.__anext__())
    await engine.recv()
    reading.cancel()  # (the generator's own finally runs: the reader has left)
    with pytest.raises(asyncio.CancelledError):
        await reading
    kind, body = (await engine.recv())[0:2]
    assert kind == ABORT and engine.codec.decode_abort([body]) == ["b"]

    # the engine is gone: what is in flight and what comes next fail as vLLM's EngineDeadError
    dead = []
    client.on_dead(lambda: dead.append(True))
    pending = asyncio.ensure_future(read("c"))
    await engine.recv()
    await engine.out.send(ENGINE_CORE_DEAD)
    with pytest.raises(EngineDeadError, match="EngineCore encountered an issue"):
        await asyncio.wait_for(pending, 10)
    assert str(client.dead) == DEAD_MESSAGE and dead == [True] and not client.is_running
    with pytest.raises(EngineDeadError):
        await read("d")


async def test_output_batches_are_read_in_order_through_bursts_and_bad_frames(tmp_path, caplog):
    """Batches the engine sent before the client read any (its socket's FD had signalled them
    already), more than one turn of the loop reads at once, undecodable frames among them, a
    listener that fails: every good batch arrives, once, in order, and reading goes on."""
    client = EngineCoreClient(EngineArgs(), input_address=f"ipc://{tmp_path}/in",
                              output_address=f"ipc://{tmp_path}/out", ready_timeout=10)
    client.bind()
    ctx = zmq.asyncio.Context()
    engine = ScriptedEngine(ctx, client)
    seen: list[int] = []

    def listener(idx: int, outs: EngineCoreOutputs) -> None:
        if outs.scheduler_stats is None:
            raise RuntimeError("a failing listener")  # (its readers get the outputs all the same)
        seen.append(outs.scheduler_stats.step_counter)

    client.add_output_listener(listener)
    try:
        await engine.announce()
        n = 3 * DRAIN_MAX + 5
        frames: list[tuple[bytes, bool]] = []  # (frame, a good batch)
        for i in range(n):
            frames.append((engine.codec.encode(EngineCoreOutputs(scheduler_stats=SchedulerStats(step_counter=i))), True))
            if i % 50 == 3:
                frames.append((b"\xc1", False))  # not msgpack
                frames.append((msgspec.msgpack.encode({"outputs": "not a list"}), False))
        half = len(frames) // 2

        async def seen_reaches(count: int) -> None:
            deadline = asyncio.get_running_loop().time() + scaled(10)
            while len(seen) < count and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)

        for f, _ in frames[:half]:  # half before the client reads (nothing more signals them), half after
            await engine.out.send(f)
        await asyncio.sleep(0.2)
        await client.start()
        first = sum(good for _, good in frames[:half])
        await seen_reaches(first)
        assert seen == list(range(first))
        for f, _ in frames[half:]:
            await engine.out.send(f)
        await seen_reaches(n)
        assert seen == list(range(n))
        assert "undecodable engine output ignored" in caplog.text
        assert client.is_running
        # the reader still reads, and a request still completes (its batch fails the listener)
        reading = asyncio.ensure_future(client.generate(request("z")).__anext__())
        await engine.recv()
        await engine.send(EngineCoreOutputs(outputs=[EngineCoreOutput(request_id="z", new_token_ids=[9],
                                                                      finish_reason=FinishReason.STOP)]))
        assert (await asyncio.wait_for(reading, scaled(10))).new_token_ids == [9]
        assert "output listener failed" in caplog.text
    finally:
        engine.close()
        client.close()
        ctx.term()
