"""BurstAcceptor drains the listen backlog in one turn of the loop (uvloop's server takes one
connection per turn, which left a burst of 1000 new clients waiting seconds behind busy turns)."""

from __future__ import annotations

import asyncio
import socket

import pytest

uvloop = pytest.importorskip("uvloop")

from vllm_vcr.http.acceptor import BurstAcceptor  # noqa: E402

N = 300


class _Echo(asyncio.Protocol):
    made = 0

    def connection_made(self, transport):  # noqa: ANN001
        type(self).made += 1
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data.upper())


async def _turns_to_accept(use_acceptor: bool) -> tuple[int, bytes]:
    """Loop turns until N connections waiting in the backlog have their protocols."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    listener.setblocking(False)
    clients = [socket.create_connection(listener.getsockname()) for _ in range(N)]
    _Echo.made = 0
    loop = asyncio.get_running_loop()
    if use_acceptor:
        server = BurstAcceptor(listener, _Echo)
    else:
        server = await loop.create_server(_Echo, sock=listener)
    turns = 0
    while _Echo.made < N and turns < 10 * N:
        await asyncio.sleep(0)
        turns += 1
    clients[0].sendall(b"ping")
    reply = await loop.run_in_executor(None, clients[0].recv, 16)
    server.close()
    if use_acceptor:  # stopped: a new connection stays in the backlog
        late = socket.create_connection(listener.getsockname())
        for _ in range(5):
            await asyncio.sleep(0)
        assert _Echo.made == N
        clients.append(late)
    for c in clients:
        c.close()
    listener.close()
    return turns, reply


def test_a_backlog_of_connections_is_taken_in_a_few_turns_not_one_per_turn():
    turns, reply = uvloop.run(_turns_to_accept(use_acceptor=True))
    assert turns <= 5 and reply == b"PING"
    plain, _ = uvloop.run(_turns_to_accept(use_acceptor=False))
    assert plain >= N // 2  # what it replaces: about one accept per turn
