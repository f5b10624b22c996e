"""GET /v1/models, POST /tokenize and POST /detokenize, as vLLM 0.32 serves them."""

from __future__ import annotations

import secrets
import time
from typing import Any

from ..frontend.errors import HTTPError
from ..frontend.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from ..http.serving_base import RequestContext, encode, parse_request
from ..http.sse import send_bytes


class ModelsServing:
    """The model cards and the tokenizer endpoints; `app` holds the chat and completion servings."""

    def __init__(self, app: Any) -> None:
        self.settings = app.settings
        self.tokenizer = app.tokenizer
        self.chat = app.chat
        self.completions = app.completions
        self._perm_id = f"modelperm-{secrets.token_hex(8)}"

    async def models(self, ctx: RequestContext) -> None:
        s = self.settings
        root = s.model_root or s.model_name
        now = int(time.time())  # vLLM stamps the cards when they are listed
        perm = {"id": self._perm_id, "object": "model_permission", "created": now,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False}
        # SGLang's cards say "sglang": routers (smg) tell the engine type by it
        owner = "sglang" if s.engine_type == "sglang" else "vllm"
        data = [{"id": name, "object": "model", "created": now, "owned_by": owner, "root": root,
                 "parent": None, "max_model_len": s.max_model_len, "permission": [perm]}
                for name in s.served_model_names]
        if s.lora_adapters is not None:
            data += s.lora_adapters.model_cards(now, perm)
        await send_bytes(ctx.send, 200, encode({"object": "list", "data": data}))

    async def tokenize(self, ctx: RequestContext) -> None:
        raw = ctx.body
        is_chat = b'"messages"' in raw
        req: Any = parse_request(raw, TokenizeChatRequest if is_chat else TokenizeCompletionRequest)
        self.completions.check_model(req.model)
        tok = self.tokenizer
        if is_chat:
            _, ids = await self.chat.render_prompt_async(
                req.messages, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs, add_special_tokens=req.add_special_tokens)
        else:
            ids = await tok.encode_async(req.prompt, add_special_tokens=req.add_special_tokens)
        body: dict[str, Any] = {"count": len(ids), "max_model_len": self.settings.max_model_len, "tokens": ids,
                                "token_strs": [tok.hf.id_to_token(i) or "" for i in ids]
                                if req.return_token_strs else None}
        await send_bytes(ctx.send, 200, encode(body))

    async def detokenize(self, ctx: RequestContext) -> None:
        req = parse_request(ctx.body, DetokenizeRequest)
        self.completions.check_model(req.model)
        try:  # as vLLM's tokenizer: ids outside the vocabulary decode to nothing
            text = self.tokenizer.decode(req.tokens, skip_special_tokens=False)
        except OverflowError as e:  # an id beyond the tokenizer's integer type
            raise HTTPError(400, str(e), "BadRequestError") from None
        await send_bytes(ctx.send, 200, encode({"prompt": text}))
