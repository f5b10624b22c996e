"""Bootstrap handoff sessions, between the engines and the bootstrap wire protocol.

The engine calls `arrived` / `prefilled` / `ended` (engine.kv_transfer.HandoffObserver, of the
manager bound to that engine: `for_engine`) for every request carrying handoff metadata in its
kv_transfer_params:

    {"bootstrap_host": str, "bootstrap_port": int, "bootstrap_room": u64, "handoff_id": str}

* prefill worker: the request registers its room with the bootstrap server; its prefill (KV held)
  ACKs the decoder; the decoder closing its connection after the pull releases the hold, and
  only then does the request finish (its final output waits for the handoff, as in Dynamo's
  mocker): with `length` and its kv_transfer_params when the decoder pulled, with an error when
  the handoff failed (no decoder within the session timeout, the decoder left first).
* decode worker: the request gets its blocks, then waits while this module joins the room; the
  ACK lets its pull start (`EngineCore.kv_ready`), and its pull's end closes the connection.

Each rank admits at most `max_num_seqs` sessions at a time (Dynamo's per-rank capacity), with the
Dynamo mocker's error text beyond that.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..engine.core import EngineCore
from ..engine.policy import HandoffOrder
from .bootstrap import BootstrapError, BootstrapServer, join_room

logger = logging.getLogger("vllm_vcr.pd")


class HandoffManager:
    def __init__(self, server: BootstrapServer | None, session_timeout: float) -> None:
        self.server = server  # prefill workers with --bootstrap-port only
        self.session_timeout = session_timeout  # seconds, already divided by time_scale
        self.active: dict[int, int] = {}  # engine index -> open sessions
        self._rooms: dict[tuple[int, str], int] = {}  # (engine, request id) -> room
        self._joins: dict[tuple[int, str], asyncio.Task] = {}  # decode: joining or pulling
        self._conns: dict[tuple[int, str], asyncio.StreamWriter] = {}  # decode: ACKed, pulling
        self._by_room: dict[tuple[int, str, int, int], str] = {}  # decode: (engine, host, port, room) -> rid
        self._rkeys: dict[tuple[int, str], tuple[int, str, int, int]] = {}  # its inverse

    def for_engine(self, core: EngineCore) -> EngineHandoffs:
        """The engine's handoff observer (`core.kv_transfer.set_handoff_observer`): this manager's
        calls, for `core`."""
        return EngineHandoffs(self, core)

    # --- HandoffObserver, per engine -------------------------------------------------------------
    def arrived(self, core: EngineCore, request_id: str, params: dict[str, Any]) -> str | None:
        try:
            return self._arrived(core, request_id, params)
        except Exception as e:  # called inside the engine step: a bug here must fail one request, not the engine
            logger.exception("request %s: handoff registration failed", request_id)
            return f"handoff registration failed: {e}"

    def _arrived(self, core: EngineCore, request_id: str, params: dict[str, Any]) -> str | None:
        idx = core.engine_index
        if self.active.get(idx, 0) >= core.config.max_num_seqs:
            return f"mocker handoff session limit reached for DP rank {idx}"
        room = params["bootstrap_room"]
        key = (idx, request_id)
        if core.args.worker_type == "prefill":
            if self.server is None:
                return "source handoff manager is not initialized"
            joined = None
            if core.scheduler.engine_policy.handoff_order is HandoffOrder.DESTINATION_FIRST:
                joined = lambda error: core.destination_joined(request_id, error)  # noqa: E731
            err = self.server.register(room, key, lambda error=None: core.release_kv_hold(request_id, error), joined)
            if err is not None:
                return err
        else:
            rkey = (idx, params["bootstrap_host"], params["bootstrap_port"], room)
            if rkey in self._by_room:
                return f"bootstrap room {room} is already in use"
            self._by_room[rkey] = request_id
            self._rkeys[key] = rkey
            self._joins[key] = asyncio.get_running_loop().create_task(
                self._join(core, request_id, rkey), name=f"handoff-join-{request_id}")
        self._rooms[key] = room
        self.active[idx] = self.active.get(idx, 0) + 1
        return None

    def prefilled(self, core: EngineCore, request_id: str, params: dict[str, Any]) -> None:
        key = (core.engine_index, request_id)
        if self.server is not None and key in self._rooms:
            self.server.ready(self._rooms[key], key)

    def ended(self, core: EngineCore, request_id: str) -> None:
        key = (core.engine_index, request_id)
        room = self._rooms.pop(key, None)
        if room is None:
            return
        self.active[key[0]] -= 1
        if core.args.worker_type == "prefill":
            if self.server is not None:
                self.server.end(room, key)
            return
        self._finish_join(key)

    # --- decode side ---------------------------------------------------------------------------
    async def _join(self, core: EngineCore, request_id: str, rkey: tuple[int, str, int, int]) -> None:
        _, host, port, room = rkey
        key = (core.engine_index, request_id)
        try:
            writer = await join_room(host, port, room, self.session_timeout)
        except BootstrapError as e:
            core.kv_ready(request_id, error=str(e))
            return
        if key not in self._rooms:  # the request ended while we waited
            writer.close()
            return
        self._conns[key] = writer
        core.kv_ready(request_id)

    def kv_pulled(self, core: EngineCore, params: dict[str, Any]) -> bool:
        """The engine finished a pull; True when it belonged to a bootstrap session."""
        if params.get("handoff_id") is None or "bootstrap_room" not in params:
            return False
        try:
            rkey = (core.engine_index, params["bootstrap_host"], params["bootstrap_port"], params["bootstrap_room"])
            rid = self._by_room.get(rkey)
        except (KeyError, TypeError):  # unhashable junk: not one of our sessions
            return False
        if rid is not None:
            self._finish_join((core.engine_index, rid))  # closing tells the prefill side to release
        return True

    def _finish_join(self, key: tuple[int, str]) -> None:
        task = self._joins.pop(key, None)
        if task is not None and not task.done():
            task.cancel()
        writer = self._conns.pop(key, None)
        if writer is not None:
            writer.close()
        rkey = self._rkeys.pop(key, None)
        if rkey is not None:
            self._by_room.pop(rkey, None)

    async def close(self) -> None:
        tasks = list(self._joins.values())
        for key in list(self._joins) + list(self._conns):
            self._finish_join(key)
        await asyncio.gather(*tasks, return_exceptions=True)


class EngineHandoffs:
    """A HandoffManager bound to one engine: the engine's HandoffObserver."""

    __slots__ = ("manager", "core")

    def __init__(self, manager: HandoffManager, core: EngineCore) -> None:
        self.manager = manager
        self.core = core

    def arrived(self, request_id: str, params: dict[str, Any]) -> str | None:
        return self.manager.arrived(self.core, request_id, params)

    def prefilled(self, request_id: str, params: dict[str, Any]) -> None:
        self.manager.prefilled(self.core, request_id, params)

    def ended(self, request_id: str) -> None:
        self.manager.ended(self.core, request_id)
