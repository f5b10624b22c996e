"""Engine request/output types, shaped like vLLM v1's engine-core structs.

The msgspec layouts (array_like positions, map keys) match vLLM 0.32/0.33 exactly, so the
`wire/` adapter puts these objects on the ZMQ socket without a translation layer and `serve`
uses the very same objects in process.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    def __str__(self) -> str:  # the strings the OpenAI layer reports
        return self.name.lower()


class EngineCoreEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """The engine-relevant subset of vLLM's SamplingParams (a msgpack map; unknown keys ignored)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: int = 0
    extra_args: dict[str, Any] | None = None
    eos_token_id: int | None = msgspec.field(default=None, name="_eos_token_id")
    all_stop_token_ids: list[int] = msgspec.field(default_factory=list, name="_all_stop_token_ids")
    repetition_detection: dict[str, Any] | None = None
    # shape the random draw (tokens.py BiasedTokens); the frontend clamps biases to [-100, 100]
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's StructuredOutputsParams (a map): play's constrained token source reads it
    structured_outputs: dict[str, Any] | None = None


class LoRARequest(msgspec.Struct, array_like=True):
    lora_name: str
    lora_int_id: int
    lora_path: str = ""


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """Positional layout of vLLM's EngineCoreRequest (22 fields, same in 0.32 and 0.33)."""

    request_id: str
    prompt_token_ids: list[int] | None
    mm_features: Any = None
    sampling_params: SamplingParams | None = None
    pooling_params: Any = None
    arrival_time: float = 0.0
    lora_request: Any = None  # LoRARequest array; read positions 0/1 only
    cache_salt: str | None = None
    data_parallel_rank: int | None = None
    prompt_embeds: Any = None
    prompt_is_token_ids: Any = None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    trace_headers: dict[str, str] | None = None
    resumable: bool = False
    external_req_id: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: Any = None
    abort_immediately: bool = False
    session_id: str | None = None
    kv_hints: Any = None
    # kv_transfer_params travel inside sampling_params.extra_args in vLLM; kept there.

    @property
    def lora_name(self) -> str | None:
        lr = self.lora_request
        if lr is None:
            return None
        if isinstance(lr, LoRARequest):
            return lr.lora_name
        return lr[0] if lr else None

    @property
    def lora_path(self) -> str:
        lr = self.lora_request
        if lr is None:
            return ""
        if isinstance(lr, LoRARequest):
            return lr.lora_path
        return lr[2] if len(lr) > 2 and isinstance(lr[2], str) else ""

    @property
    def lora_int_id(self) -> int | None:
        lr = self.lora_request
        if lr is None:
            return None
        if isinstance(lr, LoRARequest):
            return lr.lora_int_id
        return lr[1] if len(lr) > 1 and isinstance(lr[1], int) else None

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        sp = self.sampling_params
        if sp is None or not sp.extra_args:
            return None
        return sp.extra_args.get("kv_transfer_params")


class EngineCoreEvent(msgspec.Struct):
    """A map `{"type": int, "timestamp": float}` (not array_like in vLLM)."""

    type: int
    timestamp: float


class PrefillStats(msgspec.Struct, kw_only=True):
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_local_cached_tokens: int = 0
    num_external_cached_tokens: int = 0
    num_cache_creation_tokens: int = 0


class RequestError(msgspec.Struct):
    """vLLM 0.33's per-output error (ignored by 0.32 frontends)."""

    code: str
    message: str
    retryable: bool = False


class EngineCoreOutput(msgspec.Struct, array_like=True, kw_only=True, gc=False):
    """vLLM 0.33 layout (19 positions); 0.32 frontends drop the trailing `error`.

    Not tracked by the cyclic GC (`gc=False`): one is made per token, and nothing it holds (ids,
    events, params) ever refers back to it, so it is never part of a cycle; untracked, it is
    smaller and cheaper to make and free, and does not count towards young collections."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Any = None
    new_prompt_logprobs_tensors: Any = None
    pooling_output: Any = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    events: list[EngineCoreEvent] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: Any = None
    trace_headers: dict[str, str] | None = None
    prefill_stats: PrefillStats | None = None
    routed_experts: Any = None
    num_nans_in_logits: int = 0
    mm_cache_miss_hashes: Any = None
    new_sampling_mask: Any = None
    spec_decode_metrics: Any = None
    prompt_token_id_logprobs: Any = None
    error: RequestError | None = None


class PrefixCacheStats(msgspec.Struct, kw_only=True):
    """Per-report deltas, in tokens as vLLM counts them."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    hits_by_source: dict[str, int] = msgspec.field(default_factory=dict)


class SchedulerStats(msgspec.Struct, kw_only=True):
    """Every field of vLLM's SchedulerStats (0.32 and 0.33 alike): the Rust frontend requires them all."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_skipped_waiting_reqs: int = 0
    num_kv_fetch_reqs_by_stage: dict[str, int] = msgspec.field(default_factory=dict)
    step_counter: int = 0
    current_wave: int = 0
    kv_cache_usage: float = 0.0
    iteration_details: Any = None
    prefix_cache_stats: PrefixCacheStats = msgspec.field(default_factory=PrefixCacheStats)
    connector_prefix_cache_stats: Any = None
    kv_cache_eviction_events: list[Any] = msgspec.field(default_factory=list)
    spec_decoding_stats: Any = None
    kv_connector_stats: Any = None
    ec_connector_stats: Any = None
    waiting_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)
    running_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)
    cudagraph_stats: Any = None
    perf_stats: Any = None
    num_preemptions: int = 0  # our own addition: preemptions during this report window


class UtilityOutput(msgspec.Struct, array_like=True):
    call_id: int
    failure_message: str | None = None
    result: Any = None  # [type_info(null), value] on success


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """One batch per engine step (9 positions, same in 0.32 and 0.33)."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: list[str] | None = None
    wave_complete: int | None = None
    start_wave: int | None = None
    weight_version: str | None = None


class RequestFieldError(ValueError):
    """A request field of the wrong shape: the request fails alone, the engine never sees it."""


def check_lora_request(value: Any) -> None:
    """vLLM's LoRARequest travels as an array [lora_name, lora_int_id, lora_path, ...]."""
    if value is None or isinstance(value, LoRARequest):
        return
    if not isinstance(value, (list, tuple)) or len(value) < 2:
        raise RequestFieldError(f"lora_request must be an array [lora_name, lora_int_id, ...], "
                                f"got {type(value).__name__}")
    name, int_id = value[0], value[1]
    if not isinstance(name, str) or not isinstance(int_id, int) or isinstance(int_id, bool):
        raise RequestFieldError("lora_request must start with a string lora_name and an integer lora_int_id")
    if len(value) > 2 and value[2] is not None and not isinstance(value[2], str):
        raise RequestFieldError("lora_request's lora_path must be a string")


# The fields the engine reads, with the types it relies on (the rest are carried, never read).
_CHECKED_FIELDS = {f.name: f.type for f in msgspec.structs.fields(EngineCoreRequest)
                   if f.type is not Any and f.name not in ("request_id", "prompt_token_ids")}


def request_from_fields(fields: dict[str, Any]) -> EngineCoreRequest:
    """An EngineCoreRequest from loosely-typed fields (an untyped decode), every read field
    converted to its type or refused with RequestFieldError naming it."""
    kw: dict[str, Any] = {}
    rid = fields.get("request_id")
    if not isinstance(rid, str) or not rid:
        raise RequestFieldError("request_id must be a non-empty string")
    kw["request_id"] = rid
    prompt = fields.get("prompt_token_ids")
    if prompt is not None:
        if not isinstance(prompt, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise RequestFieldError("prompt_token_ids must be an array of integers")
        prompt = list(prompt)
    kw["prompt_token_ids"] = prompt
    for name, value in fields.items():
        if name in kw:
            continue
        typ = _CHECKED_FIELDS.get(name)
        if value is None and typ is not None:
            continue  # the field's default (a frontend that sends nil for a defaulted field)
        if typ is None:
            kw[name] = value
            continue
        try:
            kw[name] = msgspec.convert(value, typ, strict=False)
        except (msgspec.ValidationError, TypeError, ValueError) as e:
            raise RequestFieldError(f"{name}: {e}") from None
    check_lora_request(kw.get("lora_request"))
    return EngineCoreRequest(**kw)


def not_simulated(method: str) -> str:
    """The failure of an engine utility call (collective_rpc into workers, weight transfer) that a
    mock without workers or weights cannot perform: the words `play` answers its frontend with."""
    return f"Call to {method} method failed: vllm-vcr does not simulate '{method}'"
