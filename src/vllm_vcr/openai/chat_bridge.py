"""Running a chat completion on behalf of another API (Responses, Anthropic Messages, Cohere).

vLLM builds those endpoints on the same renderer, parsers and engine client as chat; here they
are adapters over `ChatServing.handle`: the adapter writes a chat request body, the chat handler
runs it (all its checks, tool calls, structured outputs, reasoning split), and its answer is
captured instead of sent: the whole body, or each streamed chunk as it is produced.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from ..frontend.errors import HTTPError
from ..http.serving_base import RequestContext, encode

ChunkHandler = Callable[[dict[str, Any]], Awaitable[None]]


class _Capture:
    """An ASGI `send` that keeps the status and body, or hands each SSE event to a callback."""

    def __init__(self, on_chunk: ChunkHandler | None) -> None:
        self.status = 200
        self.body = bytearray()
        self.on_chunk = on_chunk
        self._pending = b""

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            return
        data = message.get("body", b"")
        if self.on_chunk is None or self.status != 200:
            self.body += data
            return
        self._pending += data
        *events, self._pending = self._pending.split(b"\n\n")
        for event in events:
            payload = event.strip()
            if payload.startswith(b"data: ") and payload != b"data: [DONE]":
                await self.on_chunk(msgspec.json.decode(payload[6:]))


async def run_chat(chat: Any, ctx: RequestContext, body: dict[str, Any],
                   on_chunk: ChunkHandler | None = None) -> dict[str, Any] | None:
    """The chat answer for `body`: the response dict (non-streaming), or None after every chunk
    went to `on_chunk`. An error answer is raised as the HTTPError the chat handler would send."""
    capture = _Capture(on_chunk if body.get("stream") else None)
    # without the server's raw send: the chat stream must not write to the client's socket itself
    scope = {k: v for k, v in ctx.scope.items() if k != "vllm_vcr.send"}
    inner = RequestContext(scope, ctx.receive, capture, encode(body))
    inner.arrival = ctx.arrival
    try:
        await chat.handle(inner)
    finally:
        ctx.finishing = inner.finishing
    if capture.status != 200:
        err = msgspec.json.decode(bytes(capture.body)).get("error", {})
        raise HTTPError(capture.status, err.get("message", ""), err.get("type"), err.get("param"))
    if on_chunk is not None and body.get("stream"):
        return None
    return msgspec.json.decode(bytes(capture.body))
