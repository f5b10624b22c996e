"""Accept every pending connection in one turn of the event loop.

uvloop's servers accept one connection per turn of the loop. A `serve` loop that is streaming to
a thousand clients takes milliseconds per turn, so a burst of new connections (a load generator
opening 1000 at once) waited seconds in the listen backlog before their first byte was read: a
TTFT tail that no engine setting explains. Here a reader on the listening socket drains the
backlog (up to `batch` per turn) and hands each connection to uvicorn's protocol.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

logger = logging.getLogger("vllm_vcr.http")


class BurstAcceptor:
    """Stands in for the asyncio Server uvicorn would create on `sock` (it only needs `close()`)."""

    def __init__(self, sock: socket.socket, protocol_factory: Callable[[], asyncio.Protocol],
                 batch: int = 512) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = sock
        self._factory = protocol_factory
        self._batch = batch
        self._closed = False
        self._tasks: set[asyncio.Task] = set()
        sock.setblocking(False)
        self._loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        tcp = self._sock.family in (socket.AF_INET, socket.AF_INET6)
        for _ in range(self._batch):  # bounded: one turn of accepting cannot starve the streams
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. out of file descriptors: keep serving, retry next turn
                logger.warning("accept failed: %s", e)
                return
            conn.setblocking(False)
            if tcp:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = self._loop.create_task(self._loop.connect_accepted_socket(self._factory, conn))
            self._tasks.add(task)
            task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("could not set up an accepted connection: %s", task.exception())

    def close(self) -> None:
        """Stop accepting (uvicorn's shutdown calls this); the socket itself stays the caller's."""
        if not self._closed:
            self._closed = True
            self._loop.remove_reader(self._sock.fileno())

    async def wait_closed(self) -> None:
        return None
