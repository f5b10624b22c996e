"""Streaming derender: one /inference/v1/generate stream chunk and the client-carried state in, the
chat or completion chunk and the next state out (vllm/derender.py has the routes).

Each call decodes the output so far (`stream_state.output_token_ids`) and this chunk's tokens and
sends the difference; with a tool parser the earlier chunks are replayed through the same
streaming tool-call reader chat uses, so the deltas are those a chat stream would have sent.
"""

from __future__ import annotations

import time
from typing import Any

from ..frontend.chat_outputs import ChatOutputPlan
from ..frontend.protocol import ChatCompletionRequest
from ..openai.tool_stream import ToolDeltas
from .derender_protocol import (
    PARSER_NEEDS_REQUEST,
    DerenderChat,
    DerenderCompletion,
    StreamState,
    TokensChoice,
    bad_request,
)


def _one_choice(chunk: Any) -> TokensChoice | None:
    if chunk is None:
        raise bad_request("generate_chunk: Field required")
    if len(chunk.choices) > 1:
        raise bad_request(f"derender_chat_stream expects at most one choice per chunk (got {len(chunk.choices)}).")
    return chunk.choices[0] if chunk.choices else None


def _advance(state: StreamState, new_ids: list[int]) -> None:
    if new_ids:
        state.output_token_ids += new_ids
        state.output_chunk_lens.append(len(new_ids))


def _text_delta(serving: Any, state: StreamState, new_ids: list[int], skip: bool) -> str:
    before = serving._decode(state.output_token_ids, skip)
    return serving._decode(state.output_token_ids + new_ids, skip)[len(before):]


def chat_chunk(serving: Any, body: DerenderChat, model: str) -> dict[str, Any]:
    req = body.chat_request
    if serving.has_parser and req is None:
        raise bad_request(PARSER_NEEDS_REQUEST)
    if serving.has_parser and body.prompt_token_ids is None:
        raise bad_request("prompt_token_ids is required when a tool or reasoning parser is configured. Without it "
                   "parse_delta cannot tell whether the prompt left reasoning open (e.g. a chat template that "
                   "pre-opens <think>) and would misclassify reasoning content as plain content.")
    choice = _one_choice(body.generate_chunk)
    state = body.stream_state or StreamState()
    new_ids = list(choice.token_ids or ()) if choice is not None else []
    prompt_len = len(body.prompt_token_ids or ())
    if prompt_len + len(state.output_token_ids) + len(new_ids) > serving.settings.max_model_len:
        raise bad_request(f"prompt_token_ids length ({prompt_len}) plus output_token_ids length "
                   f"({len(state.output_token_ids)}) plus delta ({len(new_ids)}) exceeds max_model_len "
                   f"({serving.settings.max_model_len}).")
    finished = choice is not None and choice.finish_reason is not None
    delta: dict[str, Any] = {}
    if not state.role_sent:
        delta["role"] = "assistant"
        state.role_sent = True
    named = None
    if req is not None and serving.settings.tools.available and req.tools and req.tool_choice not in (None, "none"):
        content, calls = replay_tool_deltas(serving, req, state, new_ids, finished)
        named = req.tool_choice if isinstance(req.tool_choice, dict) else None
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
            state.tools_streamed = True
    else:
        skip = req.skip_special_tokens if req is not None and not serving.has_parser else not serving.has_parser
        delta["content"] = _text_delta(serving, state, new_ids, skip)
    _advance(state, new_ids)
    reason = choice.finish_reason if choice is not None else None
    if reason == "stop" and state.tools_streamed and named is None:
        reason = "tool_calls"
    choices = [] if choice is None else [{"index": choice.index, "delta": delta, "logprobs": None,
                                          "finish_reason": reason, "stop_reason": choice.stop_reason,
                                          "token_ids": None}]
    chunk = {"id": body.generate_chunk.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
             "model": model, "choices": choices}
    return {"chunk": chunk, "stream_state": state.model_dump()}


def completion_chunk(serving: Any, body: DerenderCompletion, model: str) -> dict[str, Any]:
    prompt_ids = body.prompt_token_ids if body.prompt_token_ids and isinstance(body.prompt_token_ids[0], int) \
        else None
    serving._check_prompt_ids(prompt_ids)
    choice = _one_choice(body.generate_chunk)
    state = body.stream_state or StreamState()
    new_ids = list(choice.token_ids or ()) if choice is not None else []
    skip = body.completion_request.skip_special_tokens if body.completion_request is not None else True
    text = _text_delta(serving, state, new_ids, skip)
    _advance(state, new_ids)
    choices = [] if choice is None else [{"index": choice.index, "text": text, "logprobs": None,
                                          "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason,
                                          "token_ids": None}]
    chunk = {"id": body.generate_chunk.request_id, "object": "text_completion", "created": int(time.time()),
             "model": model, "choices": choices}
    return {"chunk": chunk, "stream_state": state.model_dump()}


def replay_tool_deltas(serving: Any, req: ChatCompletionRequest, state: StreamState,
                       new_ids: list[int], finished: bool) -> tuple[str, list[dict[str, Any]]]:
    """The content and tool-call deltas of this chunk: the earlier chunks are replayed through a
    fresh ToolDeltas (nothing is kept on the server) and their output thrown away."""
    plan = ChatOutputPlan(req, serving.settings.tools, serving.settings.reasoning_ids)
    deltas = ToolDeltas(plan)
    seen: list[int] = []
    start = 0
    for n in state.output_chunk_lens:
        before = serving._decode(seen, False)
        seen += state.output_token_ids[start:start + n]
        start += n
        deltas.advance(serving._decode(seen, False)[len(before):], False)
    before = serving._decode(seen, False)
    content, calls = deltas.advance(serving._decode(seen + new_ids, False)[len(before):], finished)
    for call in calls:  # ids stay what the first call that named them said
        if "id" in call:
            k = call["index"]
            if k < len(state.last_tool_call_ids):
                call["id"] = state.last_tool_call_ids[k]
            else:
                state.last_tool_call_ids.append(call["id"])
    return content, calls
