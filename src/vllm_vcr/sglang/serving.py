"""SGLang's own HTTP surface, served beside the OpenAI routes when `--engine-type sglang`: what an
SGLang router (sgl-model-gateway, Dynamo's SGLang frontend) talks to.

* `POST /generate`: `{"text" | "input_ids", "sampling_params", "stream", "rid"}`; answers
  `{"text", "output_ids", "meta_info"}`; streamed, every SSE event carries the text and ids so far
  (SGLang's default, non-incremental stream output), then `data: [DONE]`.
* `GET /get_model_info`, `GET /health_generate` (a one-token generation), `POST|GET /flush_cache`.
* `GET /get_server_info` and `GET /model_info` (the name newer SGLang and SMG use for
  `/get_model_info`; `/server_info` is vLLM's dev-mode route here, so SMG falls back to the old name):
  SGLang's server arguments that mean something here, its scheduler info and a per-rank internal
  state, from the engine's configuration: `max_running_requests` is `--max-num-seqs` (SMG's P/D
  admission bounds in-flight requests to a decode worker by it), `max_total_num_tokens` is the KV
  cache in tokens, `page_size` the block size, `disaggregation_mode` the worker type.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from .. import __version__
from ..engine.types import EngineCoreRequest, FinishReason, SamplingParams
from ..frontend.errors import HTTPError
from ..frontend.generation import sglang_handoff
from ..http.sse import DONE, SSEWriter, send_bytes


class SGLangSamplingParams(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    max_new_tokens: int = 128  # SGLang's default
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False


class GenerateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SGLangSamplingParams = msgspec.field(default_factory=SGLangSamplingParams)
    stream: bool = False
    rid: str | None = None
    # P/D: the prefill worker's bootstrap server and the transfer's room (frontend.generation.sglang_handoff)
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


_decode_generate = msgspec.json.Decoder(GenerateRequest).decode
_encode = msgspec.json.Encoder().encode


def sglang_error(message: str, status: int = 400) -> HTTPError:
    return HTTPError(status, message, "BadRequestError" if status == 400 else "ServiceUnavailableError")


class SGLangServing:
    """Handlers bound to the app's engine, tokenizer and settings."""

    def __init__(self, app: Any) -> None:
        self.app = app

    # -- requests -------------------------------------------------------------------------------
    def _parse(self, body: bytes) -> tuple[GenerateRequest, list[int]]:
        try:
            req = _decode_generate(body)
        except msgspec.DecodeError as e:
            raise sglang_error(f"Invalid request: {e}") from None
        if (req.text is None) == (req.input_ids is None):
            raise sglang_error("Either text or input_ids should be provided.")
        ids = req.input_ids if req.input_ids is not None else self.app.tokenizer.encode(req.text)
        sp = req.sampling_params
        limit = self.app.settings.max_model_len
        if sp.stop:
            raise sglang_error("stop strings are not simulated by /generate; use stop_token_ids, or the "
                               "OpenAI routes, which apply them")
        if sp.max_new_tokens < 0:
            raise sglang_error(f"max_new_tokens must be at least 0, got {sp.max_new_tokens}.")
        if len(ids) + sp.max_new_tokens > limit:
            raise sglang_error(f"Requested token count exceeds the model's maximum context length of {limit} "
                               f"tokens. You requested a total of {len(ids) + sp.max_new_tokens} tokens: "
                               f"{len(ids)} tokens from the input messages and {sp.max_new_tokens} tokens "
                               f"for the completion.")
        return req, ids

    def _engine_request(self, req: GenerateRequest, ids: list[int], rid: str) -> EngineCoreRequest:
        sp = req.sampling_params
        eos = self.app.tokenizer.eos_token_id
        stop_ids = list(sp.stop_token_ids or [])
        handoff = sglang_handoff({"bootstrap_host": req.bootstrap_host, "bootstrap_port": req.bootstrap_port,
                                  "bootstrap_room": req.bootstrap_room})
        return EngineCoreRequest(
            request_id=rid, prompt_token_ids=ids, arrival_time=time.time(), external_req_id=rid,
            sampling_params=SamplingParams(
                temperature=sp.temperature, top_p=sp.top_p, top_k=max(sp.top_k, 0), ignore_eos=sp.ignore_eos,
                max_tokens=sp.max_new_tokens, min_tokens=sp.min_new_tokens, stop_token_ids=stop_ids or None,
                output_kind=1, eos_token_id=eos, extra_args={"kv_transfer_params": handoff} if handoff else None,
                all_stop_token_ids=stop_ids + ([eos] if eos is not None and not sp.ignore_eos else [])))

    async def generate(self, ctx: Any) -> None:
        req, ids = self._parse(ctx.body)
        rid = req.rid or uuid.uuid4().hex
        start = time.perf_counter()
        result = _Result(rid, len(ids), self.app.tokenizer)
        writer = SSEWriter(ctx.send) if req.stream else None
        async for out in self.app.engine.generate(self._engine_request(req, ids, rid)):
            result.add(out)
            if writer is not None and (out.new_token_ids or out.finish_reason is not None):
                await writer.write(b"data: " + _encode(result.body(time.perf_counter() - start)) + b"\n\n")
        if writer is not None:
            ctx.finishing = True
            await writer.close(DONE)
            return
        await send_bytes(ctx.send, 200, _encode(result.body(time.perf_counter() - start)))

    async def model_info(self, ctx: Any) -> None:
        s = self.app.settings
        await send_bytes(ctx.send, 200, _encode({
            "model_path": s.model_name, "tokenizer_path": s.model_name, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": None, "architectures": None}))

    async def server_info(self, ctx: Any) -> None:
        """SGLang's `/get_server_info`: `{**server_args, **scheduler_info, "internal_states": [per DP
        rank], "version"}`, with the server arguments this engine has a value for."""
        s, args = self.app.settings, self.app.engine.args
        cfg = args.config
        capacity = args.kv_cache_size * args.tokens_per_block  # per rank, as SGLang's scheduler reports it
        ranks = [{"num_running_reqs": r["running"], "num_waiting_reqs": r["waiting"], "token_usage": r["token_usage"]}
                 for r in await self.app.engine.loads()]
        mode = s.worker_type if s.worker_type in ("prefill", "decode") else "null"
        await send_bytes(ctx.send, 200, _encode({
            "model_path": s.model_root or s.model_name, "tokenizer_path": s.model_root or s.model_name,
            "served_model_name": s.model_name, "context_length": s.max_model_len, "is_embedding": False,
            "tp_size": 1, "pp_size": 1, "dp_size": s.engine_count, "page_size": args.tokens_per_block,
            "max_running_requests": cfg.max_num_seqs, "max_total_tokens": capacity,
            "max_prefill_tokens": cfg.max_num_batched_tokens, "chunked_prefill_size": cfg.max_num_batched_tokens,
            "schedule_policy": s.scheduling_policy, "disaggregation_mode": mode, "weight_version": "default",
            # the scheduler's info
            "max_total_num_tokens": capacity, "max_req_input_len": max(min(s.max_model_len, capacity) - 1, 1),
            "internal_states": [{"dp_rank": i, **r, "effective_max_running_requests_per_dp": cfg.max_num_seqs,
                                 "memory_usage": {"token_capacity": capacity}} for i, r in enumerate(ranks)],
            "version": __version__}))

    async def health_generate(self, ctx: Any) -> None:
        """Healthy when the engine produces a token (SGLang sends a one-token request)."""
        req = GenerateRequest(input_ids=[0], sampling_params=SGLangSamplingParams(max_new_tokens=1,
                                                                                  ignore_eos=True))
        rid = "HEALTH_CHECK_" + uuid.uuid4().hex
        try:
            async for out in self.app.engine.generate(self._engine_request(req, [0], rid)):
                if out.new_token_ids:
                    await send_bytes(ctx.send, 200, b"")
                    return
        except Exception:  # a dead engine: the router takes the worker out
            pass
        await send_bytes(ctx.send, 503, b"")

    async def flush_cache(self, ctx: Any) -> None:
        done = await self.app.engine.reset_prefix_cache()
        if all(done):
            await send_bytes(ctx.send, 200, b"Cache flushed.\nPlease check backend logs for more details. (When "
                             b"there are running or waiting requests, the operation will not be performed.)\n",
                             content_type=b"text/plain; charset=utf-8")
        else:
            await send_bytes(ctx.send, 400, b"Cache not flushed. Please check backend logs for more details. "
                             b"(When there are running or waiting requests, the operation will not be performed.)\n",
                             content_type=b"text/plain; charset=utf-8")


class _Result:
    """The output so far, in SGLang's response shape."""

    def __init__(self, rid: str, prompt_tokens: int, tokenizer: Any) -> None:
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.cached = 0
        self.finish: dict[str, Any] | None = None

    def add(self, out: Any) -> None:
        self.ids.extend(out.new_token_ids)
        if out.prefill_stats is not None:
            self.cached = out.prefill_stats.num_cached_tokens
        if out.finish_reason is not None:
            self.finish = _finish_reason(out, len(self.ids))

    def body(self, elapsed: float) -> dict[str, Any]:
        return {"text": self.tokenizer.decode(self.ids), "output_ids": list(self.ids), "meta_info": {
            "id": self.rid, "finish_reason": self.finish, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.ids), "cached_tokens": self.cached, "e2e_latency": elapsed}}


def _finish_reason(out: Any, n: int) -> dict[str, Any]:
    if out.finish_reason == FinishReason.LENGTH:
        return {"type": "length", "length": n}
    if out.finish_reason == FinishReason.STOP:
        return {"type": "stop", "matched": out.stop_reason if out.stop_reason is not None else
                (out.new_token_ids[-1] if out.new_token_ids else None)}
    return {"type": "abort", "message": out.error.message if out.error is not None else str(out.finish_reason)}
