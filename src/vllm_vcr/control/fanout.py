"""The control API of a server whose engines run in other processes (`serve --api-server-count N`):
one address, every call fanned out to each engine-core process's own control API, in rank order.

The answers are the ones a single process with N engines gives (control/server.py): GET /config
is the first engine's config; GET /stats, GET /stats/kv and POST /stats/reset are the sums over
the engines; every other call goes to all engines in order and answers the first engine's reply,
or the first failure (the engines before it have applied the call: the message says which).

The HTTP faults act in the API servers; their state is one SharedFaultController (faults/shared.py)
that every process opens. The parent serves /faults and /gauges with the routes of
control/faults_routes.py over it, adds its rates to GET/PATCH /config and its injected counts to
/stats, and `on_log` passes a PUT /log the engines accepted on to the API servers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import msgspec
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .faults_routes import RATE_FIELDS, apply_rates, check_rates, fault_routes
from .schema import ControlError, split_config_patch
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
            elif k in out and isinstance(v, dict) and isinstance(out[k], dict):
                out[k] = _sum([out[k], v])
            else:
                out.setdefault(k, v)
    return out


def build_fanout_app(backends: Sequence[str], token: str | None = None, *, faults: Any = None,
                     on_log: Callable[[str], None] | None = None) -> Starlette:
    """`backends`: the engine-core processes' control API base URLs, in rank order. `faults`: the
    API servers' shared FaultController; `on_log(filter)`: applies an accepted log filter in the
    processes that are not engines."""
    client = httpx.AsyncClient(timeout=CALL_TIMEOUT)

    async def forward(request: Request) -> Response:
        method, path = request.method, request.url.path
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        if faults is None:
            return await call_engines(method, path, body, headers, request.query_params)
        if (method, path) == ("PATCH", "/config"):
            patch, fault_patch = split_config_patch(body, RATE_FIELDS)
            check_rates(faults, fault_patch)  # a bad rate changes nothing, as with one process
            if patch:
                reply = await call_engines(method, path, msgspec.json.encode(patch), headers, request.query_params)
                if reply.status_code >= 400:
                    return reply
            if fault_patch:
                apply_rates(faults, fault_patch)
            method, body = "GET", b""
        reply = await call_engines(method, path, body, headers, request.query_params)
        if reply.status_code >= 400:
            return reply
        if path == "/config":
            return _json({**msgspec.json.decode(reply.body), **faults.rates_dict()})
        if path == "/stats/reset":
            faults.reset_stats()
        if path in ("/stats", "/stats/reset"):
            return _json({**msgspec.json.decode(reply.body), **faults.stats()})
        return reply

    async def call_engines(method: str, path: str, body: bytes, headers: dict[str, str], params: Any) -> Response:
        targets = backends[:1] if (method, path) in FIRST_ONLY else backends
        replies: list[httpx.Response] = []
        for i, base in enumerate(targets):
            try:
                reply = await client.request(method, base + path, content=body, headers=headers, params=params)
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
        if (method, path) == ("PUT", "/log") and on_log is not None:
            on_log(replies[0].json()["filter"])  # (the engines checked it)
        if (method, path) in SUMMED:
            return _json(_sum([r.json() for r in replies]))
        first = replies[0]
        return Response(first.content, first.status_code, media_type=first.headers.get("content-type"))

    async def on_control_error(request: Request, exc: ControlError) -> Response:
        return _error(exc.status, exc.message)

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]
    app = Starlette(
        routes=[*(fault_routes(faults) if faults is not None else []),
                Route("/{path:path}", forward, methods=methods)],
        middleware=[*([Middleware(BearerToken, token=token)] if token else []), Middleware(BodyLimit)],
        exception_handlers={ControlError: on_control_error},
    )
    app.state.loop_watch = None  # (ControlServer.stop reads it)
    app.state.client = client  # closed by the owner, after the server stops
    app.router.redirect_slashes = False
    return app


async def start_control_fanout(address: str, backends: Sequence[str], token: str | None = None, *,
                               faults: Any = None, on_log: Callable[[str], None] | None = None,
                               sock: Any = None) -> ControlServer:
    """Serve the fanned-out control API on `address` (HOST:PORT) in the running event loop (on
    `sock` when it was claimed already: control/server.py's listen_control)."""
    token = token or None
    app = build_fanout_app(list(backends), token, faults=faults, on_log=on_log)
    try:
        return await serve_control_app(app, address, token, sock)
    except BaseException:
        await app.state.client.aclose()
        raise
