"""The FPM record: Dynamo's ForwardPassMetrics v1 (field names, order and msgpack map encoding of
`dynamo.common.forward_pass_metrics`), plus vllm-vcr's own fields after Dynamo's.

Consumers decode the record as a msgpack map and ignore keys they do not know (msgspec without
`forbid_unknown_fields`, serde's default), so the added fields (`step`, `start`, `sim_duration`,
`kv_usage`, `engine_type`) do not disturb Dynamo's planner or aiconfigurator-core.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

FPM_VERSION = 1  # Dynamo's schema version; a consumer rejects other versions


class ScheduledRequestMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """The work the step computes."""

    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0  # prompt tokens computed by this step's prefill chunks
    var_prefill_length: float = 0.0  # population variance of those chunks' lengths
    sum_prefill_kv_tokens: int = 0  # tokens already in the KV cache that the chunks attend to
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0  # context (KV) tokens the decodes attend to
    var_decode_kv_tokens: float = 0.0


class QueuedRequestMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """What is left waiting after the step was scheduled."""

    num_prefill_requests: int = 0  # waiting requests that have not produced a token
    sum_prefill_tokens: int = 0  # their prompt tokens
    var_prefill_length: float = 0.0
    num_decode_requests: int = 0  # waiting requests that had produced tokens (preempted, to resume)
    sum_decode_kv_tokens: int = 0  # their context tokens
    var_decode_kv_tokens: float = 0.0


class ForwardPassMetrics(msgspec.Struct, frozen=True, kw_only=True):
    version: int = FPM_VERSION
    worker_id: str = ""
    dp_rank: int = 0
    counter_id: int = 0  # the publisher's sequence number on this rank
    wall_time: float = 0.0  # seconds the step took (0: an idle heartbeat, or a step paced per request)
    scheduled_requests: ScheduledRequestMetrics = ScheduledRequestMetrics()
    queued_requests: QueuedRequestMetrics = QueuedRequestMetrics()
    # vllm-vcr's fields (ignored by Dynamo's decoders)
    step: int = 0  # the engine's step counter (0 on a heartbeat)
    start: float = 0.0  # engine clock at the step's start (s)
    sim_duration: float = 0.0  # the latency model's duration of the step (s, engine clock)
    kv_usage: float = 0.0  # fraction of KV blocks in use after scheduling
    engine_type: str = "vllm"


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ForwardPassMetrics)


def encode(metrics: ForwardPassMetrics) -> bytes:
    return _encoder.encode(metrics)


def decode(data: bytes) -> ForwardPassMetrics:
    return _decoder.decode(data)


def count_sum_var(values: Iterable[int]) -> tuple[int, int, float]:
    """(count, sum, population variance), in one pass (Welford)."""
    n = total = 0
    mean = m2 = 0.0
    for v in values:
        n += 1
        total += v
        delta = v - mean
        mean += delta / n
        m2 += delta * (v - mean)
    return n, total, (m2 / n if n else 0.0)
