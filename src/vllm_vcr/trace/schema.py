"""The trace schema: one `{"meta": ...}` line, then one record per completed request.

Optional record kind: `{"fpm": {...}}`, one engine step's forward-pass metrics (Dynamo's
ForwardPassMetrics fields, see fpm/record.py). A trace without them is exactly the Rust tool's
format; readers here collect them apart from the request records (`Trace.fpm`).

Field names and meanings are those of the Rust vllm-vcr trace format so traces move between the
two tools in both directions. Unknown keys are kept in `extra` and written back on save, so a
trace written by a newer tool survives a read/write cycle here.
"""

from __future__ import annotations

from typing import Any

import msgspec

FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

# Meta `source` values written by the tools of this package (others are tolerated on read).
SOURCE_TAP = "tap"
SOURCE_HTTP_TAP = "http-tap"
SOURCE_GUIDELLM = "guidellm"
SOURCE_AIPERF = "aiperf"
SOURCE_GEN_DEMO = "gen-demo"
SOURCE_GEN_DEMO_FAST = "gen-demo-fast"
SOURCE_REPLAY_ARRIVALS = "replay-arrivals"
SOURCE_FPM = "fpm"  # serve --forward-pass-metrics-trace: step records only

FPM_KEY = "fpm"  # the optional per-step record kind


def _zero() -> int:
    return 0


def _one() -> int:
    return 1


class ItlSummary(msgspec.Struct, omit_defaults=True):
    """Mean inter-token latency, for converters that have no per-gap data (guidellm)."""

    mean_ms: float
    count: int


class ItlCtx(msgspec.Struct):
    """Engine context of the step closing each gap, parallel to `itl_ms`."""

    num_running: list[int]
    prefill_tokens: list[int]


class TraceMeta(msgspec.Struct, omit_defaults=True, kw_only=True):
    model: str | None = None
    gpu: str | None = None
    tp: int | None = None
    max_num_seqs: int | None = None
    source: str | None = None
    block_size: int | None = None
    config_hash: str | None = None
    vllm_version: str | None = None
    ready_response_hex: str | None = None
    # Keys we do not know; flattened back into the meta object on write (serde `flatten` there).
    extra: dict[str, Any] | None = msgspec.field(default=None, name="__vcr_extra__")


class TraceRecord(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One completed request. Optional fields are omitted from the JSON when None;
    `cached_tokens` and `concurrency` are always written (as the Rust tap does)."""

    prompt_tokens: int
    # default_factory, not default: omit_defaults would drop them otherwise
    cached_tokens: int = msgspec.field(default_factory=_zero)
    output_tokens: int
    ttft_ms: float
    itl_ms: list[float] | None = None
    itl_tokens: list[int] | None = None
    itl_summary: ItlSummary | None = None
    concurrency: int = msgspec.field(default_factory=_one)
    arrival_ms: float | None = None
    itl_ctx: ItlCtx | None = None
    block_hashes: list[int] | None = None
    mm_hashes: list[str] | None = None
    output_token_ids: list[int] | None = None
    finish_reason: str | None = None
    remote_prefill: bool | None = None
    extra: dict[str, Any] | None = msgspec.field(default=None, name="__vcr_extra__")

    # -- derived views -------------------------------------------------------------------------

    def gap_tokens(self) -> list[int]:
        """Tokens delivered by the chunk closing each gap (all ones when `itl_tokens` is absent)."""
        if self.itl_tokens is not None:
            return self.itl_tokens
        return [1] * len(self.itl_ms or ())

    def first_chunk_tokens(self) -> int:
        return max(self.output_tokens - sum(self.gap_tokens()), 1)

    def decode_ms(self) -> float:
        """Time from the first token to the last one."""
        if self.itl_ms is not None:
            return float(sum(self.itl_ms))
        if self.itl_summary is not None:
            return self.itl_summary.mean_ms * self.itl_summary.count
        return 0.0

    def latency_ms(self) -> float:
        return self.ttft_ms + self.decode_ms()

    def uncached_prompt_tokens(self) -> int:
        return max(self.prompt_tokens - self.cached_tokens, 0)


META_FIELDS = frozenset(f for f in TraceMeta.__struct_fields__ if f != "extra")
RECORD_FIELDS = frozenset(f for f in TraceRecord.__struct_fields__ if f != "extra")


def validate_record(rec: TraceRecord) -> tuple[str, str] | None:
    """The consistency rules every reader enforces; returns (field, problem) or None."""
    n_gaps = len(rec.itl_ms) if rec.itl_ms is not None else None
    if rec.prompt_tokens < 0:
        return "prompt_tokens", "must be >= 0"
    if rec.output_tokens < 0:
        return "output_tokens", "must be >= 0"
    if rec.output_tokens > 1 and rec.itl_ms is None and rec.itl_summary is None:
        return "itl_ms", f"output_tokens is {rec.output_tokens} but neither itl_ms nor itl_summary is set"
    if rec.itl_ctx is not None:
        if n_gaps is None:
            return "itl_ctx", "set without itl_ms"
        for name in ("num_running", "prefill_tokens"):
            got = len(getattr(rec.itl_ctx, name))
            if got != n_gaps:
                return f"itl_ctx.{name}", f"has {got} entries, itl_ms has {n_gaps}"
    if rec.itl_tokens is not None:
        if n_gaps is None:
            return "itl_tokens", "set without itl_ms"
        if len(rec.itl_tokens) != n_gaps:
            return "itl_tokens", f"has {len(rec.itl_tokens)} entries, itl_ms has {n_gaps}"
        if any(t <= 0 for t in rec.itl_tokens):
            return "itl_tokens", "entries must be > 0"
        if sum(rec.itl_tokens) >= rec.output_tokens:
            return "itl_tokens", f"sum {sum(rec.itl_tokens)} must be < output_tokens {rec.output_tokens}"
    if rec.output_token_ids is not None and len(rec.output_token_ids) != rec.output_tokens:
        return "output_token_ids", (
            f"has {len(rec.output_token_ids)} entries, output_tokens is {rec.output_tokens}"
        )
    return None


def replay_subset(records: list[TraceRecord]) -> list[TraceRecord]:
    """Records with an arrival time, stable-sorted by it. The index in this list is a request's
    identity during replay (`replay-{i}`), on both the load-generator and the engine side."""
    timed = [r for r in records if r.arrival_ms is not None]
    timed.sort(key=lambda r: r.arrival_ms)  # list.sort is stable
    return timed


def replay_index(request_id: str) -> int | None:
    """The replay index of a request id: the integer after its last `-` (the whole id if none)."""
    tail = request_id.rsplit("-", 1)[-1]
    try:
        return int(tail)
    except ValueError:
        return None
