"""The control API of a server whose engines run in other processes (`serve --api-server-count N`):
one address, every call fanned out to each engine-core process's own control API, in rank order.

The answers are the ones a single process with N engines gives (control/server.py): GET /config
is the first engine's config; GET /stats, GET /stats/kv and POST /stats/reset are the sums over
the engines; every other call goes to all engines in order and answers the first engine's reply,
or the first failure (the engines before it have applied the call: the message says which).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .server import BearerToken, BodyLimit, ControlServer, _error, _json, serve_control_app

logger = logging.getLogger("vllm_vcr.control")
logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per forwarded call

SUMMED = {("GET", "/stats"), ("GET", "/stats/kv"), ("POST", "/stats/reset")}
FIRST_ONLY = {("GET", "/config"), ("GET", "/stats/loop")}
FORWARDED_HEADERS = ("authorization", "content-type", "origin", "sec-fetch-site", "sec-fetch-mode")
CALL_TIMEOUT = 30.0


def _sum(replies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Field by field: numbers added up, anything else as the first engine has it."""
    out: dict[str, Any] = {}
    for reply in replies:
        for k, v in reply.items():
            if k in out and isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(out[k], (int, float)):
                out[k] += v
            else:
                out.setdefault(k, v)
    return out


def build_fanout_app(backends: Sequence[str], token: str | None = None) -> Starlette:
    """`backends`: the engine-core processes' control API base URLs, in rank order."""
    client = httpx.AsyncClient(timeout=CALL_TIMEOUT)

    async def forward(request: Request) -> Response:
        method, path = request.method, request.url.path
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        targets = backends[:1] if (method, path) in FIRST_ONLY else backends
        replies: list[httpx.Response] = []
        for i, base in enumerate(targets):
            try:
                reply = await client.request(method, base + path, content=body, headers=headers,
                                             params=request.query_params)
            except httpx.HTTPError as e:
                done = f"engines 0-{i - 1} have it" if i else "no engine has it"
                return _error(500, f"engine {i} is gone: {type(e).__name__} ({done})")
            if reply.status_code >= 400:
                if i == 0:
                    return Response(reply.content, reply.status_code, media_type="application/json",
                                    headers={k: v for k, v in reply.headers.items() if k.lower() == "allow"})
                try:
                    message = reply.json().get("error", reply.text)
                except ValueError:
                    message = reply.text
                return _error(reply.status_code, f"engine {i}: {message} (engines 0-{i - 1} have it; the "
                                                 "engines' configs may differ)")
            replies.append(reply)
        if (method, path) in SUMMED:
            return _json(_sum([r.json() for r in replies]))
        first = replies[0]
        return Response(first.content, first.status_code, media_type=first.headers.get("content-type"))

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]
    app = Starlette(
        routes=[Route("/{path:path}", forward, methods=methods)],
        middleware=[*([Middleware(BearerToken, token=token)] if token else []), Middleware(BodyLimit)],
    )
    app.state.loop_watch = None  # (ControlServer.stop reads it)
    app.state.client = client  # closed by the owner, after the server stops
    app.router.redirect_slashes = False
    return app


async def start_control_fanout(address: str, backends: Sequence[str], token: str | None = None) -> ControlServer:
    """Serve the fanned-out control API on `address` (HOST:PORT) in the running event loop."""
    token = token or None
    app = build_fanout_app(list(backends), token)
    try:
        return await serve_control_app(app, address, token)
    except BaseException:
        await app.state.client.aclose()
        raise
