"""Raw ASGI responses: JSON bodies and Server-Sent Events written straight to `send`.

Streaming skips every framework layer on the hot path: each chunk is one pre-built bytes object
and one `send` call.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import msgspec

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
