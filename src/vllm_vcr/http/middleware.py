"""What vLLM's FastAPI stack does around its routes, in raw ASGI: X-Request-Id headers
(`--enable-request-id-headers`), CORS (Starlette's CORSMiddleware with vLLM's flags), the
trailing-slash redirect of Starlette's router, and the JSON content-type check of vLLM's
generation and tokenizer routes.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable
from urllib.parse import quote

from ..frontend.errors import HTTPError

_MEDIA_TYPE_MESSAGE = "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"


def with_request_id(scope: dict[str, Any], send: Callable) -> Callable:
    """`send` that adds X-Request-Id (the request's, else a uuid4 hex) to the response head."""

    async def send_with_request_id(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            rid = None
            for name, value in scope.get("headers") or ():
                if name == b"x-request-id":
                    rid = value
                    break
            headers = [*message.get("headers", ()), (b"x-request-id", rid or uuid.uuid4().hex.encode())]
            message = {**message, "headers": headers}
        await send(message)

    return send_with_request_id


def cors_middleware(app: Callable, settings: Any) -> Callable:
    """Starlette's CORSMiddleware configured as vLLM configures it. Our responses carry the
    `Vary: Origin` vLLM's carry, to which the middleware appends its own for a request with an
    Origin: the header is merged, so it reads "Origin" once, as vLLM's does."""
    from starlette.middleware.cors import CORSMiddleware

    cors = CORSMiddleware(app, allow_origins=settings.allowed_origins, allow_credentials=settings.allow_credentials,
                          allow_methods=settings.allowed_methods, allow_headers=settings.allowed_headers)

    async def cors_with_one_vary(scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope.get("type") != "http" or not any(name == b"origin" for name, _ in scope.get("headers") or ()):
            await cors(scope, receive, send)  # the middleware leaves such a response alone
            return

        async def send_merged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": merge_vary(message.get("headers") or [])}
            await send(message)

        await cors(scope, receive, send_merged)

    return cors_with_one_vary


def merge_vary(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """One Vary header naming each field once (in first-seen order)."""
    seen: dict[bytes, bytes] = {}
    rest = []
    for name, value in headers:
        if name.lower() == b"vary":
            for field in value.split(b","):
                field = field.strip()
                if field:
                    seen.setdefault(field.lower(), field)
        else:
            rest.append((name, value))
    if seen:
        rest.append((b"vary", b", ".join(seen.values())))
    return rest


def check_json_content_type(headers: dict[bytes, bytes]) -> None:
    """vLLM's validate_json_request: a body that is not application/json is a 400, checked before
    the body is parsed (a malformed body of another type reports the media type)."""
    raw = headers.get(b"content-type", b"")
    if raw in _JSON_TYPES:  # a value seen before that passed (the usual case: the client's one)
        return
    content_type = raw.decode("latin-1").lower()
    if content_type.split(";", 1)[0].strip() != "application/json":
        raise HTTPError(400, _MEDIA_TYPE_MESSAGE, "Bad Request")
    if len(_JSON_TYPES) < 64:
        _JSON_TYPES.add(raw)


_JSON_TYPES: set[bytes] = set()  # Content-Type values that passed check_json_content_type (a few kept)


def redirect_location(scope: dict[str, Any], path: str) -> bytes:
    """The absolute URL Starlette's router redirects a trailing-slash path to."""
    host = None
    for name, value in scope.get("headers") or ():
        if name == b"host":
            host = value.decode("latin-1")
            break
    scheme = scope.get("scheme", "http")
    if host is None:
        server = scope.get("server") or ("127.0.0.1", 80)
        host = server[0] if server[1] == {"http": 80, "https": 443}.get(scheme) else f"{server[0]}:{server[1]}"
    url = f"{scheme}://{host}{scope.get('root_path', '')}{path}"
    query = scope.get("query_string", b"")
    if query:
        url += "?" + query.decode("latin-1")
    return quote(url, safe=":/%#?=@[]!$&'()*+,;").encode("latin-1")
