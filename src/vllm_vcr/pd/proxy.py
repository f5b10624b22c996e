"""`vllm-vcr pd-proxy`: a small router doing the two-step P/D flow in front of two instances.

vLLM NixlConnector flow (default), as vLLM's toy proxy and llm-d's routing sidecar drive it:

1. send the request to a prefill instance with `max_tokens: 1`, `stream: false` and
   `kv_transfer_params: {"do_remote_decode": true, ...}`;
2. send the original request to a decode instance with the `kv_transfer_params` the prefill
   answered (remote_engine_id, remote_block_ids, remote_host, remote_port, ...) and stream its
   answer back unchanged.

Dynamo bootstrap flow (`--bootstrap HOST:PORT` per prefill instance): both requests carry the same
`kv_transfer_params: {"bootstrap_host", "bootstrap_port", "bootstrap_room", "handoff_id"}` and go
out at once; the decode instance waits in the room for the prefill's ACK.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
import uuid
from typing import Any

import aiohttp
from aiohttp import web

logger = logging.getLogger("vllm_vcr.pd.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
# what a prefill request must not carry (the prefill answers one token, in one piece)
_PREFILL_DROP = ("stream_options", "min_tokens", "min_completion_tokens")


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def prefill_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    pre = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    pre["kv_transfer_params"] = kv_transfer_params
    pre["stream"] = False
    pre["max_tokens"] = 1
    if "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    return pre


def nixl_prefill_params() -> dict[str, Any]:
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


class PDProxy:
    def __init__(self, prefill: list[str], decode: list[str],
                 bootstrap: list[tuple[str, int]] | None = None) -> None:
        if not prefill or not decode:
            raise ValueError("pd-proxy needs at least one --prefill and one --decode URL")
        if bootstrap and len(bootstrap) != len(prefill):
            raise ValueError("give one --bootstrap HOST:PORT per --prefill URL")
        self.prefill = [base_url(u) for u in prefill]
        self.decode = [base_url(u) for u in decode]
        self.bootstrap = bootstrap
        self._p = itertools.cycle(range(len(self.prefill)))
        self._d = itertools.cycle(range(len(self.decode)))
        self.session: aiohttp.ClientSession | None = None
        self._warned = False
        self._background: set[asyncio.Task] = set()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        for path in ROUTES:
            app.router.add_post(path, self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                             connector=aiohttp.TCPConnector(limit=0))

    async def _close(self, app: web.Application) -> None:
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "prefill": self.prefill, "decode": self.decode})

    async def models(self, request: web.Request) -> web.Response:
        async with self.session.get(self.decode[0] + "/v1/models", headers=_forward_headers(request)) as r:
            return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        headers = _forward_headers(request)
        headers.setdefault("X-Request-Id", str(uuid.uuid4()))
        pi, di = next(self._p), next(self._d)
        path = request.path
        if self.bootstrap:
            return await self._bootstrap_flow(request, path, body, headers, pi, di)
        return await self._nixl_flow(request, path, body, headers, pi, di)

    async def _nixl_flow(self, request: web.Request, path: str, body: dict[str, Any], headers: dict[str, str],
                         pi: int, di: int) -> web.StreamResponse:
        try:
            async with self.session.post(self.prefill[pi] + path, json=prefill_body(body, nixl_prefill_params()),
                                         headers=headers) as r:
                data = await r.read()
                if r.status != 200:  # the prefill's own error is the answer
                    return web.Response(status=r.status, body=data, content_type=r.content_type)
        except aiohttp.ClientError as e:
            return _error(502, f"prefill instance {self.prefill[pi]} unreachable: {e}")
        try:
            params = json.loads(data).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        decode = dict(body)
        if params:
            decode["kv_transfer_params"] = params
        elif not self._warned:
            self._warned = True
            logger.warning("prefill %s returned no kv_transfer_params: decode instances compute prompts themselves",
                           self.prefill[pi])
        return await self._stream(request, self.decode[di] + path, decode, headers)

    async def _bootstrap_flow(self, request: web.Request, path: str, body: dict[str, Any], headers: dict[str, str],
                              pi: int, di: int) -> web.StreamResponse:
        host, port = self.bootstrap[pi]
        meta = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": secrets.randbits(64),
                "handoff_id": headers["X-Request-Id"]}
        task = asyncio.ensure_future(self._prefill_only(self.prefill[pi] + path, prefill_body(body, dict(meta)),
                                                        headers))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return await self._stream(request, self.decode[di] + path, {**body, "kv_transfer_params": meta}, headers)

    async def _prefill_only(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        try:
            async with self.session.post(url, json=body, headers=headers) as r:
                data = await r.read()
                if r.status != 200:  # the decoder is told ABORT through the bootstrap room
                    logger.warning("prefill %s answered %d: %s", url, r.status, data[:300])
        except aiohttp.ClientError as e:
            logger.warning("prefill %s unreachable: %s", url, e)

    async def _stream(self, request: web.Request, url: str, body: dict[str, Any],
                      headers: dict[str, str]) -> web.StreamResponse:
        try:
            async with self.session.post(url, json=body, headers=headers) as r:
                resp = web.StreamResponse(status=r.status)
                resp.content_type = r.content_type
                await resp.prepare(request)
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except aiohttp.ClientError as e:
            return _error(502, f"decode instance {url} failed: {e}")


def _forward_headers(request: web.Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "x-request-id")}


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "BadGatewayError" if status == 502
                                        else "BadRequestError", "param": None, "code": status}}, status=status)


def parse_bootstrap(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--bootstrap must be HOST:PORT, got {value!r}")
    return host, int(port)
