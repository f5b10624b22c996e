"""Raw ASGI responses: JSON bodies and Server-Sent Events written straight to `send`.

Streaming skips every framework layer on the hot path: each chunk is one pre-built bytes object
and one `send` call.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import msgspec

from .uvicorn_internals import DirectBody

_encode = msgspec.json.encode

Send = Callable[[dict[str, Any]], Awaitable[None]]

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [  # what vLLM's StreamingResponse sends, no more (uvicorn checks every header)
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"vary", b"Origin"),
]
DONE = b"data: [DONE]\n\n"


def named_event(kind: str, body: Any) -> bytes:
    """A named SSE event (`event: <kind>` then its JSON data): the Responses and Anthropic
    Messages streams are made of these."""
    return b"event: " + kind.encode() + b"\ndata: " + _encode(body) + b"\n\n"


async def send_bytes(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None,
                     content_type: bytes | None = b"application/json") -> None:
    h = [(b"content-length", str(len(body)).encode()), (b"vary", b"Origin")]
    if content_type is not None:  # a redirect has none
        h.insert(0, (b"content-type", content_type))
    if headers:
        h.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": h})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class HeadObserver:
    """A `send` wrapper that only looks at the response head and passes every message on to
    `send`: a stream that writes its head straight to the server's transport tells it instead
    (`saw_head`), so what it notes is the same."""

    __slots__ = ("send",)

    def saw_head(self, status: int, headers: Any) -> None:
        raise NotImplementedError


class SSEWriter:
    """One event stream. `start()` is implicit on the first `write`."""

    __slots__ = ("_send", "started", "closed")

    def __init__(self, send: Send):
        self._send = send
        self.started = False
        self.closed = False

    async def start(self) -> None:
        if not self.started:
            self.started = True
            await self._send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

    def start_direct(self, raw_send: Send) -> DirectBody | None:
        """`start()` written straight to uvicorn's transport (DirectBody.start), when nothing but a
        HeadObserver stands between this writer's `send` and the server's own (`raw_send`); the
        body then attached. None: not started, call `start()`."""
        send = self._send
        if self.started:
            return None
        if send is raw_send:
            observer = None
        elif isinstance(send, HeadObserver) and send.send is raw_send:
            observer = send
        else:
            return None
        direct = DirectBody.start(raw_send, 200, SSE_HEADERS)
        if direct is not None:
            self.started = True
            if observer is not None:
                observer.saw_head(200, SSE_HEADERS)
        return direct

    def close_direct(self, direct: DirectBody, data: bytes) -> bool:
        """`close(data)` written straight to the transport (DirectBody.finish); False: not closed,
        call `close`. Only for a writer whose head `start_direct` wrote."""
        if self.closed or not direct.finish(data):
            return False
        self.closed = True
        return True

    async def write(self, data: bytes) -> None:
        if not self.started:
            await self.start()
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def close(self, data: bytes = b"") -> None:
        if self.closed:
            return
        if not self.started:
            await self.start()
        self.closed = True
        await self._send({"type": "http.response.body", "body": data, "more_body": False})
