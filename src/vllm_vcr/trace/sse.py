"""Incremental Server-Sent-Events parsing and the reading of OpenAI stream chunks.

Shared by the load generator and the recording proxy, which both time chunks client-side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

_decoder = msgspec.json.Decoder()


class SSEParser:
    """Feed raw bytes as they arrive; get back the `data:` payload of every completed event."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buf += chunk
        out: list[bytes] = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                return out
            line = self._buf[:nl].rstrip(b"\r")
            self._buf = self._buf[nl + 1:]
            if not line:  # a blank line ends the event
                if self._data:
                    out.append(b"\n".join(self._data))
                    self._data = []
            elif line.startswith(b"data:"):
                self._data.append(line[5:].lstrip(b" ") if line[5:6] == b" " else line[5:])
            # comments (":") and other fields (event:, id:, retry:) carry nothing we time

    def close(self) -> list[bytes]:
        """An event not closed by a blank line at end of stream still counts."""
        rest = self.feed(b"\n\n") if self._buf or self._data else []
        return rest


@dataclass
class ChunkInfo:
    tokens: int = 0  # output tokens this chunk delivered (best knowledge)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    done: bool = False  # the `[DONE]` sentinel


def _count_tokens(choice: dict[str, Any]) -> int:
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids)  # vLLM `return_token_ids`: exact
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        if isinstance(lp.get("tokens"), list):  # completions logprobs
            return len(lp["tokens"])
        if isinstance(lp.get("content"), list):  # chat logprobs
            return len(lp["content"])
    text = choice.get("text")
    if text is None:
        delta = choice.get("delta") or {}
        text = "".join(str(delta.get(k) or "") for k in ("content", "reasoning_content", "reasoning"))
        if not text and delta.get("tool_calls"):
            return 1
    return 1 if text else 0  # without ids or logprobs, one non-empty text delta = one token


def parse_chunk(payload: bytes) -> ChunkInfo:
    """Read one OpenAI completions / chat-completions stream event."""
    if payload.strip() == b"[DONE]":
        return ChunkInfo(done=True)
    try:
        obj = _decoder.decode(payload)
    except msgspec.DecodeError:
        return ChunkInfo()
    if not isinstance(obj, dict):
        return ChunkInfo()
    info = ChunkInfo()
    if "error" in obj and "choices" not in obj:
        err = obj["error"]
        info.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        return info
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            continue  # n > 1: time the first sequence only
        info.tokens += _count_tokens(choice)
        if choice.get("finish_reason"):
            info.finish_reason = str(choice["finish_reason"])
    usage = obj.get("usage")
    if isinstance(usage, dict):
        info.usage = usage
    return info
