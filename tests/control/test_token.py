"""The control API's token and bind warning, on a real engine and the real control server."""

from __future__ import annotations

import logging

import httpx

from vllm_vcr.control import start_control_server
from vllm_vcr.control.server import is_loopback
from vllm_vcr.engine.async_engine import AsyncEngine

from .control_helpers import engine_args, free_port


def test_loopback_addresses():
    assert all(map(is_loopback, ["127.0.0.1", "127.9.9.9", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "example.com", ""]))


async def test_every_interface_without_a_token_is_warned_about_and_a_token_is_enforced(caplog):
    engine = AsyncEngine(engine_args())
    await engine.start()
    try:
        with caplog.at_level(logging.INFO, logger="vllm_vcr.control"):
            quiet = await start_control_server(engine, f"127.0.0.1:{free_port()}")
            await quiet.stop()
            assert "without a token" not in caplog.text
            loud = await start_control_server(engine, "0.0.0.0:0")
            await loud.stop()
            assert "without a token" in caplog.text
            caplog.clear()
            guarded = await start_control_server(engine, "0.0.0.0:0", token="t")
            assert "without a token" not in caplog.text and "token required" in caplog.text
        try:
            url = f"http://127.0.0.1:{guarded.port}/config"
            async with httpx.AsyncClient(timeout=10) as c:
                r = await c.get(url)
                assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
                assert (await c.get(url, headers={"authorization": "bearer t"})).status_code == 200
        finally:
            await guarded.stop()
    finally:
        await engine.stop(0)
