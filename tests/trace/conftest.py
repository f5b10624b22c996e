"""Shared helpers for the trace tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

try:  # the package is normally installed (pip install -e .); fall back to the source tree
    import vllm_vcr  # noqa: F401
except ModuleNotFoundError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES


# -- a tiny OpenAI-compatible streaming server (for replay-arrivals and record --http tests) -----

import asyncio
import json
import threading


from tests.conftest import free_port  # noqa: E402,F401  (the one port picker, re-exported)


class FakeOpenAI:
    """Streams `max_tokens` tokens: first after `ttft_s`, then one chunk per `itl_s` carrying
    `burst` tokens. Runs its own event loop in a thread because the CLIs under test call
    asyncio.run themselves."""

    def __init__(self, ttft_s: float = 0.02, itl_s: float = 0.004, burst: int = 1):
        self.ttft_s, self.itl_s, self.burst = ttft_s, itl_s, burst
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def _complete(self, request):
        from aiohttp import web

        body = await request.json()
        self.requests.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        chat = request.path.endswith("chat/completions")
        n_out = int(body.get("max_tokens") or 16)
        prompt = body.get("prompt") if not chat else body["messages"][-1]["content"].split()
        n_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        if body.get("max_tokens") == 0:
            return web.json_response({"error": {"message": "max_tokens must be >= 1"}}, status=400)
        if not body.get("stream"):
            await asyncio.sleep(self.ttft_s)
            return web.json_response({"id": "cmpl-1", "object": "text_completion",
                                      "choices": [{"index": 0, "text": "x" * n_out, "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                                "total_tokens": n_prompt + n_out}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(self.ttft_s)
        sent = 0
        while sent < n_out:
            k = 1 if sent == 0 else min(self.burst, n_out - sent)
            sent += k
            fin = "length" if sent >= n_out else None
            if chat:
                choice = {"index": 0, "delta": {"content": " tok" * k}, "finish_reason": fin}
            else:
                choice = {"index": 0, "text": " tok" * k, "finish_reason": fin}
            if body.get("return_token_ids"):
                choice["token_ids"] = list(range(sent - k, sent))
            await resp.write(b"data: " + json.dumps({"id": "cmpl-1", "choices": [choice]}).encode() + b"\n\n")
            if sent < n_out:
                await asyncio.sleep(self.itl_s)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
            await resp.write(b"data: " + json.dumps({"id": "cmpl-1", "choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _run(self) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def start(self) -> FakeOpenAI:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def fake_openai():
    server = FakeOpenAI().start()
    yield server
    server.stop()
