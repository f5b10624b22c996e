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

    async def docs(self, ctx: RequestContext) -> None:
        await send_bytes(ctx.send, 200, _SWAGGER_UI, content_type=_HTML)

    async def redoc(self, ctx: RequestContext) -> None:
        await send_bytes(ctx.send, 200, _REDOC, content_type=_HTML)

    async def oauth2_redirect(self, ctx: RequestContext) -> None:
        await send_bytes(ctx.send, 200, _OAUTH2_REDIRECT, content_type=_HTML)

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


# The interactive API pages vLLM's FastAPI app serves over /openapi.json (Swagger UI and ReDoc,
# loaded from their CDN bundles; the titles are FastAPI's defaults, which vLLM keeps)
_HTML = b"text/html; charset=utf-8"
_SWAGGER_UI = """<!DOCTYPE html>
<html>
<head>
<meta name="viewport" content="width=device-width, initial-scale=1.0">
<title>FastAPI - Swagger UI</title>
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>
window.ui = SwaggerUIBundle({url: "/openapi.json", dom_id: "#swagger-ui", deepLinking: true,
  oauth2RedirectUrl: window.location.origin + "/docs/oauth2-redirect",
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
  layout: "BaseLayout"});
</script>
</body>
</html>
""".encode()
_REDOC = """<!DOCTYPE html>
<html>
<head>
<title>FastAPI - ReDoc</title>
<meta charset="utf-8"/>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>body { margin: 0; padding: 0; }</style>
</head>
<body>
<redoc spec-url="/openapi.json"></redoc>
<script src="https://cdn.jsdelivr.net/npm/redoc@2/bundles/redoc.standalone.js"></script>
</body>
</html>
""".encode()
# Swagger UI's OAuth2 redirect: hand the authorization response back to the page that opened it
_OAUTH2_REDIRECT = """<!doctype html>
<html lang="en-US">
<head><title>Swagger UI: OAuth2 Redirect</title></head>
<body>
<script>
(function () {
  var oauth2 = window.opener && window.opener.swaggerUIRedirectOauth2;
  if (!oauth2) { window.close(); return; }
  var raw = /code|token|error/.test(window.location.hash) ? window.location.hash.substring(1)
                                                          : window.location.search.substring(1);
  var params = {};
  new URLSearchParams(raw).forEach(function (v, k) { params[k] = v; });
  if (params.state !== oauth2.state) {
    oauth2.errCb({authId: oauth2.auth.name, source: "auth", level: "warning",
                  message: "Authorization may be unsafe: the state differs from the one sent"});
  }
  if (oauth2.auth.schema.get("flow") === "accessCode" || oauth2.auth.schema.get("flow") === "authorizationCode") {
    if (params.code) { delete oauth2.state; oauth2.auth.code = params.code;
                       oauth2.callback({auth: oauth2.auth, redirectUrl: oauth2.redirectUrl}); }
    else { oauth2.errCb({authId: oauth2.auth.name, source: "auth", level: "error",
                         message: params.error || "No authorization code received"}); }
  } else {
    oauth2.callback({auth: oauth2.auth, token: params, isValid: true, redirectUrl: oauth2.redirectUrl});
  }
  window.close();
})();
</script>
</body>
</html>
""".encode()

