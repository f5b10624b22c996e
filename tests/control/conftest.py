"""Fixtures for the control API tests.

`virtual_engine`: one real EngineCore on the virtual clock, stepped by the test (exact timings).
`control_stack`: real AsyncEngine cores on the real clock plus the real control server over HTTP.
"""

from __future__ import annotations

import httpx
import pytest

from vllm_vcr.control import start_control_server
from vllm_vcr.engine.async_engine import AsyncEngine

from .control_helpers import VirtualEngine, engine_args, free_port


@pytest.fixture
def virtual_engine():
    return VirtualEngine


@pytest.fixture
async def control_stack():
    """start(engine_count=N, **engine_args) -> (AsyncEngine, httpx.AsyncClient on the control API)."""
    started = []

    async def start(engine_count: int = 1, log_control="auto", **kw):
        engine = AsyncEngine(engine_args(**kw), engine_count=engine_count)
        await engine.start()
        server = await start_control_server(engine, f"127.0.0.1:{free_port()}", log_control=log_control)
        client = httpx.AsyncClient(base_url=server.url, timeout=10)
        started.append((engine, server, client))
        return engine, client

    yield start
    for engine, server, client in started:
        await client.aclose()
        await server.stop()
        await engine.stop(0)
