"""Dynamo-style bootstrap handoff: the rendezvous between a prefill and a decode worker.

Wire protocol (TCP, Dynamo mocker's simple version):

* decode -> prefill: the room id, 8 bytes, little-endian unsigned 64-bit;
* prefill -> decode: one byte, 0x01 ACK (the prefill is complete, its KV may be pulled) or
  0x02 ABORT (the prefill failed, was cancelled, or nobody came in time).

Either side may arrive first: the prefill request registers its room when it reaches the engine,
the decode connection may already be waiting in it, or come later. The decode connection itself
says "I have reserved blocks for this" (NIXL-like backpressure). One addition to Dynamo's
protocol keeps the prefill's blocks until they are really pulled: the decode side keeps the
connection open during its pull and closes it when done, and that close is what releases the
prefill's KV hold (a decode worker that dies mid-pull closes it too, and the KV is useless then).

Every wait is bounded by the handoff session timeout; rooms that were aborted are remembered for
as long again, so a late decoder gets ABORT instead of waiting for nothing.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from typing import Callable

logger = logging.getLogger("vllm_vcr.pd")

ROOM = struct.Struct("<Q")
ACK = b"\x01"
ABORT = b"\x02"

PENDING, READY, ABORTED = "pending", "ready", "aborted"


class BootstrapError(Exception):
    """A decode-side handoff failed; the message is what the request fails with."""


class Room:
    __slots__ = ("room_id", "state", "owner", "release", "decided", "decoder", "expiry", "joined", "abort_reason")

    def __init__(self, room_id: int) -> None:
        self.room_id = room_id
        self.state = PENDING
        self.owner: object = None  # the prefill request that registered it; None until it arrives
        # frees the prefill's KV hold: release() once its decoder has pulled it (the handoff is
        # complete), release(error) when the handoff failed after the prefill was done
        self.release: Callable[..., None] | None = None
        self.abort_reason = ""  # why the room was aborted, what a done prefill is told
        self.decided = asyncio.get_running_loop().create_future()  # READY or ABORTED
        self.decoder = False  # a decode connection is attached
        self.expiry: asyncio.TimerHandle | None = None
        # destination-first (SGLang): tells the waiting prefill its decoder joined (None) or the handoff failed
        self.joined: Callable[[str | None], None] | None = None

    def tell_joined(self, error: str | None = None) -> None:
        fn, self.joined = self.joined, None
        if fn is not None:
            fn(error)


class BootstrapServer:
    """Prefill side: rooms registered by prefill requests, joined by decode connections."""

    def __init__(self, session_timeout: float, max_pending_connections: int) -> None:
        self.session_timeout = session_timeout  # seconds, already divided by time_scale
        self.max_pending = max_pending_connections
        self.rooms: dict[int, Room] = {}
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self._conns: set[asyncio.StreamWriter] = set()

    async def start(self, host: str, port: int) -> None:
        self.server = await asyncio.start_server(self._serve, host, port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for room in self.rooms.values():  # decoders still waiting are told ABORT, then closed
            if not room.decided.done():
                room.decided.set_result(ABORTED)
        for w in list(self._conns):
            w.close()
        if self.server is not None:
            await self.server.wait_closed()
            self.server = None
        for room in self.rooms.values():
            if room.expiry is not None:
                room.expiry.cancel()
        self.rooms.clear()

    # --- the engine's side (called from the engine loop through the handoff manager) ----------
    def register(self, room_id: int, owner: object, release: Callable[..., None],
                 joined: Callable[[str | None], None] | None = None) -> str | None:
        """A prefill request with this room arrived; `release()` frees its hold once pulled,
        `release(error)` once the handoff failed.
        Destination first, `joined(None)` lets it start once its decoder is in the room
        (`joined(error)`: the handoff failed before that)."""
        room = self.rooms.get(room_id)
        if room is not None and room.owner is not None:
            return f"bootstrap room {room_id} is already in use"
        if room is not None and room.state == ABORTED:  # its decoder gave up or left: nobody would pull
            return f"bootstrap room {room_id} was aborted before its prefill arrived"
        if room is None:
            room = self.rooms[room_id] = Room(room_id)
            self._expire_later(room)  # a prefill nobody joins is given up with its session
        room.owner, room.release, room.joined = owner, release, joined
        if room.decoder:
            room.tell_joined()
        return None

    def ready(self, room_id: int, owner: object) -> None:
        """The prefill is complete and its KV held: ACK the decoder (now or when it comes)."""
        room = self.rooms.get(room_id)
        if room is None or room.owner != owner:
            return
        if room.state != PENDING:  # aborted meanwhile: nobody will pull, free the hold at once
            self._release(room, room.abort_reason)
            return
        room.state = READY
        room.decided.set_result(READY)

    def end(self, room_id: int, owner: object) -> None:
        """The prefill request or its hold is gone: a decoder not yet pulling gets ABORT."""
        room = self.rooms.get(room_id)
        if room is None or room.owner != owner:
            return
        room.release = None
        if room.state == PENDING or (room.state == READY and not room.decoder):
            self._abort(room, f"the prefill request of bootstrap room {room_id} ended")

    # --- rooms ---------------------------------------------------------------------------------
    def _release(self, room: Room, error: str | None = None) -> None:
        fn, room.release = room.release, None
        if fn is not None:
            fn() if error is None else fn(error)

    def _abort(self, room: Room, reason: str) -> None:
        room.tell_joined(f"bootstrap room {room.room_id} was aborted before its decoder joined")
        room.abort_reason = reason
        room.state = ABORTED
        if not room.decided.done():
            room.decided.set_result(ABORTED)
        self._expire_later(room)  # remembered, so a late decoder is told ABORT

    def _expire_later(self, room: Room) -> None:
        if room.expiry is not None:
            room.expiry.cancel()
        room.expiry = asyncio.get_running_loop().call_later(self.session_timeout, self._expire, room)

    def _expire(self, room: Room) -> None:
        room.expiry = None
        if self.rooms.get(room.room_id) is not room:
            return
        if room.state == ABORTED:
            del self.rooms[room.room_id]
            return
        if room.decoder:
            return  # its connection handler owns the room's end
        logger.warning("bootstrap room %d: no decoder within the handoff session timeout", room.room_id)
        reason = (f"handoff session timed out after {self.session_timeout * 1000:.0f} ms waiting for the "
                  f"decode worker (bootstrap room {room.room_id})")
        if room.state == READY:
            self._release(room, reason)
        self._abort(room, reason)

    def _forget(self, room: Room) -> None:
        if self.rooms.get(room.room_id) is room:
            del self.rooms[room.room_id]
        if room.expiry is not None:
            room.expiry.cancel()
            room.expiry = None

    # --- a decode connection -------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        room: Room | None = None
        try:
            if len(self._conns) > self.max_pending:
                logger.warning("bootstrap: %d connections exceed the limit of %d; refusing one",
                               len(self._conns), self.max_pending)
                writer.write(ABORT)
                return
            try:
                room_id = ROOM.unpack(await asyncio.wait_for(reader.readexactly(ROOM.size), self.session_timeout))[0]
            except (asyncio.TimeoutError, asyncio.IncompleteReadError):
                return
            room = self.rooms.get(room_id)
            if room is None:  # the decoder came first
                room = self.rooms[room_id] = Room(room_id)
            elif room.decoder:
                logger.warning("bootstrap room %d: a second decoder connected; aborting it", room_id)
                writer.write(ABORT)
                room = None
                return
            if room.expiry is not None and room.state != ABORTED:
                room.expiry.cancel()
                room.expiry = None
            if room.state == ABORTED:
                writer.write(ABORT)
                room = None
                return
            room.decoder = True
            room.tell_joined()
            await self._attend(room, reader, writer)
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            self._conns.discard(writer)
            if room is not None and self.rooms.get(room.room_id) is room:
                room.decoder = False
                if room.state == READY:  # pulled (or the decoder died mid-pull): free the hold
                    self._release(room)
                    self._forget(room)
                elif room.state == PENDING:  # the decoder left first: nobody will pull
                    self._abort(room, f"the decode worker left bootstrap room {room.room_id} before the "
                                      "prefill was complete")
            writer.close()

    async def _attend(self, room: Room, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        eof = asyncio.ensure_future(reader.read(1))
        try:
            done, _ = await asyncio.wait({room.decided, eof}, timeout=self.session_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            if eof in done:
                return  # the decoder left before the prefill was done
            if not done:
                logger.warning("bootstrap room %d: the prefill did not finish within the handoff session timeout",
                               room.room_id)
                self._abort(room, f"handoff session timed out after {self.session_timeout * 1000:.0f} ms "
                                  f"before the prefill was complete (bootstrap room {room.room_id})")
            if room.state != READY:
                writer.write(ABORT)
                await writer.drain()
                return
            writer.write(ACK)
            await writer.drain()
            # the decoder pulls now and closes when done; bounded, so a stuck one cannot pin the hold
            await asyncio.wait({eof}, timeout=self.session_timeout)
        finally:
            eof.cancel()


async def join_room(host: str, port: int, room_id: int, timeout: float) -> asyncio.StreamWriter:
    """Decode side: connect, name the room, wait for ACK. Returns the open connection, which the
    caller closes after its pull; raises BootstrapError with the request's error text."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError) as e:
        raise BootstrapError(f"bootstrap connection failed: {e or type(e).__name__}") from None
    try:
        writer.write(ROOM.pack(room_id))
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(1), timeout)
    except asyncio.TimeoutError:
        writer.close()
        raise BootstrapError(f"handoff session timed out after {timeout * 1000:.0f} ms waiting for the "
                             f"prefill worker (bootstrap room {room_id})") from None
    except OSError as e:
        writer.close()
        raise BootstrapError(f"bootstrap connection failed: {e}") from None
    except BaseException:  # cancelled (the request went away): leaving the room frees the prefill's KV
        writer.close()
        raise
    if reply == ACK:
        return writer
    writer.close()
    if reply == ABORT:
        raise BootstrapError(f"prefill worker aborted bootstrap room {room_id}")
    raise BootstrapError("source handoff session ended without completion")
