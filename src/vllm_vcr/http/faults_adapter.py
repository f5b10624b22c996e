"""Faults applied to HTTP requests: the thin side of `faults/` that touches ASGI and sockets.

`FaultGate.admit` runs once per generation request before its handler. An HTTP failure is
answered at once (the engine never sees the request); a mid-stream fault wraps the request's
`send`, which also takes the request off the direct-write streaming path (only that request).
A request a fault ends early raises FaultEnded out of its handler, which closes its engine
stream (the engine counts it aborted) and which the app swallows.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from typing import Any, Callable

import msgspec

from ..faults import RETURN_ERROR_HEADER, FaultAction, FaultController, RequestInfo
from ..frontend.errors import INTERNAL_ERROR_BODY, STREAM_INTERNAL_ERROR
from .sse import DONE, send_bytes
from .uvicorn_internals import transport_of

logger = logging.getLogger("vllm_vcr.faults")


class FaultEnded(Exception):
    """A fault ended this response; nothing more is to be sent."""


class _Model(msgspec.Struct):
    model: Any = None


_model_decoder = msgspec.json.Decoder(_Model)


def _model_of(body: bytes) -> str | None:
    try:
        model = _model_decoder.decode(body).model
    except (msgspec.DecodeError, RecursionError):
        return None
    return model if isinstance(model, str) else None


class FaultGate:
    def __init__(self, controller: FaultController) -> None:
        self.controller = controller

    async def admit(self, scope: dict[str, Any], body: bytes, send: Callable) -> Callable | None:
        """The `send` the handler should use, or None when the request was answered here."""
        header = None
        for name, value in scope.get("headers") or ():
            if name == RETURN_ERROR_HEADER:
                header = value
                break
        c = self.controller
        if header is not None:
            action: FaultAction | None = c.from_header(header)
        elif not c.active:
            return send
        else:
            headers = dict(scope.get("headers") or ())
            try:
                action = c.decide(RequestInfo(scope["path"], headers, lambda: _model_of(body)))
            except Exception:  # a fault rule must never become the client's 500: serve it unfaulted
                logger.exception("fault script failed on %s; the request is served without a fault",
                                 scope.get("path"))
                action = None
        if action is None:
            return send
        if action.failure is not None:
            f = action.failure
            await send_bytes(send, f.status, f.body, list(f.headers))
            return None
        faulty = FaultySend(send, action)
        scope["vllm_vcr.send"] = faulty  # streams write through the fault, not straight to the transport
        return faulty


def _reset(send: Callable) -> None:
    """Abort the connection with a TCP RST (SO_LINGER 0), as a crashed peer or proxy would."""
    transport = transport_of(send)
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()


def _token_events(data: bytes, first: bool) -> int:
    """SSE events that carry output (not [DONE]; not a chat stream's opening role chunk)."""
    n = data.count(b"data: ") - data.count(b"data: [DONE]")
    if first and b'"role":' in data[:400] and b'"content":""' in data[:400]:
        n -= 1
    return max(n, 0)


class FaultySend:
    """The ASGI `send` of one request with a mid-stream fault (stall, stream_error, reset)."""

    def __init__(self, send: Callable, action: FaultAction) -> None:
        self._send = send
        self.action = action
        self.streaming = False
        self.tokens = 0
        self.fired = False
        self.ended = False
        self._first = True

    async def __call__(self, message: dict[str, Any]) -> None:
        if self.ended:
            raise FaultEnded()
        kind = message["type"]
        if kind == "http.response.start":
            headers = dict(message.get("headers") or ())
            self.streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            if not self.streaming and message.get("status", 200) < 400:
                await self._fire_before_body()
            await self._send(message)
            return
        if kind == "http.response.body" and self.streaming and not self.fired:
            data = message.get("body", b"")
            last = not message.get("more_body", False)
            n = _token_events(data, self._first)
            self._first = False
            if self.tokens + n > self.action.after_tokens or (last and n):
                await self._fire_in_stream()
            self.tokens += n
        await self._send(message)

    async def _fire_before_body(self) -> None:
        """A non-streamed response: stall delays it, reset drops it, stream_error becomes a 500."""
        self.fired = True
        a = self.action.action
        if a == "stall":
            await asyncio.sleep(self.action.stall_ms / 1000)
        elif a == "reset":
            self.ended = True
            _reset(self._send)
            raise FaultEnded()
        elif a == "stream_error":
            self.ended = True
            await send_bytes(self._send, 500, INTERNAL_ERROR_BODY)
            raise FaultEnded()

    async def _fire_in_stream(self) -> None:
        self.fired = True
        a = self.action.action
        if a == "stall":
            await asyncio.sleep(self.action.stall_ms / 1000)
            return
        self.ended = True
        if a == "reset":
            _reset(self._send)
        else:  # stream_error: vLLM's event when generation fails mid-stream, then [DONE]
            await self._send({"type": "http.response.body", "body": STREAM_INTERNAL_ERROR + DONE, "more_body": False})
        raise FaultEnded()


def install_gauges(metrics: Any, controller: FaultController) -> None:
    """Scripted gauges replace the engines' values in /metrics (every engine series of a gauge)."""
    if metrics is None or not hasattr(metrics, "family_rewrite"):
        return

    def source(name: str) -> str:
        return "vllm:num_requests_waiting" if name == "vllm:num_requests_waiting_by_reason" else name

    def key(name: str) -> Any:
        """What the rewrite of the family `name` depends on: the scripted value now, if any."""
        # (gauge_value, not the local script: with several API servers the script is shared state)
        v = controller.gauge_value(source(name))
        return float.hex(v) if type(v) is float else v  # (-0.0 and 0.0 are different texts)

    def rewrite(fam: Any) -> Any:
        v = controller.gauge_value(source(fam.name))
        if v is None:
            return fam
        if fam.name == "vllm:num_requests_waiting_by_reason":
            fam.samples = [s._replace(value=v if s.labels.get("reason") == "capacity" else 0.0) for s in fam.samples]
        else:
            fam.samples = [s._replace(value=v) for s in fam.samples]
        return fam

    metrics.family_rewrite_key = key
    metrics.family_rewrite = rewrite
    # (several API servers: when the shared gauges change, each re-stamps its gauges)
    metrics.gauges_epoch = getattr(controller, "gauges_epoch", None)
