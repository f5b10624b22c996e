"""Responses request schema (vLLM 0.32's ResponsesRequest fields) and its translation to the
chat request the rest of the frontend already knows how to run."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator

from ...frontend.generation import random_hex
from ...frontend.protocol import ChatCompletionRequest, RequestValueError, StopParam, _Base


# The fields the OpenAI SDK's models write (null when unset) for what vLLM echoes back in a response
_FUNCTION_TOOL_FIELDS = ("name", "parameters", "strict", "type", "allowed_callers", "async", "defer_loading",
                         "description", "output_schema")
_FORMAT_FIELDS = {"json_schema": ("name", "schema", "type", "description", "strict")}


def _with_nulls(obj: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    return {**{k: obj.get(k) for k in fields}, **obj}


def echoed_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's tools as vLLM's response shows them (the SDK model's every field)."""
    return [_with_nulls(t, _FUNCTION_TOOL_FIELDS) if isinstance(t, dict) and t.get("type") == "function" else t
            for t in tools]


def echoed_text(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """A request's `text` as vLLM's response shows it: `format` (with its type's null fields) and
    `verbosity`."""
    if text is None:
        return None
    fmt = text.get("format")
    if isinstance(fmt, dict):
        fmt = _with_nulls(fmt, _FORMAT_FIELDS.get(fmt.get("type"), ()))
    return {**text, "format": fmt, "verbosity": text.get("verbosity")}


class ResponsesRequest(_Base):
    background: bool | None = False
    include: list[str] | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    model: str | None = None
    logit_bias: dict[str, float] | None = None
    parallel_tool_calls: bool | None = True
    previous_response_id: str | None = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    include_reasoning: bool = True
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    store: bool | None = True
    stream: bool | None = False
    temperature: float | None = None
    text: dict[str, Any] | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = 0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    request_id: str = Field(default_factory=lambda: f"resp_{random_hex(16)}")
    priority: int = 0
    cache_salt: str | None = None
    previous_input_messages: list[dict[str, Any]] | None = None
    structured_outputs: dict[str, Any] | None = None
    seed: int | None = None
    stop: StopParam = []
    stop_token_ids: list[int] | None = []
    ignore_eos: bool = False
    vllm_xargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def input_messages(req: ResponsesRequest, prev_messages: list[dict] | None,
                   prev_output: list[dict] | None) -> list[dict[str, Any]]:
    """vLLM's construct_input_messages: instructions, history, then the new input."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if prev_messages:
        messages += [m for m in prev_messages if m.get("role") != "system"]
    for item in prev_output or ():
        if item.get("type") == "message":  # reasoning and calls of the previous turn are skipped
            messages += [{"role": "assistant", "content": part.get("text", "")} for part in item["content"]]
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        for item in req.input:
            _add_item(messages, item)
    return messages


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any]) -> None:
    kind = item.get("type")
    if kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
        prev = messages[-1] if messages else None
        if prev is not None and prev.get("role") == "assistant" and not prev.get("content"):
            prev.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output", "")})
    elif kind == "reasoning":
        return
    elif "role" in item:
        messages.append({"role": item["role"], "content": item.get("content", "")})
    else:
        raise RequestValueError(f"Unsupported input item type: {kind}", "input")


def chat_tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    """Function tools as chat tools (other tool types need vLLM's tool server: not offered)."""
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                               if k in t}}
             for t in req.tools if t.get("type") == "function"]
    return tools or None


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = (req.text or {}).get("format")
    if not fmt:
        return None
    if req.structured_outputs is not None:
        raise RequestValueError("Cannot specify both structured_outputs and text.format", "structured_outputs")
    if fmt.get("type") == "json_schema" and fmt.get("schema") is not None:
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"),
                                                       "schema": fmt["schema"]}}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    return None


def chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The equivalent chat request (sampling fields, tools, constraint)."""
    tools = chat_tools(req)
    body: dict[str, Any] = {
        "messages": messages, "model": req.model, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty, "seed": req.seed, "stop": req.stop,
        "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos, "priority": req.priority,
        "cache_salt": req.cache_salt, "vllm_xargs": req.vllm_xargs, "kv_transfer_params": req.kv_transfer_params,
        "chat_template_kwargs": req.chat_template_kwargs, "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls, "structured_outputs": req.structured_outputs,
        "response_format": response_format(req), "skip_special_tokens": True, "request_id": req.request_id,
    }
    if tools:
        body["tools"] = tools
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    return ChatCompletionRequest.model_validate_json(json.dumps(body))
