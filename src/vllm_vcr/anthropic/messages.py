"""POST /v1/messages (Anthropic Messages) and /v1/messages/count_tokens, as vLLM 0.32 serves
them: the request becomes a chat request, the chat answer (or its stream of chunks) becomes an
Anthropic message (or its event stream). Errors from the chat side are re-worded into
Anthropic's `{"type": "error", "error": {"type", "message"}}` with the same status."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..frontend.conversation import BILLING_HEADER
from ..frontend.errors import HTTPError, UnencodableText
from ..frontend.protocol import RequestValueError
from ..http.serving_base import RequestContext, encode, parse_request
from ..http.sse import SSEWriter, named_event, send_bytes
from ..openai.chat_bridge import run_chat


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class AnthropicToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


ThinkingDisplay = Literal["summarized", "omitted", "updates"]


class ThinkingEnabled(BaseModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)
    display: ThinkingDisplay | None = None


class ThinkingDisabled(BaseModel):
    type: Literal["disabled"]


class ThinkingAdaptive(BaseModel):
    type: Literal["adaptive"]
    display: ThinkingDisplay | None = None


ThinkingConfig = Annotated[ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive, Field(discriminator="type")]


class MessagesRequest(_Model):
    model: str
    messages: list[dict[str, Any]]
    max_tokens: int
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    system: str | list[dict[str, Any]] | None = None
    temperature: float | None = None
    tool_choice: AnthropicToolChoice | None = None
    tools: list[dict[str, Any]] | None = None
    top_k: int | None = None
    top_p: float | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _thinking_budget(self) -> MessagesRequest:
        # (a prefill leg of a disaggregated request never decodes: vLLM leaves it unchecked)
        if self.kv_transfer_params and self.kv_transfer_params.get("do_remote_decode"):
            return self
        if isinstance(self.thinking, ThinkingEnabled) and self.thinking.budget_tokens >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self


class CountTokensRequest(_Model):
    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tool_choice: AnthropicToolChoice | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# -- request conversion ------------------------------------------------------------------------

def _system_text(blocks: Any) -> str | None:
    if isinstance(blocks, str):
        return None if blocks.startswith(BILLING_HEADER) else blocks
    parts = [b["text"] for b in blocks or () if b.get("type") == "text" and b.get("text")
             and not b["text"].startswith(BILLING_HEADER)]
    return "".join(parts) or None


def chat_messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = _system_text(req.system) if req.system else None
    if system:
        out.append({"role": "system", "content": system})
    for msg in req.messages:
        role, content = msg.get("role"), msg.get("content")
        if role == "system":
            text = _system_text(content)
            if text:
                out.append({"role": "system", "content": text})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        converted = _convert_blocks(role, content or [], out)
        if converted or role != "user":
            out.append({"role": role, **converted})
    return out


def _convert_blocks(role: str, blocks: list[dict[str, Any]], out: list[dict[str, Any]]) -> dict[str, Any]:
    texts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for b in blocks:
        kind = b.get("type")
        if kind == "text" and b.get("text"):
            texts.append({"type": "text", "text": b["text"]})
        elif kind == "thinking" and b.get("thinking") is not None:
            reasoning.append(b["thinking"])
        elif kind == "tool_use":
            calls.append({"id": b.get("id") or "call_0", "type": "function",
                          "function": {"name": b.get("name") or "", "arguments": json.dumps(b.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            result = b.get("content")
            if isinstance(result, list):
                result = "\n".join(i.get("text", "") for i in result if isinstance(i, dict) and i.get("type") == "text")
            out.append({"role": "tool", "tool_call_id": b.get("tool_use_id") or "", "content": result or ""})
        elif kind == "tool_result":
            texts.append({"type": "text", "text": f"Tool result: {b.get('content') or ''}"})
    msg: dict[str, Any] = {}
    if reasoning:
        msg["reasoning"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    if texts:
        msg["content"] = texts[0]["text"] if len(texts) == 1 else texts
    return msg


def _tool_fields(req: MessagesRequest | CountTokensRequest, body: dict[str, Any]) -> None:
    choice = req.tool_choice
    if choice is not None:
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
    if req.tools is not None:
        body["tools"] = [{"type": "function", "function": {
            k2: t.get(k1) for k1, k2 in (("name", "name"), ("description", "description"),
                                          ("input_schema", "parameters"), ("strict", "strict"))
            if t.get(k1) is not None}} for t in req.tools]
        body.setdefault("tool_choice", "auto")


def chat_body(req: MessagesRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req), "max_tokens": req.max_tokens,
                            "max_completion_tokens": req.max_tokens, "stop": req.stop_sequences or []}
    for name in ("temperature", "top_p", "top_k", "cache_salt", "kv_transfer_params", "vllm_xargs",
                 "chat_template_kwargs"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    fmt = (req.output_config or {}).get("format") or {}
    if fmt.get("schema") or fmt.get("json_schema"):
        body["response_format"] = {"type": fmt.get("type", "json_schema"),
                                   "json_schema": {"name": fmt.get("type", "json_schema"),
                                                   "schema": fmt.get("schema") or fmt.get("json_schema")}}
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    _tool_fields(req, body)
    return body


# -- answer conversion -------------------------------------------------------------------------

def anthropic_usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    if not usage:
        return {"input_tokens": 0, "output_tokens": 0}
    out: dict[str, Any] = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage.get("completion_tokens") or 0}
    details = usage.get("prompt_tokens_details")
    if details:
        if details.get("cached_tokens") is not None:
            out["input_tokens"] -= details["cached_tokens"]
            out["cache_read_input_tokens"] = details["cached_tokens"]
        if details.get("created_cache_tokens") is not None:
            out["input_tokens"] -= details["created_cache_tokens"]
            out["cache_creation_input_tokens"] = details["created_cache_tokens"]
        out["input_tokens"] = max(0, out["input_tokens"])
    return out


def stop_reason(finish: str | None, stop: Any, tool_used: bool, tool_complete: bool) -> tuple[str | None, str | None]:
    if finish == "length":
        return "max_tokens", None
    if finish not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return ("tool_use", None) if finish == "tool_calls" or tool_used else ("end_turn", None)


def full_message(answer: dict[str, Any]) -> dict[str, Any]:
    choice = answer["choices"][0]
    msg = choice["message"]
    calls = msg.get("tool_calls") or []
    content: list[dict[str, Any]] = []
    if msg.get("reasoning"):
        content.append({"type": "thinking", "thinking": msg["reasoning"], "signature": uuid.uuid4().hex})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    content += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": json.loads(c["function"]["arguments"])} for c in calls]
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"), bool(calls), bool(calls))
    body = {"id": answer["id"], "type": "message", "role": "assistant",
            "content": content or [{"type": "text", "text": ""}], "model": answer["model"], "stop_reason": reason,
            "stop_sequence": sequence, "usage": anthropic_usage(answer.get("usage"))}
    return {k: v for k, v in body.items() if v is not None}


class MessageEvents:
    """Chat chunks in, Anthropic stream events out (message_start, content blocks, message_delta,
    message_stop)."""

    def __init__(self) -> None:
        self.first = True
        self.index = 0  # the next block's index
        self.block: str | None = None
        self.tool_id: str | None = None
        self.signature: str | None = None
        self.finish: str | None = None
        self.stop: Any = None
        self.tool_used = False
        self.tool_args: list[str] = []

    def feed(self, chunk: dict[str, Any]) -> bytes:
        if self.first:
            self.first = False
            return named_event("message_start", {"type": "message_start", "message": {
                "id": chunk["id"], "type": "message", "role": "assistant", "content": [], "model": chunk["model"],
                "stop_reason": None, "stop_sequence": None, "usage": anthropic_usage(chunk.get("usage"))}})
        if not chunk.get("choices"):
            reason, seq = stop_reason(self.finish or "stop", self.stop, self.tool_used,
                                      self.tool_used and _is_json("".join(self.tool_args)))
            return self.close() + named_event("message_delta", {"type": "message_delta", "delta": {
                "stop_reason": reason, "stop_sequence": seq}, "usage": anthropic_usage(chunk.get("usage"))})
        choice = chunk["choices"][0]
        if choice.get("finish_reason") is not None:
            self.finish, self.stop = choice["finish_reason"], choice.get("stop_reason")
        delta = choice.get("delta") or {}
        out = []
        if delta.get("reasoning"):
            if self.block != "thinking":
                out.append(self.close() + self._start({"type": "thinking", "thinking": ""}))
                self.signature = uuid.uuid4().hex
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]}))
        if delta.get("content"):
            if self.block != "text":
                out.append(self.close() + self._start({"type": "text", "text": ""}))
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            name = (call.get("function") or {}).get("name")
            if call.get("id") and name and call["id"] != self.tool_id:
                out.append(self.close() + self._start({"type": "tool_use", "id": call["id"], "name": name,
                                                       "input": {}}))
                self.tool_id, self.tool_used, self.tool_args = call["id"], True, []
            args = (call.get("function") or {}).get("arguments")
            if args and self.block == "tool_use":
                self.tool_args.append(args)
                out.append(self._delta({"type": "input_json_delta", "partial_json": args}))
        return b"".join(out)

    def _start(self, block: dict[str, Any]) -> bytes:
        self.block = block["type"]
        return named_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                              "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return named_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def close(self) -> bytes:
        if self.block is None:
            return b""
        out = b""
        if self.block == "thinking":
            out = self._delta({"type": "signature_delta", "signature": self.signature})
        out += named_event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        self.block, self.tool_id = None, None
        self.index += 1
        return out

    @staticmethod
    def end() -> bytes:
        return named_event("message_stop", {"type": "message_stop"})


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def anthropic_error(e: HTTPError | RequestValueError) -> HTTPError:
    """The same status and message, in Anthropic's error body."""
    if isinstance(e, RequestValueError):
        e = HTTPError(400, str(e), "BadRequestError", e.param)
    return _AnthropicHTTPError(e.status, e.message, e.err_type)


class _AnthropicHTTPError(HTTPError):
    def body(self) -> bytes:
        return encode({"type": "error", "error": {"type": self.err_type, "message": self.message}})


def _parse(body: bytes, model: type) -> Any:
    """The request, as `parse_request` gives it; text the tokenizer cannot take is refused in
    Anthropic's error body, where vLLM's tokenizer refuses it (its schema errors are vLLM's own)."""
    try:
        return parse_request(body, model)
    except UnencodableText as e:
        raise anthropic_error(e) from None


class MessagesServing:
    def __init__(self, chat: Any) -> None:
        self.chat = chat

    async def create(self, ctx: RequestContext) -> None:
        req: MessagesRequest = _parse(ctx.body, MessagesRequest)
        body = chat_body(req)
        try:
            if req.stream:
                await self._stream(ctx, body)
            else:
                answer = await run_chat(self.chat, ctx, body)
                ctx.finishing = True
                await send_bytes(ctx.send, 200, encode(full_message(answer)))
        except (HTTPError, RequestValueError) as e:
            raise anthropic_error(e) from None

    async def _stream(self, ctx: RequestContext, body: dict[str, Any]) -> None:
        w = SSEWriter(ctx.send)
        events = MessageEvents()

        async def on_chunk(chunk: dict[str, Any]) -> None:
            if "error" in chunk:
                err = chunk["error"]
                await w.write(named_event("error", {"type": "error", "error": {"type": "internal_error",
                                                                          "message": err.get("message", "")}}))
                return
            data = events.feed(chunk)
            if data:
                await w.write(data)

        await run_chat(self.chat, ctx, body, on_chunk)
        ctx.finishing = True
        await w.close(events.close() + events.end())

    async def count_tokens(self, ctx: RequestContext) -> None:
        req: CountTokensRequest = _parse(ctx.body, CountTokensRequest)
        try:
            self.chat.check_model(req.model)
            body: dict[str, Any] = {}
            _tool_fields(req, body)
            _, ids = self.chat.render_prompt(chat_messages(req), add_generation_prompt=True,
                                             continue_final_message=False, chat_template=None,
                                             chat_template_kwargs=req.chat_template_kwargs,
                                             add_special_tokens=False, tools=body.get("tools"))
        except (HTTPError, RequestValueError) as e:
            raise anthropic_error(e) from None
        await send_bytes(ctx.send, 200, encode({"input_tokens": len(ids),
                                                "context_management": {"original_input_tokens": len(ids)}}))
