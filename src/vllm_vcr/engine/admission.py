"""Admission: request checks, the output budget, the one reject path, and what a request gets
when the scheduler first admits it (its pacing and token source)."""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING, Callable, Mapping

from .config import FailureType
from .kv_transfer import has_handoff_metadata
from .latency import RequestPacing
from .lora import LoRAResidency
from .output_length import modeled_eos_at
from .plan import RequestPlan, ScriptedPacing
from .request import Request
from .tokens import (
    PLANNED_OUTPUT_KEY,
    BiasedTokens,
    EchoTokens,
    RandomTokens,
    ReasoningConfig,
    ReasoningTokens,
    ScriptedTokens,
    TokenSource,
    can_sample,
    seeded_random,
)
from .types import EngineCoreEvent, EngineCoreOutput, EngineCoreRequest, FinishReason, RequestError

if TYPE_CHECKING:
    from .clock import Clock
    from .config import EngineArgs, EngineConfig
    from .kv_cache_manager import KVCacheManager
    from .kv_transfer import KVTransfer
    from .latency import LatencyModel
    from .output_length import OutputLengthModel
    from .plan import OutputReplayTable, Planner
    from .scheduler import Scheduler
    from .stats import EngineStats

logger = logging.getLogger("vllm_vcr.engine")
_NO_PARAMS: dict = {}  # (read only)
GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature is greedy sampling
TokenSourceFactory = Callable[[Request, random.Random], "TokenSource | None"]
_FAILURE_REASONS = {
    FailureType.ERROR: FinishReason.ERROR,
    FailureType.LENGTH: FinishReason.LENGTH,
    FailureType.REPETITION: FinishReason.REPETITION,
}


def finish_output(rid: str, reason: FinishReason, *, events: list[EngineCoreEvent] | None = None,
                  stop_reason: int | str | None = None, error: RequestError | None = None) -> EngineCoreOutput:
    """The output that ends a request without a token."""
    return EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason=reason, stop_reason=stop_reason,
                            events=events or None, error=error)


def reject(stats: EngineStats, outputs: list, finished: list, client: int, rid: str, reason: FinishReason, *,
           counter: str = "requests_failed", events: list[EngineCoreEvent] | None = None,
           stop_reason: int | str | None = None, error: RequestError | None = None) -> None:
    """End a request that will not (or no longer) run: count it in `stats`, answer it, mark it
    finished (the one path for every rejection, injected failure, and abort or failure with an output)."""
    setattr(stats, counter, getattr(stats, counter) + 1)
    outputs.append((client, finish_output(rid, reason, events=events, stop_reason=stop_reason, error=error)))
    finished.append((client, rid))


def context_error(prompt_len: int, max_model_len: int) -> str:
    """vLLM's words (its input processor) for a prompt that leaves no room for one output token."""
    if prompt_len > max_model_len:
        return (f"The decoder prompt (length {prompt_len}) is longer than the maximum model length of "
                f"{max_model_len}. Make sure that `max_model_len` is no smaller than the number of text tokens.")
    return (f"The decoder prompt (length {prompt_len}) plus the number of requested output tokens (at least 1) "
            f"is longer than the maximum model length of {max_model_len}. Make sure that `max_model_len` is no "
            "smaller than the number of text tokens (prompt + requested output tokens).")


class Admission:
    """Admission for one engine. Its collaborators: the engine's args and index, its current
    config and latency model (`config()`, `latency()`: patches and swaps included), the loop's
    count of sleeps (`idle_waits()`), its counters, live requests (by id), scheduler, KV cache,
    KV transfers and clock, and the recorded inputs (`planner`, `replay_table`)."""

    def __init__(self, args: EngineArgs, engine_index: int, *, config: Callable[[], EngineConfig],
                 latency: Callable[[], LatencyModel], idle_waits: Callable[[], int], stats: EngineStats,
                 requests: Mapping[str, Request], scheduler: Scheduler, kv: KVCacheManager, kv_transfer: KVTransfer,
                 clock: Clock, planner: Planner | None = None, replay_table: OutputReplayTable | None = None,
                 token_source_factory: TokenSourceFactory | None = None,
                 textless_ids: frozenset[int] = frozenset()) -> None:
        self.args = args
        self.engine_index = engine_index
        self._config = config
        self._latency = latency
        self._idle_waits = idle_waits
        self._stats = stats
        self._requests = requests
        self._scheduler = scheduler
        self._kv = kv
        self._kv_transfer = kv_transfer
        self._clock = clock
        self.planner = planner
        self.replay_table = replay_table
        self.kv_capacity_tokens = args.kv_cache_size * args.tokens_per_block
        self.token_source_factory = token_source_factory
        self.reasoning = ReasoningConfig.parse(args.reasoning) if args.reasoning else None
        self.failure_rng = random.Random(args.seed ^ (engine_index * 0x9E3779B9))
        self.latency_rng = random.Random(args.seed * 7919 + engine_index)
        self.length_rng = random.Random(f"output-length/{args.seed}/{engine_index}")
        self._length_config: EngineConfig | None = None  # the config the cached length model was built from
        self._length_model: OutputLengthModel | None = None
        self.seq = 0
        avoid = set() if args.eos_token_id is None else {args.eos_token_id}
        if self.reasoning is not None:
            avoid |= {self.reasoning.start_id, self.reasoning.end_id}
        self.avoid_tokens: frozenset[int] = frozenset(avoid)
        self.random_avoid = self.avoid_tokens | textless_ids  # a plain random draw's
        # LoRA adapters' residency (GPU slots, CPU pool) and the loading time not yet charged to a step
        self.lora = LoRAResidency(args.max_loras, max(args.max_cpu_loras, args.max_loras),
                                  args.lora_load_time / args.time_scale,
                                  args.lora_swap_in_time / args.time_scale) if args.max_loras else None
        self.lora_time = 0.0
        # set by a driver whose prompt lists are fresh and never read again (with CountedTokens: no
        # token source reads the prompt): requests extend them instead of a copy (request.py)
        self.adopt_prompts = False

    # --- on arrival ------------------------------------------------------------------------------
    def admit(self, ecr: EngineCoreRequest, now: float, draining: bool, outputs: list,
              finished: list) -> Request | None:
        """The request to queue, or None when it was rejected (its finish output is in `outputs`)."""
        stats = self._stats
        stats.requests_received += 1
        rid, client = ecr.request_id, ecr.client_index
        if rid in self._requests:  # a duplicate must not disturb the live request with the same id
            logger.warning("request %s: duplicate request id, rejected", rid)
            return reject(stats, outputs, finished, client, rid, FinishReason.ERROR)
        err = self.check(ecr)
        if err is None:
            req = self.new_request(ecr, now)
            ktp = req.kv_transfer_params
            if has_handoff_metadata(ktp):
                # registered first, so that a request ended right here still ends its handoff:
                # the other side is told at once (a decoder waiting for this prefill gets ABORT),
                # as when a client leaves mid-way, instead of waiting out the session timeout
                err = self._kv_transfer.admit_handoff(req, ktp)
        if err is None:
            early: tuple[FinishReason, str | None, str] | None = None
            if draining:
                early = (FinishReason.ABORT, None, "requests_aborted")
            elif (failure := self.injected_failure(rid)) is not None:
                early = (failure[0], failure[1], "requests_failed")
            elif req.max_tokens == 0:  # nothing may be generated: LENGTH without running (vLLM's check_stop)
                early = (FinishReason.LENGTH, None, "requests_completed")
            if early is not None:
                self._kv_transfer.end_handoff(rid)
                return reject(stats, outputs, finished, client, rid, early[0], stop_reason=early[1],
                              counter=early[2], events=req.pending_events)
        if err is not None:
            logger.warning("request %s rejected: %s", rid, err)
            return reject(stats, outputs, finished, client, rid, FinishReason.ERROR,
                          error=RequestError("validation_error", err))
        return req

    def check(self, ecr: EngineCoreRequest) -> str | None:
        """Why the engine cannot run this request, or None."""
        sp = ecr.sampling_params
        if sp is None:
            return "request has no sampling_params (pooling is not simulated)"
        if not ecr.prompt_token_ids:
            return "request has no prompt_token_ids (prompt_embeds and multimodal inputs are not simulated)"
        kv = self._kv
        prompt_len = len(ecr.prompt_token_ids)
        if not kv.can_fit(prompt_len + 1):
            return (f"prompt of {prompt_len} tokens needs {kv.blocks_needed(prompt_len + 1)} KV blocks "
                    f"but the cache has {kv.pool.num_blocks}")
        if sp.max_tokens is not None and sp.max_tokens < 0:
            return f"max_tokens must be >= 0, got {sp.max_tokens}"
        cfg = self._config()
        # (a pooling request generates nothing: its prompt may fill the whole context)
        room = 0 if ecr.pooling_params is not None else 1
        if cfg.max_model_len and prompt_len + room > cfg.max_model_len:
            # a patched max_model_len the prompt leaves no room in: vLLM's input check, a failure
            return context_error(prompt_len, cfg.max_model_len)
        if not self.args.enable_chunked_prefill and prompt_len > cfg.max_num_batched_tokens:
            return (f"prompt of {prompt_len} tokens exceeds max_num_batched_tokens {cfg.max_num_batched_tokens} "
                    "and chunked prefill is disabled")
        return None

    def new_request(self, ecr: EngineCoreRequest, now: float) -> Request:
        """The engine's request, with its output budget (max_tokens after the context window, the
        KV capacity, a recorded plan, a modeled EOS and the prefill-worker cap)."""
        args = self.args
        sp = ecr.sampling_params
        prompt_len = len(ecr.prompt_token_ids)
        max_len = self._config().max_model_len or args.advertised_max_model_len
        room = min(max_len, self.kv_capacity_tokens) - prompt_len
        max_tokens = room if sp.max_tokens is None else min(sp.max_tokens, room)
        ktp = ecr.kv_transfer_params or _NO_PARAMS
        remote_decode = bool(ktp.get("do_remote_decode")) or args.worker_type == "prefill"
        plan = self.plan_for(ecr)
        if plan is not None and plan.num_tokens is not None:
            max_tokens = min(plan.num_tokens if plan.overrides_max_tokens else min(max_tokens, plan.num_tokens), room)
        eos_at, without_eos = None, max_tokens
        if plan is None and self.may_end_on_eos(ecr, max_len):
            eos_at = modeled_eos_at(self.draw_output_len(ecr), sp.min_tokens, max_tokens)
            if eos_at is not None:
                max_tokens = eos_at
        if remote_decode:
            max_tokens = min(max_tokens, 1)  # a prefill worker serves only the first token
        self.seq += 1
        req = Request(ecr, sp, max(max_tokens, 0), now, self.seq, self.adopt_prompts, not self._clock.virtual)
        req.planned = plan.token_ids if plan is not None else None
        req.plan = plan
        req.eos_at = eos_at
        if eos_at is not None and not remote_decode:
            req.max_tokens_without_eos = max(without_eos, 0)
        req.remote_decode = remote_decode
        if ktp.get("do_remote_prefill") and not remote_decode:
            req.remote_prefill = ktp
        return req

    def may_end_on_eos(self, ecr: EngineCoreRequest, max_len: int) -> bool:
        """Whether the request's output may end on a modeled EOS: not `ignore_eos`, an EOS id to end
        with (or no limit short of the context), and the engine's own tokens (not constrained)."""
        sp = ecr.sampling_params
        if sp.ignore_eos or sp.structured_outputs is not None:
            return False
        if sp.extra_args and PLANNED_OUTPUT_KEY in sp.extra_args:
            return False
        eos = sp.eos_token_id
        if eos is not None and not can_sample(eos, sp.allowed_token_ids, sp.logit_bias):
            return False  # the request masks its own EOS: only its budget can end it (as in vLLM)
        return eos is not None or sp.max_tokens is None or len(ecr.prompt_token_ids) + sp.max_tokens >= max_len

    def draw_output_len(self, ecr: EngineCoreRequest) -> int | None:
        """An output length from the recording (`--latency-trace`), else from the configured
        distribution (random mode only): per request `seed` when given, from the prompt when greedy,
        else from the engine's own sequence (`--seed`)."""
        n = self._latency().sample_output_len(self.latency_rng)
        if n is not None or self.args.mode != "random":
            return n
        cfg = self._config()
        if cfg is not self._length_config:
            self._length_config, self._length_model = cfg, cfg.output_length_model()
        if self._length_model is None:
            return None
        sp = ecr.sampling_params
        rng = self.length_rng
        if sp.seed is not None:
            rng = random.Random(f"output-length/{sp.seed}")
        elif sp.temperature is not None and sp.temperature < GREEDY_EPS:
            # greedy: the prompt decides (apart from the token draw, which the same hash seeds)
            rng = random.Random(f"output-length/{hash((self.args.seed, tuple(ecr.prompt_token_ids)))}")
        return self._length_model.draw(rng)

    def plan_for(self, ecr: EngineCoreRequest) -> RequestPlan | None:
        """A recorded trace's plan (planner), else the response replay table's planned ids."""
        if self.planner is not None:
            plan = self.planner(ecr)
            if plan is not None:
                return plan
        key = (ecr.sampling_params.extra_args or {}).get("output_replay_id")
        if key is None:
            return None
        if self.replay_table is None:
            logger.warning("request %s asked for output replay id %r but no response replay trace is loaded",
                           ecr.request_id, key)
            return None
        planned = self.replay_table.get(str(key))
        if planned is None:
            logger.warning("request %s: output replay id %r not found in the response replay trace",
                           ecr.request_id, key)
            return None
        return RequestPlan(token_ids=planned, overrides_max_tokens=True)

    def injected_failure(self, rid: str) -> tuple[FinishReason, str | None] | None:
        """--failure-injection-rate: the (finish reason, stop reason) this request fails with, or None."""
        cfg = self._config()
        if cfg.failure_injection_rate <= 0 or self.failure_rng.random() >= cfg.failure_injection_rate:
            return None
        ftype = self.failure_rng.choice(cfg.failure_types)
        if cfg.log_requests:
            logger.info("request %s: injected failure %s", rid, ftype.value)
        return _FAILURE_REASONS[ftype], "repetition_detected" if ftype is FailureType.REPETITION else None

    # --- on first admission by the scheduler ----------------------------------------------------
    def on_admit(self, req: Request, now: float) -> None:
        """Fix the request's pacing and token source (a preempted request keeps both)."""
        if req.pacing is not None:
            return
        args = self.args
        sp = req.sampling_params
        seed = sp.seed
        if seed is None and sp.temperature is not None and sp.temperature < GREEDY_EPS:
            seed = hash((args.seed, tuple(req.prompt_token_ids)))  # greedy: same prompt, same tokens
        # (bytes: random.Random(s) seeds from s.encode(); surrogatepass keeps an id no frontend
        # should let through from killing the engine loop)
        rng_seed = seed if seed is not None else \
            f"{args.seed}/{self.engine_index}/{req.request_id}".encode("utf-8", "surrogatepass")
        pacing: RequestPacing | ScriptedPacing = self._latency().pacing(req.num_prompt_tokens, max(req.num_cached_tokens, 0),
                                        len(self._scheduler.running), self.latency_rng)
        plan = req.plan
        if plan is not None and (plan.ttft is not None or plan.steps is not None):
            pacing = ScriptedPacing(plan, pacing, args.time_scale)
        req.pacing = pacing
        req.chunk = pacing.first_chunk
        ttft = pacing.ttft
        modeled = type(pacing) is RequestPacing
        if modeled and not self._clock.virtual:
            # vLLM counts TTFT from the request's arrival: the server's own delay is inside it
            ttft = max(0.0, ttft - self.server_delay(req, now))
        req.first_due = now + ttft
        if self.lora is not None and req.lora_id:
            self._load_adapter(req)
        req.burstable = modeled and pacing.itl_mean == 0.0 and pacing.itl_std == 0.0
        req.token_source = self._token_source(req, rng_seed)
        if modeled and type(req.token_source) is RandomTokens and pacing.itl_std == 0.0 and not req.pooling:
            req.steady_gap = pacing.itl_mean

    def server_delay(self, req: Request, now: float) -> float:
        """Seconds of the request's TTFT already spent in this server before `now` (the step
        admitting it): the frontend's (parsing, templating, tokenizing, up to the engine's inbox),
        and, when the engine admits it in the same busy run of its loop that received it, the
        engine's own admission work too (the steps that admitted the requests before it). A request
        that waited while the loop slept waited for capacity (a full batch, KV blocks, a pause):
        that queueing adds to its TTFT, as in vLLM."""
        if req.received_in != self._idle_waits() or req.arrival_time <= 0:
            return req.frontend_delay
        # the wall-clock time of `now`: the step started before this admission's own work
        return max(0.0, time.time() - (self._clock.now() - now) - req.arrival_time)

    def _load_adapter(self, req: Request) -> None:
        """Make the request's adapter resident beside the batch's; loading delays its first token
        (untimed) or the step (timed, charged by `take_lora_time`)."""
        batch = {r.lora_id for r in self._scheduler.running if r.lora_id}
        cost = self.lora.activate([*batch, req.lora_id])
        if cost > 0 and self._latency().times_steps:
            self.lora_time += cost
        else:
            req.first_due += cost

    def take_lora_time(self) -> float:
        t, self.lora_time = self.lora_time, 0.0
        return t

    @staticmethod
    def _avoided(base: frozenset[int], req: Request) -> frozenset[int]:
        """base plus the request's stop and EOS ids (no copy of base when they add nothing)."""
        extra = req.stop_ids if req.eos_token_id is None else req.stop_ids | {req.eos_token_id}
        return base if extra <= base else base | extra

    def _token_source(self, req: Request, rng_seed) -> TokenSource:
        args = self.args
        factory = self.token_source_factory
        # the request's own random sequence; a factory marked `rng_free` never reads it, and when it
        # makes the source, none is seeded (it is fresh per request: nothing else could see it)
        rng = None if factory is not None and getattr(factory, "rng_free", False) else seeded_random(rng_seed)
        src = factory(req, rng) if factory is not None else None
        if src is None and rng is None:
            rng = seeded_random(rng_seed)
        if src is not None and req.eos_at is not None:
            # the source writes the whole answer (a tool call read from the prompt) and ends it
            # with its own EOS: a modeled length must not cut it short
            req.eos_at, req.max_tokens = None, req.max_tokens_without_eos
        if src is None and req.planned is not None:
            src = ScriptedTokens(req.planned, RandomTokens(rng, args.vocab_size, self.random_avoid))
        if src is not None:
            return src
        if args.mode == "echo":
            src = EchoTokens(req.prompt_token_ids)
        else:
            sp = req.sampling_params
            if sp.logit_bias or sp.allowed_token_ids:
                src = BiasedTokens(rng, args.vocab_size, self._avoided(self.avoid_tokens, req), req.min_tokens,
                                   sp.logit_bias, sp.allowed_token_ids)
            else:
                avoid = self._avoided(self.random_avoid, req)
                if len(avoid) >= args.vocab_size and avoid.issuperset(range(args.vocab_size)):
                    # every id ends the request (stop_token_ids cover the vocabulary): a model's first
                    # token does; a RandomTokens would find nothing to draw
                    src = ScriptedTokens([int(rng.random() * args.vocab_size)], RandomTokens(rng, args.vocab_size,
                                                                                               frozenset()))
                else:
                    src = RandomTokens(rng, args.vocab_size, avoid)
                    src.draw_ahead(req.max_tokens)  # (the ids are the same whatever it is told)
        if self.reasoning is not None:
            src = ReasoningTokens(src, self.reasoning, req.max_tokens)
        return src
