"""The pooling runner (`--runner pooling`, task embed): `/v1/embeddings`, `/pooling`, `/score`,
`/rerank` and their `/v1/` (and `/v2/rerank`) forms, as vLLM 0.32 serves an embedding model.

Every input runs through the engine as prefill-only work (one engine request per prompt that ends
after its prefill), so pooling requests take KV blocks, count as running and in `/stats`, queue
behind generation and follow the latency model. The vector itself is computed here, from the
prompt's token ids only: the mean of one fixed pseudo-random vector per token id, normalized
when `use_activation` (the default) holds. The same input always gives the same unit vector, and
texts sharing tokens score as similar, so `/score` and `/rerank` orderings mean something.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..engine.types import EngineCoreRequest, FinishReason, SamplingParams
from ..frontend.errors import HTTPError
from ..frontend.generation import parse_dp_rank, random_hex
from ..frontend.protocol import RequestValueError
from ..frontend.request_checks import check_prompt_tokens, check_truncation, truncate_prompt
from ..http.serving_base import RequestContext, ServingBase, encode, metrics_arrival, metrics_end, parse_request
from ..http.sse import send_bytes

DEFAULT_EMBEDDING_SIZE = 1024
SUPPORTED_TASKS = ("embed", "token_embed")  # what vLLM reports for a model converted to embedding
MAX_POOLING_INPUTS = 10_000  # a bound on one request's fan-out into engine requests


@dataclass
class PoolingConfig:
    enabled: bool = False  # --runner pooling
    task: str = "embed"
    embedding_size: int = DEFAULT_EMBEDDING_SIZE
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None

    @classmethod
    def from_cli(cls, args: Any) -> "PoolingConfig":
        runner = getattr(args, "runner", "auto") or "auto"
        convert = getattr(args, "convert", "auto") or "auto"
        if runner == "draft":
            raise ValueError("--runner draft: a draft model is not served on its own")
        if runner != "pooling":
            if convert not in ("auto", "none"):
                raise ValueError(f"--convert {convert} needs --runner pooling")
            return cls()
        if convert == "classify":
            raise ValueError("--convert classify: vllm-vcr simulates embedding models only (--convert embed)")
        hf = _model_config(getattr(args, "model_opt", None) or getattr(args, "model_tag", None))
        size = getattr(args, "embedding_size", None) or hf.get("hidden_size") or DEFAULT_EMBEDDING_SIZE
        dims = hf.get("matryoshka_dimensions")
        matryoshka = getattr(args, "is_matryoshka", None)
        if matryoshka is None:
            matryoshka = bool(hf.get("is_matryoshka") or dims)
        return cls(enabled=True, embedding_size=int(size), is_matryoshka=bool(matryoshka),
                   matryoshka_dimensions=list(dims) if dims else None)


def _model_config(model: str | None) -> dict[str, Any]:
    """MODEL/config.json, when MODEL is a local directory (never downloaded)."""
    if not model:
        return {}
    try:
        data = json.loads((Path(model).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# -- the vectors ------------------------------------------------------------------------------------

@lru_cache(maxsize=8192)
def _token_vector(token_id: int, size: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(f"vllm-vcr-embed:{token_id}".encode()).digest()[:8], "little")
    return np.random.default_rng(seed).standard_normal(size).astype(np.float32)


def embed_tokens(token_ids: list[int], size: int, dimensions: int | None = None,
                 use_activation: bool = True) -> np.ndarray:
    """The simulated pooled output: mean of per-token vectors, Matryoshka-cut, L2-normalized."""
    if token_ids:
        vec = np.mean([_token_vector(t, size) for t in token_ids], axis=0).astype(np.float32)
    else:
        vec = np.zeros(size, dtype=np.float32)
    if dimensions is not None:
        vec = vec[:dimensions]
    if use_activation:
        norm = float(np.linalg.norm(vec))
        if norm > 0:
            vec = vec / norm
    return vec.astype(np.float32)


def encode_vector(vec: np.ndarray, encoding_format: str, embed_dtype: str, endianness: str) -> Any:
    if encoding_format == "float":
        return vec.tolist()
    if embed_dtype == "bfloat16":  # the top half of each float32
        raw = (vec.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    else:
        raw = vec.astype({"float32": np.float32, "float16": np.float16}[embed_dtype])
    if endianness != "native":
        raw = raw.astype(raw.dtype.newbyteorder("<" if endianness == "little" else ">"))
    return base64.b64encode(raw.tobytes()).decode("ascii")


# -- requests ---------------------------------------------------------------------------------------

class _PoolingBase(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    request_id: str | None = None
    priority: int = 0
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    use_activation: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if "normalize" in data:
                raise RequestValueError("Parameter `normalize` was removed; use `use_activation` instead.",
                                        "normalize")
            if data.get("task") in ("score", "encode"):
                raise RequestValueError({"score": "`score` task was removed; use `classify` instead.",
                                         "encode": "`encode` task was removed; use `token_embed` or "
                                                   "`token_classify` instead."}[data["task"]], "task")
        return data


class EmbeddingRequest(_PoolingBase):
    input: list[int] | list[list[int]] | str | list[str] | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    encoding_format: Literal["float", "base64", "bytes", "bytes_only"] = "float"
    embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    endianness: Literal["native", "big", "little"] = "native"
    dimensions: int | None = None
    task: str | None = None


class ScoreRequest(_PoolingBase):
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None

    def pair(self) -> tuple[Any, Any]:
        for a, b in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2")):
            x, y = getattr(self, a), getattr(self, b)
            if x is not None and y is not None:
                return x, y
        raise RequestValueError("Field required: one of queries/documents, queries/items, data_1/data_2 or "
                                "text_1/text_2", "data_1")


class RerankRequest(_PoolingBase):
    query: str
    documents: str | list[str]
    top_n: Annotated[int, Field(ge=0)] = 0


@dataclass
class _Prompt:
    ids: list[int]


class PoolingServing(ServingBase):
    """The handlers of the pooling routes; one engine request per prompt."""

    def __init__(self, app: Any, config: PoolingConfig):  # the serve app
        super().__init__(app.engine, app.tokenizer, app.settings, app.metrics)
        self.app = app
        self.config = config

    # -- inputs -----------------------------------------------------------------------------------
    def _tokenize(self, text: str, add_special_tokens: bool, req: _PoolingBase) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return self._truncate(ids, req, from_text=True, text=text)

    def _truncate(self, ids: list[int], req: _PoolingBase, from_text: bool, text: str | None = None) -> list[int]:
        """vLLM's truncation (request_checks.truncate_prompt; a pooling request keeps the whole
        context for -1), then the context check."""
        limit = self.settings.max_model_len
        n = req.truncate_prompt_tokens
        check_truncation(n, limit)
        specials = self.tokenizer.special_tokens_around(text, ids) if text is not None and n is not None else (0, 0)
        ids = truncate_prompt(ids, n, req.truncation_side, limit, pooling=True, specials=specials)
        check_prompt_tokens(len(ids), limit, from_text=from_text and n is None)
        return ids

    def _embedding_prompts(self, req: EmbeddingRequest) -> list[list[int]]:
        if req.messages is not None or _is_chat(req.input):
            messages = req.messages if req.messages is not None else req.input
            _, ids = self.app.chat.render_prompt(
                messages, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs, add_special_tokens=bool(req.add_special_tokens))
            return [self._truncate(list(ids), req, from_text=True)]
        inp = req.input
        if inp is None or inp == "" or inp == []:
            raise RequestValueError("Either input or messages must be provided and non-empty.", "input")
        special = True if req.add_special_tokens is None else req.add_special_tokens
        if isinstance(inp, str):
            return [self._tokenize(inp, special, req)]
        if isinstance(inp[0], int):
            return [self._checked_ids(list(inp), req)]
        if isinstance(inp[0], str):
            return [self._tokenize(t, special, req) for t in inp]
        return [self._checked_ids(list(x), req) for x in inp]

    def _checked_ids(self, ids: list[int], req: _PoolingBase) -> list[int]:
        self.check_token_ids(ids)
        return self._truncate(ids, req, from_text=False)

    def _check_dimensions(self, req: EmbeddingRequest, model: str) -> None:
        d = req.dimensions
        if d is None:
            return
        cfg = self.config
        if not cfg.is_matryoshka:
            raise RequestValueError(f"Model {model!r} does not support Matryoshka embeddings; dimensions must be "
                                    f"unset (received dimensions={d}).")
        if not 1 <= d <= cfg.embedding_size:
            raise RequestValueError(f"Model {model!r} only supports dimensions in range "
                                    f"[1, {cfg.embedding_size}], got {d}.")
        if cfg.matryoshka_dimensions is not None and d not in cfg.matryoshka_dimensions:
            raise RequestValueError(f"Model {model!r} only supports Matryoshka dimensions "
                                    f"{cfg.matryoshka_dimensions}, got {d}.")

    # -- the engine -------------------------------------------------------------------------------
    async def run_prompts(self, ctx: RequestContext, req: _PoolingBase, rid: str, prompts: list[list[int]]) -> None:
        """Each prompt as prefill-only engine work; returns once all are done."""
        if len(prompts) > MAX_POOLING_INPUTS:
            raise RequestValueError(f"at most {MAX_POOLING_INPUTS} inputs per request, got {len(prompts)}", "input")
        dp_rank = parse_dp_rank(ctx.headers, self.settings.engine_count)
        lora = self.lora_request(req.model)
        engine_reqs = [EngineCoreRequest(
            request_id=f"{rid}-{i}-{random_hex(8)}", prompt_token_ids=ids,
            sampling_params=SamplingParams(max_tokens=1, ignore_eos=True, output_kind=2),
            pooling_params={"task": self.config.task}, arrival_time=time.time(), lora_request=lora,
            cache_salt=req.cache_salt, data_parallel_rank=dp_rank, priority=int(req.priority),
            external_req_id=rid) for i, ids in enumerate(prompts)]
        self.admit(len(engine_reqs))
        metrics_arrival(self.metrics, ctx, engine_reqs, 1, rid)
        states = [_Done() for _ in engine_reqs]
        try:
            await asyncio.gather(*(self._one(r, st) for r, st in zip(engine_reqs, states)))
        finally:
            metrics_end(self.metrics, engine_reqs, states)

    async def _one(self, req: EngineCoreRequest, state: "_Done") -> None:
        async for out in self.engine.generate(req):
            if out.finish_reason is not None:
                state.finished = True
                if out.finish_reason == FinishReason.ERROR:
                    raise HTTPError(500, "Internal server error", "InternalServerError")

    # -- endpoints --------------------------------------------------------------------------------
    async def embeddings(self, ctx: RequestContext) -> None:
        await self._embed_like(ctx, parse_request(ctx.body, EmbeddingRequest), "embd", "embedding", "embedding")

    async def pooling(self, ctx: RequestContext) -> None:
        req = parse_request(ctx.body, EmbeddingRequest)
        if req.dimensions is not None:
            raise RequestValueError("dimensions is currently not supported", "dimensions")
        if req.task not in (None, self.config.task):
            if req.task not in SUPPORTED_TASKS:
                raise RequestValueError(f"Unsupported task: {req.task!r} Supported tasks: {SUPPORTED_TASKS}", "task")
            raise RequestValueError(f"Try switching the model's pooling_task via --pooler-config.task {req.task}.",
                                    "task")
        await self._embed_like(ctx, req, "pooling", "pooling", "data")

    async def _embed_like(self, ctx: RequestContext, req: EmbeddingRequest, prefix: str, obj: str, key: str) -> None:
        model = self.check_model(req.model)
        self._check_dimensions(req, model)
        if req.encoding_format not in ("float", "base64"):
            raise RequestValueError(f"encoding_format {req.encoding_format!r} is not simulated by vllm-vcr; "
                                    "use 'float' or 'base64'", "encoding_format")
        prompts = self._embedding_prompts(req)
        rid = f"{prefix}-{self.base_request_id(ctx, req.request_id)}"
        await self.run_prompts(ctx, req, rid, prompts)
        use_act = True if req.use_activation is None else req.use_activation
        data = [{"index": i, "object": obj,
                 key: encode_vector(embed_tokens(ids, self.config.embedding_size, req.dimensions, use_act),
                                    req.encoding_format, req.embed_dtype, req.endianness)}
                for i, ids in enumerate(prompts)]
        await self._respond(ctx, {"id": rid, "object": "list", "created": int(time.time()), "model": model,
                                  "data": data, "usage": _usage(sum(len(p) for p in prompts))})

    async def score(self, ctx: RequestContext) -> None:
        req = parse_request(ctx.body, ScoreRequest)
        model = self.check_model(req.model)
        d1, d2 = (x if isinstance(x, list) else [x] for x in req.pair())
        _check_lens(d1, d2)
        scores, tokens, rid = await self._scores(ctx, req, d1, d2)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        await self._respond(ctx, {"id": rid, "object": "list", "created": int(time.time()), "model": model,
                                  "data": data, "usage": _usage(tokens)})

    async def rerank(self, ctx: RequestContext) -> None:
        req = parse_request(ctx.body, RerankRequest)
        model = self.check_model(req.model)
        docs = req.documents if isinstance(req.documents, list) else [req.documents]
        _check_lens([req.query], docs)
        scores, tokens, rid = await self._scores(ctx, req, [req.query], docs)
        order = sorted(range(len(docs)), key=lambda i: scores[i], reverse=True)
        top = req.top_n if req.top_n > 0 else len(docs)
        results = [{"index": i, "document": {"text": docs[i], "multi_modal": None}, "relevance_score": scores[i]}
                   for i in order[:top]]
        await self._respond(ctx, {"id": rid, "model": model, "usage": {"prompt_tokens": tokens,
                                                                       "total_tokens": tokens},
                                  "results": results})

    async def _scores(self, ctx: RequestContext, req: _PoolingBase, d1: list[str],
                      d2: list[str]) -> tuple[list[float], int, str]:
        """Bi-encoder scores: cosine similarity of the two sides' embeddings (1:N or N:N)."""
        ids1 = [self._tokenize(t, True, req) for t in d1]
        ids2 = [self._tokenize(t, True, req) for t in d2]
        rid = f"score-{self.base_request_id(ctx, req.request_id)}"
        await self.run_prompts(ctx, req, rid, ids1 + ids2)
        size = self.config.embedding_size
        v1 = [embed_tokens(i, size) for i in ids1]
        v2 = [embed_tokens(i, size) for i in ids2]
        if len(v1) == 1:
            v1 = v1 * len(v2)
        scores = [float(np.dot(a, b)) for a, b in zip(v1, v2)]
        return scores, sum(len(i) for i in ids1 + ids2), rid

    async def _respond(self, ctx: RequestContext, body: dict[str, Any]) -> None:
        ctx.finishing = True
        await send_bytes(ctx.send, 200, encode(body))


@dataclass
class _Done:
    finished: bool = False
    by_frontend: bool = False
    num_tokens: int = 0


def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def _usage(tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None}


def _check_lens(d1: list, d2: list) -> None:
    if len(d1) > 1 and len(d1) != len(d2):
        raise RequestValueError("Input lengths must be either 1:1, 1:N or N:N")
    if not d1:
        raise RequestValueError("At least one text element must be given")
    if not d2:
        raise RequestValueError("At least one text_pair element must be given")
