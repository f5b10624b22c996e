"""vLLM's error bodies: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import re
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

    def __reduce__(self) -> tuple[Any, ...]:
        # as it is (raised while parsing a large body in a worker process: http/serving_base.py)
        return rebuilt_exception, (type(self), self.args, self.__dict__)

    def body(self) -> bytes:
        return error_body(self.message, self.err_type, self.status, self.param)


def rebuilt_exception(cls: type, args: tuple, state: dict[str, Any]) -> Exception:
    """An exception unpickled with its attributes, without calling its __init__ again."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


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


_ROOT_PATH = re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+")
_FILE_PATH = re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+")


def sanitize(message: str) -> str:
    """vLLM hides server paths in error messages (a model served from /models/x shows <path>)."""
    return _FILE_PATH.sub("<path>", _ROOT_PATH.sub("<path>", message)).strip()


def model_not_found(model: str, served: list[str]) -> HTTPError:
    return HTTPError(404, sanitize(f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}."),
                     "NotFoundError", "model")


_MAX_REPORTED = 10
_MAX_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000
# pydantic-core's schema-kind words that show up in `loc` for unions and wrappers
_INTERNAL_LOC = frozenset({
    "function-wrap", "function-after", "function-before", "function-plain", "json-or-python", "lax-or-strict",
    "chain", "default", "nullable", "tagged-union", "union", "call", "arguments", "is-instance", "is-subclass",
    "callable", "str", "int", "float", "bool", "bytes", "bytearray", "list", "tuple", "dict", "set",
    "frozenset", "complex", "none", "nonetype", "constrained-int", "constrained-str",
})


def _clean_loc(loc: tuple) -> str:
    """('body', 'prompt', 'list[int]', 0) -> 'body.prompt.0', as vLLM reports `param`."""
    parts = [str(p) for p in loc
             if not any(c in str(p) for c in "[](){}") and str(p).lower() not in _INTERNAL_LOC]
    return ".".join(parts) if parts else ".".join(str(p) for p in loc)


def _summarize_input(value: Any) -> Any:
    # bounded, like vLLM: one malformed request must not produce a huge error body
    if isinstance(value, str):
        return value if len(value) <= _MAX_INPUT_CHARS else value[:_MAX_INPUT_CHARS] + "...[truncated]"
    if isinstance(value, (bytes, bytearray)):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = str(value)
    except Exception:
        return f"<{type(value).__name__}>"
    return text if len(text) <= _MAX_INPUT_CHARS else text[:_MAX_INPUT_CHARS] + "...[truncated]"


def validation_error(errors: list[dict[str, Any]], where: str = "body") -> HTTPError:
    """A schema error, in the words of vLLM's RequestValidationError handler: type "Bad Request",
    "N validation error(s):" and one line per error (at most 10), `param` the first error's field."""
    count = len(errors)
    lines = []
    param = None
    for k, e in enumerate(errors):
        loc = _clean_loc((where, *e.get("loc", ())))  # "query" for a query parameter
        if k == 0:
            param = loc
        if k >= _MAX_REPORTED:
            continue
        item: dict[str, Any] = {"type": e.get("type"), "loc": loc, "msg": e.get("msg"),
                                "input": _summarize_input(e.get("input"))}
        ctx = e.get("ctx")
        if ctx:
            item["ctx"] = dict(ctx)  # shown as Python shows them (an exception as ValueError('...'))
        text = str(item)
        lines.append(text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "...[truncated]")
    label = "error" if count == 1 else "errors"
    message = f"{count} validation {label}:\n" + "".join(f"  {line}\n" for line in lines)
    if count > _MAX_REPORTED:
        message += f"  ...and {count - _MAX_REPORTED} more {label}\n"
    return HTTPError(400, message.rstrip(), HTTPStatus.BAD_REQUEST.phrase, param)


class FrameworkHTTPError(HTTPError):
    """An error FastAPI answers itself, outside vLLM's exception handlers: `{"detail": message}`."""

    def body(self) -> bytes:
        return _encode({"detail": self.message})


def unparsable_body() -> HTTPError:
    """FastAPI's answer when parsing the body raised something other than a JSON error (JSON
    nested beyond the parser's depth, bytes that are not UTF-8): its own `{"detail": ...}` body."""
    return FrameworkHTTPError(400, "There was an error parsing the body", HTTPStatus.BAD_REQUEST.phrase)


class UnencodableText(HTTPError):
    """A body with a lone surrogate escape (`\\ud800`: valid JSON, no Unicode text). vLLM parses it
    and fails where the text meets the tokenizer, with the tokenizer's TypeError as a 400
    BadRequestError (in the API family's error body); serve refuses it as it parses (no string
    with one can be encoded, logged or sent back), with the same answer."""

    def __init__(self) -> None:
        super().__init__(400, "TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]",
                         "BadRequestError")


def not_an_object(value: Any) -> HTTPError:
    """A JSON body that is not an object, as FastAPI reports it: null is a missing body, any
    other value cannot give the request's fields."""
    if value is None:
        return validation_error([{"type": "missing", "loc": (), "msg": "Field required", "input": None}])
    return validation_error([{"type": "model_attributes_type", "loc": (),
                              "msg": "Input should be a valid dictionary or object to extract fields from",
                              "input": value}])


def json_decode_error(body: bytes) -> HTTPError:
    """Malformed JSON, reported as FastAPI does (position and reason from Python's json module)."""
    import json

    try:
        json.loads(body)
    except (RecursionError, UnicodeDecodeError):  # nested beyond any parser's depth, or not UTF-8
        return unparsable_body()
    except ValueError as e:
        pos = getattr(e, "pos", 0)
        reason = getattr(e, "msg", str(e))
    else:  # valid for Python but not for pydantic (e.g. a lone surrogate escape)
        pos, reason = 0, "Invalid JSON"
    return validation_error([{"type": "json_invalid", "loc": (pos,), "msg": "JSON decode error",
                              "input": {}, "ctx": {"error": reason}}])


# The streaming and non-streaming bodies for an engine-side failure (finish_reason ERROR).
INTERNAL_ERROR_BODY = error_body("Internal server error", "InternalServerError", 500)
STREAM_INTERNAL_ERROR = b"data: " + INTERNAL_ERROR_BODY + b"\n\n"
# ... and for an engine that is gone (vLLM's EngineDeadError: its message, a 500)
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
STREAM_ENGINE_DEAD = b"data: " + error_body(ENGINE_DEAD_MESSAGE, "InternalServerError", 500) + b"\n\n"
