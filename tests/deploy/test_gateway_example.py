"""A gateway test written the way a user of vllm-vcr writes one (docs/testing.md shows it): the
gateway under test is a small retrying round-robin proxy; the engines behind it are vllm-vcr
servers from the `vllm_vcr_server` fixture and `MockServer`; the client is the openai SDK.
Nothing here uses this repository's own test helpers."""

from __future__ import annotations

import itertools

import pytest
import pytest_asyncio
from aiohttp import ClientSession, web
from openai import AsyncOpenAI

from vllm_vcr import MockServer

SESSION = web.AppKey("session", ClientSession)


def retrying_gateway(backends: list[str]) -> web.Application:
    """The code under test: round-robin over backends, retry a 5xx on the next one."""
    turn = itertools.count()

    async def forward(request: web.Request) -> web.Response:
        body, first = await request.read(), next(turn)
        for attempt in range(len(backends)):
            backend = backends[(first + attempt) % len(backends)]
            async with request.app[SESSION].post(backend + request.path, data=body,
                                                 headers={"content-type": "application/json"}) as resp:
                if resp.status >= 500 and attempt < len(backends) - 1:
                    continue
                return web.Response(status=resp.status, body=await resp.read(), content_type="application/json")
        raise AssertionError("unreachable")

    async def session(app: web.Application):
        app[SESSION] = ClientSession()
        yield
        await app[SESSION].close()

    app = web.Application()
    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/chat/completions", forward)
    return app


@pytest_asyncio.fixture
async def gateway_url(unused_tcp_port, vllm_vcr_server):
    async with MockServer(failure_injection_rate=1.0, failure_types=["error"]) as broken:
        runner = web.AppRunner(retrying_gateway([broken.url, vllm_vcr_server.url]))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", unused_tcp_port).start()
        yield f"http://127.0.0.1:{unused_tcp_port}", broken
        await runner.cleanup()


@pytest.mark.asyncio
@pytest.mark.vllm_vcr(inter_token_latency=1, max_num_seqs=8)
async def test_gateway_retries_engine_errors_exactly_once(gateway_url, vllm_vcr_server):
    url, broken = gateway_url
    async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
        for _ in range(6):
            answer = await client.chat.completions.create(
                model="vllm-vcr/sim", max_tokens=8, messages=[{"role": "user", "content": "hello"}])
            assert answer.choices[0].finish_reason == "length"
    # every request reached the healthy engine once; half of them failed on the broken one first
    assert vllm_vcr_server.stats()["requests_completed"] == 6
    assert vllm_vcr_server.stats()["requests_received"] == 6
    assert broken.stats()["requests_failed"] == 3
