"""Reading a ZMQ socket from the event loop, every message waiting at once, without a future each.

A zmq.asyncio receive costs a future and a change of the loop's reader per message; an engine
core sends one output batch per step, and at a thousand streams with per-request deadlines that is
thousands of messages a second on each side. `FrameReader` puts one reader on the socket's FD and
reads with NOBLOCK until EAGAIN. ZMQ's FD signals that something arrived, not what is waiting, so
a read never stops early unless it comes back: after `DRAIN_MAX` messages (other callbacks get
their turn) it reads on in the loop's next turn while ZMQ says more is waiting.

A handler that raises is logged and reading goes on; a socket error stops the reader and goes to
`on_error` (which may `start` it again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger("vllm_vcr.wire")

DRAIN_MAX = 64  # messages read in one turn of the event loop before other callbacks run


class FrameReader:
    def __init__(self, sock: zmq.Socket, on_frames: Callable[[list[Any]], None],
                 on_error: Callable[[zmq.ZMQError], None], *, what: str, copy: bool = True) -> None:
        self.sock = sock  # a plain (synchronous) socket
        self.on_frames = on_frames  # a message's frames (zmq.Frame objects when `copy` is False)
        self.on_error = on_error
        self.what = what  # for the log: whose socket
        self.copy = copy
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd: int | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is not None or self.sock.closed:
            return
        self._loop = loop
        self._fd = self.sock.getsockopt(zmq.FD)
        loop.add_reader(self._fd, self._drain)
        loop.call_soon(self._drain)  # (what arrived before the reader: the FD signalled it already)

    def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None and self._fd is not None:
            with contextlib.suppress(Exception):  # (the loop may be closing)
                loop.remove_reader(self._fd)

    def _drain(self) -> None:
        sock = self.sock
        if self._loop is None or sock.closed:
            return
        recv, copy, on_frames = sock.recv_multipart, self.copy, self.on_frames
        for _ in range(DRAIN_MAX):
            try:
                frames = recv(zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                self.stop()
                self.on_error(e)
                return
            try:
                on_frames(frames)
            except Exception:
                log.exception("%s: a %d-frame message failed; reading goes on", self.what, len(frames))
            if self._loop is None or sock.closed:  # (the handler stopped it)
                return
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._loop.call_soon(self._drain)
