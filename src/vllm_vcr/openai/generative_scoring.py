"""POST /generative_scoring: how likely each label token is to come next after query + item.

vLLM 0.32's checks and response; each item's prompt (query then item, or item first) runs through
the engine as a one-token completion, so it is scheduled, counted and cached like any request.
The simulated engine has no logits: the label tokens' logprobs at that position are the same
synthetic, deterministic values the logprobs of every other route use (frontend/logprobs.py).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from pydantic import Field

from ..frontend.generation import as_http_error, random_hex
from ..frontend.logprobs import token_logprobs
from ..frontend.protocol import RequestValueError, _Base
from ..http.serving_base import RequestContext, encode, parse_request
from ..http.sse import send_bytes
from .chat_bridge import run_chat

_INT64 = 2**63


class GenerativeScoringRequest(_Base):
    model: str | None = None
    query: str | list[int]
    items: list[str] | list[list[int]]
    label_token_ids: list[int]
    apply_softmax: bool = True
    item_first: bool = False
    add_special_tokens: bool = True
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)  # as chat's
    priority: int = Field(default=0, ge=-_INT64, le=_INT64 - 1)
    request_id: str = Field(default_factory=lambda: random_hex(16))


def label_probabilities(logprobs: dict[int, float], apply_softmax: bool) -> dict[int, float]:
    """Softmax over the label tokens only, or each token's own probability."""
    if not apply_softmax:
        return {t: math.exp(lp) for t, lp in logprobs.items()}
    top = max(logprobs.values())
    exp = {t: math.exp(lp - top) for t, lp in logprobs.items()}
    total = sum(exp.values())
    return {t: v / total for t, v in exp.items()}


class GenerativeScoringServing:
    def __init__(self, completions: Any) -> None:
        self.completions = completions  # openai/completion.py's CompletionServing runs each item

    async def handle(self, ctx: RequestContext) -> None:
        try:
            req: GenerativeScoringRequest = parse_request(ctx.body, GenerativeScoringRequest)
            await self._handle(ctx, req)
        except RequestValueError as e:
            raise as_http_error(e) from None

    async def _handle(self, ctx: RequestContext, req: GenerativeScoringRequest) -> None:
        serving = self.completions
        model = serving.check_model(req.model)
        tok = serving.tokenizer
        vocab = tok.vocab_size
        for t in req.label_token_ids:
            if t < 0 or t >= vocab:
                raise RequestValueError(f"label_token_id {t} is out of vocabulary range [0, {vocab}). "
                                        "Please provide valid token IDs.")
        if not req.label_token_ids:
            raise RequestValueError("label_token_ids must contain at least one token ID.")
        if not req.items:
            raise RequestValueError("items must contain at least one item.")
        rid = f"generative-scoring-{serving.base_request_id(ctx, req.request_id)}"
        query = (tok.encode(req.query, add_special_tokens=req.add_special_tokens) if isinstance(req.query, str)
                 else list(req.query))
        limit = serving.settings.max_model_len - 1  # room for the one token scored
        prompts = []
        for item in req.items:
            ids = tok.encode(item, add_special_tokens=False) if isinstance(item, str) else list(item)
            prompts.append((ids + query if req.item_first else query + ids)[:limit])
        base = {"model": req.model or model, "max_tokens": 1, "add_special_tokens": False,
                "priority": req.priority}
        if req.cache_salt is not None:
            base["cache_salt"] = req.cache_salt
        answers = await asyncio.gather(*(run_chat(serving, ctx, {**base, "prompt": ids}) for ids in prompts))
        data, prompt_tokens, completion_tokens = [], 0, 0
        for i, (ids, answer) in enumerate(zip(prompts, answers)):
            logprobs = {t: token_logprobs(t, len(ids), 0, vocab)[0] for t in req.label_token_ids}
            score = label_probabilities(logprobs, req.apply_softmax)[req.label_token_ids[0]]
            data.append({"index": i, "object": "score", "score": score})
            prompt_tokens += len(ids)
            completion_tokens += answer["usage"]["completion_tokens"]
        body = {"id": rid, "object": "list", "created": int(time.time()), "model": model, "data": data,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                          "completion_tokens": completion_tokens, "prompt_tokens_details": None,
                          "completion_tokens_details": None}}
        ctx.finishing = True
        await send_bytes(ctx.send, 200, encode(body))
