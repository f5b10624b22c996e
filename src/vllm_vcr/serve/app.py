"""The OpenAI-compatible ASGI app: a small router over raw ASGI, no framework on the hot path.

`build_app(engine, tokenizer, settings)` returns it. Generation endpoints run under a
disconnect watcher: when the client goes away the handler task is cancelled, which closes the
engine iterators and so aborts the requests in the engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from itertools import compress, repeat
from operator import eq, itemgetter
from typing import Any, Awaitable, Callable

from ..frontend.errors import HTTPError, error_body
from ..frontend.protocol import RequestValueError
from ..frontend.tokenizer import Tokenizer
from ..http.faults_adapter import FaultEnded
from ..http.middleware import check_json_content_type, cors_middleware, redirect_location, with_request_id
from ..http.routes import Family, served
from ..http.serving_base import RequestContext, ServeSettings, encode, logger
from ..http.sse import HeadObserver, send_bytes
from ..http.uvicorn_internals import CLIENT_GONE, ON_DISCONNECT
from .engine_types import front_door
from .extensions import ServeExtensions
from .routes import FAMILIES, route_config

Handler = Callable[[RequestContext], Awaitable[None]]

_NOT_FOUND = encode({"detail": "Not Found"})
_NOT_ALLOWED = encode({"detail": "Method Not Allowed"})
_UNAUTHORIZED = encode({"error": "Unauthorized"})
_MAX_BODY = 64 * 1024 * 1024
_NAME, _VALUE = itemgetter(0), itemgetter(1)  # a header's name and value
_GUARDED = ("/v1", "/v2", "/inference", "/cohere")  # the prefixes vLLM's AuthenticationMiddleware guards


def _load_metrics(settings: ServeSettings) -> Any:
    """The /metrics collector of the engine type (serve/engine_types.py)."""
    from prometheus_client import CollectorRegistry

    door = front_door(settings.engine_type)
    registry = CollectorRegistry(auto_describe=False)
    metrics = door.metrics(settings.model_name, settings.engine_count, registry,
                           block_size=settings.block_size, num_gpu_blocks=settings.num_gpu_blocks,
                           max_model_len=settings.max_model_len, enable_prefix_caching=settings.enable_prefix_caching,
                           worker_type=settings.worker_type)
    if settings.data_parallel_rank:
        metrics.first_engine = settings.data_parallel_rank
    metrics.keep_request_timings = settings.per_request_metrics
    if door.http_series:  # vLLM's registry is prometheus_client's default one: these come with it
        from ..vllm.http_metrics import HttpMetrics, register_process_collectors

        register_process_collectors(registry)
        metrics.http = HttpMetrics(registry)
        if settings.tools.parser is not None:
            metrics.enable_tool_parser_series()
    return metrics


class OpenAIApp:
    def __init__(self, engine: Any, tokenizer: Tokenizer, settings: ServeSettings, metrics: Any = None,
                 on_startup: Callable[[], Awaitable[None]] | None = None,
                 on_shutdown: Callable[[], Awaitable[None]] | None = None, faults: Any = None,
                 extensions: Any = None, families: tuple[Family, ...] = FAMILIES):
        self.engine = engine
        self.faults = faults  # a FaultGate (http/faults_adapter.py), or None
        self.tokenizer = tokenizer
        self.settings = settings
        self.metrics = metrics if metrics is not None else _load_metrics(settings)
        # serve/extensions.py: LoRA, sleep, operator routes, pooling
        self.extensions = extensions = extensions if extensions is not None else ServeExtensions()
        engine = extensions.wrap_engine(engine, settings.served_model_names, self.metrics)
        self.engine = engine
        if self.metrics is not None and hasattr(self.metrics, "on_engine_outputs") \
                and hasattr(engine, "add_output_listener"):
            observer = getattr(self.metrics, "token_observer", None)
            if observer is not None and hasattr(engine, "push"):  # (tokens a stream takes in the step)
                engine.add_output_listener(self.metrics.on_engine_outputs, observer)
            else:
                engine.add_output_listener(self.metrics.on_engine_outputs)
        self._on_startup = on_startup
        self._on_shutdown = on_shutdown
        self._api_keys = [hashlib.sha256(k.encode("utf-8")).digest() for k in settings.api_keys if k]
        self._openapi_body: bytes | None = None
        self._build_routes(families)
        # vLLM's prometheus-fastapi-instrumentator: once per request that reaches the router
        self.http_metrics = getattr(self.metrics, "http", None)
        if self.http_metrics is not None:
            self._route = self._counted_route
        self._cors = cors_middleware(self._route, settings)

    def _build_routes(self, families: tuple[Family, ...]) -> None:
        """The dispatch tables from the families' route tables (serve/routes.py): each family puts
        its services on the app, then every route that exists for this configuration is bound."""
        ext = self.extensions
        self.route_config = config = route_config(self.settings, ext)
        self.settings.lora_adapters = ext.adapters
        for family in families:
            if family.services is not None:
                family.services(self, config)
        self.served = served(families, config)
        # path -> {method: (handler, generation)}; paths with a variable segment by (prefix, suffix)
        self.routes: dict[str, dict[str, tuple[Handler, bool]]] = {}
        # (prefix, suffix, methods, the path template)
        self.prefix_routes: list[tuple[str, str, dict[str, tuple[Handler, bool]], str]] = []
        json_only = set()
        for route, switched_on in self.served:
            handler = route.handler(self) if switched_on else route.closed
            generation = route.generation and switched_on
            if generation and config.load_tracking:
                handler = ext.counted(handler)
            pattern = route.pattern
            if pattern is None:
                methods = self.routes.setdefault(route.path, {})
            else:
                methods = {}
                self.prefix_routes.append((*pattern, methods, route.path))
            for method in route.methods:
                methods[method] = (handler, generation)
            if route.json_only:
                json_only.add(route.path)
        self._json_routes = frozenset(json_only)

    # -- ASGI ----------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Callable, send: Callable) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    if self._on_startup:
                        await self._on_startup()
                except Exception as e:
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                try:
                    if self._on_shutdown:
                        await self._on_shutdown()
                finally:
                    await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        # vLLM's middleware order, outermost first: X-Request-Id, API key, CORS, router
        scope["vllm_vcr.send"] = send  # the server's own send: streams write to its transport directly
        try:
            if "vllm_vcr.arrival" not in scope:  # the server stamps it as the request's bytes arrive (acceptor.py)
                scope["vllm_vcr.arrival"] = time.time()  # vLLM's arrival_time: before the body is read and parsed
            if self.settings.request_id_headers:
                send = with_request_id(scope, send)
            if self._api_keys and scope["path"].startswith(_GUARDED) and not self._authorized(scope):
                await send_bytes(send, 401, _UNAUTHORIZED)
                return
            if _has_header(scope, b"origin"):
                await self._cors(scope, receive, send)
                return
            await self._route(scope, receive, send)
        finally:
            # that send is bound to uvicorn's cycle, which holds this scope: left here, every request
            # would end as a reference cycle that only the garbage collector frees, and its young
            # collections, walking every live stream's objects, then stalled the loop 20-70 ms
            # under load (gc_tuning.py)
            scope.pop("vllm_vcr.send", None)

    async def _counted_route(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        """`_route`, counted in the http_* series: the handler's route template (`none` when no route
        matches), the method, the status, both Content-Lengths and the whole duration, stream included."""
        start = time.perf_counter()
        path = scope["path"]
        if path in self.routes:
            handler = path
        else:
            match = self._match_route(path)
            handler = "none" if match is None else match[3]
        metrics = self.http_metrics
        if metrics.excluded(handler):
            await OpenAIApp._route(self, scope, receive, send)
            return
        seen = _ResponseHead(send)
        try:
            await OpenAIApp._route(self, scope, receive, seen)
        finally:
            size = 0
            value = _first_header(scope.get("headers"), b"content-length")
            if value is not None:
                try:
                    size = int(value)
                except ValueError:
                    pass
            metrics.observe(handler, scope["method"], seen.status, size, seen.size, time.perf_counter() - start)

    async def _route(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        path = scope["path"]
        methods = self.routes.get(path) or self._match(path)
        if methods is None:
            if path != "/" and path.endswith("/") and path.rstrip("/") in self.routes:
                # Starlette's redirect_slashes: 307 to the path without the slash, any method
                await send_bytes(send, 307, b"", [(b"location", redirect_location(scope, path.rstrip("/")))],
                                 content_type=None)
                return
            await send_bytes(send, 404, _NOT_FOUND)
            return
        entry = methods.get(scope["method"])
        if entry is None:
            await send_bytes(send, 405, _NOT_ALLOWED, [(b"allow", ", ".join(methods).encode())])
            return
        handler, watch = entry
        try:
            body = await self._read_body(receive) if scope["method"] == "POST" else b""
        except _Disconnected:
            return
        except HTTPError as e:
            await send_bytes(send, e.status, e.body(), e.headers)
            return
        if watch and self.faults is not None:
            send = await self.faults.admit(scope, body, send)
            if send is None:
                return  # answered with an injected failure
        ctx = RequestContext(scope, receive, send, body)
        try:
            if path in self._json_routes:
                check_json_content_type(ctx.headers)
            if watch:
                await self._watched(handler, ctx)
            else:
                await handler(ctx)
        except HTTPError as e:
            await self._send_error(send, e.status, e.body(), e.headers)
        except RequestValueError as e:
            await self._send_error(send, 400, error_body(str(e), "BadRequestError", 400, e.param))
        except asyncio.CancelledError:
            raise
        except FaultEnded:
            pass  # an injected fault ended the response on purpose
        except Exception:
            logger.exception("unhandled error in %s %s", scope["method"], path)
            await self._send_error(send, 500, error_body("Internal server error", "InternalServerError", 500))

    @staticmethod
    async def _send_error(send: Callable, status: int, body: bytes, headers: Any = None) -> None:
        try:
            await send_bytes(send, status, body, headers)
        except Exception:
            pass  # the response had already started (or the client is gone): nothing more to say

    async def _watched(self, handler: Handler, ctx: RequestContext) -> None:
        """Run the handler in the server's task for this request; a disconnect cancels that task,
        which the handler sees as CancelledError at its current await. The server's protocol
        reports the disconnect through `scope[ON_DISCONNECT]` (http/uvicorn_internals.py); under another
        server a watcher task waits for it on `receive`."""
        scope = ctx.scope
        hooked = ON_DISCONNECT in scope
        if hooked and scope[ON_DISCONNECT] == CLIENT_GONE:
            return  # the client left before the handler started: nobody to answer
        task = asyncio.current_task()
        running = True
        disconnected = False

        def client_gone() -> None:
            nonlocal disconnected
            if running and not ctx.finishing:
                disconnected = True
                task.cancel()

        watcher = None
        if hooked:
            scope[ON_DISCONNECT] = client_gone
        else:
            watcher = asyncio.ensure_future(_watch(ctx.receive, client_gone))
        try:
            await handler(ctx)
        except asyncio.CancelledError:
            if not disconnected:
                raise
        finally:
            running = False
            if watcher is not None:
                watcher.cancel()
            elif scope[ON_DISCONNECT] is client_gone:
                scope[ON_DISCONNECT] = None
            if disconnected:
                task.uncancel()  # the cancel was ours, and it is over

    def _authorized(self, scope: dict[str, Any]) -> bool:
        """vLLM's AuthenticationMiddleware: OPTIONS passes; else the first Authorization header,
        scheme `bearer` in any case, the rest after the first space equal to one of the keys
        (header bytes read as latin-1, then UTF-8, as Starlette's Headers and vLLM do)."""
        if scope["method"] == "OPTIONS":
            return True
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                scheme, _, param = value.decode("latin-1").partition(" ")
                if scheme.lower() != "bearer":
                    return False
                digest = hashlib.sha256(param.encode("utf-8")).digest()
                match = False
                for key in self._api_keys:
                    match |= hmac.compare_digest(digest, key)
                return match
        return False

    @staticmethod
    async def _read_body(receive: Callable) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise _Disconnected()
            chunk = msg.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > _MAX_BODY:
                    # the rest of the body is never read: the connection cannot carry another request
                    raise HTTPError(413, "Request body too large", "RequestEntityTooLarge",
                                    headers=[(b"connection", b"close")])
                chunks.append(chunk)
            if not msg.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _match(self, path: str) -> dict[str, tuple[Handler, bool]] | None:
        """The methods of the route with a variable segment that `path` fills (one segment, no slash)."""
        match = self._match_route(path)
        return None if match is None else match[2]

    def _match_route(self, path: str) -> tuple[str, str, dict[str, tuple[Handler, bool]], str] | None:
        """The prefix route (prefix, suffix, methods, template) that `path` fills."""
        for route in self.prefix_routes:
            prefix, suffix = route[0], route[1]
            if path.startswith(prefix) and path.endswith(suffix):
                middle = path[len(prefix): len(path) - len(suffix)]
                if middle and "/" not in middle:
                    return route
        return None

    async def openapi(self, ctx: RequestContext) -> None:
        if self._openapi_body is None:  # built once, from the routes served
            from .openapi import build_openapi

            self._openapi_body = encode(build_openapi(self.served))
        await send_bytes(ctx.send, 200, self._openapi_body)


class _Disconnected(Exception):
    pass


class _ResponseHead(HeadObserver):
    """`send` that notes the response's status and Content-Length (for the http_* series)."""

    __slots__ = ("status", "size")

    def __init__(self, send: Callable) -> None:
        self.send = send
        self.status = 500  # (the instrumentator's value for a request that never answered)
        self.size = 0

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.saw_head(message["status"], message.get("headers"))
        await self.send(message)

    def saw_head(self, status: int, headers: Any) -> None:
        self.status = status
        value = _first_header(headers, b"content-length")
        if value is not None:
            self.size = int(value)


async def _watch(receive: Callable, client_gone: Callable[[], None]) -> None:
    """The disconnect watcher for a server without the hook: `receive` until the client leaves."""
    while True:
        if (await receive())["type"] == "http.disconnect":
            client_gone()
            return


def _has_header(scope: dict[str, Any], name: bytes) -> bool:
    return name in map(_NAME, scope.get("headers") or ())  # (the loop in C)


def _first_header(headers: Any, name: bytes) -> bytes | None:
    """The value of the first header called `name` (None if there is none), found in C."""
    if not headers:
        return None
    return next(compress(map(_VALUE, headers), map(eq, map(_NAME, headers), repeat(name))), None)


def build_app(engine: Any, tokenizer: Tokenizer, settings: ServeSettings, **kwargs: Any) -> OpenAIApp:
    """The ASGI app serving the OpenAI API for `engine` (an AsyncEngine, already started)."""
    return OpenAIApp(engine, tokenizer, settings, **kwargs)
