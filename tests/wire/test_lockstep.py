"""The lockstep coordinator's transport (wire/lockstep.py) over a real ZMQ socket: ranks' DEALERs
meet it, a bad frame is logged and survived, a rank gone is taken out of the rounds."""

from __future__ import annotations

import asyncio

import msgspec
import zmq
import zmq.asyncio

from vllm_vcr.testing.waits import scaled
from vllm_vcr.wire.lockstep import LockstepCoordinator

enc, dec = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder().decode


def _rank(ctx: zmq.asyncio.Context, address: str, rank: int) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, str(rank).encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


async def _recv(sock: zmq.asyncio.Socket) -> list:
    return dec(await asyncio.wait_for(sock.recv(), scaled(10)))


async def test_ranks_meet_the_coordinator_and_a_bad_frame_is_survived(tmp_path, caplog):
    ctx = zmq.asyncio.Context()
    address = f"ipc://{tmp_path}/lockstep"
    coordinator = LockstepCoordinator(ctx, address)
    task = asyncio.get_running_loop().create_task(coordinator.run())
    r0, r1 = _rank(ctx, address, 0), _rank(ctx, address, 1)
    try:
        await r0.send(b"\xc1 not msgpack")
        await r1.send_multipart([b"two", b"frames"])
        await r0.send(enc(["no such kind"]))
        for sock in (r0, r1):
            await sock.send(enc(["hello"]))
        await r0.send(enc(["report", 1, 10.5, True]))
        assert await _recv(r1) == ["start"]  # a wave started: rank 1 steps too
        await r1.send(enc(["report", 1, 10.2, False]))
        assert await _recv(r0) == ["go", 1, 10.5] and await _recv(r1) == ["go", 1, 10.5]  # the slowest's end
        await r1.send(enc(["report", 2, 10.6, True]))
        await coordinator.gone(0)  # rank 0's process is gone: rank 1 goes on alone
        assert await _recv(r1) == ["go", 2, 10.6]
        await r1.send(enc(["report", 3, 10.7, False]))  # (no work left: not a round where the ranks agree)
        assert await _recv(r1) == ["go", 3, 10.7]
        assert not task.done()
        assert "bad message" in caplog.text
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for sock in (r0, r1):
            sock.close()
        coordinator.close()
        ctx.term()
