"""POST /v1/chat/completions/batch: several conversations in one request, one choice each.

As vLLM 0.32 does it: the request is checked as a whole (BatchChatCompletionRequest), each
conversation then runs as its own chat request with the shared fields (every chat check applies),
and the answers are joined into one chat completion whose choices are indexed by conversation and
whose usage adds up every conversation's.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec

from ..frontend.generation import as_http_error
from ..frontend.protocol import BATCH_CHAT_FIELDS, BatchChatCompletionRequest, RequestValueError
from ..http.serving_base import RequestContext, encode, parse_request
from ..http.sse import send_bytes
from .chat_bridge import run_chat


class BatchChatServing:
    def __init__(self, chat: Any) -> None:
        self.chat = chat

    async def handle(self, ctx: RequestContext) -> None:
        try:
            req: BatchChatCompletionRequest = parse_request(ctx.body, BatchChatCompletionRequest)
        except RequestValueError as e:
            raise as_http_error(e) from None
        model = self.chat.check_model(req.model)
        shared = {k: v for k, v in msgspec.json.decode(ctx.body).items() if k in BATCH_CHAT_FIELDS and v is not None}
        shared.update(stream=False, tool_choice="none")
        tasks = [asyncio.ensure_future(run_chat(self.chat, ctx, {**shared, "messages": conversation}))
                 for conversation in req.messages]
        try:
            answers = await asyncio.gather(*tasks)
        except BaseException:  # one conversation failed (or the client left): the others stop too
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for index, answer in enumerate(answers):
            for choice in answer["choices"]:
                choices.append({**choice, "index": index})
            prompt_tokens += answer["usage"]["prompt_tokens"]
            completion_tokens += answer["usage"]["completion_tokens"]
        first = answers[0]
        body = {**first, "id": f"chatcmpl-{self.chat.base_request_id(ctx, req.model_extra.get('request_id'))}",
                "created": int(time.time()), "model": model, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                          "completion_tokens": completion_tokens, "prompt_tokens_details": None,
                          "completion_tokens_details": None}}
        ctx.finishing = True
        await send_bytes(ctx.send, 200, encode(body))
