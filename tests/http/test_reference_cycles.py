"""A finished request leaves nothing for the garbage collector: its objects are freed by reference
counting as it ends. A cycle per request (uvicorn's cycle <-> the scope holding its `send`) made
every young collection of a busy server walk thousands of live objects, stalling the loop tens of
milliseconds (gc_tuning.py)."""

from __future__ import annotations

import asyncio
import gc
import weakref

import httpx
import pytest

from vllm_vcr.serve import app as app_module

MODEL = "vllm-vcr/sim"


@pytest.mark.parametrize("stream", [True, False])
async def test_a_finished_request_is_freed_without_the_garbage_collector(inprocess, monkeypatch, stream):
    cycles: list[weakref.ref] = []
    real_http = app_module.OpenAIApp._http

    async def _http(self, scope, receive, send):
        cycles.append(weakref.ref(send.__self__))  # uvicorn's RequestResponseCycle
        await real_http(self, scope, receive, send)

    monkeypatch.setattr(app_module.OpenAIApp, "_http", _http)
    url, _ = await inprocess(itl_ms=0.5)
    gc.collect()
    gc.disable()
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            for i in range(3):
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 20,
                        "stream": stream, "stream_options": {"include_usage": True} if stream else None}
                r = await c.post(url + "/v1/chat/completions", json=body)
                assert r.status_code == 200
        for _ in range(50):  # the server's side of the closed connections winds down
            if len(cycles) == 3 and all(ref() is None for ref in cycles):
                break
            await asyncio.sleep(0.02)
        assert len(cycles) == 3
        assert [ref() is None for ref in cycles] == [True] * 3
    finally:
        gc.enable()
