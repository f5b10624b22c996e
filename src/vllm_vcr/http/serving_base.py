"""State and helpers every endpoint shares: settings, the request context, body parsing."""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import msgspec
from pydantic import BaseModel, ValidationError

from ..frontend.errors import (
    ENGINE_DEAD_MESSAGE,
    INTERNAL_ERROR_BODY,
    HTTPError,
    UnencodableText,
    json_decode_error,
    model_not_found,
    not_an_object,
    unparsable_body,
    validation_error,
)
from ..frontend.generation import OutputStream, random_hex
from ..frontend.isolated import BudgetExceeded, IsolatedPool
from ..frontend.protocol import RequestSchemaError, RequestValueError, token_choice_params
from ..frontend.request_checks import OFFLOAD_BIAS_ENTRIES
from ..frontend.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from ..frontend.tokenizer import Tokenizer
from ..frontend.tools.calls import ToolSettings
from .sse import send_bytes

logger = logging.getLogger("vllm_vcr.http")

# The vLLM release whose OpenAI API this frontend reproduces (bodies, chunks, errors, /version).
VLLM_API_VERSION = "0.32.0"
encode = msgspec.json.encode
QUEUE_OVERFLOW_MESSAGE = ("The engine is currently busy and cannot accept new requests. "
                          "Please try again later or on a different instance.")
PREFILL_BACKLOG_MESSAGE = ("The engine has reached its prefill token backlog limit. "
                           "Please try again later or on a different instance.")


@dataclass
class ServeSettings:
    """What the frontend needs to know besides the engine and the tokenizer."""

    served_model_names: list[str] = field(default_factory=lambda: ["vllm-vcr/sim"])
    model_root: str | None = None  # `root` in /v1/models (the MODEL argument)
    max_model_len: int = 4096
    engine_count: int = 1
    api_keys: list[str] = field(default_factory=list)
    scheduling_policy: str = "fcfs"
    response_role: str = "assistant"
    vocab_limit: int = 0  # prompt token ids must be below this (0: the tokenizer's size)
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details: usage...cached_tokens
    system_fingerprint: str | None = None  # vLLM's "vllm-<version>-<hash8>" (None: omitted)
    force_include_usage: bool = False
    # what /metrics reports about the KV cache (vllm:cache_config_info)
    block_size: int = 16
    num_gpu_blocks: int | None = None
    enable_prefix_caching: bool = True
    # --reasoning-parser: chat splits `reasoning` from `content` at the engine's thinking markers
    reasoning_parser: str | None = None
    reasoning_ids: tuple[int, int] | None = None  # (start, end) from the engine's --reasoning
    # --trust-request-chat-template: a `chat_template` in the request is rendered (else a 400, as vLLM)
    trust_request_chat_template: bool = False
    # --enable-auto-tool-choice / --tool-call-parser / --auto-tool-call-probability
    tools: ToolSettings = field(default_factory=ToolSettings)
    scale_out: bool = False  # --enable-scale-out / --tokens-only: tokens-in/out and render routes
    lora_adapters: Any = None  # vllm/lora.py LoRAAdapters with --enable-lora (models by adapter name)
    # vLLM's frontend flags: X-Request-Id headers, CORS (vLLM's defaults: no origin allowed),
    # tokens per SSE event
    request_id_headers: bool = False
    allowed_origins: list[str] = field(default_factory=list)
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    stream_interval: int = 1
    per_request_metrics: bool = False  # --enable-per-request-metrics: a response's `metrics`
    sse_keep_alive_interval: float = 0.0  # --sse-keep-alive-interval: an SSE comment per idle interval (s)
    max_num_queued_reqs: int | None = None  # --max-num-queued-reqs: admission limit (vLLM's 503 beyond)
    max_num_queued_tokens: int | None = None  # --max-num-queued-tokens: prompt tokens in prefill (503 at it)
    data_parallel_rank: int = 0  # --data-parallel-rank: the first engine's index in /metrics
    engine_type: str = "vllm"  # sglang: SGLang's metric names and HTTP routes
    worker_type: str = "aggregated"  # --worker-type: prefill | decode | aggregated (SGLang's engine_type label)
    # --generation-config / --override-generation-config: what a request leaves unset takes
    sampling_defaults: SamplingDefaults = NO_DEFAULTS
    # --default-chat-template-kwargs: the chat template's variables a request's chat_template_kwargs override
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # --return-tokens-as-token-ids: logprobs name tokens `token_id:N` unless a request says otherwise
    return_tokens_as_token_ids: bool = False
    # --exclude-tools-when-tool-choice-none: a request with tool_choice "none" renders without its tools
    exclude_tools_when_tool_choice_none: bool = False
    # --chat-template-content-format: message content as a string or OpenAI's parts (auto: the template's)
    chat_template_content_format: str = "auto"

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


class RequestContext:
    """One HTTP request as the handlers see it."""

    __slots__ = ("scope", "receive", "send", "headers", "body", "finishing", "arrival")

    def __init__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict]], send: Callable, body: bytes):
        self.scope = scope
        self.receive = receive
        self.send = send
        self.headers: dict[bytes, bytes] = dict(scope.get("headers") or ())
        self.body = body
        self.arrival = scope.get("vllm_vcr.arrival") or time.time()  # when the request's head arrived
        # set just before the last body message: from then on a disconnect is the normal end
        self.finishing = False


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate(body: bytes, data: Any) -> UnicodeEncodeError | None:
    """A `\\udXXX` escape that is not half of a pair (valid JSON, not Unicode): no string with it
    can be encoded, logged or sent back, so the body is refused before anything reads it. Only a
    body that has such an escape at all is walked."""
    if _SURROGATE_ESCAPE.search(body) is None:
        return None
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return e
    return None


_decode_json = msgspec.json.decode
_FAST_JSON_OPENERS = 256  # nesting no deeper than this, far from the interpreter's recursion limit


def fast_json(body: bytes) -> Any:
    """`json.loads(body)` for a body msgspec decodes (the same values: tests/http's hypothesis test
    holds the two decoders to it), None for any other body: then json.loads itself decides, and
    raises its own errors. msgspec refuses what json.loads treats its own way (a byte order mark,
    UTF-16/32, NaN and Infinity, numbers out of a float's range, lone surrogate escapes, deep
    nesting), so those take json.loads too, and so does a body with more than a few hundred
    brackets: json.loads refuses deep nesting where the interpreter's stack runs out (what that
    depth is depends on the caller's stack), msgspec at a depth of its own. msgspec decodes a
    JSON object ~3x faster."""
    if body.count(b"[") + body.count(b"{") > _FAST_JSON_OPENERS:
        return None
    try:
        return _decode_json(body)
    except Exception:  # (msgspec.DecodeError, RecursionError): json.loads decides
        return None


def raw_request_json(body: bytes, decode_error: Callable[[json.JSONDecodeError], HTTPError]) -> Any:
    """A body as a vLLM handler that reads `await raw_request.json()` itself sees it: any JSON
    value (its own checks follow); a JSONDecodeError becomes the handler's own error
    (`decode_error`). What else the parser raises reaches vLLM's exception handlers: another
    ValueError (invalid UTF-8) 400 BadRequestError, a RecursionError (nesting deeper than the
    parser's stack) the catch-all's 500, each with the exception's text."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        raise decode_error(e) from None
    except ValueError as e:
        raise HTTPError(400, str(e), "BadRequestError") from None
    except RecursionError as e:
        raise HTTPError(500, str(e), "InternalServerError") from None
    bad = lone_surrogate(body, data)
    if bad is not None:
        raise HTTPError(400, str(bad), "BadRequestError") from None
    return data


def parse_request(body: bytes, model: type[BaseModel]) -> Any:
    """Validate a JSON body as FastAPI does for vLLM (json.loads, then the model in Python mode
    with from_attributes: pydantic's Python-mode words, "a valid list"); schema and JSON errors
    become vLLM's 400 validation error, a request model validator's RequestValueError is raised
    as it is (vLLM's 400 BadRequestError)."""
    if not body or body.isspace():  # (strip() would copy the body to find out)
        # FastAPI's view of an empty body: the whole body is missing
        raise validation_error([{"type": "missing", "loc": (), "msg": "Field required", "input": None}])
    data = fast_json(body)
    slow = data is None
    if slow:
        try:
            data = json.loads(body)
        except (RecursionError, UnicodeDecodeError):
            raise unparsable_body() from None
        except ValueError:
            raise json_decode_error(body) from None
    if not isinstance(data, dict):
        raise not_an_object(data)
    if slow and lone_surrogate(body, data) is not None:  # (msgspec refuses them: only a slow parse has them)
        raise UnencodableText()
    try:
        return model.model_validate(data, from_attributes=True)
    except RecursionError:
        raise unparsable_body() from None
    except ValidationError as e:
        errors = e.errors(include_url=False)
        cause = errors[0].get("ctx", {}).get("error") if errors else None
        if isinstance(cause, RequestValueError):
            raise cause from None
        if isinstance(cause, RequestSchemaError):
            raise validation_error(cause.errors) from None
        raise validation_error(errors) from None


OFFLOAD_PARSE_BYTES = 2 << 20  # a larger body is parsed in a worker process
PARSE_TIMEOUT = 30.0
# parsing a 60 MB body holds the GIL for seconds (4.5M logit_bias keys: 5 s of pydantic, 6 s of checks)
PARSE_POOL = IsolatedPool(workers=2, memory_mb=3072, recycle_mb=64, preload=["vllm_vcr.http.serving_base"])


def parse_checked(body: bytes, model: type[BaseModel], vocab_size: int | None) -> Any:
    """parse_request, then a large `logit_bias` against the vocabulary (request_checks), so that
    neither reaches the server's event loop: run in a worker process for large bodies."""
    req = parse_request(body, model)
    if vocab_size is not None:
        bias = getattr(req, "logit_bias", None)
        if bias is not None and len(bias) > OFFLOAD_BIAS_ENTRIES:
            ids, _ = token_choice_params(req, vocab_size)
            if ids is not None and len(ids) < len(bias):  # keys naming one id twice ("1", "01"), folded
                req.logit_bias = {str(k): v for k, v in ids.items()}
    return req


async def parse_request_async(body: bytes, model: type[BaseModel], vocab_size: int | None = None) -> Any:
    """parse_request; a body over OFFLOAD_PARSE_BYTES is parsed (and a large logit_bias checked,
    which then fails here rather than after the other checks) in a worker process, under
    PARSE_TIMEOUT and a memory bound, and only the parsed request comes back."""
    if len(body) <= OFFLOAD_PARSE_BYTES:
        return parse_request(body, model)
    try:
        return await PARSE_POOL.run(parse_checked, body, model, vocab_size, timeout=PARSE_TIMEOUT)
    except BudgetExceeded as e:
        limit = f"took longer than {PARSE_TIMEOUT:g}s" if e.reason == "time" else \
            f"needed more than {PARSE_POOL.memory_mb} MiB"
        raise HTTPError(413, f"Request body too large: parsing it {limit}", "RequestEntityTooLarge") from None


# vLLM's PerRequestMetrics (no speculative decoding here: its stats stay null)
REQUEST_METRICS_FIELDS = ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
                          "tokens_per_second", "speculative_decoding")


class ServingBase:
    def __init__(self, engine: Any, tokenizer: Tokenizer, settings: ServeSettings, metrics: Any = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.metrics = metrics
        self._names = frozenset(settings.served_model_names)
        self.vocab_limit = settings.vocab_limit or tokenizer.vocab_size

    def request_metrics(self, engine_reqs: list[Any], num_generation_tokens: int) -> dict[str, Any] | None:
        """A response's `metrics` under --enable-per-request-metrics: vLLM's PerRequestMetrics of
        its one sequence (None for several, n > 1 or prompts, as vLLM leaves them out)."""
        if not self.settings.per_request_metrics or len(engine_reqs) != 1 or self.metrics is None:
            return None
        return self.metrics.request_timings(engine_reqs[0].request_id, num_generation_tokens)

    async def run_to_end(self, ctx: "RequestContext", states: list, engine_reqs: list) -> bool:
        """Drive every sequence of a non-streaming request to its end (stop strings abort theirs in
        the engine). False when an error response has already been sent."""
        total = len(states)
        done = 0
        try:
            async with OutputStream(self.engine, engine_reqs) as stream:
                index, single = stream.index, stream.single
                async for out in stream:
                    i = 0 if single else index(out)
                    st = states[i]
                    if st.finished:
                        continue
                    st.process(out)
                    if st.finished:
                        if st.finish_reason == "error":
                            raise EngineFailed(st.error)
                        if out.finish_reason is None:
                            stream.cancel(i)  # a stop string ended it: abort in the engine
                        done += 1
                        if done == total:
                            break
        except EngineFailed as e:
            mapped = request_error_response(e.args[0] if e.args else None)
            if mapped is not None:
                raise mapped from None
            await send_bytes(ctx.send, 500, INTERNAL_ERROR_BODY)
            return False
        except HTTPError:
            raise
        except Exception as e:  # the engine is gone (shutdown) or misbehaved
            if type(e).__name__ in ENGINE_GONE:
                raise engine_failure(e) from None
            raise
        return True

    def check_model(self, model: str | None) -> str:
        """The model name to report; unknown names are vLLM's 404."""
        if not model:
            return self.settings.model_name
        if model in self._names:
            return model
        if self.settings.lora_adapters is not None and model in self.settings.lora_adapters.requests:
            return model
        raise model_not_found(model, self.settings.served_model_names)

    def lora_request(self, model: str | None) -> Any:
        """The LoRARequest a request naming an adapter runs with (None for the base model)."""
        adapters = self.settings.lora_adapters
        return adapters.get(model) if adapters is not None else None

    @staticmethod
    def base_request_id(ctx: RequestContext, body_id: str | None) -> str:
        """X-Request-Id header, else the body's request_id, else random (vLLM's order)."""
        hdr = ctx.headers.get(b"x-request-id")
        if hdr:
            return hdr.decode("latin-1")
        return body_id or random_hex(16)  # vLLM 0.32: 16 hex digits

    def admit(self, n: int) -> None:
        """vLLM's check_admission before a response starts: a request that would take the
        unfinished requests (n counts n) past --max-num-queued-reqs, or that comes while the prompt
        tokens of the requests in prefill (their whole prompts, as vLLM's API server counts them)
        are at --max-num-queued-tokens, gets vLLM's 503 (counted in vllm:admission_rejections)."""
        limit = self.settings.max_num_queued_reqs
        if limit is not None and getattr(self.engine, "num_unfinished_requests", 0) + n > limit:
            self._refuse("max_num_queued_reqs", QUEUE_OVERFLOW_MESSAGE)
        tokens = self.settings.max_num_queued_tokens
        if tokens is not None and self.metrics is not None and self.metrics.num_prefill_tokens() >= tokens:
            self._refuse("max_num_queued_tokens", PREFILL_BACKLOG_MESSAGE)

    def _refuse(self, reason: str, message: str) -> None:
        record = getattr(self.metrics, "record_admission_rejection", None)
        if record is not None:
            record(reason)
        raise HTTPError(503, message, "Service Unavailable")

    def check_token_ids(self, ids: list[int]) -> None:
        if ids:
            top = max(ids)
            if top >= self.vocab_limit:
                raise HTTPError(400, f"Token id {top} is out of vocabulary", "BadRequestError", None)


def metrics_arrival(metrics: Any, ctx: RequestContext, engine_reqs: list[Any], n: int, parent: str) -> None:
    """Tell /metrics about each engine request (child ids share the parent when n > 1)."""
    if metrics is None:
        return
    for k, r in enumerate(engine_reqs):
        metrics.on_request_arrival(r.request_id, ctx.arrival, n=n, max_tokens=r.sampling_params.max_tokens,
                                   num_prompt_tokens=len(r.prompt_token_ids),
                                   parent_id=f"{parent}-p{k // n}" if n > 1 else None,
                                   frontend_finishes=bool(r.sampling_params.stop))


def metrics_end(metrics: Any, engine_reqs: list[Any], states: list[Any]) -> None:
    """Requests whose end the frontend decides: with stop strings (finished as the detokenizer saw
    them, "stop" when a string matched, as vLLM counts them) and client disconnects (aborted)."""
    if metrics is None:
        return
    if metrics.keep_request_timings:  # (a response that never took its request's timings)
        metrics.forget_timings(r.request_id for r in engine_reqs)
    for r, st in zip(engine_reqs, states):
        if not st.finished:
            metrics.on_request_aborted(r.request_id)
        elif st.by_frontend or r.sampling_params.stop:
            metrics.on_request_finished(r.request_id, st.finish_reason or "stop", num_generation_tokens=st.num_tokens)


class EngineFailed(Exception):
    """A sequence finished with ERROR: vLLM's 500 (or the engine's RequestError mapping)."""


# engine exceptions that end a request with a 500 rather than crash the handler
ENGINE_GONE = ("EngineDeadError", "DataParallelRankError", "EngineStartupError")


def engine_failure(e: BaseException) -> HTTPError:
    """The HTTP error for an engine that is gone; a failed (simulated) start-up says why."""
    if type(e).__name__ == "EngineStartupError":
        return HTTPError(500, f"Engine start-up failed: {e}", "InternalServerError")
    if type(e).__name__ == "EngineDeadError":
        return HTTPError(500, ENGINE_DEAD_MESSAGE, "InternalServerError")
    return HTTPError(500, "Internal server error", "InternalServerError")


def request_error_response(error) -> HTTPError | None:
    """vLLM 0.33's mapping of an engine RequestError: validation → 400, retryable → 503, else 500
    with its message; None (no error detail) keeps vLLM's generic 500."""
    if error is None:
        return None
    if error.code == "validation_error":
        return HTTPError(400, error.message, "BadRequestError")
    if error.retryable:
        return HTTPError(503, error.message, "ServiceUnavailableError")
    return HTTPError(500, error.message, "InternalServerError")
