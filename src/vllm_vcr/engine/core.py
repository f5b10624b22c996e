"""EngineCore: one simulated engine, owned by one asyncio loop.

Everything that changes the engine arrives on its single inbox (add, abort, control call,
shutdown) and is applied between two steps; outputs leave as one `EngineCoreOutputs` batch per
client per step through `output_sink`. Nothing else touches engine state, so the engine needs no
locks, and the same object runs on the real clock (serve, play) or a virtual one (tests, offline
simulation).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import time
from collections import deque
from typing import Any, Callable, Iterable, TypeVar

from .block_hash import make_block_hasher
from .block_pool import BlockHasher, BlockPool, KVEventSink
from .clock import RealClock, VirtualClock
from .config import LATENCY_FIELDS, ConfigError, EngineArgs, EngineConfig, FailureType
from .kv_cache_manager import KVCacheManager
from .kv_transfer import HandoffObserver, TransferQueue, handoff_error, has_handoff_metadata, prefill_side_params
from .latency import KnobLatency, LatencyModel, RequestPacing
from .plan import Planner, RequestPlan, ScriptedPacing
from .replay_table import ResponseReplayTable
from .request import Request, RequestStatus
from .scheduler import DECODE, DUE_SLACK, TRANSFER, Scheduler
from .stats import EngineStats
from .step_timing import StepTimer, is_step_model
from .tokens import EchoTokens, RandomTokens, ReasoningConfig, ReasoningTokens, ScriptedTokens, TokenSource
from .types import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    PrefillStats,
    RequestError,
    SchedulerStats,
)

logger = logging.getLogger("vllm_vcr.engine")
T = TypeVar("T")
TRACE_LEVEL = 5  # below DEBUG, like tracing's `trace` (the control API's PUT /log can enable it)
BUSY_SLICE = 0.002  # longest run of back-to-back steps before the loop lets I/O in (their outputs merge)
MAX_BURST = 8  # zero-latency decode steps run as one (see EngineCore._burst)
OutputSink = Callable[[int, EngineCoreOutputs], None]

_FAILURE_REASONS = {
    FailureType.ERROR: FinishReason.ERROR,
    FailureType.LENGTH: FinishReason.LENGTH,
    FailureType.REPETITION: FinishReason.REPETITION,
}


class LatencyTraceActive(Exception):
    """A latency knob was patched while a recorded trace paces requests (control API: 409)."""


class EngineDeadError(RuntimeError):
    """The engine loop is gone (control API: 500)."""


class EngineCore:
    def __init__(self, args: EngineArgs, *, engine_index: int = 0, clock: RealClock | VirtualClock | None = None,
                 output_sink: OutputSink | None = None, latency: LatencyModel | None = None,
                 block_hasher: BlockHasher | None = None, kv_events: KVEventSink | None = None,
                 token_source_factory: Callable[[Request, random.Random], TokenSource | None] | None = None,
                 replay_table: ResponseReplayTable | None = None, planner: Planner | None = None,
                 on_kv_pulled: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.args = args
        self.engine_index = engine_index
        self.clock = clock or RealClock()
        self.output_sink = output_sink or (lambda client, outs: None)
        self._config = args.config
        if latency is None and args.latency_trace:
            latency = _load_input("--latency-trace", _shared_trace_latency, args.latency_trace, args.time_scale)
        self.latency: LatencyModel = latency or KnobLatency(self._config, args.time_scale)
        # a step-time model runs the engine step by step (step_timing.py) instead of by deadlines
        self.step_timer = StepTimer(self, self.latency) if is_step_model(self.latency) else None
        self.block_pool = BlockPool(args.kv_cache_size, args.tokens_per_block, args.enable_prefix_caching, kv_events)
        self.kv = KVCacheManager(self.block_pool, block_hasher or make_block_hasher(args.prefix_caching_hash_algo))
        self.scheduler = Scheduler(lambda: self._config, self.kv, args.scheduling_policy,
                                   args.long_prefill_token_threshold)
        self.scheduler.on_admit = self._on_admit
        self.scheduler.on_preempt = self._on_preempt
        self.scheduler.chunked_prefill = args.enable_chunked_prefill
        self.replay_table = replay_table
        if planner is None and (args.replay_tokens or args.replay_steps):
            planner = _load_input("--replay-tokens/--replay-steps", _shared_trace_planner, args.replay_tokens,
                                  args.replay_steps, args.replay_match, args.tokens_per_block)
        self.planner = planner
        if replay_table is None and args.response_replay_trace:
            self.replay_table = _load_input("--response-replay-trace", _shared_replay_table,
                                            args.response_replay_trace)
        self.reasoning = ReasoningConfig.parse(args.reasoning) if args.reasoning else None
        # P/D: KV pulls in flight (decode side) and blocks held for pullers (prefill side)
        self.transfers = TransferQueue(args.kv_transfer_bandwidth * 1e9 * args.time_scale)
        self.kv_holds: dict[str, tuple[Request, float]] = {}
        self.on_kv_pulled = on_kv_pulled
        self._kv_events: tuple[KVEventSink, Callable[[list, float], Any]] | None = None
        # bootstrap handoffs: the network side (pd/) is told about them; decode requests in
        # _kv_waits have their blocks but start pulling only once kv_ready() says the KV is there
        self.handoff: HandoffObserver | None = None
        self.handoffs: set[str] = set()
        self._kv_waits: set[str] = set()
        self.token_source_factory = token_source_factory
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._failure_rng = random.Random(args.seed ^ (engine_index * 0x9E3779B9))
        self._latency_rng = random.Random(args.seed * 7919 + engine_index)
        self._seq = 0
        self._step_counter = 0
        self._inbox: deque[tuple] = deque()
        self._waiter: asyncio.Future | None = None
        self._draining_deadline: float | None = None
        self._frozen_at: float | None = None
        self._stopped = False
        self.dead: BaseException | None = None
        avoid = set() if args.eos_token_id is None else {args.eos_token_id}
        if self.reasoning is not None:
            avoid |= {self.reasoning.start_id, self.reasoning.end_id}
        self._avoid_tokens: frozenset[int] = frozenset(avoid)
        self.kv_capacity_tokens = args.kv_cache_size * args.tokens_per_block

    # --- inbox (the only way in) ------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        self._post(("add", request))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self._post(("abort", list(request_ids)))

    def abort_all(self) -> None:
        """Abort every request, each with a final ABORT output (vLLM's pause/sleep mode "abort")."""
        self._post(("abort_all",))

    def call(self, fn: Callable[["EngineCore"], T]) -> "asyncio.Future[T]":
        """Run fn(core) between two steps; the result (or exception) arrives on the future."""
        fut = asyncio.get_running_loop().create_future()
        if self.dead is not None or self._stopped:
            fut.set_exception(EngineDeadError(f"engine {self.engine_index} loop is gone"))
        else:
            self._post(("call", fn, fut))
        return fut

    def attach_kv_events(self, collector: KVEventSink, publish: Callable[[list, float], Any]) -> None:
        """Collect BlockStored/BlockRemoved/AllBlocksCleared and hand them to `publish` once per step.

        `publish(events, wall_time)` must not block (the KV events publisher queues them)."""
        self.block_pool.events = collector
        self._kv_events = (collector, publish)

    def set_frozen(self, frozen: bool) -> None:
        """Stop (or restart) scheduling while keeping every request in place (vLLM's pause "keep").

        Deadlines move by the frozen time, so requests resume at their own pace without a burst."""
        self._post(("freeze", frozen))

    def release_kv_hold(self, request_id: str) -> None:
        """The decode side has pulled this prefill's KV: free its held blocks."""
        self._post(("release_kv", request_id))

    def kv_ready(self, request_id: str, error: str | None = None) -> None:
        """A deferred pull may start (the prefill side's KV is complete), or fails with `error`."""
        self._post(("kv_ready", request_id, error))

    def shutdown(self, timeout: float | None = None) -> None:
        self._post(("shutdown", self.args.shutdown_timeout if timeout is None else timeout))

    def _post(self, msg: tuple) -> None:
        self._inbox.append(msg)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # --- control helpers (run inside call()) ---------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def latency_source_is_knob(self) -> bool:
        return bool(getattr(self.latency, "is_knob", False))

    def patch_config(self, patch: dict[str, Any]) -> EngineConfig:
        """Apply a validated patch at this step boundary; new requests see it, in-flight keep theirs."""
        if not self.latency_source_is_knob and any(k in LATENCY_FIELDS for k in patch):
            raise LatencyTraceActive("latency knobs cannot be patched while a latency trace paces requests")
        new = self._config.patched(patch)
        self._config = new
        if self.latency_source_is_knob:
            self.latency = KnobLatency(new, self.args.time_scale)
        elif hasattr(self.latency, "config"):
            self.latency.config = new
        return new

    def current_stats(self) -> EngineStats:
        s = self.stats
        s.running = len(self.scheduler.running)
        s.waiting = len(self.scheduler.waiting)
        return EngineStats(**{f: getattr(s, f) for f in s.__struct_fields__})

    def reset_stats(self) -> None:
        # requests still in flight finish inside the new window: counting them as received there
        # keeps received == completed + failed + aborted once idle
        self.stats = EngineStats(requests_received=len(self.requests))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # --- loop ------------------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        clock = self.clock
        last_yield = clock.now()
        try:
            while True:
                if self._inbox:
                    self._process_inbox()
                if self._stopped:
                    break
                now = clock.now()
                self.step(now)
                if self._stopped:
                    break
                if self._inbox:
                    continue
                wake = self._next_wake()
                if wake is None:
                    self._waiter = loop.create_future()
                    await self._waiter
                    self._waiter = None
                    last_yield = clock.now()
                    continue
                if wake <= clock.now():
                    # back-to-back steps (zero latency or catching up): yield to I/O every
                    # BUSY_SLICE so outputs coalesce instead of costing a wake-up per token
                    if clock.now() - last_yield >= BUSY_SLICE:
                        await asyncio.sleep(0)
                        last_yield = clock.now()
                    continue
                if clock.virtual:
                    await asyncio.sleep(0)
                    if not self._inbox:
                        clock.advance_to(wake)
                    continue
                self._waiter = loop.create_future()
                handle = loop.call_later(wake - clock.now(), _wake_up, self._waiter)
                await self._waiter
                handle.cancel()
                self._waiter = None
                last_yield = clock.now()
        except BaseException as e:
            self.dead = e
            if not isinstance(e, asyncio.CancelledError):
                logger.exception("engine %d loop died", self.engine_index)
            raise
        finally:
            self._stopped = True
            self._fail_pending_calls()

    def run_until_idle(self, until: float | None = None, max_steps: int = 1_000_000) -> None:
        """Synchronous driver for the virtual clock: process inputs and steps, jumping time."""
        assert isinstance(self.clock, VirtualClock), "run_until_idle needs a VirtualClock"
        for _ in range(max_steps):
            if self._inbox:
                self._process_inbox()
            if self._stopped:
                return
            self.step(self.clock.now())
            if self._inbox:
                continue
            wake = self._next_wake()
            if wake is None or (until is not None and wake > until):
                if until is not None:
                    self.clock.advance_to(until)
                return
            self.clock.advance_to(wake)
        raise RuntimeError("engine did not become idle")

    def _next_wake(self) -> float | None:
        if self._frozen_at is not None:
            return self._draining_deadline
        if self.step_timer is not None:
            return self.step_timer.next_wake()
        sched = self.scheduler
        if sched.has_immediate_work():
            return self.clock.now()
        wake = sched.next_deadline()
        for t in (self._draining_deadline, self.transfers.next_completion(),
                  min((d for _, d in self.kv_holds.values()), default=None)):
            if t is not None and (wake is None or t < wake):
                wake = t
        return wake

    def _fail_pending_calls(self) -> None:
        while self._inbox:
            msg = self._inbox.popleft()
            if msg[0] == "call" and not msg[2].done():
                msg[2].set_exception(EngineDeadError(f"engine {self.engine_index} loop is gone"))

    def _process_inbox(self) -> None:
        outputs: list[EngineCoreOutput] = []
        finished: list[str] = []
        freed = False
        while self._inbox:
            msg = self._inbox.popleft()
            kind = msg[0]
            if kind == "add":
                self._handle_add(msg[1], outputs, finished)
            elif kind == "abort":
                self._handle_abort(msg[1], finished)
            elif kind == "call":
                fut = msg[2]
                try:
                    result = msg[1](self)
                except Exception as e:  # the caller gets the error; the engine goes on
                    if not fut.done():
                        fut.set_exception(e)
                else:
                    if not fut.done():
                        fut.set_result(result)
            elif kind == "shutdown":
                self._begin_shutdown(msg[1], outputs, finished)
            elif kind == "freeze":
                self._freeze(msg[1])
            elif kind == "abort_all":
                self._abort_all(outputs, finished, self.clock.now())
            elif kind == "release_kv":
                freed = self._release_hold(msg[1]) or freed
            elif kind == "kv_ready":
                self._handle_kv_ready(msg[1], msg[2], outputs, finished)
        if outputs or finished or freed:  # freed blocks: a stats-only batch keeps kv_cache_usage current
            self._emit(outputs, finished, with_stats=True)
        if self._kv_events is not None:
            self._flush_kv_events()

    # --- arrival ---------------------------------------------------------------------------------
    def _handle_add(self, ecr: EngineCoreRequest, outputs: list, finished: list) -> None:
        stats = self.stats
        stats.requests_received += 1
        now = self.clock.now()
        rid = ecr.request_id
        if rid in self.requests:
            # a duplicate must not disturb the live request with the same id
            logger.warning("request %s: duplicate request id, rejected", rid)
            stats.requests_failed += 1
            outputs.append((ecr.client_index, self._finish_output(rid, FinishReason.ERROR, now)))
            finished.append((ecr.client_index, rid))
            return
        sp = ecr.sampling_params
        err = None
        if sp is None:
            err = "request has no sampling_params (pooling is not simulated)"
        elif not ecr.prompt_token_ids:
            err = "request has no prompt_token_ids (prompt_embeds and multimodal inputs are not simulated)"
        cfg = self._config
        prompt_len = len(ecr.prompt_token_ids or ())
        if err is None and not self.kv.can_fit(prompt_len + 1):
            err = (f"prompt of {prompt_len} tokens needs {self.kv.blocks_needed(prompt_len + 1)} KV blocks "
                   f"but the cache has {self.block_pool.num_blocks}")
        if err is None and sp.max_tokens is not None and sp.max_tokens < 0:
            err = f"max_tokens must be >= 0, got {sp.max_tokens}"
        if err is None and not self.args.enable_chunked_prefill and prompt_len > cfg.max_num_batched_tokens:
            err = (f"prompt of {prompt_len} tokens exceeds max_num_batched_tokens {cfg.max_num_batched_tokens} "
                   "and chunked prefill is disabled")
        self._seq += 1
        if err is not None:
            logger.warning("request %s rejected: %s", rid, err)
            stats.requests_failed += 1
            outputs.append((ecr.client_index, self._finish_output(rid, FinishReason.ERROR, now, error_message=err)))
            finished.append((ecr.client_index, rid))
            return
        max_len = cfg.max_model_len or self.args.advertised_max_model_len
        room = min(max_len, self.kv_capacity_tokens) - prompt_len
        max_tokens = room if sp.max_tokens is None else min(sp.max_tokens, room)
        ktp = ecr.kv_transfer_params or {}
        remote_decode = bool(ktp.get("do_remote_decode")) or self.args.worker_type == "prefill"
        plan = self._plan_for(ecr, sp)
        planned = plan.token_ids if plan is not None else None
        if plan is not None and plan.num_tokens is not None:
            max_tokens = min(plan.num_tokens if plan.overrides_max_tokens else min(max_tokens, plan.num_tokens), room)
        eos_at = None
        if plan is None and hasattr(self.latency, "sample_output_len"):
            open_ended = sp.max_tokens is None or prompt_len + sp.max_tokens >= max_len
            if open_ended or (sp.eos_token_id is not None and not sp.ignore_eos):
                n = self.latency.sample_output_len(self._latency_rng)
                if n is not None and n < max_tokens:  # the recording says it would have stopped here
                    max_tokens = eos_at = max(n, sp.min_tokens, 1)
        if remote_decode:
            max_tokens = min(max_tokens, 1)  # a prefill worker serves only the first token
        req = Request(ecr, sp, max(max_tokens, 0), now, self._seq)
        req.planned = planned
        req.plan = plan
        req.eos_at = eos_at
        req.remote_decode = remote_decode
        if ktp.get("do_remote_prefill") and not remote_decode:
            req.remote_prefill = ktp
        if self._draining_deadline is not None:
            stats.requests_aborted += 1
            outputs.append((req.client_index, self._finish_output(rid, FinishReason.ABORT, now, events=req.pending_events)))
            finished.append((req.client_index, rid))
            return
        if cfg.failure_injection_rate > 0 and self._failure_rng.random() < cfg.failure_injection_rate:
            ftype = self._failure_rng.choice(cfg.failure_types)
            stats.requests_failed += 1
            if cfg.log_requests:
                logger.info("request %s: injected failure %s", rid, ftype.value)
            outputs.append((req.client_index, self._finish_output(
                rid, _FAILURE_REASONS[ftype], now, events=req.pending_events,
                stop_reason="repetition_detected" if ftype is FailureType.REPETITION else None)))
            finished.append((req.client_index, rid))
            return
        if room <= 0 or req.max_tokens == 0:
            # nothing may be generated: finish LENGTH without running (vLLM's check_stop)
            stats.requests_completed += 1
            outputs.append((req.client_index, self._finish_output(rid, FinishReason.LENGTH, now, events=req.pending_events)))
            finished.append((req.client_index, rid))
            return
        if has_handoff_metadata(ktp):
            err = self._admit_handoff(req, ktp)
            if err is not None:
                logger.warning("request %s rejected: %s", rid, err)
                stats.requests_failed += 1
                outputs.append((req.client_index, self._finish_output(rid, FinishReason.ERROR, now, error_message=err)))
                finished.append((req.client_index, rid))
                return
        self.requests[rid] = req
        self.scheduler.add_waiting(req)
        if self.step_timer is not None:
            self.step_timer.on_arrival(req, now)
        if cfg.log_requests:
            logger.info("request %s queued: prompt=%d max_tokens=%d", rid, prompt_len, req.max_tokens)
        if ecr.abort_immediately:
            self._handle_abort([rid], finished)

    def _plan_for(self, ecr: EngineCoreRequest, sp) -> RequestPlan | None:
        """A recorded trace's plan (planner), else the response replay table's planned ids."""
        if self.planner is not None:
            plan = self.planner(ecr)
            if plan is not None:
                return plan
        key = (sp.extra_args or {}).get("output_replay_id")
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

    def _admit_handoff(self, req: Request, params: dict[str, Any]) -> str | None:
        """Validate a request's handoff metadata and register it with the network side."""
        wt = self.args.worker_type
        err = handoff_error(wt, params)
        if err is not None or params.get("handoff_id") is None:
            return err
        if self.handoff is None:
            return "source handoff manager is not initialized" if wt == "prefill" else \
                "bootstrap client is not initialized"
        err = self.handoff.arrived(self, req.request_id, params)
        if err is not None:
            return err
        self.handoffs.add(req.request_id)
        if wt == "decode":
            req.remote_prefill = params
            self._kv_waits.add(req.request_id)
        return None

    def _end_handoff(self, request_id: str) -> None:
        if request_id in self.handoffs:
            self.handoffs.discard(request_id)
            self._kv_waits.discard(request_id)
            if self.handoff is not None:
                self.handoff.ended(self, request_id)

    def _handle_kv_ready(self, rid: str, error: str | None, outputs: list, finished: list) -> None:
        if rid not in self._kv_waits:
            return  # finished, aborted, or never deferred
        self._kv_waits.discard(rid)
        req = self.requests.get(rid)
        if req is None:
            return
        now = self.clock.now()
        if error is not None:
            logger.warning("request %s: KV handoff failed: %s", rid, error)
            self.requests.pop(rid, None)
            self.scheduler.remove(req)
            req.status = RequestStatus.FINISHED
            self.stats.requests_failed += 1
            out = self._finish_output(rid, FinishReason.ERROR, now, events=req.pending_events)
            out.error = RequestError("kv_transfer_failed", error)
            outputs.append((req.client_index, out))
            finished.append((req.client_index, rid))
            self._end_handoff(rid)
        elif req.status is RequestStatus.RUNNING and not req.transferring and not req.output_token_ids:
            self._start_pull(req, now)  # admitted earlier, its blocks were waiting for this
        # still queued: admission starts the pull

    def _start_pull(self, req: Request, now: float) -> None:
        req.transferring = True
        self.transfers.start(req.request_id, req.external_tokens * self.args.kv_bytes_per_token, now)

    def _on_preempt(self, req: Request, now: float) -> None:
        if req.transferring:
            self.transfers.cancel(req.request_id, now)
            req.transferring = False

    def _release_hold(self, request_id: str) -> bool:
        entry = self.kv_holds.pop(request_id, None)
        if entry is None:
            return False
        self.kv.free(entry[0])
        self.scheduler.admission_blocked = False
        self._end_handoff(request_id)
        return True

    def _on_admit(self, req: Request, now: float) -> None:
        if req.pacing is not None:
            return  # pacing is fixed at the first admission; a preempted request keeps it
        seed = req.sampling_params.seed
        rng = random.Random(seed if seed is not None else f"{self.args.seed}/{self.engine_index}/{req.request_id}")
        req.pacing = self.latency.pacing(req.num_prompt_tokens, max(req.num_cached_tokens, 0),
                                         len(self.scheduler.running), self._latency_rng)
        plan = req.plan
        if plan is not None and (plan.ttft is not None or plan.steps is not None):
            req.pacing = ScriptedPacing(plan, req.pacing, self.args.time_scale)
        req.chunk = req.pacing.first_chunk
        req.first_due = now + req.pacing.ttft
        p = req.pacing
        req.burstable = type(p) is RequestPacing and p.itl_mean == 0.0 and p.itl_std == 0.0
        src = self.token_source_factory(req, rng) if self.token_source_factory else None
        if src is None and req.planned is not None:
            src = ScriptedTokens(req.planned, RandomTokens(rng, self.args.vocab_size, self._avoid_tokens))
        if src is None:
            if self.args.mode == "echo":
                src = EchoTokens(req.prompt_token_ids)
            else:
                avoid = self._avoid_tokens | req.stop_ids
                if req.eos_token_id is not None:
                    avoid = avoid | {req.eos_token_id}
                src = RandomTokens(rng, self.args.vocab_size, avoid)
            if self.reasoning is not None:
                src = ReasoningTokens(src, self.reasoning, req.max_tokens)
        req.token_source = src

    # --- abort / shutdown ------------------------------------------------------------------------
    def _handle_abort(self, request_ids: list[str], finished: list[str]) -> None:
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue  # unknown or already finished: aborts are idempotent
            self.scheduler.remove(req)
            req.status = RequestStatus.FINISHED
            self.stats.requests_aborted += 1
            finished.append((req.client_index, rid))
            self._end_handoff(rid)
            if self._config.log_requests:
                logger.info("request %s aborted", rid)

    def _begin_shutdown(self, timeout: float, outputs: list, finished: list) -> None:
        now = self.clock.now()
        if timeout > 0 and self._draining_deadline is None:
            self._draining_deadline = now + timeout
            logger.info("engine %d draining %d requests for up to %.1fs", self.engine_index, len(self.requests), timeout)
            if not self.requests:
                self._stopped = True
            return
        self._abort_all(outputs, finished, now)
        self._stopped = True

    def _abort_all(self, outputs: list, finished: list, now: float) -> None:
        for rid, req in list(self.requests.items()):
            self.scheduler.remove(req)
            req.status = RequestStatus.FINISHED
            self.stats.requests_aborted += 1
            outputs.append((req.client_index, self._finish_output(rid, FinishReason.ABORT, now,
                                                                  events=req.pending_events or None)))
            finished.append((req.client_index, rid))
            self._end_handoff(rid)
        self.requests.clear()

    # --- the step ----------------------------------------------------------------------------------
    def step(self, now: float) -> None:
        """Schedule and execute one step at `now`; emits at most one batch per client."""
        self._step(now)
        if self._kv_events is not None:
            self._flush_kv_events()

    def _flush_kv_events(self) -> None:
        collector, publish = self._kv_events
        if len(collector):
            publish(collector.drain(), self.clock.now() if self.clock.virtual else time.time())

    def _freeze(self, frozen: bool) -> None:
        now = self.clock.now()
        if frozen:
            if self._frozen_at is None:
                self._frozen_at = now
            return
        if self._frozen_at is None:
            return
        delta, self._frozen_at = now - self._frozen_at, None
        self.scheduler.shift_deadlines(delta)
        if self.step_timer is not None:
            self.step_timer.shift(delta)
        for req in self.requests.values():
            if not req.output_token_ids:
                req.first_due += delta

    @property
    def frozen(self) -> bool:
        return self._frozen_at is not None

    def _step(self, now: float) -> None:
        if self._draining_deadline is not None and now >= self._draining_deadline:
            outputs: list[EngineCoreOutput] = []
            finished: list[str] = []
            self._abort_all(outputs, finished, now)
            self._emit(outputs, finished, with_stats=True)
            self._stopped = True
            return
        if self._frozen_at is not None:
            return  # paused in place: nothing is scheduled or emitted
        sched = self.scheduler
        expired = False
        if self.kv_holds:
            for rid in [rid for rid, (_, deadline) in self.kv_holds.items() if deadline <= now]:
                logger.warning("request %s: KV hold expired before the decode side pulled it", rid)
                expired = self._release_hold(rid) or expired
        pulled = self.transfers.pop_done(now) if self.transfers.remaining else ()
        if self.step_timer is not None:
            self.step_timer.step(now, pulled, expired)
            return
        scheduled = sched.schedule(now)
        if scheduled and logger.isEnabledFor(TRACE_LEVEL):
            logger.log(TRACE_LEVEL, "engine %d step %d: %s; running=%d waiting=%d kv_usage=%.3f", self.engine_index,
                       self._step_counter + 1, " ".join(f"{r.request_id}:{n}" for r, n, _ in scheduled),
                       len(sched.running), len(sched.waiting), self.block_pool.usage())
        if not scheduled and not pulled:
            if expired:
                self._emit([], [], with_stats=True)
            return
        self._step_counter += 1
        kv = self.kv
        outputs = []
        finished = []
        push = sched.push_decode
        for rid in pulled:
            req = self.requests.get(rid)
            if req is None or not req.transferring:
                continue
            req.transferring = False
            req.num_computed_tokens += req.external_tokens
            kv.cache_computed_blocks(req)
            req.first_due = now
            if self.on_kv_pulled is not None:
                self.on_kv_pulled(req.remote_prefill)
            self._sample(req, now, outputs, finished)
        block_size = kv.block_size
        burst = self._burst(scheduled) if not pulled else 1
        if burst > 1:
            self._step_counter += burst - 1
        for req, n, kind in scheduled:
            if kind == DECODE:
                if n:
                    req.num_computed_tokens += n
                    if req.num_computed_tokens // block_size > req.num_hashed_blocks:
                        kv.cache_computed_blocks(req)
                self._sample(req, now, outputs, finished, burst)
                continue
            if kind == TRANSFER:
                req.external_tokens = n
                if req.request_id not in self._kv_waits:  # a deferred pull starts on kv_ready()
                    self._start_pull(req, now)
                continue
            # prefill chunk
            req.num_computed_tokens += n
            kv.cache_computed_blocks(req)
            if req.is_prefilling:
                continue
            if not req.output_token_ids:
                if req.first_due <= now + DUE_SLACK:
                    self._sample(req, now, outputs, finished)
                else:
                    push(req, req.first_due)
            else:  # resumed after preemption: continue on its own schedule
                push(req, max(req.next_due, now))
        if outputs or finished:
            self._emit(outputs, finished, with_stats=True)
        if self._draining_deadline is not None and not self.requests:
            self._stopped = True

    def _burst(self, scheduled: list) -> int:
        """How many zero-latency decode steps this step runs at once (1: just this one).

        When every running request decodes with no gap between tokens and nothing else can enter
        before the next step (no waiting request, prefill, transfer, hold or drain deadline), the
        next steps happen at this same instant with the same batch: emitting k tokens per request
        now is what k steps would emit, in one output instead of k. The next step computes the
        k tokens (as after a recorded chunk), so k is capped by the token budget, and bursts
        stop while free KV blocks could not cover them (preemption stays step by step)."""
        sched = self.scheduler
        n = len(scheduled)
        if n != len(sched.running) or sched.waiting or self.kv_holds or self.transfers.remaining \
                or self._draining_deadline is not None:
            return 1
        for req, _, kind in scheduled:
            if kind != DECODE or not req.burstable or not req.output_token_ids:
                return 1  # (the first token is emitted on its own, as after a prefill)
        k = min(MAX_BURST, self._config.max_num_batched_tokens // n)
        if k < 2 or self.block_pool.num_free_blocks < n * (self.kv.blocks_needed(k) + 1):
            return 1
        return k

    def _sample(self, req: Request, now: float, outputs: list, finished: list, burst: int = 1) -> None:
        """Append this step's token(s) (one, a recorded chunk or a zero-latency burst), check stop
        conditions, emit."""
        idx = len(req.output_token_ids)
        reason = None
        stop_reason = None
        max_len = self._config.max_model_len
        source = req.token_source
        out_ids = req.output_token_ids
        all_ids = req.all_token_ids
        count = burst if burst > 1 else req.chunk
        if type(source) is RandomTokens:  # never an EOS or stop id: only the length ends it
            limit = req.max_tokens - idx
            if max_len:
                limit = min(limit, max_len - len(all_ids))
            k = max(min(count, limit), 1)
            new = source.take(k)
            out_ids += new
            all_ids += new
            if k >= limit:
                reason = self._length_end(req, idx + k, new)
        else:
            new = []
            for i in range(idx, idx + count):
                tok = source.next_token(i)
                new.append(tok)
                out_ids.append(tok)
                all_ids.append(tok)
                num_out = i + 1
                if num_out >= req.max_tokens or (max_len and len(all_ids) >= max_len):
                    reason = self._length_end(req, num_out, new)
                    break
                if num_out >= req.min_tokens:
                    if tok == req.eos_token_id:
                        reason = FinishReason.STOP
                        break
                    if tok in req.stop_ids:
                        reason = FinishReason.STOP
                        stop_reason = tok
                        break
        out = EngineCoreOutput(request_id=req.request_id, new_token_ids=new)
        if req.pending_events:
            out.events = req.pending_events
            req.pending_events = []
        if not req.prefill_stats_sent:
            req.prefill_stats_sent = True
            local = max(req.num_cached_tokens, 0)
            external = req.external_tokens
            out.prefill_stats = PrefillStats(
                num_prompt_tokens=req.num_prompt_tokens,
                num_computed_tokens=req.num_prompt_tokens - local - external,
                num_cached_tokens=local + external, num_local_cached_tokens=local,
                num_external_cached_tokens=external, num_cache_creation_tokens=req.num_prompt_tokens - local)
            if req.trace_headers:
                out.trace_headers = req.trace_headers
        if reason is not None:
            out.finish_reason = reason
            out.stop_reason = stop_reason
            if req.remote_decode:
                out.kv_transfer_params = self._hold_for_decode(req, now)
            self._finish(req)
            finished.append((req.client_index, req.request_id))
        else:
            pacing = req.pacing
            if pacing.itl_std == 0.0:  # the common case, kept cheap
                gap = pacing.itl_mean
            else:
                gap, req.chunk = pacing.next_step()
            base = req.first_due if idx == 0 else req.next_due
            self.scheduler.push_decode(req, base + gap)
        outputs.append((req.client_index, out))

    def _length_end(self, req: Request, num_out: int, new: list[int]) -> FinishReason:
        """Why a request that reached its length ends: LENGTH, the recording's own ending, or a
        modeled EOS (whose id replaces the last token, as a model would emit it)."""
        plan = req.plan
        if plan is not None and plan.finish_reason is not None and num_out >= (plan.num_tokens or 0):
            return plan.finish_reason
        if req.eos_at is not None and num_out >= req.eos_at:
            if req.eos_token_id is not None:
                new[-1] = req.output_token_ids[-1] = req.all_token_ids[-1] = req.eos_token_id
            return FinishReason.STOP
        return FinishReason.LENGTH

    def _hold_for_decode(self, req: Request, now: float) -> dict[str, Any]:
        a = self.args
        self.kv_holds[req.request_id] = (req, now + a.kv_hold_timeout / a.time_scale)
        params = prefill_side_params(req.request_id, [b.block_id for b in req.blocks], a.engine_id,
                                     a.side_channel_host, a.side_channel_port + self.engine_index,
                                     request_params=req.kv_transfer_params)
        if req.request_id in self.handoffs and self.handoff is not None:
            self.handoff.prefilled(self, req.request_id, params)
        return params

    def _finish(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        held = req.request_id in self.kv_holds
        self.scheduler.remove(req, free_blocks=not held)
        req.status = RequestStatus.FINISHED
        if not held:
            self._end_handoff(req.request_id)
        self.stats.requests_completed += 1
        if self._config.log_requests:
            logger.info("request %s finished: %d tokens", req.request_id, req.num_output_tokens)

    # --- outputs -----------------------------------------------------------------------------------
    def _finish_output(self, rid: str, reason: FinishReason, now: float, *, events=None, stop_reason=None,
                       error_message: str | None = None) -> EngineCoreOutput:
        err = RequestError("validation_error", error_message) if error_message else None
        return EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason=reason, stop_reason=stop_reason,
                                events=events or None, error=err)

    def scheduler_stats(self) -> SchedulerStats:
        sched = self.scheduler
        n_pre, sched.num_preemptions = sched.num_preemptions, 0
        return SchedulerStats(
            num_running_reqs=len(sched.running), num_waiting_reqs=len(sched.waiting),
            step_counter=self._step_counter, kv_cache_usage=self.block_pool.usage(),
            prefix_cache_stats=sched.take_prefix_stats(), num_preemptions=n_pre)

    def _emit(self, outputs: list[tuple[int, EngineCoreOutput]], finished: list[tuple[int, str]],
              with_stats: bool) -> None:
        """Send this step's outputs, one batch per client; scheduler stats ride on the first."""
        ts = self.clock.now()
        stats = self.scheduler_stats() if with_stats else None
        by_client: dict[int, tuple[list[EngineCoreOutput], list[str]]] = {}
        for client, o in outputs:
            by_client.setdefault(client, ([], []))[0].append(o)
        for client, rid in finished:
            by_client.setdefault(client, ([], []))[1].append(rid)
        if not by_client:
            by_client[0] = ([], [])
        sink = self.output_sink
        for client, (outs, fin) in by_client.items():
            sink(client, EngineCoreOutputs(engine_index=self.engine_index, outputs=outs, scheduler_stats=stats,
                                           timestamp=ts, finished_requests=fin or None))
            stats = None


def _wake_up(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _load_input(flag: str, loader: Callable[..., T], *args: Any) -> T:
    """Load a start-up input file; a bad one is a ConfigError that names its flag."""
    try:
        return loader(*args)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag}: {e}") from None


@functools.lru_cache(maxsize=8)
def _shared_replay_table(path: str) -> ResponseReplayTable:
    return ResponseReplayTable.from_path(path)


@functools.lru_cache(maxsize=8)
def _shared_trace_planner(tokens: str | None, steps: str | None, match: str, block_size: int):
    # one planner per trace for every engine of the process: consume-once matching stays global
    from ..trace.replay import build_planner

    return build_planner(tokens, steps, match, block_size)


@functools.lru_cache(maxsize=8)
def _shared_trace_latency(path: str, time_scale: float):
    """The latency model of `--latency-trace`: the step-time model (step-composed timing) for an
    engine tap trace, the cell model otherwise or with VLLM_VCR_LATENCY_MODEL=cells.

    VLLM_VCR_LATENCY_MODEL: "steps" / "cells" force a model; hidden, for the fidelity benchmark
    (bench/fidelity): "fit" = the §3.2 port, "cells-v0" / "cells-v1" = the cell model's earlier draws."""
    which = os.environ.get("VLLM_VCR_LATENCY_MODEL", "").strip()
    if which == "fit":
        from ..trace.latency_fit import TraceLatency as Fit

        return Fit.from_path(path, time_scale)
    from ..trace.io import read_trace
    from ..trace.latency_model import TraceLatency
    from ..trace.schema import SOURCE_TAP
    from ..trace.step_model import StepLatency

    if which == "steps":
        return StepLatency.from_path(path, time_scale)
    if which == "cells-v0":
        return TraceLatency.from_path(path, time_scale, ttft_tail="local", decode_runs=False)
    if which == "cells-v1":
        return TraceLatency.from_path(path, time_scale, decode_runs=False)
    trace = read_trace(path)
    if which != "cells" and trace.meta is not None and trace.meta.source == SOURCE_TAP:
        try:
            return StepLatency(trace.records, time_scale)
        except ValueError as e:
            logger.warning("--latency-trace %s: %s; using the cell model", path, e)
    return TraceLatency(trace.records, time_scale)
