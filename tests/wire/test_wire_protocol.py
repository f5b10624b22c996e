"""`vllm-vcr play` against a scripted fake frontend: the wire protocol without vLLM installed.

These run in the default test command (no `conformance` marker): they bind the frontend's
sockets themselves on 127.0.0.1, run the PlayServer in-process, and check every frame.
"""

from __future__ import annotations

import asyncio
import signal

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio

from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.engine.types import (
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SamplingParams,
)
from vllm_vcr.wire.codec import Codec, FrameError
from vllm_vcr.wire.handshake import ReadyInfo
from vllm_vcr.wire.server import PlayServer

REQUIRED_READY_KEYS = {
    "max_model_len", "num_gpu_blocks", "block_size", "dp_stats_address", "dtype", "vllm_version",
    "world_size", "data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size",
    "decode_context_parallel_size", "data_parallel_rank", "max_num_seqs", "max_num_batched_tokens",
    "instance_id", "supports_lora", "max_loras",
}
enc = msgspec.msgpack.Encoder()
dec = msgspec.msgpack.Decoder()
out_dec = msgspec.msgpack.Decoder(EngineCoreOutputs)


def _req(rid: str, *, client: int = 0, max_tokens: int = 3, prompt=(1, 2, 3, 4)) -> list:
    """An ADD body the way vLLM writes it: all 22 positions, sampling params as a map."""
    sp = {"temperature": 1.0, "max_tokens": max_tokens, "output_kind": 1, "stop": [], "stop_token_ids": [],
          "_eos_token_id": 1, "_all_stop_token_ids": [1], "skip_clone": True, "bad_words": []}
    return [rid, list(prompt), None, sp, None, 1700000000.5, None, None, None, None, None, client, 0, 0,
            None, False, rid.rsplit("-", 1)[0], None, None, False, None, None]


class FakeFrontend:
    """The sockets a vLLM frontend binds, plus a DP coordinator's when asked."""

    def __init__(self, clients: int = 1, coordinator: bool = False):
        self.ctx = zmq.asyncio.Context()
        self.hs = self._bind(zmq.ROUTER)
        self.inputs = [self._bind(zmq.ROUTER) for _ in range(clients)]
        self.outputs = [self._bind(zmq.PULL) for _ in range(clients)]
        self.coord_pub = self._bind(zmq.XPUB, verbose=True) if coordinator else None
        self.coord_pull = self._bind(zmq.PULL) if coordinator else None

    def _bind(self, kind, verbose: bool = False) -> zmq.asyncio.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        if verbose:  # hear every engine's subscription, like vLLM's coordinator
            s.setsockopt(zmq.XPUB_VERBOSE, 1)
        s.bind("tcp://127.0.0.1:*")
        return s

    @staticmethod
    def addr(s) -> str:
        return s.getsockopt(zmq.LAST_ENDPOINT).decode()

    async def handshake(self, engines: int = 1) -> dict[bytes, dict]:
        ready: dict[bytes, dict] = {}
        hello = {}
        for _ in range(engines):
            ident, msg = await asyncio.wait_for(self.hs.recv_multipart(), 10)
            hello[ident] = dec.decode(msg)
            assert hello[ident] == {"status": "HELLO", "local": False, "headless": True}
            init = {"addresses": {
                "inputs": [self.addr(s) for s in self.inputs], "outputs": [self.addr(s) for s in self.outputs],
                "coordinator_input": self.addr(self.coord_pub) if self.coord_pub else None,
                "coordinator_output": self.addr(self.coord_pull) if self.coord_pull else None,
                "frontend_stats_publish_address": "ipc:///tmp/stats" if self.coord_pub else None},
                "parallel_config": {}}
            await self.hs.send_multipart([ident, enc.encode(init)])
        for s in self.inputs:
            for _ in range(engines):
                ident, payload = await asyncio.wait_for(s.recv_multipart(), 10)
                ready[ident] = dec.decode(payload)
        if self.coord_pub is not None:
            for _ in range(engines):
                sub = await asyncio.wait_for(self.coord_pub.recv(), 10)
                assert sub == b"\x01"
            await self.coord_pub.send(b"READY")
        for _ in range(engines):
            ident, msg = await asyncio.wait_for(self.hs.recv_multipart(), 10)
            assert dec.decode(msg)["status"] == "READY"
        return ready

    async def send(self, ident: bytes, kind: bytes, *frames: bytes, client: int = 0) -> None:
        await self.inputs[client].send_multipart([ident, kind, *frames])

    async def recv(self, client: int = 0, timeout: float = 10) -> EngineCoreOutputs | bytes:
        frames = await asyncio.wait_for(self.outputs[client].recv_multipart(), timeout)
        if frames[0] == b"ENGINE_CORE_DEAD":
            return frames[0]
        return out_dec.decode(frames[0])

    async def collect(self, rid: str, client: int = 0) -> list:
        """Outputs of one request until it finishes."""
        outs = []
        while True:
            msg = await self.recv(client)
            assert isinstance(msg, EngineCoreOutputs), msg
            mine = [o for o in msg.outputs if o.request_id == rid]
            outs.extend(mine)
            if any(o.finish_reason is not None for o in mine):
                assert rid in (msg.finished_requests or [])
                return outs

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _server(fe: FakeFrontend, engines: int = 1, kv_events=None, **cfg) -> PlayServer:
    args = EngineArgs(config=EngineConfig(**cfg), vocab_size=100, kv_cache_size=64, engine_id="test-engine")
    ready = ReadyInfo(max_model_len=2048, num_gpu_blocks=64, block_size=16, max_num_seqs=8,
                      max_num_batched_tokens=512, instance_id="test-engine")
    return PlayServer(args, handshake_address=fe.addr(fe.hs), engine_count=engines, ready=ready,
                      handshake_timeout=10, kv_events=kv_events)


@pytest.fixture
async def single():
    fe = FakeFrontend()
    server = _server(fe, log_requests=False)
    task = asyncio.create_task(server.run())
    ready = await fe.handshake()
    yield fe, server, task, ready
    if not task.done():
        server._on_signal(signal.SIGTERM)
        await asyncio.wait_for(task, 10)
    fe.close()


async def test_handshake_ready_payload(single):
    _fe, _srv, _task, ready = single
    assert list(ready) == [b"\x00\x00"]
    payload = ready[b"\x00\x00"]
    assert REQUIRED_READY_KEYS <= payload.keys()
    assert payload["data_parallel_rank"] == 0 and payload["num_gpu_blocks"] == 64
    assert payload["block_size"] == 16 and payload["instance_id"] == "test-engine"
    assert type(payload["supports_lora"]) is bool and type(payload["max_num_seqs"]) is int


async def test_request_outputs_and_finish(single):
    fe, *_ = single
    await fe.send(b"\x00\x00", b"\x00", enc.encode(_req("r-1", max_tokens=3)))
    outs = await fe.collect("r-1")
    assert sum(len(o.new_token_ids) for o in outs) == 3
    first = outs[0]
    assert [e.type for e in first.events] == [1, 2]  # QUEUED, SCHEDULED
    assert first.prefill_stats.num_prompt_tokens == 4
    assert outs[-1].finish_reason == FinishReason.LENGTH


async def test_utility_answers(single):
    fe, *_ = single
    await fe.send(b"\x00\x00", b"\x03", enc.encode([0, 2**64 - 1, "get_supported_tasks", []]))
    msg = await fe.recv()
    assert msg.utility_output.call_id == 2**64 - 1
    assert msg.utility_output.failure_message is None and msg.utility_output.result == [None, ["generate"]]
    await fe.send(b"\x00\x00", b"\x03", enc.encode([0, 7, "no_such_method", [1, 2]]))
    msg = await fe.recv()
    assert msg.utility_output.result is None
    assert msg.utility_output.failure_message.startswith("Call to no_such_method method failed")
    await fe.send(b"\x00\x00", b"\x03", enc.encode([0, 8, "reset_prefix_cache", [False, False]]))
    assert (await fe.recv()).utility_output.result == [None, True]


async def test_startup_time_delays_the_ready_payload():
    import time

    fe = FakeFrontend()
    args = EngineArgs(config=EngineConfig(log_requests=False), vocab_size=100, kv_cache_size=64, startup_time=0.6)
    ready = ReadyInfo(max_model_len=2048, num_gpu_blocks=64, block_size=16, max_num_seqs=8,
                      max_num_batched_tokens=512, instance_id="test-engine")
    server = PlayServer(args, handshake_address=fe.addr(fe.hs), ready=ready, handshake_timeout=10)
    task = asyncio.create_task(server.run())
    t0 = time.monotonic()
    try:
        await fe.handshake()  # HELLO, init, then the ready payload only after the simulated load
        assert time.monotonic() - t0 >= 0.6
    finally:
        server._on_signal(signal.SIGTERM)
        await asyncio.wait_for(task, 10)
        fe.close()


async def test_pause_keep_freezes_requests_until_resume():
    fe = FakeFrontend()
    server = _server(fe, log_requests=False, inter_token_latency=5)
    task = asyncio.create_task(server.run())
    await fe.handshake()
    try:
        await fe.send(b"\x00\x00", b"\x00", enc.encode(_req("k-1", max_tokens=40)))
        first = await fe.recv()
        assert first.outputs and first.outputs[0].request_id == "k-1"
        await fe.send(b"\x00\x00", b"\x03", enc.encode([0, 11, "pause_generation", ["keep", False]]))
        got = 0
        while True:  # tokens already on their way, then the utility reply
            msg = await fe.recv()
            if msg.utility_output is not None:
                assert msg.utility_output.result == [None, None]
                break
            got += sum(len(o.new_token_ids) for o in msg.outputs)
        with pytest.raises(asyncio.TimeoutError):  # frozen: nothing for a while
            while True:
                msg = await fe.recv(timeout=0.3)
                assert not any(o.new_token_ids for o in msg.outputs), "tokens while paused"
        await fe.send(b"\x00\x00", b"\x03", enc.encode([0, 12, "resume_generation", []]))
        outs = []
        while not any(o.finish_reason is not None for o in outs):
            msg = await fe.recv()
            outs.extend(o for o in msg.outputs if o.request_id == "k-1")
        total = len(first.outputs[0].new_token_ids) + got + sum(len(o.new_token_ids) for o in outs)
        assert total == 40 and outs[-1].finish_reason == FinishReason.LENGTH
    finally:
        server._on_signal(signal.SIGTERM)
        await asyncio.wait_for(task, 10)
        fe.close()


async def _utility(fe: FakeFrontend, call_id: int, method: str, args: list):
    """Send one utility call; its answer ([None, value]) or failure message, skipping step outputs."""
    await fe.send(b"\x00\x00", b"\x03", enc.encode([0, call_id, method, args]))
    while True:
        msg = await fe.recv()
        if msg.utility_output is not None and msg.utility_output.call_id == call_id:
            return msg.utility_output.result if msg.utility_output.failure_message is None else \
                msg.utility_output.failure_message


async def test_sleep_wake_and_pause_follow_the_engine_core(single):
    """vLLM's engine core: a partial wake-up is not fully awake and scheduling stays paused, a
    paused scheduler counts as sleeping, and 0.33's pause_generation refuses new requests."""
    fe, *_ = single
    assert await _utility(fe, 1, "sleep", [1, "abort"]) == [None, None]
    assert await _utility(fe, 2, "is_sleeping", []) == [None, True]
    assert await _utility(fe, 3, "wake_up", [["weights"]]) == [None, False]
    assert await _utility(fe, 4, "is_sleeping", []) == [None, True]
    assert await _utility(fe, 5, "wake_up", [["nonsense"]]) == [None, False]  # not a sleeping tag: nothing wakes
    assert await _utility(fe, 6, "wake_up", [["kv_cache"]]) == [None, True]
    assert await _utility(fe, 7, "is_sleeping", []) == [None, False]
    assert await _utility(fe, 8, "pause_scheduler", ["abort", True]) == [None, None]
    assert await _utility(fe, 9, "is_sleeping", []) == [None, True]
    assert await _utility(fe, 10, "is_scheduler_paused", []) == [None, True]
    assert (await _utility(fe, 11, "pause_scheduler", ["soon", True])) == "Call to pause_scheduler method failed: Invalid pause mode: soon"
    assert await _utility(fe, 12, "resume_scheduler", []) == [None, None]
    assert await _utility(fe, 13, "pause_generation", ["abort", True]) == [None, None]
    await fe.send(b"\x00\x00", b"\x00", enc.encode(_req("p-1")))
    outs = await fe.collect("p-1")
    assert outs[-1].finish_reason == FinishReason.ERROR and outs[-1].error.retryable, outs
    assert await _utility(fe, 14, "resume_scheduler", []) == [None, None]
    await fe.send(b"\x00\x00", b"\x00", enc.encode(_req("p-2")))
    assert (await fe.collect("p-2"))[-1].finish_reason == FinishReason.LENGTH


async def test_malformed_frames_are_survived(single):
    fe, _srv, task, _ = single
    await fe.send(b"\x00\x00", b"\x09", b"junk")               # unknown request type
    await fe.inputs[0].send_multipart([b"\x00\x00", b"\x00"])  # ADD without a body
    await fe.send(b"\x00\x00", b"\x00", b"\xc1")               # invalid msgpack
    await fe.send(b"\x00\x00", b"\x01", enc.encode({"not": "a list"}))  # bad ABORT
    await fe.send(b"\x00\x00", b"\x03", enc.encode("nope"))    # bad UTILITY
    # an ADD whose id is readable but whose fields are not: answered ERROR, never left pending
    bad = _req("bad-1")
    bad[3] = {"max_tokens": "many"}
    await fe.send(b"\x00\x00", b"\x00", enc.encode(bad))
    msg = await fe.recv()
    assert [(o.request_id, o.finish_reason) for o in msg.outputs] == [("bad-1", FinishReason.ERROR)]
    assert msg.finished_requests == ["bad-1"]
    # still serving
    await fe.send(b"\x00\x00", b"\x00", enc.encode(_req("ok-1", max_tokens=2)))
    assert (await fe.collect("ok-1"))[-1].finish_reason == FinishReason.LENGTH
    assert not task.done()


async def test_abort_is_idempotent_and_silent(single):
    fe, server, *_ = single
    await fe.send(b"\x00\x00", b"\x01", enc.encode(["never-seen", "also-unknown"]))
    await fe.send(b"\x00\x00", b"\x00", enc.encode(_req("ok-2", max_tokens=2)))
    outs = await fe.collect("ok-2")
    await fe.send(b"\x00\x00", b"\x01", enc.encode(["ok-2", "ok-2"]))  # after it finished
    assert outs[-1].finish_reason == FinishReason.LENGTH
    assert server.bridges[0].inflight == {}


async def test_tolerant_request_layouts(single):
    fe, *_ = single
    short = _req("short-1", max_tokens=2)[:12]            # an older, shorter layout
    long = _req("long-1", max_tokens=2) + [None, 5, "x"]   # a newer, longer one
    await fe.send(b"\x00\x00", b"\x00", enc.encode(short))
    assert (await fe.collect("short-1"))[-1].finish_reason == FinishReason.LENGTH
    await fe.send(b"\x00\x00", b"\x00", enc.encode(long), b"aux-buffer")
    assert (await fe.collect("long-1"))[-1].finish_reason == FinishReason.LENGTH


async def test_shutdown_sends_engine_core_dead(single):
    fe, server, task, _ = single
    server._on_signal(signal.SIGTERM)
    assert await asyncio.wait_for(task, 10) == 0
    assert await fe.recv() == b"ENGINE_CORE_DEAD"


async def test_shutdown_aborts_in_flight():
    fe = FakeFrontend()
    server = _server(fe, log_requests=False, inter_token_latency=50.0)
    task = asyncio.create_task(server.run())
    await fe.handshake()
    await fe.send(b"\x00\x00", b"\x00", enc.encode(_req("slow-1", max_tokens=1000)))
    first = await fe.recv()
    assert first.outputs[0].request_id == "slow-1"
    server._on_signal(signal.SIGTERM)  # --shutdown-timeout 0: abort at once
    assert await asyncio.wait_for(task, 10) == 0
    seen_abort = False
    while True:
        msg = await fe.recv()
        if msg == b"ENGINE_CORE_DEAD":
            break
        seen_abort |= any(o.finish_reason == FinishReason.ABORT for o in msg.outputs)
    assert seen_abort
    fe.close()


async def test_two_clients_and_two_ranks_with_coordinator():
    fe = FakeFrontend(clients=2, coordinator=True)
    server = _server(fe, engines=2, log_requests=False)
    task = asyncio.create_task(server.run())
    try:
        ready = await fe.handshake(engines=2)
        assert sorted(ready) == [b"\x00\x00", b"\x01\x00"]
        assert {p["data_parallel_rank"] for p in ready.values()} == {0, 1}
        assert all(p["data_parallel_size"] == 2 and p["dp_stats_address"] == "ipc:///tmp/stats"
                   for p in ready.values())
        assert ready[b"\x01\x00"]["instance_id"] == "test-engine-1"
        # rank 1, API server 1: the answer must come on output socket 1 with engine_index 1
        await fe.send(b"\x01\x00", b"\x00", enc.encode(_req("c1-1", client=1, max_tokens=2)), client=1)
        msg = await fe.recv(client=1)
        assert msg.engine_index == 1 and msg.outputs[0].request_id == "c1-1"
        # the coordinator hears the load change as a stats-only message
        counts = out_dec.decode(await asyncio.wait_for(fe.coord_pull.recv(), 10))
        assert counts.engine_index == 1 and counts.outputs == [] and counts.scheduler_stats is not None
        await fe.coord_pub.send_multipart([b"\x02", enc.encode([3, None])])  # START_DP_WAVE: ignored
    finally:
        server._on_signal(signal.SIGTERM)
        assert await asyncio.wait_for(task, 10) == 0
        fe.close()


# ---- codec --------------------------------------------------------------------------------------

def test_codec_reads_ext3_arrays_and_refuses_pickle():
    codec = Codec()
    body = _req("emb-1")
    body[9] = ["float32", [2, 2], msgspec.msgpack.Ext(3, np.zeros(4, np.float32).tobytes())]
    req = codec.decode_add([enc.encode(body)])
    assert isinstance(req, EngineCoreRequest) and req.prompt_token_ids == [1, 2, 3, 4]
    body[9] = msgspec.msgpack.Ext(1, b"pickled")
    with pytest.raises(FrameError, match="pickle"):
        codec.decode_add([enc.encode(body)])


def test_codec_encodes_ndarray_inline():
    codec = Codec()
    buf = codec.encode({"x": np.arange(3, dtype=np.int32)})
    got = msgspec.msgpack.decode(buf, ext_hook=lambda code, data: (code, bytes(data)))
    assert got["x"][0] == "<i4" and got["x"][1] == [3]
    assert got["x"][2] == (3, np.arange(3, dtype=np.int32).tobytes())


def test_sampling_params_defaults_when_keys_missing():
    codec = Codec()
    body = _req("sp-1")
    body[3] = {"max_tokens": 5}
    req = codec.decode_add([enc.encode(body)])
    assert isinstance(req.sampling_params, SamplingParams) and req.sampling_params.max_tokens == 5


async def test_engine_crash_sends_engine_core_dead():
    fe = FakeFrontend()
    server = _server(fe, log_requests=False)
    task = asyncio.create_task(server.run())
    await fe.handshake()

    def boom(now):
        raise RuntimeError("simulated engine bug")

    server.bridges[0].core.step = boom
    await fe.send(b"\x00\x00", b"\x00", enc.encode(_req("x-1")))
    assert await asyncio.wait_for(task, 10) == 1  # a fatal error is a non-zero exit
    while (await fe.recv()) != b"ENGINE_CORE_DEAD":
        pass
    fe.close()


# ---- fuzz: no frame sequence may raise out of the bridge or leave a request unanswered ---------

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.wire.handshake import EngineSockets
from vllm_vcr.wire.server import EngineBridge


class _Sent:
    def __init__(self):
        self.frames: list[bytes] = []
        self.closed = False

    def send(self, data, flags=0, **kw):
        self.frames.append(bytes(data))


class _Core:
    def __init__(self):
        self.added: list[str] = []

    def add_request(self, req):
        self.added.append(req.request_id)

    def abort_requests(self, ids):
        pass


_frame = st.one_of(st.binary(max_size=64), st.builds(lambda v: enc.encode(v), st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=8) | st.binary(max_size=8),
    lambda c: st.lists(c, max_size=24) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=40)))


@settings(max_examples=100, deadline=None)
@given(kind=st.sampled_from([b"\x00", b"\x01", b"\x02", b"\x03", b"\x04", b"\xff", b""]),
       body=st.lists(_frame, max_size=3))
def test_bridge_survives_any_frames(kind, body):
    out = _Sent()
    bridge = EngineBridge(0, EngineSockets(rank=0, identity=b"\x00\x00", inputs=[], outputs=[out]), Codec())
    core = _Core()
    bridge.attach_core(core)
    bridge._spawn = lambda coro: coro.close()  # utilities are covered above; only decoding here
    bridge.on_frames(0, [kind, *body])
    # every ADD the bridge accepted reached the engine; every one it refused was answered
    answered = [out_dec.decode(f) for f in out.frames]
    for msg in answered:
        assert all(o.finish_reason == FinishReason.ERROR for o in msg.outputs)
    assert len(core.added) + sum(len(m.outputs) for m in answered) <= 1


_value = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False)
                      | st.text(max_size=8), lambda c: st.lists(c, max_size=4)
                      | st.dictionaries(st.text(max_size=12), c, max_size=4), max_leaves=10)


@settings(max_examples=200, deadline=None)
# position 19 is abort_immediately: silent by design, like vLLM
@given(pos=st.integers(1, 24).filter(lambda p: p != 19), value=_value, sp_key=st.sampled_from(["max_tokens", "stop", "_eos_token_id", "n",
                                                                    "temperature", "extra_args", "seed"]),
       sp_value=_value)
def test_mutated_add_is_served_or_answered(pos, value, sp_key, sp_value):
    """An ADD whose id is readable is never dropped silently, whatever else is wrong with it."""
    out = _Sent()
    bridge = EngineBridge(0, EngineSockets(rank=0, identity=b"\x00\x00", inputs=[], outputs=[out]), Codec())
    core = _Core()
    bridge.attach_core(core)
    body = _req("m-1")
    body[3] = {**body[3], sp_key: sp_value}
    if pos < len(body):
        body[pos] = value
    else:
        body.append(value)
    bridge.on_frames(0, [b"\x00", enc.encode(body)])
    answered = [o.request_id for f in out.frames for o in out_dec.decode(f).outputs]
    assert core.added + answered == ["m-1"], (core.added, answered)


async def test_kv_events_published_and_reported():
    from vllm_vcr.kv_events import decode_batch, parse_kv_events_config

    fe = FakeFrontend()
    sub = fe.ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:*")  # a concrete host: the engine's PUB connects to us
    endpoint = FakeFrontend.addr(sub)
    cfg = parse_kv_events_config(f'{{"enable_kv_cache_events": true, "endpoint": "{endpoint}", "topic": "kv"}}')
    server = _server(fe, kv_events=cfg, log_requests=False)
    task = asyncio.create_task(server.run())
    try:
        ready = await fe.handshake()
        reported = ready[b"\x00\x00"]["kv_events_config"]
        assert reported["enable_kv_cache_events"] is True and reported["endpoint"] == endpoint
        # PUB/SUB joins late (the subscription travels after the connection): keep making new
        # blocks until a batch arrives.
        for attempt in range(40):
            await fe.send(b"\x00\x00", b"\x00", enc.encode(_req(f"kv-{attempt}", max_tokens=2,
                                                                 prompt=range(2 + attempt, 50 + attempt))))
            await fe.collect(f"kv-{attempt}")
            for _ in range(5):
                if sub.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    break
                await asyncio.sleep(0.05)
            else:
                continue
            break
        topic, _seq, payload = await asyncio.wait_for(sub.recv_multipart(), 10)
        assert topic == b"kv"
        batch = decode_batch(payload)
        assert any(type(e).__name__ == "BlockStored" for e in batch.events)
    finally:
        server._on_signal(signal.SIGTERM)
        assert await asyncio.wait_for(task, 10) == 0
        fe.close()
