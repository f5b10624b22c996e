"""The engine types: what differs between a vLLM and an SGLang engine, on one shared scheduler,
KV pool and prefix cache, as a scheduling policy per type, and the registry of the types.

| decision | vLLM v1 (`VLLMPolicy`) | SGLang (`SGLangPolicy`, as Dynamo's mocker models it) |
|---|---|---|
| step composition | decodes first, then prefill chunks, in one batch | a step with any prefill (extend) runs only prefills; decodes wait for a step without one (`enable_mixed_chunk=false`) |
| admission | as long as KV blocks can be allocated | also needs, while anything runs, `extend + reserve(new) < free + evictable - Σ reserve(running)`, reserve = `min(remaining output, clip_max_new_tokens) · new_token_ratio` |
| new_token_ratio | – | starts at `0.7·conservativeness`, decays linearly to `0.14·init` over 600 steps, back to init after a retraction |
| chunked prefill | a chunk is what the token budget leaves | a partial chunk is page-aligned (`floor(budget / page) · page`) |
| P/D bootstrap handoff | source first: the prefill computes, then holds its KV until the decoder pulls | destination first: the prefill waits (not queued) until its decoder has joined the room |
| KV pressure | preempt the newest running request (LIFO) | retract the running request with the fewest output tokens (longest prompt on ties) |
| DP ranks of an MoE model (`LockstepRule`) | a wave of steps runs while any rank has unfinished requests, checked at its first step and every 16th (dummy steps between) | the ranks gather their batch sizes every step: a step runs on every rank (an idle batch where there is none) when any rank has a batch, on none otherwise |

The prefix cache is the same page-granular chain for both (SGLang's radix tree matches the same
prefixes at `page_size` = `--tokens-per-block`); SGLang's own default page size is 1.

An engine type is its policy class, declared once with every per-type decision of the engine
(its name, step composition, admission, chunking, victim, handoff order, whether timing-only
decodes apply) and registered under its name with `register_engine_type`; `engine_type(name)`
looks it up (`--engine-type` validates against `engine_types()`). vLLM and SGLang are declared
below; a third engine type is one module that subclasses `EnginePolicy` and registers it
(imported before the CLI parses `--engine-type` or an engine is built).
This module reads nothing else of the engine: what a policy looks at is typed by the small
protocols below, so any engine module (and the config) may import it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, sub
from typing import Protocol, Sequence


class HandoffOrder(enum.Enum):
    """Which side of a P/D bootstrap handoff goes first."""

    SOURCE_FIRST = "source_first"  # vLLM: the prefill computes at once and holds its KV for the decoder
    DESTINATION_FIRST = "destination_first"  # SGLang: the prefill waits until its decoder has joined the room


DP_SYNC_INTERVAL = 16  # vLLM's ParallelConfig.dp_sync_interval (--dp-sync-interval) default


@dataclass(frozen=True)
class LockstepRule:
    """How an engine type steps the data-parallel ranks of an MoE model together (engine/lockstep.py).

    `per_step`: SGLang's DP attention (scheduler.py `prepare_mlp_sync_batch`, every iteration):
    the ranks all-gather their batch sizes before every forward; when any rank has tokens the
    others run an idle batch (`ForwardMode.IDLE`), when none has, no rank runs a forward. Else
    vLLM's `DPEngineCoreProc`: a wave of steps runs while any rank has unfinished requests, which
    the ranks agree on after a wave's first step and every `sync_interval` steps (a rank with
    nothing scheduled runs a dummy batch until then)."""

    per_step: bool = False
    sync_interval: int = DP_SYNC_INTERVAL


# --- what a policy reads ---------------------------------------------------------------------------

class PolicyRequest(Protocol):
    """A request, as a policy reads it (engine/request.py's Request)."""
    max_tokens: int
    num_prompt_tokens: int
    seq: int

    @property
    def num_output_tokens(self) -> int: ...


class FreeBlocks(Protocol):
    num_free_blocks: int


class KVSpace(Protocol):
    """The KV cache, as an admission check reads it (engine/kv_cache_manager.py's KVCacheManager)."""
    block_size: int
    pool: FreeBlocks

    def blocks_needed(self, num_tokens: int) -> int: ...


class SchedulerState(Protocol):
    """The scheduler, as an admission check reads it: the running requests, their output so far
    (timing-only decodes count it without the request's lists: decode_cohort.py) and the KV cache."""
    running: Sequence[PolicyRequest]
    kv: KVSpace

    def output_counts(self) -> list[int]:
        """Each running request's output tokens so far, in `running`'s order."""

    def reserve_tokens(self, clip: int) -> int:
        """Σ over the running requests of the output each may still produce, at most `clip` each."""


_max_tokens = attrgetter("max_tokens")


def reserve_tokens(running: Sequence[PolicyRequest], outputs: Sequence[int], clip: int) -> int:
    """Σ min(max(max_tokens - output, 0), clip) over `running` (`outputs`: their output tokens so far)."""
    return sum(map(min, map(max, map(sub, map(_max_tokens, running), outputs), repeat(0)), repeat(clip)))


# --- the policies ------------------------------------------------------------------------------------

class EnginePolicy:
    """The per-type decisions of an engine step. The methods default to vLLM v1's; the identity of
    a type (its name, its handoff order, whether timing-only decodes reproduce it) has no default."""

    name = ""
    extend_first = False  # True: a step with prefills runs no decodes
    handoff_order: HandoffOrder | None = None  # None: no disaggregated handoff
    # timing-only decodes (decode_cohort.py) reproduce this policy's steps (the cohort's scheduler
    # re-implements the shared scheduler's step for both compositions)
    decode_cohort = False
    # how the data-parallel ranks of an MoE model step together; None: they run independently
    dp_lockstep: LockstepRule | None = LockstepRule()

    def on_step(self) -> None:
        """A step is being scheduled."""

    def can_admit(self, sched: SchedulerState, req: PolicyRequest, num_new_tokens: int) -> bool:
        return True

    def chunk(self, num_tokens: int, budget: int, page: int) -> int:
        """Tokens of a prompt remainder `num_tokens` computed with `budget` left."""
        return min(num_tokens, budget)

    def pick_victim(self, running: Sequence[PolicyRequest], outputs: Sequence[int] | None = None) -> PolicyRequest:
        """The running request to preempt (`outputs`: their output tokens so far, default their lists')."""
        return running[-1]

    def on_retract(self) -> None:
        """A running request lost its KV blocks."""


# --- the registry --------------------------------------------------------------------------------------

_ENGINE_TYPES: dict[str, type[EnginePolicy]] = {}


def register_engine_type(name: str, policy: type[EnginePolicy]) -> type[EnginePolicy]:
    """Make `name` an engine type (`--engine-type name`): `policy` is its policy class, one
    instance per engine (a policy may keep state), whose `name` is `name`."""
    if policy.name != name:
        raise ValueError(f"engine type {name!r}: its policy {policy.__name__} is named {policy.name!r}")
    known = _ENGINE_TYPES.get(name)
    if known is not None and known is not policy:
        raise ValueError(f"engine type {name!r} is already registered ({known.__name__})")
    _ENGINE_TYPES[name] = policy
    return policy


def engine_type(name: str) -> type[EnginePolicy]:
    """The policy class of a registered engine type."""
    policy = _ENGINE_TYPES.get(name)
    if policy is None:
        raise ValueError(f"unknown engine type {name!r}; choose from {', '.join(_ENGINE_TYPES)}")
    return policy


def engine_types() -> tuple[str, ...]:
    """The registered engine types' names, in registration order."""
    return tuple(_ENGINE_TYPES)


def policy_for(name: str) -> EnginePolicy:
    """A new scheduling policy of engine type `name` (one per engine)."""
    return engine_type(name)()


def order_for_engine(name: str) -> HandoffOrder:
    """The handoff order of an engine type (Dynamo's mocker has none for TRT-LLM: an error)."""
    policy = _ENGINE_TYPES.get(name)
    if policy is None or policy.handoff_order is None:
        raise ValueError(f"{name} engine type does not support disaggregated handoff")
    return policy.handoff_order


# --- the engine types ---------------------------------------------------------------------------------

class VLLMPolicy(EnginePolicy):
    name = "vllm"
    handoff_order: HandoffOrder | None = HandoffOrder.SOURCE_FIRST
    decode_cohort = True


register_engine_type("vllm", VLLMPolicy)


CLIP_MAX_NEW_TOKENS = 4096  # SGLang's clip on the output a request is expected to still produce
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600


class SGLangPolicy(EnginePolicy):
    name = "sglang"
    extend_first = True
    handoff_order: HandoffOrder | None = HandoffOrder.DESTINATION_FIRST
    dp_lockstep: LockstepRule | None = LockstepRule(per_step=True, sync_interval=1)
    decode_cohort = True

    def __init__(self, conservativeness: float = 1.0) -> None:
        self.init_ratio = min(INIT_NEW_TOKEN_RATIO * conservativeness, 1.0)
        self.min_ratio = self.init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR
        self.decay = (self.init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_ratio

    def on_step(self) -> None:
        self.new_token_ratio = max(self.new_token_ratio - self.decay, self.min_ratio)

    def reserve(self, req: PolicyRequest) -> float:
        """Output tokens the request is expected to still need, scaled by the ratio."""
        remaining = max(req.max_tokens - req.num_output_tokens, 0)
        return min(remaining, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio

    def can_admit(self, sched: SchedulerState, req: PolicyRequest, num_new_tokens: int) -> bool:
        if not sched.running:  # the reserve is a guess about output: it never keeps an idle engine idle
            return True
        kv = sched.kv
        available = kv.pool.num_free_blocks * kv.block_size  # free blocks include evictable cached ones
        # Σ reserve(r) over the running requests: their clipped remaining outputs (an exact int), scaled once
        rem_total = available - sched.reserve_tokens(CLIP_MAX_NEW_TOKENS) * self.new_token_ratio
        extend = kv.blocks_needed(num_new_tokens) * kv.block_size
        return extend + self.reserve(req) < rem_total

    def chunk(self, num_tokens: int, budget: int, page: int) -> int:
        if num_tokens <= budget:
            return num_tokens
        return budget // page * page

    def pick_victim(self, running: Sequence[PolicyRequest], outputs: Sequence[int] | None = None) -> PolicyRequest:
        if outputs is None:
            outputs = [r.num_output_tokens for r in running]
        i = min(range(len(running)), key=lambda i: (outputs[i], -running[i].num_prompt_tokens, -running[i].seq))
        return running[i]

    def on_retract(self) -> None:
        self.new_token_ratio = self.init_ratio


register_engine_type("sglang", SGLangPolicy)
