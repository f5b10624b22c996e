"""`play`'s input, fuzzed over real ZMQ sockets against a real engine: a malformed ADD fails
alone (answered with an ERROR output), the engine never dies, and every request the engine took
ends, whichever frame or field is malformed."""

from __future__ import annotations

import asyncio
import signal

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.wire.test_wire_protocol import FakeFrontend, _req, _server
from vllm_vcr.engine.types import EngineCoreOutputs, FinishReason

enc = msgspec.msgpack.Encoder()
ADD, ABORT, UTILITY = b"\x00", b"\x01", b"\x03"
IDENT = b"\x00\x00"


@pytest.fixture
async def play():
    fe = FakeFrontend()
    server = _server(fe, log_requests=False, inter_token_latency=0, time_to_first_token=0)
    task = asyncio.create_task(server.run())
    await fe.handshake()
    yield fe, server, task
    if not task.done():
        server._on_signal(signal.SIGTERM)
        await asyncio.wait_for(task, 10)
    fe.close()


async def _finish_of(fe: FakeFrontend, rid: str) -> tuple[FinishReason, str | None]:
    outs = await fe.collect(rid)
    last = outs[-1]
    return last.finish_reason, (last.error.message if last.error else None)


@pytest.mark.parametrize("lora", [True, 7, {"a": 1}, ["only-a-name"], [1, 2], ["name", "1"], "adapter"])
async def test_malformed_lora_request_fails_alone(play, lora):
    fe, server, task = play
    bad = _req("bad-lora")
    bad[6] = lora
    await fe.send(IDENT, ADD, enc.encode(bad))
    reason, message = await _finish_of(fe, "bad-lora")
    assert reason == FinishReason.ERROR and "lora_request" in message
    await fe.send(IDENT, ADD, enc.encode(_req("after", max_tokens=2)))
    assert (await _finish_of(fe, "after"))[0] == FinishReason.LENGTH
    assert not task.done()


@pytest.mark.parametrize("code", [3, 9, 1])
async def test_trace_headers_as_an_extension_fail_alone(play, code):
    fe, server, task = play
    bad = _req("bad-trace")
    bad[14] = msgspec.msgpack.Ext(code, b"\x01\x02\x03")
    await fe.send(IDENT, ADD, enc.encode(bad))
    reason, message = await _finish_of(fe, "bad-trace")
    assert reason == FinishReason.ERROR and message
    await fe.send(IDENT, ADD, enc.encode(_req("after", max_tokens=2)))
    assert (await _finish_of(fe, "after"))[0] == FinishReason.LENGTH
    assert not task.done()


_leaf = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=6)
         | st.binary(max_size=6) | st.builds(lambda c, d: msgspec.msgpack.Ext(c, d), st.integers(0, 127),
                                              st.binary(max_size=4)))
_value = st.recursive(_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                      max_leaves=8)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(mutations=st.lists(st.tuples(st.integers(1, 23).filter(lambda p: p != 19), _value), min_size=1, max_size=3),
       junk=st.lists(st.tuples(st.sampled_from([ADD, ABORT, UTILITY, b"\x02", b"\x07", b""]),
                               st.binary(max_size=40)), max_size=3))
def test_field_and_frame_fuzzing_never_kills_the_engine(mutations, junk):
    """Every mutated ADD (readable id) is served or answered; junk frames are skipped; the engine
    keeps serving and its counters add up."""

    async def scenario() -> None:
        fe = FakeFrontend()
        server = _server(fe, log_requests=False, inter_token_latency=0, time_to_first_token=0)
        task = asyncio.create_task(server.run())
        try:
            await fe.handshake()
            for kind, body in junk:
                await fe.send(IDENT, kind, body)
            body = _req("fuzz-1", max_tokens=2)
            for pos, value in mutations:
                if pos < len(body):
                    body[pos] = value
                else:
                    body.append(value)
            await fe.send(IDENT, ADD, enc.encode(body))
            await fe.send(IDENT, ADD, enc.encode(_req("probe", max_tokens=2)))
            finished: set[str] = set()
            while "probe" not in finished:
                msg = await fe.recv(timeout=10)
                assert isinstance(msg, EngineCoreOutputs), msg  # never ENGINE_CORE_DEAD
                finished.update(o.request_id for o in msg.outputs if o.finish_reason is not None)
                if "fuzz-1" not in finished and "probe" in finished:
                    # the mutated request may still be running (a larger max_tokens): wait for it
                    while "fuzz-1" not in finished:
                        m2 = await fe.recv(timeout=10)
                        assert isinstance(m2, EngineCoreOutputs)
                        finished.update(o.request_id for o in m2.outputs if o.finish_reason is not None)
            assert not task.done()
            stats = server.bridges[0].core.stats
            assert stats.requests_received == stats.requests_completed + stats.requests_failed + stats.requests_aborted
        finally:
            if not task.done():
                server._on_signal(signal.SIGTERM)
                await asyncio.wait_for(task, 10)
            fe.close()

    asyncio.run(scenario())
