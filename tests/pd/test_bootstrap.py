"""The bootstrap wire protocol: room ids, ACK/ABORT, both arrival orders, timeouts, limits."""

from __future__ import annotations

import asyncio
import logging

import pytest

from vllm_vcr.pd.bootstrap import ABORT, ACK, ROOM, BootstrapError, BootstrapServer, join_room

from tests.conftest import async_wait_until


@pytest.fixture
async def server():
    s = BootstrapServer(session_timeout=2.0, max_pending_connections=4)
    await s.start("127.0.0.1", 0)
    yield s
    await s.close()


class Hold:
    """Stands in for a prefill request's KV hold."""

    def __init__(self):
        self.released = asyncio.Event()
        self.error: str | None = None

    def release(self, error: str | None = None):
        self.error = error
        self.released.set()


def decoder_in(server: BootstrapServer, room: int) -> bool:
    return room in server.rooms and server.rooms[room].decoder


async def raw_decoder(port: int, room: int):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(ROOM.pack(room))
    await writer.drain()
    return reader, writer


def test_room_id_is_eight_bytes_little_endian():
    assert ROOM.pack(1) == b"\x01" + b"\x00" * 7 and ROOM.pack(2**64 - 1) == b"\xff" * 8
    assert (ACK, ABORT) == (b"\x01", b"\x02")


async def test_prefill_first_then_decoder_gets_ack_and_its_close_releases(server):
    hold = Hold()
    assert server.register(42, "p", hold.release) is None
    server.ready(42, "p")
    writer = await join_room("127.0.0.1", server.port, 42, timeout=2.0)
    await async_wait_until(lambda: decoder_in(server, 42), 5)
    assert not hold.released.is_set()  # held while the decoder pulls
    writer.close()
    await asyncio.wait_for(hold.released.wait(), 2.0)
    assert 42 not in server.rooms


async def test_decoder_first_waits_for_the_prefill(server):
    hold = Hold()
    join = asyncio.ensure_future(join_room("127.0.0.1", server.port, 7, timeout=2.0))
    await async_wait_until(lambda: decoder_in(server, 7), 5)  # the room exists, waiting for its prefill
    assert not join.done()
    assert server.register(7, "p", hold.release) is None
    await asyncio.sleep(0.05)  # (nothing to wait for: registered but not computed, no ACK may come)
    assert not join.done()
    server.ready(7, "p")
    writer = await asyncio.wait_for(join, 2.0)
    writer.close()
    await asyncio.wait_for(hold.released.wait(), 2.0)


async def test_prefill_failure_aborts_waiting_and_late_decoders(server):
    server.register(9, "p", Hold().release)
    join = asyncio.ensure_future(join_room("127.0.0.1", server.port, 9, timeout=2.0))
    await async_wait_until(lambda: decoder_in(server, 9), 5)
    server.end(9, "p")  # the prefill request was aborted before it finished
    with pytest.raises(BootstrapError, match="prefill worker aborted bootstrap room 9"):
        await join
    with pytest.raises(BootstrapError, match="aborted"):  # remembered for late decoders
        await join_room("127.0.0.1", server.port, 9, timeout=2.0)


async def test_end_from_a_stale_owner_does_not_touch_a_new_room(server):
    server.register(5, "new", Hold().release)
    server.end(5, "old")
    assert server.rooms[5].state == "pending"


async def test_room_in_use(server):
    assert server.register(3, "a", Hold().release) is None
    assert server.register(3, "b", Hold().release) == "bootstrap room 3 is already in use"


async def test_decoder_times_out_when_no_prefill_comes():
    s = BootstrapServer(session_timeout=0.3, max_pending_connections=4)
    await s.start("127.0.0.1", 0)
    try:
        with pytest.raises(BootstrapError, match="aborted bootstrap room 11"):
            await join_room("127.0.0.1", s.port, 11, timeout=5.0)  # the server's rendezvous gives up first
        with pytest.raises(BootstrapError, match="handoff session timed out after 200 ms"):
            await join_room("127.0.0.1", s.port, 12, timeout=0.2)  # the client's own timeout
    finally:
        await s.close()


async def test_prefill_nobody_joins_is_released_after_the_session_timeout():
    s = BootstrapServer(session_timeout=0.5, max_pending_connections=4)
    await s.start("127.0.0.1", 0)
    try:
        hold = Hold()
        s.register(1, "p", hold.release)
        s.ready(1, "p")
        await asyncio.wait_for(hold.released.wait(), 2.0)
        with pytest.raises(BootstrapError, match="aborted"):
            await join_room("127.0.0.1", s.port, 1, timeout=2.0)
    finally:
        await s.close()


async def test_decoder_leaving_before_ack_frees_the_hold_once_computed(server):
    hold = Hold()
    server.register(4, "p", hold.release)
    _, writer = await raw_decoder(server.port, 4)
    await async_wait_until(lambda: decoder_in(server, 4), 5)
    writer.close()
    await async_wait_until(lambda: server.rooms[4].state == "aborted", 5,
                           what="the room aborted by its leaving decoder")
    server.ready(4, "p")  # computed after its decoder left: nobody will pull
    assert hold.released.is_set()


async def test_second_decoder_for_a_room_is_aborted(server):
    server.register(6, "p", Hold().release)
    _, w1 = await raw_decoder(server.port, 6)
    await async_wait_until(lambda: decoder_in(server, 6), 5)
    r2, w2 = await raw_decoder(server.port, 6)
    assert await asyncio.wait_for(r2.read(1), 2.0) == ABORT
    w1.close()
    w2.close()


async def test_connections_beyond_the_limit_are_refused(caplog):
    s = BootstrapServer(session_timeout=2.0, max_pending_connections=1)
    await s.start("127.0.0.1", 0)
    try:
        _, w1 = await raw_decoder(s.port, 1)
        await async_wait_until(lambda: decoder_in(s, 1), 5)
        r2, w2 = await raw_decoder(s.port, 2)
        with caplog.at_level(logging.WARNING, "vllm_vcr.pd"):
            assert await asyncio.wait_for(r2.read(1), 2.0) == ABORT
        w1.close()
        w2.close()
    finally:
        await s.close()


async def test_unreachable_bootstrap_server():
    s = BootstrapServer(session_timeout=1.0, max_pending_connections=1)
    await s.start("127.0.0.1", 0)
    port = s.port
    await s.close()
    with pytest.raises(BootstrapError, match="^bootstrap connection failed: "):
        await join_room("127.0.0.1", port, 1, timeout=1.0)


async def test_cancelled_join_leaves_the_room(server):
    hold = Hold()
    server.register(8, "p", hold.release)
    join = asyncio.ensure_future(join_room("127.0.0.1", server.port, 8, timeout=5.0))
    await async_wait_until(lambda: decoder_in(server, 8), 5)
    join.cancel()  # the decode request was aborted while waiting
    await asyncio.gather(join, return_exceptions=True)
    await async_wait_until(lambda: server.rooms[8].state == "aborted", 5, what="the room aborted by the cancelled join")
    server.ready(8, "p")  # computed after its decoder left: freed at once
    assert hold.released.is_set()


async def test_prefill_arriving_after_its_decoder_gave_up_is_refused():
    s = BootstrapServer(session_timeout=0.2, max_pending_connections=4)
    await s.start("127.0.0.1", 0)
    try:
        with pytest.raises(BootstrapError, match="aborted"):
            await join_room("127.0.0.1", s.port, 13, timeout=5.0)
        assert s.register(13, "p", Hold().release) == "bootstrap room 13 was aborted before its prefill arrived"
    finally:
        await s.close()
