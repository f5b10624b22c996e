"""The OpenAI-compatible ASGI app: a small router over raw ASGI, no framework on the hot path.

`build_app(engine, tokenizer, settings)` returns it. Generation endpoints run under a
disconnect watcher: when the client goes away the handler task is cancelled, which closes the
engine iterators and so aborts the requests in the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from typing import Any, Awaitable, Callable

from .. import __version__
from ..http.acceptor import CLIENT_GONE, ON_DISCONNECT
from ..frontend.errors import HTTPError, error_body
from ..http.faults_adapter import FaultEnded
from .extra_routes import add_generative_routes, match_route
from ..http.middleware import check_json_content_type, cors_middleware, redirect_location, with_request_id
from ..frontend.protocol import DetokenizeRequest, RequestValueError, TokenizeChatRequest, TokenizeCompletionRequest
from ..http.serving_base import VLLM_API_VERSION, RequestContext, ServeSettings, encode, logger, parse_request
from ..openai.chat import ChatServing
from ..openai.completion import CompletionServing
from ..http.sse import send_bytes
from ..frontend.tokenizer import Tokenizer

Handler = Callable[[RequestContext], Awaitable[None]]

_NOT_FOUND = encode({"detail": "Not Found"})
_NOT_ALLOWED = encode({"detail": "Method Not Allowed"})
_UNAUTHORIZED = encode({"error": "Unauthorized"})
_MAX_BODY = 64 * 1024 * 1024
_GUARDED = ("/v1", "/v2", "/inference", "/cohere")  # the prefixes vLLM's AuthenticationMiddleware guards
# routes whose body must be application/json (vLLM's validate_json_request)
_JSON_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})


def _load_metrics(settings: ServeSettings) -> Any:
    """The Prometheus side (http/metrics.py, written separately); None when it is absent."""
    try:
        from ..vllm import metrics as metrics_mod
    except ImportError:
        return None
    cls = getattr(metrics_mod, "FrontendMetrics", None)
    if settings.engine_type == "sglang":
        from ..sglang.metrics import SGLangFrontendMetrics as cls
    if cls is None:
        return None
    try:
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry(auto_describe=False)
        try:
            return cls(settings.model_name, settings.engine_count, registry, block_size=settings.block_size,
                       num_gpu_blocks=settings.num_gpu_blocks, max_model_len=settings.max_model_len,
                       enable_prefix_caching=settings.enable_prefix_caching)
        except TypeError:  # an older FrontendMetrics without the keyword arguments
            return cls(settings.model_name, settings.engine_count, CollectorRegistry(auto_describe=False))
    except Exception:  # metrics must never keep the server from starting
        logging.getLogger("vllm_vcr.http").exception("metrics disabled: FrontendMetrics failed to initialise")
        return None


class OpenAIApp:
    def __init__(self, engine: Any, tokenizer: Tokenizer, settings: ServeSettings, metrics: Any = None,
                 on_startup: Callable[[], Awaitable[None]] | None = None,
                 on_shutdown: Callable[[], Awaitable[None]] | None = None, faults: Any = None,
                 extensions: Any = None):
        self.engine = engine
        self.faults = faults  # a FaultGate (http/faults_adapter.py), or None
        self.tokenizer = tokenizer
        self.settings = settings
        self.metrics = metrics if metrics is not None else _load_metrics(settings)
        self.extensions = extensions  # http/extensions.py: LoRA, sleep, operator routes, pooling
        if extensions is not None:
            engine = extensions.wrap_engine(engine, settings.served_model_names, self.metrics)
        self.engine = engine
        if self.metrics is not None and hasattr(self.metrics, "on_engine_outputs") \
                and hasattr(engine, "add_output_listener"):
            observer = getattr(self.metrics, "token_observer", None)
            if observer is not None and hasattr(engine, "push"):  # (tokens a stream takes in the step)
                engine.add_output_listener(self.metrics.on_engine_outputs, observer)
            else:
                engine.add_output_listener(self.metrics.on_engine_outputs)
        self.completions = CompletionServing(engine, tokenizer, settings, self.metrics)
        self.chat = ChatServing(engine, tokenizer, settings, self.metrics)
        self._on_startup = on_startup
        self._on_shutdown = on_shutdown
        self._api_keys = [k.encode() for k in settings.api_keys if k]
        self._perm_id = f"modelperm-{secrets.token_hex(8)}"
        # path -> {method: (handler, watch_disconnect)}
        self.routes: dict[str, dict[str, tuple[Handler, bool]]] = {
            "/v1/completions": {"POST": (self.completions.handle, True)},
            "/v1/chat/completions": {"POST": (self.chat.handle, True)},
            "/v1/models": {"GET": (self._models, False)},
            "/health": {"GET": (self._health, False)},
            "/ping": {"GET": (self._health, False), "POST": (self._health, False)},
            "/version": {"GET": (self._version, False)},
            "/metrics": {"GET": (self._metrics, False)},
            "/tokenize": {"POST": (self._tokenize, False)},
            "/detokenize": {"POST": (self._detokenize, False)},
            "/openapi.json": {"GET": (self._openapi, False)},
        }
        self._openapi_body: bytes | None = None
        # /v1/responses, /v1/messages, ...: what else vLLM serves for a generative model
        self.prefix_routes = add_generative_routes(self)
        if extensions is not None:
            extensions.install(self)
        self._cors = cors_middleware(self._route, settings)
        if settings.engine_type == "sglang":
            from ..sglang.routes import SGLangRoutes

            self.routes.update(SGLangRoutes(self).routes())

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

    async def _route(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        path = scope["path"]
        methods = self.routes.get(path) or match_route(self.prefix_routes, path)
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
            if path in _JSON_ROUTES:
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
        reports the disconnect through `scope[ON_DISCONNECT]` (acceptor.py); under another
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
        if scope["method"] == "OPTIONS":
            return True
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                for key in self._api_keys:
                    if hmac.compare_digest(value, b"Bearer " + key):
                        return True
                return False
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

    # -- small endpoints -----------------------------------------------------------------------

    async def _models(self, ctx: RequestContext) -> None:
        s = self.settings
        root = s.model_root or s.model_name
        now = int(time.time())  # vLLM stamps the cards when they are listed
        perm = {"id": self._perm_id, "object": "model_permission", "created": now,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False}
        data = [{"id": name, "object": "model", "created": now, "owned_by": "vllm", "root": root,
                 "parent": None, "max_model_len": s.max_model_len, "permission": [perm]}
                for name in s.served_model_names]
        if s.lora_adapters is not None:
            data += s.lora_adapters.model_cards(now, perm)
        await send_bytes(ctx.send, 200, encode({"object": "list", "data": data}))

    async def _health(self, ctx: RequestContext) -> None:
        running = getattr(self.engine, "is_running", True)
        if running:
            await send_bytes(ctx.send, 200, b"")
        else:
            await send_bytes(ctx.send, 503, error_body("Engine is not running", "ServiceUnavailableError", 503))

    async def _version(self, ctx: RequestContext) -> None:
        # the vLLM release whose API is reproduced (clients compare it); vllm-vcr's own version beside it
        await send_bytes(ctx.send, 200, encode({"version": VLLM_API_VERSION, "vllm_vcr_version": __version__}))

    async def _metrics(self, ctx: RequestContext) -> None:
        m = self.metrics
        if m is None:
            await send_bytes(ctx.send, 404, _NOT_FOUND)
            return
        accept = ctx.headers.get(b"accept", b"").decode("latin-1")
        try:
            body, content_type = m.render(accept)
        except TypeError:
            body, content_type = m.render()
        await send_bytes(ctx.send, 200, body, content_type=content_type.encode()
                         if isinstance(content_type, str) else content_type)

    async def _openapi(self, ctx: RequestContext) -> None:
        if self._openapi_body is None:  # built once, from the routes as they are by then
            from .openapi import build_openapi

            self._openapi_body = encode(build_openapi(self.routes))
        await send_bytes(ctx.send, 200, self._openapi_body)

    async def _tokenize(self, ctx: RequestContext) -> None:
        raw = ctx.body
        is_chat = b'"messages"' in raw
        req: Any = parse_request(raw, TokenizeChatRequest if is_chat else TokenizeCompletionRequest)
        self.completions.check_model(req.model)
        tok = self.tokenizer
        if is_chat:
            _, ids = await self.chat.render_prompt_async(
                req.messages, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs, add_special_tokens=req.add_special_tokens)
        else:
            ids = await tok.encode_async(req.prompt, add_special_tokens=req.add_special_tokens)
        body: dict[str, Any] = {"count": len(ids), "max_model_len": self.settings.max_model_len, "tokens": ids,
                                "token_strs": [tok.hf.id_to_token(i) or "" for i in ids]
                                if req.return_token_strs else None}
        await send_bytes(ctx.send, 200, encode(body))

    async def _detokenize(self, ctx: RequestContext) -> None:
        req = parse_request(ctx.body, DetokenizeRequest)
        self.completions.check_model(req.model)
        try:  # as vLLM's tokenizer: ids outside the vocabulary decode to nothing
            text = self.tokenizer.decode(req.tokens, skip_special_tokens=False)
        except OverflowError as e:  # an id beyond the tokenizer's integer type
            raise HTTPError(400, str(e), "BadRequestError") from None
        await send_bytes(ctx.send, 200, encode({"prompt": text}))


class _Disconnected(Exception):
    pass


async def _watch(receive: Callable, client_gone: Callable[[], None]) -> None:
    """The disconnect watcher for a server without the hook: `receive` until the client leaves."""
    while True:
        if (await receive())["type"] == "http.disconnect":
            client_gone()
            return


def _has_header(scope: dict[str, Any], name: bytes) -> bool:
    return any(k == name for k, _ in scope.get("headers") or ())


def build_app(engine: Any, tokenizer: Tokenizer, settings: ServeSettings, **kwargs: Any) -> OpenAIApp:
    """The ASGI app serving the OpenAI API for `engine` (an AsyncEngine, already started)."""
    return OpenAIApp(engine, tokenizer, settings, **kwargs)
