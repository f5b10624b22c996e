"""vLLM's server routes every deployment has: /health, /ping, /version, /metrics, and
SageMaker's /invocations."""

from __future__ import annotations

import gzip
from typing import Any

from pydantic import ValidationError

from .. import __version__
from ..frontend.errors import HTTPError, bad_request, error_body
from ..frontend.protocol import ChatCompletionRequest, CompletionRequest, RequestValueError
from ..http.serving_base import VLLM_API_VERSION, RequestContext, encode, raw_request_json
from ..http.sse import send_bytes

_NOT_FOUND = encode({"detail": "Not Found"})
# prometheus_client's CONTENT_TYPE_LATEST in the release vLLM 0.32 ships (0.26)
PROMETHEUS_TEXT = b"text/plain; version=1.0.0; charset=utf-8"


class BasicServing:
    def __init__(self, app: Any) -> None:
        self.app = app  # (its engine and metrics may be replaced after this is built)

    async def health(self, ctx: RequestContext) -> None:
        if getattr(self.app.engine, "is_running", True):
            await send_bytes(ctx.send, 200, b"")
        else:
            await send_bytes(ctx.send, 503, error_body("Engine is not running", "ServiceUnavailableError", 503))

    async def version(self, ctx: RequestContext) -> None:
        # the vLLM release whose API is reproduced (clients compare it); vllm-vcr's own version beside it
        await send_bytes(ctx.send, 200, encode({"version": VLLM_API_VERSION, "vllm_vcr_version": __version__}))

    async def metrics(self, ctx: RequestContext) -> None:
        """vLLM mounts two things at /metrics: the instrumentator's GET route, which always answers the
        Prometheus text format (whatever the Accept header asks), and prometheus_client's ASGI app
        behind it, which answers POST and HEAD: the format Accept asks for (OpenMetrics escapes `vllm:`
        to `vllm_`), gzipped when Accept-Encoding allows, with no Content-Length."""
        m = self.app.metrics
        if m is None:
            await send_bytes(ctx.send, 404, _NOT_FOUND)
            return
        method = ctx.scope["method"]
        if method == "GET" and getattr(m, "GET_IGNORES_ACCEPT", False):
            await send_bytes(ctx.send, 200, m.render_text(), content_type=PROMETHEUS_TEXT)
            return
        accept = ctx.headers.get(b"accept", b"").decode("latin-1")
        try:
            body, content_type = m.render(accept)
        except TypeError:
            body, content_type = m.render()
        if isinstance(content_type, str):
            content_type = content_type.encode()
        if method == "GET":
            await send_bytes(ctx.send, 200, body, content_type=content_type)
            return
        headers = [(b"content-type", content_type)]
        if b"gzip" in ctx.headers.get(b"accept-encoding", b""):
            body = gzip.compress(body)
            headers.append((b"content-encoding", b"gzip"))
        headers.append((b"vary", b"Origin"))
        await ctx.send({"type": "http.response.start", "status": 200, "headers": headers})
        await ctx.send({"type": "http.response.body", "body": b"" if method == "HEAD" else body, "more_body": False})

    async def invocations(self, ctx: RequestContext) -> None:
        """SageMaker's /invocations: the body is a chat request or else a completion request (the
        first request model that validates it wins, as in vLLM)."""
        raw_request_json(ctx.body, lambda e: HTTPError(400, f"JSON decode error: {e}", "Bad Request"))
        app = self.app
        for model, handler in ((ChatCompletionRequest, app.chat.handle), (CompletionRequest, app.completions.handle)):
            try:
                model.model_validate_json(ctx.body)
            except ValidationError as e:
                # vLLM's request validators raise VLLMValidationError, which pydantic does not
                # catch: it ends the search with its 400 (an empty object is a CompletionRequest
                # without a prompt)
                errors = e.errors(include_url=False)
                cause = errors[0].get("ctx", {}).get("error") if errors else None
                if isinstance(cause, RequestValueError):
                    raise cause from None
                continue
            return await handler(ctx)
        raise bad_request("Cannot find suitable handler for request. Expected one of: "
                          "['ChatCompletionRequest', 'CompletionRequest']")
