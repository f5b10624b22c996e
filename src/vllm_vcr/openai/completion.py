"""POST /v1/completions."""

from __future__ import annotations

import time
from typing import Any

from ..engine.types import EngineCoreOutput, EngineCoreRequest
from ..frontend.errors import HTTPError
from ..frontend.generation import (
    SequenceState,
    as_http_error,
    build_engine_request,
    output_replay_header,
    parse_dp_rank,
    random_hex,
)
from ..frontend.logprobs import completion_logprobs, prompt_logprobs_many, tokens_as_ids
from ..frontend.protocol import MAX_CHOICES, CompletionRequest, RequestValueError, stop_list
from ..frontend.request_checks import (
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
    effective_prompt_logprobs,
    is_greedy,
    truncate_prompt,
)
from ..frontend.structured.completion_outputs import CompletionOutputPlan
from ..http.serving_base import (
    RequestContext,
    ServingBase,
    encode,
    metrics_arrival,
    metrics_end,
    parse_request_async,
)
from ..http.sse import DONE, SSEWriter, send_bytes
from ..http.streaming import ChoiceStream, stream_response
from .chunks import COMPLETION_CHUNK
from .chunks import USAGE_COUNTS as _USAGE
from .chunks import ChunkTemplate

_TAIL = b',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}\n\n'
_MID = b',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]'


class Prompt:
    __slots__ = ("ids", "text")

    def __init__(self, ids: list[int], text: str | None):
        self.ids = ids
        self.text = text


def usage_dict(prompt_tokens: int, completion_tokens: int, details: dict[str, Any] | None,
               completion_details: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's UsageInfo, every field."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": details,
            "completion_tokens_details": completion_details}


def include_usage_flags(req: Any, force: bool) -> tuple[bool, bool]:
    so = req.stream_options
    if so is None:
        return force, False
    inc = bool(so.include_usage) or force
    return inc, inc and bool(so.continuous_usage_stats)


class CompletionServing(ServingBase):
    async def handle(self, ctx: RequestContext) -> None:
        try:
            req: CompletionRequest = await parse_request_async(ctx.body, CompletionRequest, self.tokenizer.vocab_size)
            await self._handle(ctx, req)
        except RequestValueError as e:
            raise as_http_error(e) from None

    async def _handle(self, ctx: RequestContext, req: CompletionRequest) -> None:
        model = self.check_model(req.model)
        defaults = self.settings.sampling_defaults
        defaults.fill(req)
        if req.prompt_embeds is not None and req.prompt_embeds != []:
            # vLLM without --enable-prompt-embeds (which needs a real model's hidden size)
            raise RequestValueError("You must set `--enable-prompt-embeds` to input `prompt_embeds`.")
        if req.suffix is not None:  # (the mock's models have no fill-in-the-middle rendering)
            raise HTTPError(400, "suffix is only supported for models with FIM completion rendering", "BadRequestError",
                            "suffix")
        max_len = self.settings.max_model_len
        echo_only = bool(req.echo) and req.max_tokens == 0
        if not echo_only:
            check_output_budget(req.max_tokens, max_len)
        check_truncation(req.truncate_prompt_tokens, max_len)
        prompts = await self._prompts(req)
        # vLLM clamps max_tokens to the room the prompt leaves, then checks SamplingParams
        limits = [defaults.limit(len(pr.ids), max_len, req.max_tokens) for pr in prompts]
        check_sampling(req, None if echo_only else min(limits))
        if echo_only:  # vLLM runs the engine for one token, which the answer does not show (usage counts it)
            limits = [1] * len(prompts)
        if req.n * len(prompts) > MAX_CHOICES:
            raise RequestValueError(f"n x number of prompts must be at most {MAX_CHOICES}, "
                                    f"got {req.n * len(prompts)}.", "n")
        check_greedy_n(req)
        check_logprobs_limit(self.tokenizer.vocab_size if req.logprobs == -1 else req.logprobs)
        check_prompt_logprobs_limit(effective_prompt_logprobs(req, req.logprobs), self.tokenizer.vocab_size)
        for pr in prompts:
            self.check_token_ids(pr.ids)
        check_prompt_logprobs_budget(effective_prompt_logprobs(req, req.logprobs),
                                     sum(len(pr.ids) for pr in prompts) * req.n, self.tokenizer.vocab_size)
        plan = await CompletionOutputPlan.for_request(req)
        dp_rank = parse_dp_rank(ctx.headers, self.settings.engine_count)
        replay_id = output_replay_header(ctx.headers)
        await check_token_choice(req, self.tokenizer.vocab_size)

        rid = f"cmpl-{self.base_request_id(ctx, req.request_id)}"
        n = req.n
        created = int(time.time())
        stops = stop_list(req.stop)
        states: list[SequenceState] = []
        engine_reqs: list[EngineCoreRequest] = []
        for pi, pr in enumerate(prompts):
            for j in range(n):
                flat = pi * n + j
                states.append(SequenceState(self.tokenizer, stop=stops, include_stop=req.include_stop_str_in_output,
                                            min_tokens=req.min_tokens, streaming=bool(req.stream),
                                            want_logprobs=req.logprobs, keep_ids=bool(req.return_token_ids)))
                engine_reqs.append(build_engine_request(
                    internal_id=f"{rid}-{flat}-{random_hex(8)}", external_id=rid, prompt_ids=pr.ids, req=req,
                    max_tokens=limits[pi], seed=None if req.seed is None else req.seed + j,
                    logprobs=req.logprobs, stream=bool(req.stream), tokenizer=self.tokenizer, dp_rank=dp_rank,
                replay_id=replay_id, lora_request=self.lora_request(req.model),
                arrival_time=ctx.arrival, sglang_bootstrap=self.settings.engine_type == "sglang"))
        if plan is not None and replay_id is None and "output_replay_id" not in (req.vllm_xargs or {}) \
                and not echo_only:
            await plan.plan(self.tokenizer, req.seed, engine_reqs)
        self.admit(len(engine_reqs))
        metrics_arrival(self.metrics, ctx, engine_reqs, n, rid)
        try:
            if echo_only:
                await self._echo_only(ctx, req, rid, created, model, prompts, states, engine_reqs)
            elif req.stream:
                await self._stream(ctx, req, rid, created, model, prompts, states, engine_reqs)
            else:
                await self._full(ctx, req, rid, created, model, prompts, states, engine_reqs)
        finally:
            metrics_end(self.metrics, engine_reqs, states)

    async def _prompts(self, req: CompletionRequest) -> list[Prompt]:
        p = req.prompt
        tok = self.tokenizer
        max_len = self.settings.max_model_len
        out: list[Prompt] = []
        if isinstance(p, str):
            items: list[Any] = [p]
        elif p and isinstance(p[0], int):
            items = [p]
        else:
            items = list(p or [])
        if not items:
            raise RequestValueError("You must pass at least one prompt")
        trunc = req.truncate_prompt_tokens
        for item in items:
            if isinstance(item, str):
                if trunc is None:  # vLLM skips its length pre-check on text it truncates
                    check_prompt_chars(item, max_len, tok.max_chars_per_token)
                try:
                    ids = await tok.encode_async(item, add_special_tokens=req.add_special_tokens)
                except Exception as e:  # the tokenizers library rejects some inputs with TypeError
                    raise RequestValueError(f"cannot tokenize the prompt: {e}", "prompt") from None
                text: str | None = item
            else:
                ids = list(item)
                text = None
            if not ids:
                raise RequestValueError("The decoder prompt cannot be empty")
            if trunc is not None:
                specials = tok.special_tokens_around(text, ids) if text is not None else (0, 0)
                cut = truncate_prompt(ids, trunc, req.truncation_side, max_len, specials=specials)
                if len(cut) < len(ids):  # (vLLM's echo shows the prompt as sent)
                    ids, text = cut, text if text is not None else tok.decode(ids)
            check_prompt_tokens(len(ids), max_len, from_text=text is not None)
            out.append(Prompt(ids, text))
        return out

    def _prompt_text(self, p: Prompt) -> str:
        if p.text is None:
            p.text = self.tokenizer.decode(p.ids)
        return p.text

    def _choice_logprobs(self, st: SequenceState, req: CompletionRequest, p: Prompt, echo: bool,
                         delta_ids: list[int], start: int, text_offset: int) -> dict[str, Any]:
        k = req.logprobs or 0
        greedy = is_greedy(req)
        as_ids = tokens_as_ids(req, self.settings.return_tokens_as_token_ids)
        if echo:
            return completion_logprobs(self.tokenizer, p.ids + list(delta_ids), k, start_position=-len(p.ids),
                                       initial_text_offset=text_offset, first_is_prompt_start=True, greedy=greedy,
                                       as_ids=as_ids)
        return completion_logprobs(self.tokenizer, list(delta_ids), k, start_position=start,
                                   initial_text_offset=text_offset, greedy=greedy, as_ids=as_ids)

    async def _full(self, ctx: RequestContext, req: CompletionRequest, rid: str, created: int, model: str,
                    prompts: list[Prompt], states: list[SequenceState], engine_reqs: list[EngineCoreRequest]) -> None:
        if not await self.run_to_end(ctx, states, engine_reqs):
            return
        n = req.n
        plp_k = effective_prompt_logprobs(req, req.logprobs)
        plps = [] if plp_k is None else await prompt_logprobs_many(self.tokenizer, [p.ids for p in prompts], plp_k)
        choices = []
        prompt_tokens = 0
        completion_tokens = 0
        for pi, p in enumerate(prompts):
            prompt_tokens += len(p.ids)
            for j in range(n):
                flat = pi * n + j
                st = states[flat]
                completion_tokens += st.num_tokens
                text = st.full_text()
                if req.echo:
                    text = self._prompt_text(p) + text
                lp = None
                if req.logprobs is not None:
                    lp = self._choice_logprobs(st, req, p, bool(req.echo), st.token_ids, 0, 0)
                c = choice_dict(flat, text, lp, st.finish_reason, st.stop_reason)
                if plp_k is not None:
                    c["prompt_logprobs"] = plps[pi]
                if req.return_token_ids:
                    c["token_ids"] = st.token_ids
                    c["prompt_token_ids"] = p.ids
                choices.append(c)
        # vLLM reports the cache hit of the last prompt's output
        details = self.prompt_details(states[-1].cached_tokens)
        body = response_dict(rid, created, model, choices, self.settings.system_fingerprint,
                             usage_dict(prompt_tokens, completion_tokens, details), states[0].kv_transfer_params,
                             self.request_metrics(engine_reqs, completion_tokens))
        ctx.finishing = True
        await send_bytes(ctx.send, 200, encode(body))

    def prompt_details(self, cached: int | None) -> dict[str, Any] | None:
        """usage.prompt_tokens_details: only with --enable-prompt-tokens-details, as in vLLM."""
        if not self.settings.prompt_tokens_details or cached is None:
            return None
        return {"cached_tokens": cached, "created_cache_tokens": None, "multimodal_tokens": None}

    async def _echo_only(self, ctx: RequestContext, req: CompletionRequest, rid: str, created: int, model: str,
                         prompts: list[Prompt], states: list[SequenceState], engine_reqs: list[EngineCoreRequest]) -> None:
        # max_tokens=0 with echo: the prompt is the whole answer; the engine computes it and samples
        # one token that is not shown (vLLM's echo_without_generation), which the usage counts
        if not await self.run_to_end(ctx, states, engine_reqs):
            return
        plp_k = effective_prompt_logprobs(req, req.logprobs)
        plps = [] if plp_k is None else await prompt_logprobs_many(self.tokenizer, [p.ids for p in prompts], plp_k)
        choices = []
        prompt_tokens = 0
        for pi, p in enumerate(prompts):
            prompt_tokens += len(p.ids)
            for j in range(req.n):
                lp = None
                if req.logprobs is not None:
                    lp = completion_logprobs(self.tokenizer, p.ids, req.logprobs, start_position=-len(p.ids),
                                             first_is_prompt_start=True,
                                             as_ids=tokens_as_ids(req, self.settings.return_tokens_as_token_ids))
                c = choice_dict(pi * req.n + j, self._prompt_text(p), lp, "length", None)
                if plp_k is not None:
                    c["prompt_logprobs"] = plps[pi]
                choices.append(c)
        details = self.prompt_details(states[-1].cached_tokens)
        usage = usage_dict(prompt_tokens, sum(st.num_tokens for st in states), details)
        fp = self.settings.system_fingerprint
        metrics = self.request_metrics(engine_reqs, usage["completion_tokens"])
        ctx.finishing = True
        if not req.stream:
            await send_bytes(ctx.send, 200, encode(response_dict(rid, created, model, choices, fp, usage, None, metrics)))
            return
        w = SSEWriter(ctx.send)
        inc, _ = include_usage_flags(req, self.settings.force_include_usage)
        tpl = ChunkTemplate(COMPLETION_CHUNK, rid, created, model, fp)
        # (vLLM writes the fingerprint on every chunk of this answer, unless a usage chunk follows)
        parts = [tpl.chunk({**stream_choice(c), "prompt_token_ids": prompts[k // req.n].ids}, last=not inc)
                 for k, c in enumerate(choices)]
        if inc:
            parts.append(tpl.usage_chunk(usage, metrics))
        await w.close(b"".join(parts) + DONE)

    async def _stream(self, ctx: RequestContext, req: CompletionRequest, rid: str, created: int, model: str,
                      prompts: list[Prompt], states: list[SequenceState], engine_reqs: list[EngineCoreRequest]) -> None:
        renderer = CompletionStream(self, req, rid, created, model, prompts, states, engine_reqs)
        await stream_response(ctx, self.engine, engine_reqs, renderer,
                              max(req.stream_interval or 1, self.settings.stream_interval),
                              self.settings.sse_keep_alive_interval)


class CompletionStream(ChoiceStream):
    """Renders one text completion stream, chunk by chunk, in vLLM 0.32's exact bytes."""

    def __init__(self, serving: CompletionServing, req: CompletionRequest, rid: str, created: int, model: str,
                 prompts: list[Prompt], states: list[SequenceState], engine_reqs: list[EngineCoreRequest]) -> None:
        self.serving = serving
        self.req = req
        self.rid, self.created, self.model = rid, created, model
        self.prompts = prompts
        self.n = n = req.n
        total = len(states)
        self.template = tpl = ChunkTemplate(COMPLETION_CHUNK, rid, created, model, serving.settings.system_fingerprint)
        self.heads = [tpl.choice(i) + b',"text":' for i in range(total)]
        self.include_usage, self.continuous = include_usage_flags(req, serving.settings.force_include_usage)
        # vLLM stamps the fingerprint on the last chunk: the usage chunk if there is one
        super().__init__(states, engine_reqs, b"" if self.include_usage else tpl.fingerprint)
        self.want_lp = req.logprobs is not None
        self.greedy = is_greedy(req)
        self.as_ids = self.want_lp and tokens_as_ids(req, serving.settings.return_tokens_as_token_ids)
        self.rti = bool(req.return_token_ids)
        self.echo = bool(req.echo) or self.rti  # both hand the prompt ids out with the first chunk
        self.echo_text = bool(req.echo)
        self.echoed = [not self.echo] * total
        self.plain = not self.want_lp and not self.rti  # the per-token fast case (after any echo)
        self.text_lens = [0] * total
        self.prompt_lens = [len(prompts[i // n].ids) for i in range(total)]
        self.first_cached: int | None = None
        st = states[0]
        if self.single and self.plain and not self.echo and not st.stops and not st.keep_text and not st.keep_ids:
            # text_lens only serves logprobs offsets, which the fast case never has
            self.enable_fast(self.heads[0], _TAIL, _MID, _USAGE, self.prompt_lens[0])

    def feed_full(self, out: EngineCoreOutput) -> bytes:
        if self.first_cached is None and self.fast_ok:
            data = self.feed_first(out)
            if data is not None:
                self.first_cached = self.states[0].cached_tokens
                return data
        applied = self.apply(out)
        if applied is None:
            return b""
        i, st, before, text, ids = applied
        if self.first_cached is None:
            self.first_cached = st.cached_tokens
        if st.finish_reason == "error":
            self.error = self.done = True
            return b""
        finished = st.finished
        if self.echoed[i]:
            if not text and not ids and not before and not finished:
                return b""  # nothing to say yet (vLLM skips empty chunked-prefill outputs)
            self.text_lens[i] += len(text)
            if self.plain and not finished:
                if self.continuous:
                    pt = self.prompt_lens[i]
                    return (self.heads[i] + encode(text) + _MID + _USAGE % (pt, pt + st.num_tokens, st.num_tokens)
                            + b"}\n\n")
                return self.heads[i] + encode(text) + _TAIL
            prompt_ids_part = b"null"
            if self.want_lp:
                lp_bytes = encode(completion_logprobs(self.serving.tokenizer, list(ids), self.req.logprobs or 0,
                                                      start_position=before,
                                                      initial_text_offset=self.text_lens[i] - len(text),
                                                      greedy=self.greedy, as_ids=self.as_ids))
        else:  # the first chunk of an echoing choice carries the prompt (text and ids)
            self.echoed[i] = True
            p = self.prompts[i // self.n]
            if self.echo_text:
                text = self.serving._prompt_text(p) + text
            prompt_ids_part = encode(p.ids)  # vLLM returns the prompt ids with the echo
            if self.want_lp:
                lp_bytes = encode(self.serving._choice_logprobs(st, self.req, p, self.echo_text, ids, 0, 0))
            self.text_lens[i] += len(text)
        chunk = [self.heads[i], encode(text), b',"logprobs":', lp_bytes if self.want_lp else b"null",
                 b',"finish_reason":', encode(st.finish_reason), b',"stop_reason":',
                 encode(st.stop_reason), b',"prompt_token_ids":', prompt_ids_part,
                 b',"token_ids":', encode(list(ids)) if self.rti else b"null", b"}]"]
        if self.continuous:
            pt = self.prompt_lens[i]
            chunk.append(_USAGE % (pt, pt + st.num_tokens, st.num_tokens))
        return self.close_chunk(i, out, chunk, finished)

    def usage_chunk(self) -> bytes:
        if not self.include_usage:
            return b""
        prompt_tokens = sum(len(p.ids) for p in self.prompts)
        completion_tokens = sum(s.num_tokens for s in self.states)
        usage = usage_dict(prompt_tokens, completion_tokens, self.serving.prompt_details(self.first_cached))
        return self.template.usage_chunk(usage, self.serving.request_metrics(self.engine_reqs, completion_tokens))


def choice_dict(index: int, text: str, logprobs: Any, finish_reason: str | None, stop_reason: Any) -> dict[str, Any]:
    """vLLM 0.32's CompletionResponseChoice, every field."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason, "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
            "routed_experts": None}


def stream_choice(c: dict[str, Any]) -> dict[str, Any]:
    return {"index": c["index"], "text": c["text"], "logprobs": c["logprobs"], "finish_reason": c["finish_reason"],
            "stop_reason": c["stop_reason"], "prompt_token_ids": None, "token_ids": None}


def response_dict(rid: str, created: int, model: str, choices: list[dict[str, Any]], fingerprint: str | None,
                  usage: dict[str, Any], kv_transfer_params: Any,
                  metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "service_tier": None, "system_fingerprint": fingerprint, "usage": usage,
            "kv_transfer_params": kv_transfer_params, "ec_transfer_params": None, "metrics": metrics}
