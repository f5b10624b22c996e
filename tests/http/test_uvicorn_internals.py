"""The installed uvicorn has what http/uvicorn_internals.py uses of it: a real uvicorn.Server with
httptools serves a streamed response, and inside it the protocol, the request cycle, its flow
control and the server carry every attribute the module reads; `DirectBody` attaches and writes
the bytes uvicorn's own `send` writes. This fails on a uvicorn whose internals moved, which is why
pyproject.toml bounds uvicorn to the versions it passed with."""

from __future__ import annotations

import asyncio
import socket

import pytest
import uvicorn

from vllm_vcr.http import uvicorn_internals as ui


def test_the_classes_define_what_the_module_calls():
    assert ui.check() == []


async def test_a_real_server_has_every_attribute_the_module_reads():
    seen: dict[str, object] = {}

    async def app(scope, receive, send):  # noqa: ANN001
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        cycle = send.__self__
        protocol = cycle.transport.get_protocol()
        seen["cycle"] = [n for n in ui.CYCLE_NEEDS if not hasattr(cycle, n)]
        seen["flow"] = [n for n in ui.FLOW_NEEDS if not hasattr(cycle.flow, n)]
        seen["protocol"] = [n for n in ui.PROTOCOL_NEEDS if not hasattr(protocol, n)]
        seen["reports"] = protocol.reports_write_side
        direct = ui.DirectBody.attach(send)
        seen["attached"] = direct is not None
        if direct is not None:
            seen["blocked"] = direct.blocked()
            seen["reports_write_side"] = direct.reports_write_side()
            seen["wrote"] = direct.write(b"data: 2\n\n")
        await send({"type": "http.response.body", "body": b"data: 3\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    from vllm_vcr.http.acceptor import BurstAcceptor

    class Server(uvicorn.Server):  # as serve's: uvicorn starts, connections come from a BurstAcceptor
        async def startup(self, sockets=None):  # noqa: ANN001
            await super().startup(sockets=[])
            seen["server"] = [n for n in ui.SERVER_NEEDS if not hasattr(self, n)]
            self.servers = [BurstAcceptor(sock, ui.protocol_factory(self)) for sock in sockets or ()]

    config = uvicorn.Config(app, lifespan="off", log_config=None, http="httptools", access_log=False)
    server = Server(config)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    task = asyncio.ensure_future(server.serve(sockets=[listener]))
    try:
        while not server.started:
            assert not task.done(), task.exception()
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection(*listener.getsockname())
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        raw = await asyncio.wait_for(_read_until(reader, b"0\r\n\r\n"), 60)
        writer.close()
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 60)
        listener.close()
    assert seen["server"] == [] and seen["cycle"] == [] and seen["flow"] == [] and seen["protocol"] == []
    assert seen["reports"] is True and seen["attached"] and seen["blocked"] is False
    assert seen["reports_write_side"] is True and seen["wrote"] is True
    # the direct write sits between uvicorn's own chunks, framed as uvicorn frames them
    body = raw.split(b"\r\n\r\n", 1)[1]
    assert body == b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n9\r\ndata: 3\n\n\r\n0\r\n\r\n"


async def _read_until(reader: asyncio.StreamReader, end: bytes) -> bytes:
    data = b""
    while not data.endswith(end):
        chunk = await reader.read(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_pyproject_bounds_uvicorn_to_the_versions_checked_here():
    from importlib.metadata import requires, version

    spec = next(r for r in requires("vllm-vcr") if r.startswith("uvicorn"))
    assert "<" in spec, f"uvicorn is not bounded above: {spec}"
    from packaging.specifiers import SpecifierSet

    if version("uvicorn") not in SpecifierSet(spec.split(";")[0].removeprefix("uvicorn")):
        pytest.fail(f"the installed uvicorn {version('uvicorn')} is outside {spec}")
