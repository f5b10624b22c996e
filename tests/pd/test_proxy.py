"""pd-proxy against fake instances: what each step sends, and what comes back."""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web

from vllm_vcr.pd.proxy import PDProxy, base_url, parse_bootstrap

PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "127.0.0.1",
          "remote_port": 5600, "remote_request_id": "r"}


async def start(app):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


@pytest.fixture
async def fakes():
    seen = {"prefill": [], "decode": []}

    async def prefill(request):
        body = await request.json()
        seen["prefill"].append((body, {k.lower(): v for k, v in request.headers.items()}))
        if body.get("model") == "bad":
            return web.json_response({"error": {"message": "nope"}}, status=404)
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})

    async def decode(request):
        body = await request.json()
        seen["decode"].append((body, {k.lower(): v for k, v in request.headers.items()}))
        resp = web.StreamResponse()
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        for part in (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"):
            await resp.write(part)
        return resp

    runners = []
    urls = []
    for handler in (prefill, decode):
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        app.router.add_post("/v1/chat/completions", handler)
        r, u = await start(app)
        runners.append(r)
        urls.append(u)
    yield seen, urls
    for r in runners:
        await r.cleanup()


async def test_two_step_flow(fakes):
    seen, (p_url, d_url) = fakes
    runner, url = await start(PDProxy([p_url + "/v1"], [d_url]).app())
    try:
        async with aiohttp.ClientSession() as s:
            body = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True,
                    "stream_options": {"include_usage": True}, "min_tokens": 3}
            async with s.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer k"}) as r:
                assert r.status == 200 and r.content_type == "text/event-stream"
                assert await r.read() == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    finally:
        await runner.cleanup()
    pre, pre_headers = seen["prefill"][0]
    assert pre["max_tokens"] == 1 and pre["stream"] is False and pre["kv_transfer_params"]["do_remote_decode"]
    assert "stream_options" not in pre and "min_tokens" not in pre
    dec, dec_headers = seen["decode"][0]
    assert dec == {**body, "kv_transfer_params": PARAMS}
    assert pre_headers["authorization"] == dec_headers["authorization"] == "Bearer k"
    assert pre_headers["x-request-id"] == dec_headers["x-request-id"]


async def test_prefill_error_is_the_answer(fakes):
    seen, (p_url, d_url) = fakes
    runner, url = await start(PDProxy([p_url], [d_url]).app())
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/chat/completions", json={"model": "bad", "messages": []}) as r:
                assert r.status == 404 and (await r.json())["error"]["message"] == "nope"
    finally:
        await runner.cleanup()
    assert seen["decode"] == []


async def test_bootstrap_flow_sends_the_same_room_to_both(fakes):
    seen, (p_url, d_url) = fakes
    runner, url = await start(PDProxy([p_url], [d_url], bootstrap=[("127.0.0.1", 7000)]).app())
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 9}) as r:
                assert r.status == 200
                await r.read()
    finally:
        await runner.cleanup()
    pre = seen["prefill"][0][0]["kv_transfer_params"]
    dec = seen["decode"][0][0]
    assert pre == dec["kv_transfer_params"] and dec["max_tokens"] == 9
    assert pre["bootstrap_host"] == "127.0.0.1" and pre["bootstrap_port"] == 7000
    assert 0 <= pre["bootstrap_room"] < 2**64 and pre["handoff_id"]


async def test_bad_body_and_unreachable_prefill():
    runner, url = await start(PDProxy(["http://127.0.0.1:9"], ["http://127.0.0.1:9"]).app())
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", data=b"{not json") as r:
                assert r.status == 400
            async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 502 and "unreachable" in json.loads(await r.read())["error"]["message"]
    finally:
        await runner.cleanup()


def test_helpers():
    assert base_url("http://h:1/v1/") == "http://h:1" and base_url("http://h:1") == "http://h:1"
    assert parse_bootstrap("10.0.0.1:8998") == ("10.0.0.1", 8998)
    with pytest.raises(ValueError):
        parse_bootstrap("nope")
    with pytest.raises(ValueError):
        PDProxy(["a", "b"], ["c"], bootstrap=[("h", 1)])
