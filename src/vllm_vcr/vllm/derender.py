"""The derender routes of --enable-scale-out / --tokens-only, as vLLM 0.32 serves them: a token-out
answer of /inference/v1/generate turned back into a chat or completion response, without
generating. `POST /v1/chat/completions/derender` and `POST /v1/completions/derender` take a
whole GenerateResponse (`stream: false`) or one stream chunk plus the `stream_state` the previous
call returned (`stream: true`: the server keeps nothing between calls).

With a tool or reasoning parser configured the chat routes need the `chat_request` the render
step saw (as vLLM: plain detokenization would leak the parser's markup); its tools and
tool_choice decide how calls are read back, with the same parsers `serve` uses for chat.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from ..frontend.chat_outputs import ChatOutputPlan
from ..frontend.protocol import ChatCompletionRequest
from ..http.serving_base import RequestContext, encode, parse_request
from ..http.sse import send_bytes
from .derender_protocol import PARSER_NEEDS_REQUEST, DerenderChat, DerenderCompletion, TokensResponse, bad_request
from .derender_stream import chat_chunk, completion_chunk


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": None, "completion_tokens_details": None}


# vLLM answers the response models whole (model_dump): the fields derender leaves at their default
_CHAT_TAIL = {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None, "ec_transfer_params": None,
              "metrics": None}
_MESSAGE_NULLS = {"refusal": None, "annotations": None, "audio": None, "function_call": None}


class DerenderServing:
    def __init__(self, app: Any) -> None:
        self.chat = app.chat
        self.settings = app.settings
        self.tokenizer = app.chat.tokenizer

    @property
    def has_parser(self) -> bool:
        return self.settings.tools.available or bool(self.settings.reasoning_parser)

    # -- checks ----------------------------------------------------------------------------------

    def _check_bounds(self, responses: list[TokensResponse]) -> None:
        max_n = int(os.environ.get("VLLM_MAX_N_SEQUENCES", "16384"))
        max_len = self.settings.max_model_len
        if len(responses) > max_n:
            raise bad_request(f"generate_responses count ({len(responses)}) exceeds server maximum ({max_n}). "
                       "Set VLLM_MAX_N_SEQUENCES to increase this limit.")
        for gen in responses:
            if len(gen.choices) > max_n:
                raise bad_request(f"choices count ({len(gen.choices)}) in response '{gen.request_id}' exceeds server "
                           f"maximum ({max_n}).")
            for c in gen.choices:
                if c.token_ids and len(c.token_ids) > max_len:
                    raise bad_request(f"token_ids length ({len(c.token_ids)}) in choice {c.index} exceeds max_model_len "
                               f"({max_len}).")

    def _check_prompt_ids(self, ids: list[int] | None) -> None:
        if ids is not None and len(ids) > self.settings.max_model_len:
            raise bad_request(f"prompt_token_ids length ({len(ids)}) exceeds max_model_len ({self.settings.max_model_len}).")

    # -- text and messages -------------------------------------------------------------------------

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def _split_reasoning(self, ids: list[int]) -> tuple[list[int], list[int]]:
        """(reasoning ids, content ids) by the reasoning parser's start / end tokens."""
        marks = self.settings.reasoning_ids
        if not self.settings.reasoning_parser or marks is None or marks[1] not in ids:
            return [], ids
        start, end = marks
        cut = ids.index(end)
        return [i for i in ids[:cut] if i != start], ids[cut + 1:]

    def _message(self, ids: list[int], req: ChatCompletionRequest | None) -> dict[str, Any]:
        if req is None or not self.has_parser:
            skip = req.skip_special_tokens if req is not None else True
            return {"role": "assistant", "content": self._decode(ids, skip), **_MESSAGE_NULLS, "reasoning": None}
        thought, rest = self._split_reasoning(ids)
        text = self._decode(rest, False)
        plan = ChatOutputPlan(req, self.settings.tools, self.settings.reasoning_ids)
        content, calls, _ = plan.message_parts(text)
        message: dict[str, Any] = {"role": "assistant", "content": content, **_MESSAGE_NULLS}
        if calls:  # derender's ids are uuids
            message["tool_calls"] = [{**c, "id": uuid.uuid4().hex} for c in calls]
        message["reasoning"] = self._decode(thought, False) if thought and req.include_reasoning else None
        return message

    # -- chat --------------------------------------------------------------------------------------

    async def derender_chat(self, ctx: RequestContext) -> None:
        body = parse_request(ctx.body, DerenderChat)
        model = self.chat.check_model(body.model)
        if body.stream:
            await send_bytes(ctx.send, 200, encode(chat_chunk(self, body, model)))
            return
        gen = body.generate_response
        if gen is None:
            raise bad_request("generate_response: Field required")
        self._check_bounds([gen])
        self._check_prompt_ids(body.prompt_token_ids)
        if self.has_parser and body.chat_request is None:
            raise bad_request(PARSER_NEEDS_REQUEST)
        req = body.chat_request
        rti = req is not None and req.return_token_ids and (not self.has_parser or req.include_reasoning)
        choices = []
        for c in gen.choices:
            if not c.token_ids:
                raise bad_request(f"choice {c.index} has empty or null token_ids")
            choices.append({"index": c.index, "message": self._message(c.token_ids, req), "logprobs": None,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                            "token_ids": c.token_ids if rti else None, "routed_experts": None})
        completion = sum(len(c.token_ids or ()) for c in gen.choices)
        out = {"id": gen.request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
               "choices": choices, "service_tier": None, "system_fingerprint": None,
               "usage": _usage(body.prompt_tokens or 0, completion), **_CHAT_TAIL,
               "kv_transfer_params": gen.kv_transfer_params}
        await send_bytes(ctx.send, 200, encode(out))

    # -- completions -------------------------------------------------------------------------------

    async def derender_completion(self, ctx: RequestContext) -> None:
        body = parse_request(ctx.body, DerenderCompletion)
        model = self.chat.check_model(body.model)
        if body.stream:
            await send_bytes(ctx.send, 200, encode(completion_chunk(self, body, model)))
            return
        gens = body.generate_responses or []
        if not gens:
            raise bad_request("generate_responses must not be empty")
        self._check_bounds(gens)
        for ids in body.prompt_token_ids or ():
            self._check_prompt_ids(ids if isinstance(ids, list) else None)
        skip = body.completion_request.skip_special_tokens if body.completion_request is not None else True
        choices, completion = [], 0
        for gen in gens:
            for c in gen.choices:
                if not c.token_ids:
                    raise bad_request(f"choice {c.index} in response {gen.request_id} has empty or null token_ids")
                choices.append({"index": len(choices), "text": self._decode(c.token_ids, skip), "logprobs": None,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
                                "routed_experts": None})
                completion += len(c.token_ids)
        prompt = sum(body.prompt_tokens) if isinstance(body.prompt_tokens, list) else 0
        kv = gens[0].kv_transfer_params
        out = {"id": gens[0].request_id, "object": "text_completion", "created": int(time.time()), "model": model,
               "choices": choices, "service_tier": None, "system_fingerprint": None, "usage": _usage(prompt, completion),
               "kv_transfer_params": kv if all(g.kv_transfer_params == kv for g in gens) else None,
               "ec_transfer_params": None}
        await send_bytes(ctx.send, 200, encode(out))
