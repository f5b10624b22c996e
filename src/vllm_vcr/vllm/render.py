"""The render routes of --enable-scale-out: a chat, completion, Anthropic messages or Responses
request turned into the GenerateRequest that /inference/v1/generate accepts (prompt token ids
plus sampling params), without generating. The derender routes (the way back) are in
vllm/derender.py."""

from __future__ import annotations

from typing import Any

from ..frontend.errors import HTTPError
from ..frontend.protocol import ChatCompletionRequest, CompletionRequest, RequestValueError, stop_list
from ..frontend.request_checks import check_output_budget, check_prompt_tokens, check_sampling, sampling_values
from ..frontend.structured.constraints import request_constraint
from ..http.serving_base import RequestContext, encode, parse_request
from ..http.sse import send_bytes


def sampling_params(req: Any, max_tokens: int, structured: dict[str, Any] | None) -> dict[str, Any]:
    """The SamplingParams fields /inference/v1/generate reads, as vLLM serialises them."""
    return {"n": req.n, "presence_penalty": req.presence_penalty or 0.0,
            "frequency_penalty": req.frequency_penalty or 0.0,
            "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
            **sampling_values(req),
            "seed": req.seed, "stop": stop_list(req.stop), "stop_token_ids": list(req.stop_token_ids or []),
            "ignore_eos": req.ignore_eos, "max_tokens": max_tokens, "min_tokens": req.min_tokens,
            "logprobs": None, "prompt_logprobs": None, "skip_special_tokens": req.skip_special_tokens,
            "include_stop_str_in_output": req.include_stop_str_in_output, "structured_outputs": structured,
            "extra_args": req.vllm_xargs}


def generate_request(request_id: str, ids: list[int], req: Any, params: dict[str, Any]) -> dict[str, Any]:
    return {"request_id": request_id, "token_ids": ids, "token_offsets": None, "features": None,
            "content_parts": None, "sampling_params": params, "model": req.model, "reasoning_ended": None,
            "reasoning_parser_kwargs": None, "return_token_ids": None, "output_mode": "tokens",
            "stream": bool(req.stream), "stream_options": req.stream_options.model_dump()
            if req.stream and req.stream_options else None, "cache_salt": req.cache_salt,
            "priority": req.priority, "kv_transfer_params": None, "ec_transfer_params": None}


def _structured(req: Any) -> dict[str, Any] | None:
    c = request_constraint(getattr(req, "response_format", None), req.structured_outputs)
    if c is None:
        return None
    return {"json_object": True} if c.kind == "json_object" else {c.kind: c.value}


class RenderServing:
    def __init__(self, app: Any) -> None:
        self.app = app
        self.chat = app.chat
        self.settings = app.settings

    def _chat(self, ctx: RequestContext, req: ChatCompletionRequest) -> dict[str, Any]:
        self.chat.check_model(req.model)
        defaults = self.settings.sampling_defaults
        defaults.fill(req)
        max_len = self.settings.max_model_len
        wanted = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        check_output_budget(wanted, max_len)
        _, ids = self.chat.render_prompt(req.messages, add_generation_prompt=req.add_generation_prompt,
                                         continue_final_message=req.continue_final_message,
                                         chat_template=req.chat_template, chat_template_kwargs=req.chat_template_kwargs,
                                         add_special_tokens=req.add_special_tokens,
                                         tools=self.chat.template_tools(req))
        check_prompt_tokens(len(ids), max_len, from_text=True)
        limit = defaults.limit(len(ids), max_len, wanted)
        check_sampling(req, limit)
        rid = f"chatcmpl-{self.chat.base_request_id(ctx, req.request_id)}"
        return generate_request(rid, ids, req, sampling_params(req, limit, _structured(req)))

    async def render_chat(self, ctx: RequestContext) -> None:
        req = parse_request(ctx.body, ChatCompletionRequest)
        await self._answer(ctx, lambda: self._chat(ctx, req))

    async def render_completion(self, ctx: RequestContext) -> None:
        req: CompletionRequest = parse_request(ctx.body, CompletionRequest)

        def build() -> list[dict[str, Any]]:
            self.chat.check_model(req.model)
            defaults = self.settings.sampling_defaults
            defaults.fill(req)
            prompts = req.prompt if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int) \
                else [req.prompt]
            base = f"cmpl-{self.chat.base_request_id(ctx, req.request_id)}"
            out = []
            for i, p in enumerate(prompts):
                ids = list(p) if isinstance(p, list) else self.chat.tokenizer.encode(
                    p or "", add_special_tokens=req.add_special_tokens)
                check_prompt_tokens(len(ids), self.settings.max_model_len, from_text=not isinstance(p, list))
                limit = defaults.limit(len(ids), self.settings.max_model_len, req.max_tokens)
                check_sampling(req, limit)
                out.append(generate_request(base if len(prompts) == 1 else f"{base}-{i}", ids, req,
                                            sampling_params(req, limit, _structured(req))))
            return out

        await self._answer(ctx, build)

    async def render_messages(self, ctx: RequestContext) -> None:
        from ..anthropic.messages import MessagesRequest, chat_body

        req = parse_request(ctx.body, MessagesRequest)
        chat = ChatCompletionRequest.model_validate(chat_body(req))
        await self._answer(ctx, lambda: self._chat(ctx, chat))

    async def render_responses(self, ctx: RequestContext) -> None:
        from ..openai.responses.protocol import ResponsesRequest, input_messages

        req = parse_request(ctx.body, ResponsesRequest)
        body = self.app.responses.chat_body(req, input_messages(req, None, None), req.model or "")
        body["model"] = req.model
        chat = ChatCompletionRequest.model_validate(body)
        await self._answer(ctx, lambda: self._chat(ctx, chat))

    @staticmethod
    async def _answer(ctx: RequestContext, build: Any) -> None:
        try:
            body = build()
        except RequestValueError as e:
            raise HTTPError(400, str(e), "BadRequestError", e.param) from None
        await send_bytes(ctx.send, 200, encode(body))
