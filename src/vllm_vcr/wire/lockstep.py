"""The data-parallel lockstep across engine-core processes, over ZMQ (engine/lockstep.py decides).

`serve --data-parallel-size D` runs each rank in its own engine-core process; for an MoE model
vLLM's ranks still step together (its DP coordinator and a per-step all-reduce). Here the parent
process runs the coordinator (`LockstepCoordinator`: a ROUTER) and each rank whose model steps in
lockstep connects a DEALER (`LockstepLink`): one msgpack frame per message, [kind, *args]. A rank
of a dense model never connects, so its steps cost nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from ..engine.lockstep import HELLO, LEAVE, REPORT, LockstepRounds, RankLockstep, lockstep_applies
from ..engine.policy import LockstepRule

log = logging.getLogger("vllm_vcr.wire")
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


class LockstepCoordinator:
    """The ranks' rounds (LockstepRounds) behind a ROUTER bound on `address`."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, rule: LockstepRule = LockstepRule()) -> None:
        self.rounds = LockstepRounds(rule)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.sock.bind(address)

    async def run(self) -> None:
        sock, rounds = self.sock, self.rounds
        while True:
            frames = await sock.recv_multipart()
            try:
                if len(frames) != 2:
                    raise ValueError(f"{len(frames)} frames")
                rank = int(frames[0])
                kind, *args = _decode(frames[1])
                if kind == HELLO:
                    out = rounds.hello(rank)
                elif kind == REPORT:
                    seq, end, unfinished = args
                    out = rounds.report(rank, int(seq), float(end), bool(unfinished))
                elif kind == LEAVE:
                    out = rounds.leave(rank)
                else:
                    raise ValueError(f"unknown kind {kind!r}")
            except (ValueError, TypeError, msgspec.DecodeError) as e:
                log.warning("lockstep coordinator: bad message (%s); ignored", e)
                continue
            await self._send(out)

    async def gone(self, rank: int) -> None:
        """Rank `rank`'s process is gone (it could not say so): the others go on without it."""
        await self._send(self.rounds.leave(rank))

    async def _send(self, out: list[tuple[int, tuple]]) -> None:
        for to, msg in out:
            with contextlib.suppress(zmq.ZMQError):
                await self.sock.send_multipart([str(to).encode(), _encode(msg)])

    def close(self) -> None:
        self.sock.close(linger=0)


class LockstepLink:
    """One rank's connection to the coordinator; its RankLockstep is the core's `lockstep`."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, rank: int, core: Any, rule: LockstepRule) -> None:
        self.core = core
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, str(rank).encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(address)
        self.lockstep = RankLockstep(core, self._send, rule=rule)
        log.info("engine %d steps in lockstep with the other data-parallel ranks (an MoE model)", rank)

    @classmethod
    def attach(cls, ctx: zmq.asyncio.Context, address: str | None, rank: int, core: Any) -> LockstepLink | None:
        """A link when the model steps in lockstep (lockstep_applies) and a coordinator runs."""
        rule = lockstep_applies(core) if address else None
        if rule is None:
            return None
        return cls(ctx, address, rank, core, rule)

    def _send(self, *msg: Any) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.send(_encode(list(msg)), flags=zmq.NOBLOCK)

    async def run(self) -> None:
        """The coordinator's messages, each handed to the core's turn."""
        while True:
            try:
                frame = await self.sock.recv()
                kind, *args = _decode(frame)
            except (ValueError, TypeError, msgspec.DecodeError) as e:
                log.warning("lockstep: bad message from the coordinator (%s); ignored", e)
                continue
            fut = self.core.call(lambda core, kind=kind, args=args: self.lockstep.on_message(kind, *args))
            fut.add_done_callback(_swallow)

    def stopped(self, _task: asyncio.Task | None = None) -> None:
        """The core stopped: the other ranks go on without this one."""
        self.lockstep.leave()

    def close(self) -> None:
        self.lockstep.leave()
        self.sock.close()


def _swallow(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # (a core that is gone: the message is moot)
