"""Responses output items and the streaming event sequence of vLLM 0.32's simple (non-Harmony)
path: each run of reasoning, text or one tool call is an output item, opened with
`response.output_item.added` (+ `content_part.added`), filled by deltas, and closed with the
`*.done` events; `sequence_number` counts every event of the stream."""

from __future__ import annotations

import secrets
from typing import Any

from ...http.sse import named_event


def _hex() -> str:
    return secrets.token_hex(8)


def reasoning_item(text: str, item_id: str | None = None, status: str | None = None) -> dict[str, Any]:
    return {"id": item_id or f"rs_{_hex()}", "summary": [], "type": "reasoning",
            "content": [{"text": text, "type": "reasoning_text"}], "encrypted_content": None, "status": status}


def message_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or f"msg_{_hex()}",
            "content": [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}] if text else [],
            "role": "assistant", "status": "completed", "type": "message", "phase": None}


def function_call_item(name: str, arguments: str, call_id: str, item_id: str | None = None,
                       status: str = "completed") -> dict[str, Any]:
    return {"arguments": arguments, "call_id": call_id, "name": name, "type": "function_call",
            "id": item_id or f"fc_{_hex()}", "namespace": None, "status": status}


def output_items(message: dict[str, Any], parallel_tool_calls: bool | None) -> list[dict[str, Any]]:
    """A chat message (reasoning, content, tool_calls) as Responses output items."""
    items = []
    if message.get("reasoning"):
        items.append(reasoning_item(message["reasoning"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:  # (vLLM writes the message even with nothing in it)
        items.append(message_item(message.get("content") or ""))
    if parallel_tool_calls is False:
        calls = calls[:1]
    items += [function_call_item(c["function"]["name"], c["function"]["arguments"], c["id"]) for c in calls]
    return items


class EventStream:
    """Chat chunk deltas in, Responses SSE events out."""

    def __init__(self) -> None:
        self.seq = 0
        self.output_index = 0
        self.state: str | None = None  # "content" | "reasoning" | "tool"
        self.item_id = ""
        self.text = ""
        self.tool: dict[str, Any] = {}
        self.items: list[dict[str, Any]] = []

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {**fields, "sequence_number": self.seq, "type": kind}
        self.seq += 1
        return named_event(kind, body)

    def feed(self, delta: dict[str, Any]) -> bytes:
        out: list[bytes] = []
        if delta.get("reasoning"):
            out += self._switch("reasoning")
            out.append(self._text_delta("response.reasoning_text.delta", delta["reasoning"]))
        if delta.get("content"):
            out += self._switch("content")
            out.append(self._text_delta("response.output_text.delta", delta["content"], logprobs=[]))
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            if "name" in fn:
                out += self.close()
                out += self._open_tool(call, fn["name"])
            if fn.get("arguments"):
                self.text += fn["arguments"]
                out.append(self.event("response.function_call_arguments.delta", delta=fn["arguments"],
                                      item_id=self.item_id, output_index=self.output_index))
        return b"".join(out)

    def _text_delta(self, kind: str, text: str, **extra: Any) -> bytes:
        self.text += text
        return self.event(kind, content_index=0, delta=text, item_id=self.item_id, **extra,
                          output_index=self.output_index)

    def _switch(self, state: str) -> list[bytes]:
        if self.state == state:
            return []
        out = self.close()
        self.state, self.text = state, ""
        if state == "content":
            self.item_id = f"msg_{_hex()}"
            item = {"id": self.item_id, "content": [], "role": "assistant", "status": "in_progress",
                    "type": "message", "phase": None}
            part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
        else:
            self.item_id = f"rs_{_hex()}"
            item = {"id": self.item_id, "summary": [], "type": "reasoning", "content": None,
                    "encrypted_content": None, "status": "in_progress"}
            part = {"text": "", "type": "reasoning_text"}
        out.append(self.event("response.output_item.added", item=item, output_index=self.output_index))
        out.append(self.event("response.content_part.added", content_index=0, item_id=self.item_id,
                              output_index=self.output_index, part=part))
        return out

    def _open_tool(self, call: dict[str, Any], name: str) -> list[bytes]:
        self.state, self.text = "tool", ""
        self.item_id = f"fc_{_hex()}"
        self.tool = {"name": name, "call_id": call.get("id") or f"chatcmpl-tool-{_hex()}"}
        item = function_call_item(name, "", self.tool["call_id"], self.item_id, status="in_progress")
        return [self.event("response.output_item.added", item=item, output_index=self.output_index)]

    def close(self) -> list[bytes]:
        """The current item's done events (nothing when no item is open)."""
        state, idx, iid, text = self.state, self.output_index, self.item_id, self.text
        if state is None:
            return []
        if state == "content":
            item = message_item(text, iid)
            out = [self.event("response.output_text.done", content_index=0, item_id=iid, logprobs=[],
                              output_index=idx, text=text),
                   self.event("response.content_part.done", content_index=0, item_id=iid, output_index=idx,
                              part=item["content"][0] if item["content"] else
                              {"annotations": [], "text": "", "type": "output_text", "logprobs": None})]
        elif state == "reasoning":
            item = reasoning_item(text, iid, "completed")
            out = [self.event("response.reasoning_text.done", content_index=0, item_id=iid, output_index=idx,
                              text=text),
                   self.event("response.content_part.done", content_index=0, item_id=iid, output_index=idx,
                              part={"text": text, "type": "reasoning_text"})]
        else:
            item = function_call_item(self.tool["name"], text, self.tool["call_id"], iid)
            out = [self.event("response.function_call_arguments.done", arguments=text, item_id=iid,
                              name=self.tool["name"], output_index=idx)]
        out.append(self.event("response.output_item.done", item=item, output_index=idx))
        self.items.append(item)
        self.output_index += 1
        self.state = None
        return out
