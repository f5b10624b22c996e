"""Tokens in, tokens out: POST /inference/v1/generate (and /inference/v1/abort_requests), served
with --enable-scale-out or --tokens-only as vLLM 0.32 serves them; without either flag these
routes, like the render routes, answer vLLM's 403.

The request carries prompt token ids and a SamplingParams object; the answer carries output
token ids (`output_mode: "tokens"`) or text (`"text"`). A `structured_outputs` constraint in the
sampling params is honoured like chat's: the engine emits ids whose text satisfies it.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Annotated, Any, Literal

from pydantic import Field

from ..frontend.chat_outputs import plan_constraint_output
from ..frontend.errors import HTTPError
from ..frontend.generation import OutputStream, SequenceState, build_engine_request, parse_dp_rank, random_hex
from ..frontend.protocol import StreamOptions, _Base, stop_list
from ..frontend.request_checks import check_prompt_tokens, check_sampling
from ..frontend.structured.constraints import request_constraint
from ..http.serving_base import RequestContext, ServingBase, encode, parse_request
from ..http.sse import DONE, SSEWriter, send_bytes

SCALE_OUT_DISABLED = ("Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable "
                      "them.")
SCALE_OUT_ROUTES = ("/inference/v1/generate", "/inference/v1/abort_requests", "/v1/chat/completions/render",
                    "/v1/completions/render", "/v1/messages/render", "/v1/responses/render",
                    "/v1/chat/completions/derender", "/v1/completions/derender")


class GenerateRequest(_Base):
    request_id: str | None = None
    token_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    sampling_params: dict[str, Any]
    model: str | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None


def _sampling(sp: dict[str, Any], req: GenerateRequest) -> SimpleNamespace:
    """The sampling fields build_engine_request and check_sampling read, from a SamplingParams dict."""
    return SimpleNamespace(
        n=int(sp.get("n", 1)), temperature=sp.get("temperature"), top_p=sp.get("top_p"), top_k=sp.get("top_k"),
        min_p=sp.get("min_p"), presence_penalty=sp.get("presence_penalty"),
        frequency_penalty=sp.get("frequency_penalty"), repetition_penalty=sp.get("repetition_penalty"),
        stop=sp.get("stop") or [], stop_token_ids=sp.get("stop_token_ids") or [],
        ignore_eos=bool(sp.get("ignore_eos", False)), min_tokens=int(sp.get("min_tokens", 0)),
        vllm_xargs=sp.get("extra_args"), kv_transfer_params=req.kv_transfer_params, cache_salt=req.cache_salt,
        priority=req.priority, use_beam_search=False, include_stop_str_in_output=bool(
            sp.get("include_stop_str_in_output", False)))


class TokensServing(ServingBase):
    async def generate(self, ctx: RequestContext) -> None:
        req: GenerateRequest = parse_request(ctx.body, GenerateRequest)
        model = self.check_model(req.model)
        sp = req.sampling_params
        s = _sampling(sp, req)
        self.check_token_ids(req.token_ids)
        max_len = self.settings.max_model_len
        check_prompt_tokens(len(req.token_ids), max_len, from_text=False)
        max_tokens = sp.get("max_tokens")
        # (the server's default output limit and cap only where the request sets none, as vLLM's)
        limit = self.settings.sampling_defaults.limit(len(req.token_ids), max_len, None) if max_tokens is None \
            else min(int(max_tokens), max_len - len(req.token_ids))
        check_sampling(s, limit)
        constraint = request_constraint(None, sp.get("structured_outputs"))
        rid = f"generate-tokens-{self.base_request_id(ctx, req.request_id)}"
        dp_rank = parse_dp_rank(ctx.headers, self.settings.engine_count)
        logprobs = sp.get("logprobs")
        states, engine_reqs = [], []
        seed = sp.get("seed")
        for j in range(s.n):
            states.append(SequenceState(self.tokenizer, stop=stop_list(s.stop), include_stop=s.include_stop_str_in_output,
                                        min_tokens=s.min_tokens, streaming=bool(req.stream), want_logprobs=logprobs,
                                        keep_ids=True))
            er = build_engine_request(internal_id=f"{rid}-{j}-{random_hex(8)}", external_id=rid,
                                      prompt_ids=list(req.token_ids), req=s, max_tokens=limit,
                                      seed=None if seed is None else seed + j, logprobs=logprobs,
                                      stream=bool(req.stream), tokenizer=self.tokenizer, dp_rank=dp_rank)
            if constraint is not None:
                plan_constraint_output(er, constraint, None if seed is None else seed + j, self.tokenizer)
            engine_reqs.append(er)
        if req.stream:
            await self._stream(ctx, req, rid, states, engine_reqs)
        else:
            await self._full(ctx, req, rid, model, states, engine_reqs)

    def _choice(self, i: int, st: SequenceState, text_mode: bool, ids: list[int], finish: str | None,
                text: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": i, "finish_reason": finish,
                                  "stop_reason": st.stop_reason if finish else None, "token_ids": ids,
                                  "routed_experts": None, "sampling_mask": None, "weight_versions": None}
        if text_mode:
            choice["text"] = text
        choice["logprobs"] = None
        return choice

    async def _full(self, ctx: RequestContext, req: GenerateRequest, rid: str, model: str,
                    states: list[SequenceState], engine_reqs: list[Any]) -> None:
        created = int(time.time())
        if not await self.run_to_end(ctx, states, engine_reqs):
            return
        text_mode = req.output_mode == "text"
        choices = [self._choice(i, st, text_mode, st.token_ids, st.finish_reason or "stop", st.full_text())
                   for i, st in enumerate(states)]
        completion = sum(len(st.token_ids) for st in states)
        prompt_len = len(req.token_ids)
        body = {"request_id": rid, "model": model, "created": created,
                "usage": {"prompt_tokens": prompt_len, "total_tokens": prompt_len + completion,
                          "completion_tokens": completion, "prompt_tokens_details": None,
                          "completion_tokens_details": None},
                "prompt_logprobs": None, "prompt_token_id_logprobs": None,
                "prompt_token_ids": list(req.token_ids) if req.return_token_ids else None, "mm_placeholders": None,
                "metrics": None, "kv_transfer_params": states[0].kv_transfer_params, "ec_transfer_params": None,
                "output_mode": req.output_mode, "choices": choices}
        ctx.finishing = True
        await send_bytes(ctx.send, 200, encode(body))

    async def _stream(self, ctx: RequestContext, req: GenerateRequest, rid: str, states: list[SequenceState],
                      engine_reqs: list[Any]) -> None:
        w = SSEWriter(ctx.send)
        await w.start()
        text_mode = req.output_mode == "text"
        so = req.stream_options
        include_usage = bool(so and so.include_usage)
        prompt_len = len(req.token_ids)
        prompt_ids = list(req.token_ids) if req.return_token_ids else None
        tail = b""
        async with OutputStream(self.engine, engine_reqs) as stream:
            for_out = stream.index
            async for out in stream:
                i = for_out(out)
                st = states[i]
                if st.finished:
                    continue
                if out.finish_reason is not None and out.error is not None:
                    tail = b"data: " + encode({"error": {"message": "Internal server error",
                                                         "type": "InternalServerError", "param": None,
                                                         "code": 500}}) + b"\n\n"
                    break
                text, ids = st.process(out)
                if not ids and not st.finished and not (text_mode and text):
                    continue
                chunk: dict[str, Any] = {"request_id": rid}
                chunk["usage"] = None
                if prompt_ids is not None:
                    chunk["prompt_token_ids"], prompt_ids = prompt_ids, None
                chunk["output_mode"] = req.output_mode
                chunk["choices"] = [self._choice(i, st, text_mode, list(ids), st.finish_reason, text)]
                await w.write(b"data: " + encode(chunk) + b"\n\n")
                if st.finished and out.finish_reason is None:
                    stream.cancel(i)
                if all(x.finished for x in states):
                    break
        if include_usage and not tail:
            completion = sum(x.num_tokens for x in states)
            tail = b"data: " + encode({"request_id": rid, "usage": {
                "prompt_tokens": prompt_len, "total_tokens": prompt_len + completion,
                "completion_tokens": completion}, "output_mode": req.output_mode, "choices": []}) + b"\n\n"
        ctx.finishing = True
        await w.close(tail + DONE)

    async def abort_requests(self, ctx: RequestContext) -> None:
        """vLLM aborts by request id; here requests end when their HTTP stream does, so there is
        nothing to look up: the answer is the same empty 200."""
        await send_bytes(ctx.send, 200, b"{}")


async def scale_out_disabled(ctx: RequestContext) -> None:
    raise HTTPError(403, SCALE_OUT_DISABLED, "PermissionDeniedError")
