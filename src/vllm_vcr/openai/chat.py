"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Any

import msgspec

from ..engine.types import EngineCoreOutput, EngineCoreRequest, SamplingParams
from ..frontend.chat_outputs import ChatOutputPlan
from ..frontend.chat_template import ChatTemplateError, check_request_template, render_isolated
from ..frontend.content_format import resolve_content_format
from ..frontend.conversation import developer_as_system, normalize_messages
from ..frontend.generation import (
    SequenceState,
    as_http_error,
    build_engine_request,
    output_replay_header,
    parse_dp_rank,
    random_hex,
)
from ..frontend.logprobs import chat_logprobs, prompt_logprobs_many, tokens_as_ids
from ..frontend.planned_output import attach_planned_ids
from ..frontend.prompt_cache import BodyCache, PromptCache, plain_key, template_is_pure
from ..frontend.protocol import ChatCompletionRequest, RequestValueError, stop_list
from ..frontend.request_checks import (
    check_conversation,
    check_greedy_n,
    check_logprobs_limit,
    check_output_budget,
    check_prompt_chars,
    check_prompt_logprobs_budget,
    check_prompt_logprobs_limit,
    check_prompt_tokens,
    check_sampling,
    check_token_choice,
    check_truncation,
    OFFLOAD_BIAS_ENTRIES,
    effective_prompt_logprobs,
    is_greedy,
    truncate_prompt,
)
from ..http.serving_base import (
    RequestContext,
    ServingBase,
    encode,
    metrics_arrival,
    metrics_end,
    parse_request_async,
)
from ..http.sse import send_bytes
from ..http.streaming import ChoiceStream, stream_response
from .chunks import CHAT_CHUNK, ChunkTemplate
from .completion import include_usage_flags, usage_dict
from .tool_stream import ToolCallStreamMixin

_TAIL = b'},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
_MID = b'},"logprobs":null,"finish_reason":null,"token_ids":null}]'
# a chat chunk's continuous usage (vLLM writes the null details here, unlike the usage chunk)
_USAGE = b',"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d,"completion_tokens_details":null}'
_USAGE_R = (b',"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d,'
            b'"completion_tokens_details":{"reasoning_tokens":%d}}')


def _untokenizable(e: Exception) -> RequestValueError:
    return RequestValueError(f"cannot tokenize the prompt: {e}", "messages")


def _nonempty(ids: list[int]) -> list[int]:
    if not ids:
        raise RequestValueError("The chat template produced an empty prompt.", "messages")
    return ids


class ChatServing(ServingBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._prepared = BodyCache()  # body bytes -> (_prepared_owner(), _run's arguments): `_repeatable`
        # (logs the server template's content format at start-up, as vLLM logs it at its first request)
        resolve_content_format(self.settings.chat_template_content_format,
                               getattr(self.tokenizer.chat_template, "source", None))

    async def render_prompt_async(self, messages: list[dict[str, Any]], *, chat_template: Any,
                                  chat_template_kwargs: dict[str, Any] | None, **kw: Any) -> tuple[str, list[int]]:
        """render_prompt, with vLLM's refusal of request templates; a template from the request
        (--trust-request-chat-template) renders in a worker process under time and memory bounds."""
        try:
            check_request_template(chat_template, chat_template_kwargs, self.settings.trust_request_chat_template)
        except ChatTemplateError as e:
            raise RequestValueError(str(e)) from None
        if chat_template is None and chat_template_kwargs and "chat_template" in chat_template_kwargs:
            chat_template_kwargs = dict(chat_template_kwargs)
            chat_template = chat_template_kwargs.pop("chat_template")
        if chat_template is None:
            if not chat_template_kwargs and kw.get("tools") is None and not kw.get("continue_final_message", True):
                return await self._render_plain(messages, kw["add_generation_prompt"], kw["add_special_tokens"])
            return await self._render_prompt_offloaded(messages, chat_template=None,
                                                       chat_template_kwargs=chat_template_kwargs, **kw)

        render = dict(add_generation_prompt=kw["add_generation_prompt"],
                      continue_final_message=kw.get("continue_final_message", False), tools=kw.get("tools"))
        conv, kwargs = self._render_args(messages, chat_template_kwargs=chat_template_kwargs,
                                         template=getattr(chat_template, "source", chat_template), **render)
        try:  # compiled and rendered in a worker process, under the time and memory bounds
            text = await render_isolated(chat_template, conv, add_generation_prompt=render["add_generation_prompt"],
                                         bos_token=self.tokenizer.bos_token or "",
                                         eos_token=self.tokenizer.eos_token or "", tools=render["tools"], **kwargs)
        except ChatTemplateError as e:  # a bad template, or a bound
            raise RequestValueError(str(e)) from None
        text = self._finish_text(text, conv, render["continue_final_message"])
        try:
            ids = await self.tokenizer.encode_async(text, add_special_tokens=kw["add_special_tokens"])
        except Exception as e:  # as render_prompt
            raise _untokenizable(e) from None
        return text, _nonempty(ids)

    async def _render_plain(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                            add_special_tokens: bool) -> tuple[str, list[int]]:
        """The server template's render of a plain conversation, from the exact-content cache."""
        key = plain_key(messages, add_generation_prompt, add_special_tokens)
        cache = self._prompt_cache() if key is not None else None
        hit = cache.get(key) if cache is not None else None
        if hit is not None:
            return hit
        text, ids = await self._render_prompt_offloaded(
            messages, add_generation_prompt=add_generation_prompt, continue_final_message=False, chat_template=None,
            chat_template_kwargs=None, add_special_tokens=add_special_tokens)
        if cache is not None:
            cache.put(key, text, ids)
        return text, ids

    def _prompt_cache(self) -> PromptCache | None:
        """The cache for the current tokenizer, template and length limit (a new one if any changed)."""
        tok = self.tokenizer
        owner = (tok, tok.chat_template, self.settings.max_model_len)
        cached = self.__dict__.get("_prompts")
        if cached is not None and cached[0] == owner:  # identity for the objects
            return cached[1]
        template = owner[1]
        cache = PromptCache() if template is not None and template_is_pure(template.source) else None
        self._prompts = (owner, cache)
        return cache

    def render_prompt(self, messages: list[dict[str, Any]], *, add_special_tokens: bool,
                      **render: Any) -> tuple[str, list[int]]:
        """The chat template's text and its token ids (render_text's keywords)."""
        text = self.render_text(messages, **render)
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as e:  # the tokenizers library rejects some inputs with TypeError
            raise _untokenizable(e) from None
        return text, _nonempty(ids)

    async def _render_prompt_offloaded(self, messages: list[dict[str, Any]], *, add_special_tokens: bool,
                                       **render: Any) -> tuple[str, list[int]]:
        """render_prompt, with a long new prompt tokenized in a worker thread (Tokenizer.encode_async)."""
        text = self.render_text(messages, **render)
        try:
            ids = await self.tokenizer.encode_async(text, add_special_tokens=add_special_tokens)
        except Exception as e:  # as render_prompt
            raise _untokenizable(e) from None
        return text, _nonempty(ids)

    def render_text(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                    continue_final_message: bool, chat_template: Any,
                    chat_template_kwargs: dict[str, Any] | None, tools: Any = None) -> str:
        template = chat_template if chat_template is not None else self.tokenizer.chat_template
        conv, kwargs = self._render_args(messages, add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message,
                                         chat_template_kwargs=chat_template_kwargs, tools=tools,
                                         template=getattr(template, "source", template))
        try:
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                                      chat_template=chat_template, tools=tools, **kwargs)
        except ChatTemplateError as e:
            raise RequestValueError(str(e)) from None
        except ValueError as e:  # no chat template at all
            raise RequestValueError(str(e)) from None
        return self._finish_text(text, conv, continue_final_message)

    def _render_args(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, continue_final_message: bool,
                     chat_template_kwargs: dict[str, Any] | None, tools: Any = None,
                     template: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The checked conversation (developer messages as vLLM gives them to `template`, the
        source that renders it) and the template's extra variables (the request's over the
        server's --default-chat-template-kwargs, as vLLM merges them)."""
        if add_generation_prompt and continue_final_message:
            raise RequestValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        check_conversation(messages)
        fmt = resolve_content_format(self.settings.chat_template_content_format, template)
        conv = developer_as_system(normalize_messages(messages, fmt, self.settings.model_name), template)
        kwargs = {**self.settings.default_chat_template_kwargs, **(chat_template_kwargs or {})}
        for reserved in ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools"):
            kwargs.pop(reserved, None)
        return conv, kwargs

    def _finish_text(self, text: str, conv: list[dict[str, Any]], continue_final_message: bool) -> str:
        """The rendered text cut after the final message it continues, then checked for length."""
        if continue_final_message and conv:
            final = conv[-1].get("content") or ""
            if isinstance(final, list):  # (transformers continues the last text part)
                final = next((p["text"] for p in reversed(final) if "text" in p), "")
            if isinstance(final, str) and final.strip():
                cut = text.rfind(final.strip())
                if cut != -1:
                    text = text[: cut + len(final.strip())]
        check_prompt_chars(text, self.settings.max_model_len, self.tokenizer.max_chars_per_token)
        return text

    async def handle(self, ctx: RequestContext) -> None:
        try:
            hit = self._prepared.get(ctx.body)
            if hit is not None and hit[0] == self._prepared_owner():
                await self._run(ctx, *hit[1], None, hit[2])
                return
            req: ChatCompletionRequest = await parse_request_async(ctx.body, ChatCompletionRequest,
                                                                   self.tokenizer.vocab_size)
            await self._handle(ctx, req, ctx.body)
        except RequestValueError as e:
            raise as_http_error(e) from None

    def template_tools(self, req: ChatCompletionRequest) -> Any:
        """The tools the chat template sees: none for tool_choice "none" under
        --exclude-tools-when-tool-choice-none, as vLLM renders it."""
        if req.tool_choice == "none" and self.settings.exclude_tools_when_tool_choice_none:
            return None
        return req.tools

    def _prepared_owner(self) -> tuple:
        """What a prepared request depends on besides its body: the tokenizer, its template and the
        context length (the prompt cache's owner)."""
        tok = self.tokenizer
        return (tok, tok.chat_template, self.settings.max_model_len)

    async def _handle(self, ctx: RequestContext, req: ChatCompletionRequest, body: bytes | None = None) -> None:
        await self._run(ctx, req, *await self._prepare(req), body)

    def _repeatable(self, req: ChatCompletionRequest, body: bytes, plan: ChatOutputPlan | None) -> bool:
        """Whether `_prepare` gives the same answer for every request with these body bytes, and
        `_run` only reads what it gave: no output plan (tools, response formats), the server's own
        template when its render depends on the conversation only (PromptCache's rule), a model
        name that cannot come and go (a LoRA adapter can), a token choice small enough to be
        checked in place (a large one is rewritten), no KV transfer (its parameters go to the
        engine as they are)."""
        return (plan is None and req.chat_template is None and not req.chat_template_kwargs
                and req.tools is None and not req.continue_final_message and not req.kv_transfer_params
                and (not req.model or req.model in self._names)
                and self._prompt_cache() is not None and len(body) <= self._prepared.max_body
                and len(req.logit_bias or ()) + len(req.allowed_token_ids or ()) <= OFFLOAD_BIAS_ENTRIES)

    async def _prepare(self, req: ChatCompletionRequest) -> tuple:
        """What a request's checks, template and tokenizer make of it, before anything of its own
        (ids, headers, time): (model, prompt ids, output limit, logprobs, output plan)."""
        top = req.top_logprobs
        defaults = self.settings.sampling_defaults
        defaults.fill(req)  # (before any check: vLLM checks the SamplingParams the defaults went into)
        plan = await ChatOutputPlan.for_request(req, self.settings.tools, self.settings.reasoning_ids)
        model = self.check_model(req.model)
        if plan is not None:
            await plan.check()
        max_len = self.settings.max_model_len
        if req.max_completion_tokens is not None:
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = req.max_tokens, "max_tokens"
        check_output_budget(max_tokens, max_len, param)
        check_truncation(req.truncate_prompt_tokens, max_len)
        text, prompt_ids = await self.render_prompt_async(
            req.messages, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs, add_special_tokens=req.add_special_tokens,
            tools=self.template_tools(req))
        prompt_ids = truncate_prompt(prompt_ids, req.truncate_prompt_tokens, req.truncation_side, max_len)
        check_prompt_tokens(len(prompt_ids), max_len, from_text=True)
        limit = defaults.limit(len(prompt_ids), max_len, max_tokens)
        check_sampling(req, limit)
        check_greedy_n(req)
        want_lp = None
        if req.logprobs:
            want_lp = self.tokenizer.vocab_size if top == -1 else (top or 0)
            check_logprobs_limit(want_lp)
        check_prompt_logprobs_limit(effective_prompt_logprobs(req, top), self.tokenizer.vocab_size)
        check_prompt_logprobs_budget(effective_prompt_logprobs(req, top), len(prompt_ids), self.tokenizer.vocab_size)
        return model, tuple(prompt_ids), limit, want_lp, plan

    async def _run(self, ctx: RequestContext, req: ChatCompletionRequest, model: str, prompt_tuple: tuple[int, ...],
                   limit: int, want_lp: int | None, plan: ChatOutputPlan | None, body: bytes | None,
                   repeated: list[SamplingParams | None] | None = None) -> None:
        """The request's own part: its headers, ids and time, the engine requests, the response.
        `repeated`: prepared before, from the same body bytes, and its token choice checked then
        (it holds the sampling parameters that request's one choice got, unless a header made
        them its own). Else `body` (the bytes it was parsed from, if any) is kept for the next
        request with the same bytes when `_repeatable`."""
        prompt_ids = list(prompt_tuple)
        dp_rank = parse_dp_rank(ctx.headers, self.settings.engine_count)
        replay_id = output_replay_header(ctx.headers)
        if repeated is None:
            await check_token_choice(req, self.tokenizer.vocab_size)
            if body is not None and self._repeatable(req, body, plan):
                repeated = [None]
                # held beyond the body: the parsed request (about the body's size again) and the
                # prompt's ids (an int and its slot in the tuple, ~36 bytes each)
                self._prepared.put(body, (self._prepared_owner(), (req, model, prompt_tuple, limit, want_lp, plan),
                                          repeated), held=len(body) + 36 * len(prompt_tuple))
                body = None
        # the sampling parameters are the body's alone (as a copy) without X-Output-Replay-Id
        kept = repeated is not None and replay_id is None and req.n == 1
        sp = repeated[0] if kept else None

        rid = f"chatcmpl-{self.base_request_id(ctx, req.request_id)}"
        created = int(time.time())
        stops = stop_list(req.stop)
        states: list[SequenceState] = []
        engine_reqs: list[EngineCoreRequest] = []
        for j in range(req.n):
            states.append(SequenceState(self.tokenizer, stop=stops, include_stop=req.include_stop_str_in_output,
                                        min_tokens=req.min_tokens, streaming=bool(req.stream), want_logprobs=want_lp,
                                        keep_ids=bool(req.return_token_ids), think=self.settings.reasoning_ids))
            engine_reqs.append(build_engine_request(
                internal_id=f"{rid}-{j}-{random_hex(8)}", external_id=rid, prompt_ids=prompt_ids, req=req,
                max_tokens=limit, seed=None if req.seed is None else req.seed + j, logprobs=want_lp,
                stream=bool(req.stream), tokenizer=self.tokenizer, dp_rank=dp_rank,
                replay_id=replay_id, lora_request=self.lora_request(req.model),
                arrival_time=ctx.arrival, sglang_bootstrap=self.settings.engine_type == "sglang",
                sampling_params=None if sp is None else msgspec.structs.replace(sp)))
        if kept and sp is None:
            repeated[0] = msgspec.structs.replace(engine_reqs[0].sampling_params)
        role = (self.settings.response_role if req.add_generation_prompt or not req.messages
                else req.messages[-1].get("role", "assistant"))
        echo_text = ""
        if req.echo and req.messages and req.messages[-1].get("role") == role:
            last = normalize_messages([req.messages[-1]])[0].get("content")
            echo_text = last or ""
        if plan is not None and replay_id is None and "output_replay_id" not in (req.vllm_xargs or {}):
            await plan_engine_outputs(plan, self.tokenizer, req.seed, engine_reqs)
        self.admit(len(engine_reqs))
        metrics_arrival(self.metrics, ctx, engine_reqs, req.n, rid)
        try:
            if req.stream:
                await self._stream(ctx, req, rid, created, model, role, echo_text, prompt_ids, states,
                                   engine_reqs, plan)
            else:
                await self._full(ctx, req, rid, created, model, role, echo_text, prompt_ids, states,
                                 engine_reqs, plan)
        finally:
            metrics_end(self.metrics, engine_reqs, states)

    async def _full(self, ctx: RequestContext, req: ChatCompletionRequest, rid: str, created: int, model: str,
                    role: str, echo_text: str, prompt_ids: list[int], states: list[SequenceState],
                    engine_reqs: list[EngineCoreRequest], plan: ChatOutputPlan | None = None) -> None:
        prompt_len = len(prompt_ids)
        rti = bool(req.return_token_ids)
        if not await self.run_to_end(ctx, states, engine_reqs):
            return
        choices = []
        for i, st in enumerate(states):
            lp = None
            if req.logprobs:
                lp = chat_logprobs(self.tokenizer, st.token_ids, req.top_logprobs or 0, greedy=is_greedy(req),
                                   as_ids=tokens_as_ids(req, self.settings.return_tokens_as_token_ids))
            # vLLM 0.32's ChatMessage; an empty tool_calls list is left out, as vLLM's serializer does
            content: str | None = st.full_text()
            reasoning = "".join(st.reasoning) if st.think else None
            tool_calls, finish_reason = [], st.finish_reason
            if plan is not None:
                content, tool_calls, auto_called = plan.message_parts(content)
                finish_reason = plan.finish_reason(finish_reason, auto_called)
                if plan.uses_tools and plan.tool_choice == "auto" and self.metrics is not None:
                    # vLLM runs its tool parser once per choice of an "auto" request
                    record = getattr(self.metrics, "record_tool_parser_invocation", None)
                    if record is not None:
                        record(auto_called, False)
            if echo_text:
                content = echo_text + (content or "")
            if st.think and not content:
                content = None  # a reasoning parser reports no content as null
            message = {"role": role, "content": content, "refusal": None, "annotations": None,
                       "audio": None, "function_call": None}
            if tool_calls:  # vLLM's serializer leaves an empty list out
                message["tool_calls"] = tool_calls
            message["reasoning"] = reasoning or None
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish_reason,
                            "stop_reason": st.stop_reason, "token_ids": st.token_ids if rti else None,
                            "routed_experts": None})
        completion_tokens = sum(s.num_tokens for s in states)
        last = states[-1]
        plp_k = effective_prompt_logprobs(req, req.top_logprobs)
        plp = None if plp_k is None else (await prompt_logprobs_many(self.tokenizer, [prompt_ids], plp_k))[0]
        body = {
            "id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "service_tier": None, "system_fingerprint": self.settings.system_fingerprint,
            "usage": usage_dict(prompt_len, completion_tokens, self.prompt_details(last, wants_cache_details(req)),
                                {"reasoning_tokens": sum(x.reasoning_tokens for x in states)}
                                if self.settings.reasoning_parser else None),
            "prompt_logprobs": plp,
            "prompt_token_ids": prompt_ids if rti else None, "prompt_text": None,
            "kv_transfer_params": states[0].kv_transfer_params, "ec_transfer_params": None,
            "metrics": self.request_metrics(engine_reqs, completion_tokens),
        }
        ctx.finishing = True
        await send_bytes(ctx.send, 200, encode(body))

    def prompt_details(self, st: SequenceState, force: bool = False) -> dict[str, Any] | None:
        """usage.prompt_tokens_details: only with --enable-prompt-tokens-details, as in vLLM (or for
        an adapter that always reports the cache, like the Responses API)."""
        if not self.settings.prompt_tokens_details and not force:
            return None
        return {"cached_tokens": st.cached_tokens, "created_cache_tokens": st.cache_created,
                "multimodal_tokens": None}

    async def _stream(self, ctx: RequestContext, req: ChatCompletionRequest, rid: str, created: int, model: str,
                      role: str, echo_text: str, prompt_ids: list[int], states: list[SequenceState],
                      engine_reqs: list[EngineCoreRequest], plan: ChatOutputPlan | None = None) -> None:
        if plan is not None and plan.uses_tools:
            renderer: ChatStream = ToolChatStream(self, req, rid, created, model, role, echo_text, prompt_ids,
                                                  states, engine_reqs, plan)
        else:
            renderer = ChatStream(self, req, rid, created, model, role, echo_text, prompt_ids, states, engine_reqs)
        await stream_response(ctx, self.engine, engine_reqs, renderer,
                              max(req.stream_interval or 1, self.settings.stream_interval),
                              self.settings.sse_keep_alive_interval)


CACHE_DETAILS_KEY = "vllm_vcr_cache_details"  # set by adapters (chat_bridge) that always need cached_tokens


def wants_cache_details(req: ChatCompletionRequest) -> bool:
    return bool(req.model_extra and req.model_extra.get(CACHE_DETAILS_KEY))


async def plan_engine_outputs(plan: ChatOutputPlan, tokenizer: Any, seed: int | None,
                              engine_reqs: list[EngineCoreRequest]) -> None:
    """Tell the engine what each choice generates (choice j draws with seed + j, as vLLM seeds n)."""
    for j, er in enumerate(engine_reqs):
        ids = await plan.output_ids(tokenizer, None if seed is None else seed + j)
        if ids is not None:
            attach_planned_ids(er, ids)


@lru_cache(maxsize=64)
def _role_delta(role: str) -> bytes:
    """A role chunk's delta, up to the end of its choice (the role's JSON made once per role)."""
    return b'{"role":' + encode(role) + b',"content":""},"logprobs":null,"finish_reason":null}]'


class ChatStream(ChoiceStream):
    """Renders one chat completion stream, chunk by chunk, in vLLM 0.32's exact bytes."""

    def __init__(self, serving: ChatServing, req: ChatCompletionRequest, rid: str, created: int, model: str,
                 role: str, echo_text: str, prompt_ids: list[int], states: list[SequenceState],
                 engine_reqs: list[EngineCoreRequest]) -> None:
        self.serving = serving
        self.settings = settings = serving.settings
        self.tokenizer = serving.tokenizer
        self.rid, self.created, self.model, self.role, self.echo_text = rid, created, model, role, echo_text
        self.prompt_ids = prompt_ids
        self.prompt_len = len(prompt_ids)
        total = len(states)
        self.rti = bool(req.return_token_ids)
        self.template = tpl = ChunkTemplate(CHAT_CHUNK, rid, created, model, settings.system_fingerprint)
        if total == 1:  # (no comprehensions' frames for the usual case)
            head = tpl.choice(0) + b',"delta":'
            self.head_idx, self.heads = [head], [head + b'{"content":']
        else:
            self.head_idx = [tpl.choice(i) + b',"delta":' for i in range(total)]
            self.heads = [head + b'{"content":' for head in self.head_idx]
        self.include_usage, self.continuous = include_usage_flags(req, settings.force_include_usage)
        self.think = settings.reasoning_ids is not None
        # vLLM stamps the fingerprint on the last chunk: the usage chunk if there is one
        super().__init__(states, engine_reqs, b"" if self.include_usage else tpl.fingerprint)
        self.req = req
        self.want_lp = bool(req.logprobs)
        self.k = req.top_logprobs or 0
        self.greedy = is_greedy(req)
        self.as_ids = self.want_lp and tokens_as_ids(req, settings.return_tokens_as_token_ids)
        self.plain = not self.think and not self.want_lp and not self.rti  # the per-token fast case
        self.first = True
        self.first_state: SequenceState | None = None
        st = states[0]
        if (self.single and self.plain and not settings.reasoning_parser and not st.stops and not st.keep_text
                and not st.keep_ids):
            self.enable_fast(self.heads[0], _TAIL, _MID, _USAGE, self.prompt_len)
            self.first_pre = self.opening()  # now, not when the first token is due

    def usage_part(self, completion_tokens: int, st: SequenceState | None = None) -> bytes:
        pl = self.prompt_len
        if self.settings.reasoning_parser:
            return _USAGE_R % (pl, pl + completion_tokens, completion_tokens,
                               st.reasoning_tokens if st is not None else 0)
        return _USAGE % (pl, pl + completion_tokens, completion_tokens)

    def opening(self) -> bytes:
        """The role chunk for every choice, then the echoed last message (vLLM's order)."""
        cont = self.continuous
        after = (_role_delta(self.role) + (self.usage_part(0) if cont else b"")
                 + (b',"prompt_token_ids":' + encode(self.prompt_ids) if self.rti else b',"prompt_token_ids":null')
                 + b',"prompt_text":null}\n\n')
        if self.single and not self.echo_text:
            return self.head_idx[0] + after
        parts = [head + after for head in self.head_idx]
        if self.echo_text:
            for i in range(self.total):
                parts.append(self.heads[i] + encode(self.echo_text) + b'},"logprobs":null,"finish_reason":null}]'
                             + (self.usage_part(0) if cont else b"") + b"}\n\n")
        return b"".join(parts)

    def feed_full(self, out: EngineCoreOutput) -> bytes:
        if self.first and self.fast_ok:
            data = self.feed_first(out)
            if data is not None:
                self.first = False
                self.first_state = self.states[0]
                return data
        pre, applied = self.begin(out)
        if applied is None:
            return pre
        i, st, before, text, ids = applied
        finished = st.finished
        if not text and not ids and not before and not finished:
            return pre
        if self.plain and not finished:
            if self.continuous:
                return pre + self.heads[i] + encode(text) + _MID + self.usage_part(st.num_tokens) + b"}\n\n"
            return pre + self.heads[i] + encode(text) + _TAIL
        if self.think:
            if not text and not st.reasoning_delta and not finished and not self.want_lp and not self.rti:
                return pre  # only a thinking marker: a reasoning parser says nothing
            delta = {}
            if text:
                delta["content"] = text
            if st.reasoning_delta:
                delta["reasoning"] = st.reasoning_delta
            first_part = self.head_idx[i] + encode(delta)
        else:
            first_part = self.heads[i] + encode(text) + b"}"
        return self.end_chunk(out, applied, [pre, first_part], st.finish_reason)

    def begin(self, out: EngineCoreOutput) -> tuple[bytes, tuple[int, SequenceState, int, str, list[int]] | None]:
        """Apply an output to its choice: the bytes that go first (the opening, with the stream's
        first output) and the applied output (ChoiceStream.apply), or None when it says nothing
        more (an ended choice, an error)."""
        applied = self.apply(out)
        if applied is None:
            return b"", None
        st = applied[1]
        pre = b""
        if self.first:
            self.first = False
            self.first_state = st  # vLLM takes the cache numbers from the first output
            pre = self.opening()
        if st.finish_reason == "error":
            self.error = self.done = True
            return pre, None
        return pre, applied

    def end_chunk(self, out: EngineCoreOutput, applied: tuple[int, SequenceState, int, str, list[int]],
                  chunk: list[bytes], finish_reason: str | None) -> bytes:
        """A chunk begun with its delta (`chunk`), closed: logprobs, finish and stop reasons, token
        ids, continuous usage."""
        i, st, before, _, ids = applied
        chunk.append(b',"logprobs":')
        chunk.append(encode(chat_logprobs(self.tokenizer, list(ids), self.k, start_position=before,
                                          greedy=self.greedy, as_ids=self.as_ids))
                     if self.want_lp else b"null")
        ids_part = encode(list(ids)) if self.rti else b"null"
        finished = st.finished
        if finished:
            chunk += [b',"finish_reason":', encode(finish_reason), b',"stop_reason":',
                      encode(st.stop_reason), b',"token_ids":', ids_part, b"}]"]
        else:
            chunk += [b',"finish_reason":null,"token_ids":', ids_part, b"}]"]
        if self.continuous:
            chunk.append(self.usage_part(st.num_tokens, st))
        return self.close_chunk(i, out, chunk, finished)

    def usage_chunk(self) -> bytes:
        if not self.include_usage:
            return b""
        states = self.states
        completion_tokens = sum(s.num_tokens for s in states)
        metrics = self.serving.request_metrics(self.engine_reqs, completion_tokens) \
            if self.settings.per_request_metrics else None
        if not (self.settings.reasoning_parser or self.settings.prompt_tokens_details
                or wants_cache_details(self.req)) and metrics is None:  # the usual shape: the three counts only
            pl = self.prompt_len
            return self.template.usage_counts_format() % (pl, pl + completion_tokens, completion_tokens)
        usage = usage_dict(self.prompt_len, completion_tokens,
                           self.serving.prompt_details(self.first_state or states[0],
                                                       wants_cache_details(self.req)))
        if self.settings.reasoning_parser:
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(x.reasoning_tokens for x in states)}
        return self.template.usage_chunk(usage, metrics)


class ToolChatStream(ToolCallStreamMixin, ChatStream):
    """A chat stream whose deltas carry tool calls (only requests with tools use it)."""
