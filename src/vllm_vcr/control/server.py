"""The runtime control API: a small HTTP/JSON server in the engines' own event loop.

It never touches engine state: every call is a function handed to `EngineCore.call()`, which the
engine runs between two steps and answers on a future. With several engines each call goes to
all of them in order (GET /config reads only the first).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import socket
from collections.abc import Sequence
from typing import Any, Callable, Protocol

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..engine.config import ConfigError, EngineConfig
from ..engine.core import EngineDeadError, LatencyTraceActive
from ..listen_socket import bind_listener
from ..log_filter import LogFilterError
from ..server_ticks import EventServer
from .schema import (
    STATS_FIELDS,
    ControlError,
    empty_stats,
    parse_log_request,
    refuse_browser_post,
    split_config_patch,
)
from .faults_routes import RATE_FIELDS, apply_rates, fault_routes
from .loop_watch import LoopWatch

logger = logging.getLogger("vllm_vcr.control")

ENGINE_CALL_TIMEOUT = 10.0  # seconds; an engine that does not answer by then is treated as gone

LogControl = Callable[[str], str]  # applies an EnvFilter string, returns its canonical form


class ControlAddressError(ValueError):
    pass


def parse_address(address: str) -> tuple[str, int]:
    """`HOST:PORT` (IPv6 as `[::1]:PORT`) -> (host, port); errors name --control-address."""
    hint = f"--control-address (env MOCK_CONTROL_ADDRESS): expected HOST:PORT such as 127.0.0.1:8001, got {address!r}"
    if not isinstance(address, str) or ":" not in address:
        raise ControlAddressError(hint)
    host, _, port_text = address.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port_text.isdigit():
        raise ControlAddressError(hint)
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ControlAddressError(f"{hint} (port out of range)")
    return host, port


def _json(obj: Any, status: int = 200) -> Response:
    # Trailing newline so `curl -s` output ends the line in a terminal; jq does not care.
    return Response(msgspec.json.encode(obj) + b"\n", status_code=status, media_type="application/json")


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    resp = _json({"error": message}, status)
    if headers:
        resp.headers.update(headers)
    return resp


class BearerToken:
    """ASGI middleware: every request needs `Authorization: Bearer <token>`, else a 401 in the
    control API's error convention. The header is read as vLLM's --api-key middleware reads it
    (case-insensitive scheme, the rest after one space is the token); tokens are compared as
    SHA-256 digests in constant time. Routes added to the app later (GET /loras) are covered."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self._digest = hashlib.sha256(token.encode("utf-8")).digest()

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        for name, value in headers:
            if name.lower() == b"authorization":
                scheme, _, param = value.decode("latin-1").partition(" ")
                if scheme.lower() != "bearer":
                    return False
                return hmac.compare_digest(hashlib.sha256(param.encode("utf-8")).digest(), self._digest)
        return False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not self.authorized(scope.get("headers") or []):
            response = _error(401, "missing or wrong control token: send `Authorization: Bearer <token>` "
                                   "(--control-token / MOCK_CONTROL_TOKEN)",
                              {"www-authenticate": 'Bearer realm="vllm-vcr control"'})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


MAX_BODY_BYTES = 4 * 1024 * 1024  # a control body is a few hundred bytes of JSON; PUT /log refuses its own
MAX_HEAD_BYTES = 64 * 1024  # its request line and headers


class BodyLimit:
    """ASGI middleware: a body over MAX_BODY_BYTES is a 413 in the control API's convention, by
    its Content-Length before anything is read, else as the chunks come in (never buffered)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers") or ():
            if name == b"content-length" and value.isdigit() and int(value) > MAX_BODY_BYTES:
                await _too_large()(scope, receive, send)
                return
        size = 0

        async def counted() -> dict[str, Any]:
            nonlocal size
            message = await receive()
            size += len(message.get("body", b""))
            if size > MAX_BODY_BYTES:
                raise ControlError(413, _TOO_LARGE)
            return message

        await self.app(scope, counted, send)


_TOO_LARGE = f"request body over {MAX_BODY_BYTES} bytes"


def _too_large() -> Response:
    return _error(413, _TOO_LARGE, {"connection": "close"})


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`: an address only this machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ControlledCore(Protocol):
    """What the control API uses of an engine (EngineCore, or a stand-in in tests)."""

    config: EngineConfig

    def call(self, fn: Callable[[Any], Any]) -> asyncio.Future | concurrent.futures.Future: ...
    def check_patch(self, patch: dict[str, Any]) -> Any: ...
    def patch_config(self, patch: dict[str, Any]) -> Any: ...
    def reset_stats(self) -> Any: ...
    def current_stats(self) -> Any: ...


class EngineGroup(Protocol):
    """The engines of a serve or play process (AsyncEngine, PlayEngines): read on every call,
    since play creates its engines after the control API is up."""

    @property
    def engines(self) -> Sequence[ControlledCore]: ...


Engines = EngineGroup | Sequence[ControlledCore]


class _Engines:
    """The engines the API drives: a list of cores, or an engine group (read lazily)."""

    def __init__(self, engines: Engines, timeout: float) -> None:
        self._src = engines
        self.timeout = timeout
        # Fan-out calls take one engine at a time; the lock keeps two PATCHes from interleaving
        # engine by engine, which would leave the engines with different configs.
        self.lock = asyncio.Lock()

    def cores(self) -> list[ControlledCore]:
        return list(self._src if isinstance(self._src, Sequence) else self._src.engines)

    async def call(self, index: int, core: ControlledCore, fn: Callable[[Any], Any]) -> Any:
        gone = f"engine {index} loop is gone"
        try:
            fut = core.call(fn)
        except Exception as e:  # the engine refused the message: its loop has stopped
            raise ControlError(500, f"{gone} ({e})") from None
        if isinstance(fut, concurrent.futures.Future):
            fut = asyncio.wrap_future(fut)
        # asyncio.wait, not wait_for: a timeout must not cancel a future the engine may still set.
        done, _ = await asyncio.wait({fut}, timeout=self.timeout)
        if not done:
            raise ControlError(500, f"{gone} (no answer within {self.timeout:g}s)")
        try:
            return fut.result()
        except (ControlError, ConfigError, LatencyTraceActive):
            raise
        except EngineDeadError as e:
            raise ControlError(500, str(e) or gone) from None
        except asyncio.CancelledError:
            raise ControlError(500, f"{gone} (call cancelled)") from None
        except Exception as e:  # the call itself failed inside the engine
            raise ControlError(500, f"engine {index}: {type(e).__name__}: {e}") from None

    async def call_all(self, fn: Callable[[Any], Any]) -> list[Any]:
        cores = self.cores()
        if not cores:
            raise ControlError(500, "no engine is running")
        return [await self.call(i, core, fn) for i, core in enumerate(cores)]

    async def call_first(self, fn: Callable[[Any], Any]) -> Any:
        cores = self.cores()
        if not cores:
            raise ControlError(500, "no engine is running")
        return await self.call(0, cores[0], fn)


def _read_config(core: ControlledCore) -> dict[str, Any]:
    return core.config.to_dict()


def _read_stats(core: ControlledCore) -> dict[str, int]:
    # current_stats(), not stats: it fills the running/waiting gauges from the scheduler
    stats = core.current_stats()
    return {name: int(getattr(stats, name)) for name in STATS_FIELDS}


def _read_kv_blocks(core: ControlledCore) -> tuple[int, int]:
    pool = core.block_pool
    return int(pool.num_blocks), int(pool.num_free_blocks)


def _reset_stats(core: ControlledCore) -> dict[str, int]:
    core.reset_stats()
    return _read_stats(core)


def _sum_stats(per_engine: Sequence[dict[str, int]]) -> dict[str, int]:
    total = empty_stats()
    for s in per_engine:
        for name in STATS_FIELDS:
            total[name] += s[name]
    return total


def build_control_app(
    engines: Engines,
    log_control: LogControl | None = None,
    *,
    call_timeout: float = ENGINE_CALL_TIMEOUT,
    faults: Any = None,
    token: str | None = None,
) -> Starlette:
    """The Starlette app. `log_control=None` means no reloadable logging: PUT /log answers 501.
    `faults` (a FaultController, `serve` only) adds its fields to /config and /stats and the
    /faults and /gauges routes (control/faults_routes.py). `token`: every route needs it as a
    Bearer token (401 otherwise)."""
    eng = _Engines(engines, call_timeout)
    fault_fields = RATE_FIELDS if faults is not None else ()

    def with_faults(config: dict[str, Any]) -> dict[str, Any]:
        return {**config, **faults.rates_dict()} if faults is not None else config

    async def get_config(request: Request) -> Response:
        return _json(with_faults(await eng.call_first(_read_config)))

    async def patch_config(request: Request) -> Response:
        patch, fault_patch = split_config_patch(await request.body(), fault_fields)
        if fault_patch and not patch:
            apply_rates(faults, fault_patch)
            return _json(with_faults(await eng.call_first(_read_config)))

        def dry_run(core: ControlledCore) -> None:
            # Nothing is applied until every engine accepted the patch, so a rejected PATCH
            # leaves all engines as they were.
            core.check_patch(patch)

        def apply(core: ControlledCore) -> dict[str, Any]:
            core.patch_config(patch)
            return core.config.to_dict()

        async with eng.lock:
            try:
                await eng.call_all(dry_run)
            except LatencyTraceActive as e:
                raise ControlError(409, str(e)) from None
            except ConfigError as e:
                raise ControlError(400, str(e)) from None
            if fault_patch:
                apply_rates(faults, fault_patch)
            configs = []
            for i, core in enumerate(eng.cores()):
                try:
                    configs.append(await eng.call(i, core, apply))
                except (ControlError, LatencyTraceActive, ConfigError) as e:
                    # an engine died between the dry run and now: say which engines have the patch
                    status = e.status if isinstance(e, ControlError) else 500
                    done = f"engines 0-{i - 1} have the patch" if i else "no engine has the patch"
                    raise ControlError(status, f"{e} ({done}; the engines' configs may differ)") from None
        logger.info("control: config patched on %d engine(s): %s", len(configs),
                    msgspec.json.encode(patch).decode())
        return _json(with_faults(configs[0]))

    def with_fault_stats(stats: dict[str, Any]) -> dict[str, Any]:
        return {**stats, **faults.stats()} if faults is not None else stats

    async def get_stats(request: Request) -> Response:
        return _json(with_fault_stats(_sum_stats(await eng.call_all(_read_stats))))

    async def get_kv_stats(request: Request) -> Response:
        # for leak checks: every block of an idle engine is free (prefix-cached blocks count as free)
        per_engine = await eng.call_all(_read_kv_blocks)
        return _json({"blocks_total": sum(t for t, _ in per_engine), "blocks_free": sum(f for _, f in per_engine)})

    async def reset_stats(request: Request) -> Response:
        refuse_browser_post(request.headers)
        async with eng.lock:
            per_engine = await eng.call_all(_reset_stats)
            if faults is not None:
                faults.reset_stats()
            if app.state.loop_watch is not None:
                app.state.loop_watch.reset()
        logger.info("control: stats reset on %d engine(s)", len(per_engine))
        return _json(with_fault_stats(_sum_stats(per_engine)))

    async def get_loop_stats(request: Request) -> Response:
        # the first call starts the watch (control/loop_watch.py); it runs until the server stops
        if app.state.loop_watch is None:
            app.state.loop_watch = LoopWatch(asyncio.get_running_loop())
        app.state.loop_watch.start()
        return _json(app.state.loop_watch.snapshot())

    async def put_log(request: Request) -> Response:
        if log_control is None:
            raise ControlError(
                501,
                "no reloadable log subscriber in this process (only the vllm-vcr command installs one)",
            )
        spec = parse_log_request(await request.body())
        try:
            applied = log_control(spec)
        except LogFilterError as e:
            raise ControlError(400, f"invalid log filter: {e}") from None
        # Logging is process state, not engine state, so it is applied here, in the loop thread.
        logger.info("control: log filter set to %s", applied)
        return _json({"filter": applied})

    async def on_control_error(request: Request, exc: ControlError) -> Response:
        log = logger.warning if exc.status == 500 else logger.debug
        log("control: %s %s -> %d %s", request.method, request.url.path, exc.status, exc.message)
        return _error(exc.status, exc.message)

    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            extra = ", GET/PUT/DELETE /faults, GET/PUT/DELETE /gauges" if faults is not None else ""
            message = (f"no route {request.url.path}; routes: GET/PATCH /config, GET /stats, GET /stats/kv, "
                       "GET /stats/loop, POST /stats/reset, "
                       f"PUT /log{extra}")
        elif exc.status_code == 405:
            message = f"method {request.method} not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return _error(exc.status_code, message, dict(exc.headers or {}))

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("control: %s %s failed", request.method, request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    async def config(request: Request) -> Response:
        # One route per path, so a 405 names every method the path allows in its Allow header.
        return await (patch_config if request.method == "PATCH" else get_config)(request)

    routes = [
        Route("/config", config, methods=["GET", "PATCH"]),
        Route("/stats", get_stats, methods=["GET"]),
        Route("/stats/reset", reset_stats, methods=["POST"]),
        Route("/stats/kv", get_kv_stats, methods=["GET"]),
        Route("/stats/loop", get_loop_stats, methods=["GET"]),
        Route("/log", put_log, methods=["PUT"]),
        *(fault_routes(faults) if faults is not None else []),
    ]
    app = Starlette(
        routes=routes,
        middleware=[*([Middleware(BearerToken, token=token)] if token else []), Middleware(BodyLimit)],
        exception_handlers={
            ControlError: on_control_error,
            HTTPException: on_http_error,
            Exception: on_unexpected,
        },
    )
    app.state.loop_watch = None
    app.router.redirect_slashes = False  # `/config/` is a 404, not a redirect curl would not follow
    return app


class _EmbeddedServer(EventServer):
    @contextlib.contextmanager
    def capture_signals(self):
        # The owning command (serve/play) handles SIGINT/SIGTERM and stops us; uvicorn must not
        # replace its handlers.
        yield


class ControlServer:
    """Handle of a running control server; `await stop()` closes it."""

    def __init__(self, server: _EmbeddedServer, task: asyncio.Task, host: str, port: int, app: Starlette):
        self._server = server
        self._task = task
        self.host = host
        self.port = port
        self.app = app

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def stop(self) -> None:
        """Stop accepting, close connections, wait for uvicorn to finish (idempotent)."""
        self._server.should_exit = True
        if not self._task.done():
            await asyncio.wait({self._task})  # unlike awaiting the task, our own cancellation still propagates
        if not self._task.cancelled() and self._task.exception() is not None:
            logger.warning("control API stopped with an error: %r", self._task.exception())
        if self.app.state.loop_watch is not None:
            self.app.state.loop_watch.stop()

    async def __aenter__(self) -> ControlServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _auto_log_control(spec: str) -> str:
    from ..logging_setup import apply_log_filter

    return apply_log_filter(spec)


async def start_control_server(
    engines: Engines,
    address: str,
    *,
    log_control: LogControl | None | str = "auto",
    call_timeout: float = ENGINE_CALL_TIMEOUT,
    faults: Any = None,
    token: str | None = None,
) -> ControlServer:
    """Serve the control API on `address` (HOST:PORT) in the running event loop.

    `engines` is a list of EngineCore or an engine group (AsyncEngine, PlayEngines). `log_control="auto"` uses the reloadable
    logging the vllm-vcr CLI installs, or answers PUT /log with 501 when it is not installed.
    `token` (--control-token): every request must carry it as `Authorization: Bearer <token>`.
    Raises ControlAddressError for a malformed address and OSError when it cannot bind.
    """
    parse_address(address)  # a malformed address fails before anything is built
    token = token or None
    if log_control == "auto":
        from ..logging_setup import reloadable_logging_installed

        log_control = _auto_log_control if reloadable_logging_installed() else None
    app = build_control_app(engines, log_control, call_timeout=call_timeout, faults=faults,  # type: ignore[arg-type]
                            token=token)
    return await serve_control_app(app, address, token)


def listen_control(address: str) -> socket.socket:
    """The listening socket of `address` (HOST:PORT, port 0: any): connections wait in its backlog
    until a server takes it over."""
    host, port = parse_address(address)
    try:
        sock = bind_listener(host, port, f"--control-address {address}")
    except socket.gaierror as e:
        raise OSError(e.errno, f"cannot listen on --control-address {address}: {e.strerror or e}") from None
    sock.listen(128)
    return sock


async def serve_control_app(app: Starlette, address: str, token: str | None,
                            sock: socket.socket | None = None) -> ControlServer:
    """Serve a control API app on `address` (HOST:PORT, port 0: any) in the running event loop, or
    on `sock` (listen_control's, claimed earlier)."""
    host, _ = parse_address(address)
    if sock is None:
        sock = listen_control(address)
    actual_port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_config=None,  # leave the process's logging alone (it belongs to the CLI)
        lifespan="off",
        timeout_graceful_shutdown=2,
        server_header=False,
        # h11, not httptools: a request head over MAX_HEAD_BYTES is uvicorn's 400 before any of it
        # is kept (httptools has no such bound); control traffic is a few requests a second
        http="h11",
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
    )
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="vllm-vcr-control-server")
    while not server.started:
        if task.done():
            sock.close()
            exc = task.exception() if not task.cancelled() else None
            raise RuntimeError(f"control server on {address} failed to start: {exc!r}")
        await asyncio.sleep(0.01)
    handle = ControlServer(server, task, host, actual_port, app)
    logger.info("control API listening on %s%s", handle.url, " (token required)" if token else "")
    if token is None and not is_loopback(host):
        logger.warning("control API on %s without a token: anyone who reaches this address can change the "
                       "engine's behaviour; set MOCK_CONTROL_TOKEN (or --control-token) or bind 127.0.0.1",
                       handle.url)
    return handle
