"""The engine's per-request state (vLLM's `Request`, trimmed to what a simulator needs)."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any, Callable

from .block_pool import BlockHash, KVCacheBlock
from .latency import RequestPacing
from .tokens import TokenSource
from .types import EngineCoreEvent, EngineCoreRequest, FinishReason, SamplingParams

if TYPE_CHECKING:
    from .plan import ScriptedPacing

# (token id, the step's clock time) -> True when the reader took the token; False: send it as an output
TokenSink = Callable[[int, float], bool]

# what an in-process reader's `take` answers for one token (AsyncEngine.push)
DECLINED = 0  # not taken: the token reaches the reader as an output
TAKEN = 1  # taken and sent
TAKEN_WAKE = 2  # taken, but queued (the socket pushed back): the reader must be woken to send it


_NO_IDS: frozenset[int] = frozenset()


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    BOOTSTRAPPING = 4  # a destination-first prefill waiting for its decoder (not queued yet)
    HANDING_OFF = 5  # a prefill worker's computed handoff request: its finish waits for the handoff's end


class Request:
    __slots__ = (
        "request_id", "prompt_token_ids", "all_token_ids", "num_prompt_tokens", "output_token_ids",
        "sampling_params", "max_tokens", "min_tokens", "stop_ids", "eos_token_id", "priority", "arrival_time",
        "lora_name", "cache_salt", "client_index", "trace_headers", "kv_transfer_params", "status",
        "num_computed_tokens", "num_cached_tokens", "block_hashes", "blocks", "pacing", "next_due",
        "token_source", "pending_events", "prefill_stats_sent", "num_preemptions",
        "seq", "finish_reason", "stop_reason", "num_hashed_blocks", "heap_gen",
        "first_due", "lora_path", "lora_id", "remote_prefill", "remote_decode", "transferring", "external_tokens", "planned", "plan", "chunk", "eos_at", "max_tokens_without_eos",
        "burstable", "pooling", "frontend_delay", "received_in", "token_sink", "batch_member", "steady_gap",
        "steady_left", "steady_batch", "external_id",
    )

    def __init__(self, req: EngineCoreRequest, sp: SamplingParams, max_tokens: int, queued_ts: float, seq: int,
                 adopt_prompt: bool = False, wall_clock: bool = True) -> None:
        self.request_id = req.request_id
        self.external_id = req.external_req_id  # the id the client knows (vLLM's abort by request id)
        self.prompt_token_ids: list[int] = req.prompt_token_ids or []
        # `adopt_prompt`: the caller never reads the list again (the offline simulator's fresh prompts),
        # so the request's tokens extend it, and `prompt_token_ids` is only its first num_prompt_tokens
        self.all_token_ids: list[int] = self.prompt_token_ids if adopt_prompt else list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sp
        self.max_tokens = max_tokens
        self.min_tokens = sp.min_tokens
        self.stop_ids = frozenset(sp.stop_token_ids) if sp.stop_token_ids else _NO_IDS
        self.eos_token_id = None if sp.ignore_eos else sp.eos_token_id
        self.priority = req.priority
        self.arrival_time = req.arrival_time
        # wall-clock seconds between the frontend's arrival_time and the engine getting the request
        # (the server's parsing, templating, tokenizing): the configured TTFT absorbs them; read only
        # on a real clock (`wall_clock`: an engine on the virtual clock, whose arrival times are its
        # own, leaves it 0)
        self.frontend_delay = max(0.0, time.time() - req.arrival_time) if wall_clock and req.arrival_time > 0 \
            else 0.0
        self.received_in = -1  # the engine loop's busy run (EngineCore.idle_waits) that received it
        # an in-process reader that takes a steady decode's token directly (see OutputProcessor._steady_decode)
        self.token_sink: TokenSink | None = None
        # that reader as a member of the steady batches (steady_batch.BatchReader), if it can be one
        self.batch_member: Any = None
        # the fixed gap between its tokens when its decodes can take the steady path (random ids,
        # one token per step, no jitter; fixed at admission with its pacing and token source), else -1
        self.steady_gap = -1.0
        # tokens the steady path may still append before the request's last (counted by `sample`
        # each time it gives the request a token; the steady path only counts it down)
        self.steady_left = 0
        self.steady_batch: Any = None  # the SteadyBatch it decodes in (steady_batch.py), if any
        if req.lora_request is None:  # (the properties' answers without a LoRA, without their calls)
            self.lora_name, self.lora_path, self.lora_id = None, "", None
        else:
            self.lora_name = req.lora_name
            self.lora_path = req.lora_path
            self.lora_id = req.lora_int_id
        self.pooling = req.pooling_params is not None  # prefill-only: finishes after its prefill, no token
        self.cache_salt = req.cache_salt
        self.client_index = req.client_index
        self.trace_headers = req.trace_headers
        self.kv_transfer_params = req.kv_transfer_params
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # known at first scheduling
        self.block_hashes: list[BlockHash] = []
        self.blocks: list[KVCacheBlock] = []
        self.pacing: RequestPacing | ScriptedPacing | None = None
        self.next_due = 0.0  # when the next output token may be emitted
        self.token_source: TokenSource | None = None
        self.pending_events: list[EngineCoreEvent] = [EngineCoreEvent(1, queued_ts)]
        self.prefill_stats_sent = False
        self.num_preemptions = 0
        self.seq = seq  # arrival order, the FCFS tie-breaker
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.num_hashed_blocks = 0  # leading blocks registered in the prefix cache
        self.heap_gen = 0  # invalidates stale entries in the decode heap
        self.first_due = 0.0
        self.remote_prefill: dict[str, Any] | None = None  # decode side: pull the prompt's KV
        self.remote_decode = False  # prefill side: finish after prefill, hold blocks for the puller
        self.transferring = False
        self.external_tokens = 0  # prompt tokens whose KV arrived by transfer
        self.planned: list[int] | None = None  # output ids to emit verbatim (replay)
        self.plan: Any = None  # RequestPlan from a trace, if any
        self.chunk = 1  # tokens the next sample emits (recorded chunking)
        self.eos_at: int | None = None  # a fitted model decided the request stops (EOS) here
        self.max_tokens_without_eos = max_tokens  # the budget had no modeled EOS cut it
        self.burstable = False  # decodes with no gap between tokens: zero-latency steps may merge

    def shift_due(self, delta: float) -> None:
        """The next deadline `delta` later (after a pause)."""
        self.next_due += delta

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def prefill_target(self) -> int:
        """Tokens to compute before the next token can be sampled.

        A fresh request computes its prompt; a request resumed after preemption recomputes all
        but its last token, which the next decode step computes (vLLM's recompute semantics)."""
        return self.num_prompt_tokens if not self.output_token_ids else self.num_tokens - 1

    @property
    def is_prefilling(self) -> bool:
        # (prefill_target's formula, inline: read for every running request in every step)
        return self.num_computed_tokens < (self.num_prompt_tokens if not self.output_token_ids
                                           else len(self.all_token_ids) - 1)
