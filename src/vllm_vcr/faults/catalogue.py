"""The HTTP failures a fault can answer with: status, headers and vLLM/OpenAI error body.

Bodies use vLLM's envelope `{"error": {"message", "type", "param", "code"}}` with the words vLLM
uses where vLLM has the error (context length, unknown model, 500, 503) and OpenAI's where it has
none (429), except 401, which is the exact body vLLM's API-key middleware sends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

RETRY_AFTER_DEFAULT = 1  # seconds, in the Retry-After header of a 429 or 503


@dataclass(frozen=True)
class HTTPFailure:
    status: int
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()


def _body(message: str, err_type: str, status: int, param: str | None = None) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": err_type, "param": param, "code": status}})


# status -> error type, as openai-python/openai-node name the classes (llm-d-inference-sim's table)
_TYPE_BY_STATUS = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                   404: "NotFoundError", 409: "ConflictError", 422: "UnprocessableEntityError",
                   429: "RateLimitError"}

ERROR_KINDS = ("rate_limit", "unauthorized", "context_length", "model_not_found", "server_error", "unavailable")


def _retry_after(seconds: float | None) -> tuple[tuple[bytes, bytes], ...]:
    """RFC 9110 delay-seconds is a whole number: rounded up, so a client never retries early."""
    value = RETRY_AFTER_DEFAULT if seconds is None else seconds
    return ((b"retry-after", str(max(0, math.ceil(value))).encode()),)


def failure_for_kind(kind: str, *, model: str, max_model_len: int, retry_after: float | None = None) -> HTTPFailure:
    """One of ERROR_KINDS as the response vLLM (or OpenAI, for 429) would send."""
    if kind == "rate_limit":
        return HTTPFailure(429, _body(f"Rate limit reached for {model} on requests per min (RPM). "
                                      "Please try again later.", "RateLimitError", 429), _retry_after(retry_after))
    if kind == "unauthorized":
        return HTTPFailure(401, b'{"error":"Unauthorized"}')
    if kind == "context_length":  # vLLM's words for a prompt that fills the context by itself
        count = max_model_len + 1
        return HTTPFailure(400, _body(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{count} input tokens, which exceeds this limit even without any output tokens. Please reduce "
            f"the length of the input prompt. (parameter=input_tokens, value={count})",
            "BadRequestError", 400, "input_tokens"))
    if kind == "model_not_found":
        return HTTPFailure(404, _body(f"The model `{model}` does not exist.", "NotFoundError", 404, "model"))
    if kind == "server_error":
        return HTTPFailure(500, _body("Internal server error", "InternalServerError", 500))
    if kind == "unavailable":
        return HTTPFailure(503, _body("The server is overloaded or not ready yet.", "ServiceUnavailableError", 503),
                           _retry_after(retry_after))
    raise ValueError(f"unknown error kind {kind!r}; one of {', '.join(ERROR_KINDS)}")


def failure_for_status(status: int, *, retry_after: float | None = None, reason: str | None = None) -> HTTPFailure:
    """Any 4xx/5xx status, as llm-d-inference-sim's `X-Return-Error: N` answers it."""
    err_type = _TYPE_BY_STATUS.get(status, "InternalServerError" if status >= 500 else "APIError")
    message = reason or f"Simulated error triggered by X-Return-Error header (code {status})"
    headers = _retry_after(retry_after) if status in (429, 503) else ()
    return HTTPFailure(status, _body(message, err_type, status), headers)


def parse_return_error(value: bytes) -> HTTPFailure:
    """The `X-Return-Error` header: an integer 4xx/5xx status; anything else is a 400."""
    text = value.decode("latin-1").strip()
    try:
        status = int(text)
    except ValueError:
        status = 0
    if not 400 <= status <= 599:
        return HTTPFailure(400, _body(f"Invalid X-Return-Error header value {text[:40]!r}: expected an HTTP "
                                      "error status between 400 and 599", "BadRequestError", 400))
    return failure_for_status(status)
