"""The engine type as a scheduling policy: what differs between a vLLM and an SGLang engine step,
on one shared scheduler, KV pool and prefix cache.

| decision | vLLM v1 (`VLLMPolicy`) | SGLang (`SGLangPolicy`, as Dynamo's mocker models it) |
|---|---|---|
| step composition | decodes first, then prefill chunks, in one batch | a step with any prefill (extend) runs only prefills; decodes wait for a step without one (`enable_mixed_chunk=false`) |
| admission | as long as KV blocks can be allocated | also needs, while anything runs, `extend + reserve(new) < free + evictable - Σ reserve(running)`, reserve = `min(remaining output, clip_max_new_tokens) · new_token_ratio` |
| new_token_ratio | – | starts at `0.7·conservativeness`, decays linearly to `0.14·init` over 600 steps, back to init after a retraction |
| chunked prefill | a chunk is what the token budget leaves | a partial chunk is page-aligned (`floor(budget / page) · page`) |
| P/D bootstrap handoff | source first: the prefill computes, then holds its KV until the decoder pulls | destination first: the prefill waits (not queued) until its decoder has joined the room |
| KV pressure | preempt the newest running request (LIFO) | retract the running request with the fewest output tokens (longest prompt on ties) |

The prefix cache is the same page-granular chain for both (SGLang's radix tree matches the same
prefixes at `page_size` = `--tokens-per-block`); SGLang's own default page size is 1.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import Request
    from .scheduler import Scheduler

CLIP_MAX_NEW_TOKENS = 4096  # SGLang's clip on the output a request is expected to still produce
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600


class HandoffOrder(enum.Enum):
    """Which side of a P/D bootstrap handoff goes first."""

    SOURCE_FIRST = "source_first"  # vLLM: the prefill computes at once and holds its KV for the decoder
    DESTINATION_FIRST = "destination_first"  # SGLang: the prefill waits until its decoder has joined the room


def order_for_engine(engine_type: str) -> HandoffOrder:
    """The handoff order of an engine type (Dynamo's mocker has none for TRT-LLM: an error)."""
    if engine_type == "vllm":
        return HandoffOrder.SOURCE_FIRST
    if engine_type == "sglang":
        return HandoffOrder.DESTINATION_FIRST
    raise ValueError(f"{engine_type} engine type does not support disaggregated handoff")


class VLLMPolicy:
    name = "vllm"
    extend_first = False  # True: a step with prefills runs no decodes
    handoff_order = HandoffOrder.SOURCE_FIRST

    def on_step(self) -> None:
        """A step is being scheduled."""

    def can_admit(self, sched: Scheduler, req: Request, num_new_tokens: int) -> bool:
        return True

    def chunk(self, num_tokens: int, budget: int, page: int) -> int:
        """Tokens of a prompt remainder `num_tokens` computed with `budget` left."""
        return min(num_tokens, budget)

    def pick_victim(self, running: list[Request]) -> Request:
        return running[-1]

    def on_retract(self) -> None:
        """A running request lost its KV blocks."""


class SGLangPolicy(VLLMPolicy):
    name = "sglang"
    extend_first = True
    handoff_order = HandoffOrder.DESTINATION_FIRST

    def __init__(self, conservativeness: float = 1.0) -> None:
        self.init_ratio = min(INIT_NEW_TOKEN_RATIO * conservativeness, 1.0)
        self.min_ratio = self.init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR
        self.decay = (self.init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_ratio

    def on_step(self) -> None:
        self.new_token_ratio = max(self.new_token_ratio - self.decay, self.min_ratio)

    def reserve(self, req: Request) -> float:
        """Output tokens the request is expected to still need, scaled by the ratio."""
        remaining = max(req.max_tokens - req.num_output_tokens, 0)
        return min(remaining, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio

    def can_admit(self, sched: Scheduler, req: Request, num_new_tokens: int) -> bool:
        if not sched.running:  # the reserve is a guess about output: it never keeps an idle engine idle
            return True
        kv = sched.kv
        available = kv.pool.num_free_blocks * kv.block_size  # free blocks include evictable cached ones
        rem_total = available - sum(self.reserve(r) for r in sched.running)
        extend = kv.blocks_needed(num_new_tokens) * kv.block_size
        return extend + self.reserve(req) < rem_total

    def chunk(self, num_tokens: int, budget: int, page: int) -> int:
        if num_tokens <= budget:
            return num_tokens
        return budget // page * page

    def pick_victim(self, running: list[Request]) -> Request:
        return min(running, key=lambda r: (r.num_output_tokens, -r.num_prompt_tokens, -r.seq))

    def on_retract(self) -> None:
        self.new_token_ratio = self.init_ratio


def policy_for(engine_type: str) -> VLLMPolicy:
    return SGLangPolicy() if engine_type == "sglang" else VLLMPolicy()
