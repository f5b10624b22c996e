"""The "pulled, you may release" notification between a decode and a prefill instance.

In vLLM the decode worker tells the prefill worker over NIXL that it has read a request's blocks,
and the prefill worker frees them (or frees them after VLLM_NIXL_ABORT_REQUEST_TIMEOUT). Here the
prefill instance listens on `side_channel_host:side_channel_port + engine_index` (the
`remote_host`/`remote_port` it advertised) and the decode instance sends one line per pulled
request:

    {"release": "<remote_request_id>"}\\n

Nothing is answered. A lost notification costs only memory: the prefill's `--kv-hold-timeout`
frees the blocks anyway, so an unreachable peer is logged, never fatal.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Protocol

logger = logging.getLogger("vllm_vcr.pd")

CONNECT_TIMEOUT = 2.0


class Releasable(Protocol):
    engine_index: int

    def release_kv_hold(self, request_id: str) -> None: ...


def encode_release(request_id: str) -> bytes:
    return json.dumps({"release": request_id}, separators=(",", ":")).encode() + b"\n"


class ReleaseListener:
    """Prefill side: one TCP listener per engine; a `release` line frees that engine's hold."""

    def __init__(self) -> None:
        self.servers: list[asyncio.base_events.Server] = []
        self.ports: list[int] = []
        self._conns: set[asyncio.StreamWriter] = set()

    async def start(self, cores: list[Releasable], host: str, base_port: int) -> None:
        """Bind every engine's port (port 0 = any free one, for tests); raises OSError if taken."""
        try:
            for core in cores:
                port = base_port + core.engine_index if base_port else 0
                server = await asyncio.start_server(lambda r, w, c=core: self._serve(c, r, w), host, port)
                self.servers.append(server)
                self.ports.append(server.sockets[0].getsockname()[1])
        except OSError:
            await self.close()
            raise

    async def _serve(self, core: Releasable, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        try:
            while line := await reader.readline():
                try:
                    rid = json.loads(line)["release"]
                    if not isinstance(rid, str):
                        raise TypeError("request id is not a string")
                except (ValueError, KeyError, TypeError) as e:
                    logger.warning("side channel: ignoring a malformed message %r: %s", line[:200], e)
                    continue
                core.release_kv_hold(rid)
        except (ConnectionError, asyncio.LimitOverrunError, ValueError, asyncio.CancelledError):
            pass  # a broken peer (its holds time out), or shutting down
        finally:
            self._conns.discard(writer)
            writer.close()

    async def close(self) -> None:
        for s in self.servers:
            s.close()
        for w in list(self._conns):  # EOF ends each handler (cancelling them makes asyncio log noise)
            w.close()
        for s in self.servers:
            await s.wait_closed()
        self.servers = []


class _Peer:
    """One persistent connection to a prefill instance, fed by a queue so callers never wait."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()
        self.writer: asyncio.StreamWriter | None = None
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"side-channel-{host}:{port}")

    async def _connect(self) -> asyncio.StreamWriter:
        _, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), CONNECT_TIMEOUT)
        return writer

    async def _run(self) -> None:
        while True:
            data = [await self.queue.get()]
            while not self.queue.empty():
                data.append(self.queue.get_nowait())
            payload = b"".join(data)
            # one retry on a fresh connection: a kept-alive one may have died since the last use
            for attempt in (0, 1):
                try:
                    if self.writer is None or self.writer.is_closing():
                        self.writer = await self._connect()
                    self.writer.write(payload)
                    await self.writer.drain()
                    break
                except (OSError, asyncio.TimeoutError) as e:
                    self._drop()
                    if attempt:
                        logger.warning("side channel %s:%d unreachable (%s); %d release(s) dropped, the "
                                       "prefill's hold timeout will free those blocks",
                                       self.host, self.port, e or type(e).__name__, len(data))

    def _drop(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self._drop()


class ReleaseNotifier:
    """Decode side: tells the prefill instance that advertised `remote_host:remote_port` to release."""

    def __init__(self) -> None:
        self._peers: dict[tuple[str, int], _Peer] = {}

    def notify(self, host: Any, port: Any, request_id: Any) -> bool:
        """Queue one release; never blocks or raises. False when the address is unusable."""
        if not host or not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536 \
                or not isinstance(request_id, str):
            logger.debug("side channel: no usable remote_host/remote_port/remote_request_id (%r, %r, %r)",
                         host, port, request_id)
            return False
        key = (str(host), port)
        peer = self._peers.get(key)
        if peer is None or peer.task.done():
            peer = self._peers[key] = _Peer(*key)
        peer.queue.put_nowait(encode_release(request_id))
        return True

    async def close(self) -> None:
        peers, self._peers = list(self._peers.values()), {}
        for p in peers:
            await p.close()
