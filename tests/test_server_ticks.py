"""server_ticks.EventServer: uvicorn servers that sleep until `should_exit` instead of polling,
their Date headers refreshed by one tick per event loop."""

from __future__ import annotations

import asyncio
import socket
import time
from email.utils import parsedate_to_datetime

import httpx
import uvicorn

from tests.conftest import scaled
from vllm_vcr import server_ticks
from vllm_vcr.server_ticks import EventServer, ticking_servers


async def _app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


def test_servers_share_one_tick_refresh_their_date_and_stop_when_told(monkeypatch):
    monkeypatch.setattr(server_ticks, "TICK_S", 0.05)

    async def main() -> None:
        socks = [_listening() for _ in range(3)]
        servers = [EventServer(uvicorn.Config(_app, lifespan="off", log_config=None, headers=[("x-who", str(i))]))
                   for i in range(3)]
        tasks = [asyncio.create_task(s.serve(sockets=[sock])) for s, sock in zip(servers, socks)]
        async with httpx.AsyncClient() as client:
            while not all(s.started for s in servers):
                await asyncio.sleep(0.01)
            assert ticking_servers() == 3
            first = await client.get(f"http://127.0.0.1:{socks[1].getsockname()[1]}/")
            assert first.headers["x-who"] == "1"
            monkeypatch.setattr(server_ticks, "clock", lambda: time.time() + 3600)  # an hour later
            await asyncio.sleep(0.2)
            later = await client.get(f"http://127.0.0.1:{socks[2].getsockname()[1]}/")
        assert later.headers["x-who"] == "2"
        assert (parsedate_to_datetime(later.headers["date"]).timestamp()
                - parsedate_to_datetime(first.headers["date"]).timestamp()) >= 3600 - 1
        servers[0].should_exit = True
        await asyncio.wait_for(tasks[0], scaled(5))
        assert ticking_servers() == 2 and not tasks[1].done()
        for s in servers[1:]:
            s.should_exit = True
        await asyncio.wait_for(asyncio.gather(*tasks[1:]), scaled(5))
        assert ticking_servers() == 0
        for sock in socks:
            sock.close()

    asyncio.run(main())
