"""vLLM's error bodies: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import msgspec

_encode = msgspec.json.encode


class HTTPError(Exception):
    """Raised anywhere in a handler; the app turns it into vLLM's JSON error body."""

    def __init__(self, status: int, message: str, err_type: str | None = None, param: str | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.err_type = err_type or _default_type(self.status)
        self.param = param
        self.headers = headers or []

    def body(self) -> bytes:
        return error_body(self.message, self.err_type, self.status, self.param)


def _default_type(status: int) -> str:
    return {
        400: "BadRequestError",
        401: "Unauthorized",
        404: "NotFoundError",
        500: "InternalServerError",
        501: "NotImplementedError",
        503: "ServiceUnavailableError",
    }.get(status, HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error")


def error_dict(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> bytes:
    return _encode(error_dict(message, err_type, code, param))


def bad_request(message: str, param: str | None = None) -> HTTPError:
    return HTTPError(400, message, "BadRequestError", param)


def model_not_found(model: str) -> HTTPError:
    return HTTPError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


def validation_error(errors: list[dict[str, Any]]) -> HTTPError:
    """A schema error, worded as FastAPI's RequestValidationError reaches vLLM's handler."""
    cleaned = []
    for e in errors:
        item = {"type": e.get("type"), "loc": ("body", *e.get("loc", ())), "msg": e.get("msg"),
                "input": e.get("input")}
        ctx = e.get("ctx")
        if ctx:
            item["ctx"] = {k: (v if isinstance(v, (str, int, float, bool, type(None))) else str(v))
                           for k, v in ctx.items()}
        cleaned.append(item)
    return HTTPError(400, str(cleaned), HTTPStatus.BAD_REQUEST.phrase, None)


def json_decode_error(position: int, reason: str) -> HTTPError:
    return validation_error([{"type": "json_invalid", "loc": (position,), "msg": "JSON decode error",
                              "input": {}, "ctx": {"error": reason}}])


# The streaming and non-streaming bodies for an engine-side failure (finish_reason ERROR).
INTERNAL_ERROR_BODY = error_body("Internal server error", "InternalServerError", 500)
STREAM_INTERNAL_ERROR = b"data: " + INTERNAL_ERROR_BODY + b"\n\n"
