"""EngineCore: one simulated engine, owned by one asyncio loop.

Everything that changes the engine arrives on its single inbox (add, abort, control call,
shutdown) and is applied between two steps; outputs leave as one `EngineCoreOutputs` batch per
client per step through `output_sink`. Nothing else touches engine state (but the DP ranks it
steps in lockstep with, lockstep.py, in the same loop), so the engine needs no locks, and the same
object runs on the real clock (serve, play) or a virtual one (tests, offline simulation).

A step: schedule (scheduler.py), time it (the latency model's timing interface,
latency/base.py), apply its work and sample its tokens (`update_from_output`, output.py).
Admission is in admission.py, P/D state in kv_transfer.py, the step in flight in step.py; the
inbox, pause/drain and the control surface in inbox.py, lifecycle.py and controls.py.
Inputs (latency model, planner, replay table) are built by the caller (engine_inputs.py).
asyncio is imported by the loop (`run`) and `call`: an offline simulation drives its engines
synchronously (`run_until_idle`) and never loads it.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Callable, Iterable, TypeVar

from .admission import Admission, TokenSourceFactory, finish_output, reject
from .block_hash import make_block_hasher
from .block_pool import BlockHasher, BlockPool, KVEventSink
from .clock import RealClock, VirtualClock
from .config import EngineArgs, EngineConfig
from .controls import EngineControls, LatencyTraceActive  # noqa: F401  (LatencyTraceActive: re-exported)
from .decode_cohort import CohortOutputProcessor, CohortScheduler, DecodeCohort, timing_only_unsupported
from .inbox import Inbox, run_call
from .kv_cache_manager import KVCacheManager
from .kv_transfer import KVTransfer
from .latency import KnobLatency, LatencyModel, StepRecord
from .lifecycle import EngineLifecycle
from .lockstep import DataParallelLockstep
from .output import OutputProcessor, OutputSink
from .plan import OutputReplayTable, Planner
from .policy import policy_for
from .request import Request, RequestStatus, TokenSink
from .scheduler import TRANSFER, Scheduler
from .stats import EngineStats
from .step import Bursts, StepInFlight, TimedSteps, compose, log_step
from .types import EngineCoreOutputs, EngineCoreRequest, FinishReason, RequestError

if TYPE_CHECKING:
    import asyncio

logger = logging.getLogger("vllm_vcr.engine")
_kind = itemgetter(2)  # a scheduled entry's kind
T = TypeVar("T")
TRACE_LEVEL = 5  # below DEBUG, like tracing's `trace` (the control API's PUT /log can enable it)
BUSY_SLICE = 0.002  # longest run of back-to-back steps before the loop lets I/O in (their outputs merge)
# (steps that emit nothing, e.g. admitting a burst of requests a token budget at a time, run back to
# back up to BUSY_SLICE even at one token per event: yielding after each would queue every one
# behind all the other work of the loop and move the requests' first tokens later)
StepObserver = Callable[[StepRecord], None]


class EngineDeadError(RuntimeError):
    """The engine loop is gone (control API: 500)."""


class _Turn(enum.Enum):
    """What a turn of the loop returns instead of a wake-up time."""
    AGAIN = "inputs arrived during the step: take another turn at once"
    STOPPED = "the engine stopped"


class EngineCore(EngineControls):
    def __init__(self, args: EngineArgs, *, engine_index: int = 0, clock: RealClock | VirtualClock | None = None,
                 output_sink: OutputSink | None = None, latency: LatencyModel | None = None,
                 block_hasher: BlockHasher | None = None, kv_events: KVEventSink | None = None,
                 token_source_factory: TokenSourceFactory | None = None,
                 replay_table: OutputReplayTable | None = None, planner: Planner | None = None,
                 timing_only: bool = False, textless_ids: frozenset[int] = frozenset(),
                 on_idle: Callable[[float], None] | None = None) -> None:
        """`timing_only`: decodes between a request's first and last token advance as one cohort
        and emit no outputs (the offline simulator's fast path, decode_cohort.py). `textless_ids`:
        ids random output never draws, having no whole-character text of their own (special
        tokens, byte-level pieces of a multi-byte character), so that every random token is text as
        a model's is (serve knows them from its tokenizer; logit_bias / allowed_token_ids may still
        choose them). `on_idle(seconds)`: called before the loop sleeps that long with nothing due
        (inf: until a message), for work best done then (serve and play collect garbage)."""
        args.check_injected(latency, planner, replay_table)
        self.args = args
        self.engine_index = engine_index
        self.clock = clock or RealClock()
        self.output_sink = self._counting_sink(output_sink or (lambda client, outs: None))
        self.emits = 0  # output batches sent so far
        self.idle_waits = 0  # times the loop slept: between two, it ran without waiting for anything
        self.on_idle = on_idle
        self._config = args.config
        config = self._current_config
        self.latency: LatencyModel = latency or KnobLatency(self._config, args.time_scale)
        self.block_pool = BlockPool(args.kv_cache_size, args.tokens_per_block, args.enable_prefix_caching, kv_events)
        self.kv = KVCacheManager(self.block_pool, block_hasher or make_block_hasher(args.prefix_caching_hash_algo,
                                                                                    args.none_hash_seed))
        sched_args = (config, self.kv, args.scheduling_policy, args.long_prefill_token_threshold,
                      policy_for(args.engine_type))
        self.cohort: DecodeCohort | None = None
        if timing_only:
            why = timing_only_unsupported(self.latency, sched_args[-1], args)
            if why is not None:
                raise ValueError(f"timing-only decodes are unavailable: {why}")
            self.cohort = DecodeCohort(args.tokens_per_block)
            self.scheduler = CohortScheduler(self.cohort, lambda: self.output.max_model_len, *sched_args)
        else:
            self.scheduler = Scheduler(*sched_args)
        self.scheduler.chunked_prefill = args.enable_chunked_prefill
        self.scheduler.reserve_full_isl = args.scheduler_reserve_full_isl and args.engine_type == "vllm"
        if args.engine_type == "vllm":
            self.scheduler.watermark_blocks = int(args.watermark * args.kv_cache_size)
        self.scheduler.max_loras = args.max_loras
        self.scheduler.max_active_seqs = args.max_num_active_seqs
        self.scheduler.max_scheduled_tokens = args.max_num_scheduled_tokens
        self.kv_capacity_tokens = args.kv_cache_size * args.tokens_per_block
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()  # (one object for the engine's life: reset_stats resets it in place)
        self.dead: BaseException | None = None
        self.kv_transfer = KVTransfer(args, engine_index, self.kv, self.scheduler, self.requests)
        self.admission = Admission(args, engine_index, config=config, latency=lambda: self.latency,
                                   idle_waits=lambda: self.idle_waits, stats=self.stats, requests=self.requests,
                                   scheduler=self.scheduler, kv=self.kv, kv_transfer=self.kv_transfer,
                                   clock=self.clock, planner=planner, replay_table=replay_table,
                                   token_source_factory=token_source_factory, textless_ids=textless_ids)
        collaborators = dict(scheduler=self.scheduler, kv=self.kv, kv_transfer=self.kv_transfer, requests=self.requests,
                             stats=self.stats, clock=self.clock, config=config, sink=self.output_sink,
                             engine_index=engine_index, scheduler_stats=self.scheduler_stats)
        self.output = OutputProcessor(**collaborators) if self.cohort is None else \
            CohortOutputProcessor(self.cohort, **collaborators)
        self._bursts = Bursts(args, self.scheduler, self.kv_transfer, self.kv, config).size
        self.scheduler.on_admit = self.admission.on_admit
        self.scheduler.on_preempt = self.kv_transfer.cancel_pull
        self._kv_events: tuple[KVEventSink, Callable[[list, float], Any]] | None = None
        self._step_observers: list[StepObserver] = []
        self.step_counter = 0
        self.lockstep: DataParallelLockstep | None = None  # the DP ranks this one steps with (lockstep.py)
        # timed steps (a step-time model): the step in flight; KV pulls waiting for the next step
        self.timed = TimedSteps(lambda: self.latency, args.seed, engine_index, args.scheduler_recv_interval)
        # an untimed step starts at least min_step_time after the previous one ended (play: a real
        # step never takes ~0 µs)
        self._step_floor = args.min_step_time / args.time_scale
        self._floor_until = 0.0
        self._pulled: list[str] = []
        self.inbox = Inbox()
        self._inbox = self.inbox.messages  # read every turn
        self.lifecycle = EngineLifecycle(engine_index, self.clock, self.requests, abort_all=self._abort_all,
                                         emit=self.output.emit, resume=self._resume)  # frozen, draining, stopped

    def _current_config(self) -> EngineConfig:
        return self._config

    @property
    def planner(self) -> Planner | None:
        """A recorded trace's plans for arriving requests (admission reads it)."""
        return self.admission.planner

    @planner.setter
    def planner(self, planner: Planner | None) -> None:
        self.admission.planner = planner

    @property
    def replay_table(self) -> OutputReplayTable | None:
        """A response replay trace's planned output ids (admission reads it)."""
        return self.admission.replay_table

    @replay_table.setter
    def replay_table(self, table: OutputReplayTable | None) -> None:
        self.admission.replay_table = table

    def _counting_sink(self, sink: OutputSink) -> OutputSink:
        def counted(client: int, outs: EngineCoreOutputs) -> None:
            self.emits += 1
            sink(client, outs)
        return counted

    # --- inbox (the only way in) ------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest, token_sink: TokenSink | None = None,
                    batch_member: Any = None) -> None:
        """Queue a request; an in-process reader may pass a `token_sink` for its steady decodes, and
        itself as a steady-batch member (steady_batch.BatchReader)."""
        self.inbox.post(("add", request, token_sink, batch_member))

    def abort_requests(self, request_ids: Iterable[str], notify: bool = False) -> None:
        """Abort requests; `notify`: each gets a final ABORT output (an abort its reader did not ask
        for, such as vLLM's /abort_requests), else the reader has left already."""
        self.inbox.post(("abort_notify" if notify else "abort", list(request_ids)))

    def abort_all(self) -> None:
        """Abort every request, each with a final ABORT output (vLLM's pause/sleep mode "abort")."""
        self.inbox.post(("abort_all",))

    def call(self, fn: Callable[["EngineCore"], T]) -> "asyncio.Future[T]":
        """Run fn(core) between two steps; the result (or exception) arrives on the future."""
        import asyncio

        fut = asyncio.get_running_loop().create_future()
        if self.dead is not None or self.lifecycle.stopped:
            fut.set_exception(EngineDeadError(f"engine {self.engine_index} loop is gone"))
        else:
            self.inbox.post(("call", fn, fut))
        return fut

    def attach_kv_events(self, collector: KVEventSink, publish: Callable[[list, float], Any]) -> None:
        """Collect BlockStored/BlockRemoved/AllBlocksCleared and hand them to `publish` once per step.

        `publish(events, wall_time)` must not block (the KV events publisher queues them)."""
        if self.cohort is not None:
            raise ValueError("KV events need every decode step: not with timing-only decodes")
        self.block_pool.events = collector
        self._kv_events = (collector, publish)

    def add_step_observer(self, observer: StepObserver) -> None:
        """`observer(StepRecord)` runs in the loop as each step starts (its composition and duration)."""
        self._step_observers.append(observer)

    def set_frozen(self, frozen: bool) -> None:
        """Stop (or restart) scheduling while keeping every request in place (vLLM's pause "keep").

        Deadlines move by the frozen time, so requests resume at their own pace without a burst."""
        self.inbox.post(("freeze", frozen))

    def set_paused(self, paused: bool) -> None:
        """Admit no waiting request (new ones queue and count as waiting) until unpaused, while the
        running ones go on: vLLM's PAUSED_NEW, the state of a sleeping or paused engine."""
        self.inbox.post(("pause", paused))

    def release_kv_hold(self, request_id: str, error: str | None = None) -> None:
        """The decode side has pulled this prefill's KV: free its held blocks (`error`: the
        handoff failed instead; a prefill whose finish waits for its handoff fails with it)."""
        self.inbox.post(("release_kv", request_id, error))

    def kv_ready(self, request_id: str, error: str | None = None) -> None:
        """A deferred pull may start (the prefill side's KV is complete), or fails with `error`."""
        self.inbox.post(("kv_ready", request_id, error))

    def destination_joined(self, request_id: str, error: str | None = None) -> None:
        """A destination-first prefill's decoder joined its room (it may be scheduled now), or the
        handoff failed with `error` before it did."""
        self.inbox.post(("destination_joined", request_id, error))

    def shutdown(self, timeout: float | None = None) -> None:
        self.inbox.post(("shutdown", self.args.shutdown_timeout if timeout is None else timeout))

    @property
    def stopped(self) -> bool:
        return self.lifecycle.stopped

    @property
    def frozen(self) -> bool:
        return self.lifecycle.frozen_at is not None

    # --- loop ------------------------------------------------------------------------------------
    async def run(self) -> None:
        import asyncio

        clock = self.clock
        last_yield = clock.now()
        busy_slice = BUSY_SLICE if self.args.max_burst > 1 else 0.0
        emits_seen = self.emits  # output batches the loop has let go to their readers
        try:
            while True:
                wake = self._turn()
                if wake is _Turn.STOPPED:
                    break
                if wake is _Turn.AGAIN:
                    continue
                if wake is None:
                    self.idle_waits += 1
                    if self.on_idle is not None:
                        self.on_idle(math.inf)
                    await self.inbox.wait(None)
                    last_yield = clock.now()
                    continue
                if wake <= clock.now():
                    # back-to-back steps (zero latency or catching up): with bursts allowed, yield
                    # to I/O every BUSY_SLICE so outputs coalesce; else after every step, so each
                    # step's outputs reach their readers as they would from a real engine
                    busy = clock.now() - last_yield
                    if busy >= BUSY_SLICE or (busy >= busy_slice and self.emits != emits_seen):
                        await asyncio.sleep(0)
                        last_yield = clock.now()
                        emits_seen = self.emits
                    continue
                if clock.virtual:
                    await asyncio.sleep(0)
                    if not self._inbox:
                        clock.advance_to(wake)
                    continue
                self.idle_waits += 1
                if self.on_idle is not None:
                    self.on_idle(wake - clock.now())
                await self.inbox.wait(wake - clock.now())
                last_yield = clock.now()
        except BaseException as e:
            self.dead = e
            if not isinstance(e, asyncio.CancelledError):
                logger.exception("engine %d loop died", self.engine_index)
            raise
        finally:
            self.lifecycle.stopped = True
            self.inbox.fail_calls(lambda: EngineDeadError(f"engine {self.engine_index} loop is gone"))

    def run_until_idle(self, until: float | None = None, max_steps: int = 1_000_000) -> float | None:
        """Synchronous driver for the virtual clock: process inputs and steps, jumping time. Returns
        when the engine next has work (`next_wake`, as it is then)."""
        assert isinstance(self.clock, VirtualClock), "run_until_idle needs a VirtualClock"
        for _ in range(max_steps):
            wake = self._turn()
            if wake is _Turn.STOPPED:
                return self.next_wake()
            if wake is _Turn.AGAIN:
                continue
            if wake is None or (until is not None and wake > until):
                if until is not None:
                    self.clock.advance_to(until)
                return wake  # (the inbox is empty: `_turn` took another turn otherwise)
            self.clock.advance_to(wake)
        raise RuntimeError("engine did not become idle")

    def _turn(self) -> float | None | _Turn:
        """One turn of either driver: apply the inbox, then run the step due now. Returns when to
        run the next one (None: nothing to do until an input), AGAIN (inputs arrived meanwhile)
        or STOPPED."""
        if self._inbox:
            self._process_inbox()
        life = self.lifecycle
        if life.stopped:
            return _Turn.STOPPED
        self.step(self.clock.now())
        if life.stopped:
            return _Turn.STOPPED
        if self._inbox:
            return _Turn.AGAIN
        return self._next_wake()

    def next_wake(self) -> float | None:
        """When this engine next has work on its clock (now while inputs wait; None: idle until one
        arrives). For drivers of several engines on one virtual clock (simulate)."""
        return self.clock.now() if self._inbox else self._next_wake()

    def _next_wake(self) -> float | None:
        life = self.lifecycle
        drain = life.draining_deadline
        if life.frozen_at is not None:
            return drain
        batch = self.timed.in_flight
        if batch is not None:
            return drain if drain is not None and drain < batch.end else batch.end
        sched = self.scheduler
        if self._pulled or sched.has_immediate_work():
            return max(self.clock.now(), self._floor_until)
        wake = sched.next_deadline()
        for t in (drain, self.kv_transfer.next_event(), self.timed.next_release()):
            if t is not None and (wake is None or t < wake):
                wake = t
        return wake if wake is None or wake >= self._floor_until else self._floor_until

    def _process_inbox(self) -> None:
        outputs: list = []
        finished: list = []
        freed = False
        while self._inbox:
            msg = self._inbox.popleft()
            kind = msg[0]
            if kind == "add":
                self._add_request(msg[1], outputs, finished, msg[2], msg[3])
            elif kind == "abort":
                self.finish_requests(msg[1], finished)
            elif kind == "abort_notify":
                self.finish_requests(msg[1], finished, outputs)
            elif kind == "call":
                run_call(self, msg[1], msg[2])
            elif kind == "shutdown":
                self.lifecycle.begin_shutdown(msg[1], outputs, finished)
            elif kind == "freeze":
                self.lifecycle.set_frozen(msg[1])
            elif kind == "pause":
                self.scheduler.paused_new = msg[1]
            elif kind == "abort_all":
                self.finish_requests(list(self.requests), finished, outputs)
            elif kind == "release_kv":
                freed = self.kv_transfer.release_hold(msg[1], msg[2] if len(msg) > 2 else None) or freed
            elif kind == "destination_joined":
                if msg[2] is not None:
                    self.finish_requests([msg[1]], finished, outputs, RequestError("kv_transfer_failed", msg[2]))
                else:
                    self.scheduler.destination_joined(msg[1])
            elif kind == "kv_ready":
                if self.kv_transfer.kv_ready(msg[1], msg[2], self.clock.now()):
                    self.finish_requests([msg[1]], finished, outputs, RequestError("kv_transfer_failed", msg[2]))
        if self.kv_transfer.settled:
            self._settle_handoffs(outputs, finished)
        if self.output.steady.touched:  # a batch whose earliest member left moves in the lane
            self.output.steady.flush()
        if outputs or finished or freed:  # freed blocks: a stats-only batch keeps kv_cache_usage current
            self.output.emit(outputs, finished, with_stats=True)
        if self._kv_events is not None:
            self._flush_kv_events()

    # --- arrival, finish, abort --------------------------------------------------------------------
    def _add_request(self, ecr: EngineCoreRequest, outputs: list, finished: list,
                     token_sink: TokenSink | None = None, batch_member: Any = None) -> None:
        now = self.clock.now()
        req = self.admission.admit(ecr, now, self.lifecycle.draining_deadline is not None, outputs, finished)
        if req is None:
            return
        req.token_sink = token_sink
        req.batch_member = batch_member
        rid = req.request_id
        req.received_in = self.idle_waits
        self.requests[rid] = req
        delay = self.latency.frontend_delay(req.num_prompt_tokens, len(self.requests) - 1) \
            if self.latency.times_steps else 0.0
        if delay > 0.0 and not self.clock.virtual:  # the real frontend's own time counts towards it
            delay -= req.frontend_delay
        if delay > 0.0 and req.status is RequestStatus.WAITING:
            self.timed.hold(req, now + delay)
        else:
            self.scheduler.add_waiting(req)
            self.timed.on_arrival(rid, now)
        if self._config.log_requests:
            logger.info("request %s queued: prompt=%d max_tokens=%d", rid, req.num_prompt_tokens, req.max_tokens)
        if ecr.abort_immediately:
            self.finish_requests([rid], finished)

    def finish_requests(self, request_ids: Iterable[str], finished: list, outputs: list | None = None,
                        error: RequestError | None = None) -> None:
        """Abort requests (unknown or finished ids are skipped: aborts are idempotent). With
        `outputs` each also gets a finish output carrying its pending events: ABORT (shutdown), or
        ERROR with `error` (a failed KV handoff)."""
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.status is RequestStatus.HANDING_OFF:  # its KV is held: free it, ending the handoff
                self.kv_transfer.parked.pop(rid, None)
                self.kv_transfer.release_hold(rid)
            if not (self.timed.arriving and self.timed.drop(req)):  # (held for the frontend's time: never scheduled)
                self.scheduler.remove(req)
            req.status = RequestStatus.FINISHED
            if outputs is None:
                self.stats.requests_aborted += 1
                finished.append((req.client_index, rid))
                if self._config.log_requests:
                    logger.info("request %s aborted", rid)
            elif error is None:
                reject(self.stats, outputs, finished, req.client_index, rid, FinishReason.ABORT,
                       counter="requests_aborted", events=req.pending_events)
            else:
                reject(self.stats, outputs, finished, req.client_index, rid, FinishReason.ERROR,
                       events=req.pending_events, error=error)
            self.kv_transfer.end_handoff(rid)

    def _settle_handoffs(self, outputs: list, finished: list) -> None:
        """Finish the prefills whose handoff ended: as computed (the decoder pulled their KV), or
        with the handoff's error."""
        kvt = self.kv_transfer
        settled, kvt.settled = kvt.settled, []
        for rid, error in settled:
            parked = kvt.parked.pop(rid, None)
            req = self.requests.get(rid)
            if parked is None or req is None or req.status is not RequestStatus.HANDING_OFF:
                continue
            del self.requests[rid]
            req.status = RequestStatus.FINISHED
            if error is not None:
                logger.warning("request %s: KV handoff failed: %s", rid, error)
                reject(self.stats, outputs, finished, req.client_index, rid, FinishReason.ERROR,
                       error=RequestError("kv_transfer_failed", error))
                continue
            reason, stop_reason, params = parked
            out = finish_output(rid, reason, stop_reason=stop_reason)
            out.kv_transfer_params = params
            self.stats.requests_completed += 1
            outputs.append((req.client_index, out))
            finished.append((req.client_index, rid))
            if self._config.log_requests:
                logger.info("request %s finished: %d tokens", rid, req.num_output_tokens)

    def _abort_all(self, outputs: list, finished: list) -> None:
        """Abort every live request, each with a finish output (shutdown, the end of a drain)."""
        self.finish_requests(list(self.requests), finished, outputs)

    def _resume(self, delta: float) -> None:
        """Resumed after `delta` seconds frozen: every deadline moves by that much."""
        self.scheduler.shift_deadlines(delta)
        self.timed.shift(delta)
        for req in self.requests.values():
            if not req.output_token_ids:
                req.first_due += delta

    # --- the step ----------------------------------------------------------------------------------
    def step(self, now: float) -> None:
        """Run the engine at `now`: end the step in flight, start (and, untimed, apply) the next one."""
        self._step(now)
        if self._kv_events is not None:
            self._flush_kv_events()

    def _flush_kv_events(self) -> None:
        collector, publish = self._kv_events
        if len(collector):
            publish(collector.drain(), self.clock.now() if self.clock.virtual else time.time())

    def _step(self, now: float) -> None:
        life = self.lifecycle
        if life.draining_deadline is not None and life.drain_expired(now):
            return
        if life.frozen_at is not None:
            return  # paused in place: nothing is scheduled or emitted
        kvt = self.kv_transfer
        expired = kvt.expire_holds(now) if kvt.holds else False
        if kvt.settled:  # an expired hold failed a prefill waiting for its handoff
            settled_out: list = []
            settled_fin: list = []
            self._settle_handoffs(settled_out, settled_fin)
            self.output.emit(settled_out, settled_fin, with_stats=True)
            expired = False
        if kvt.transfers.remaining:
            self._pulled += kvt.pop_pulled(now)
        timed = self.timed
        batch = timed.in_flight
        if batch is not None:
            if now < batch.end:
                if expired:  # a KV hold expired mid-step: keep kv_cache_usage current
                    self.output.emit([], [], with_stats=True)
                return
            if self.lockstep is not None:  # every rank's step ends, every rank's next one starts
                self.lockstep.advance(self, batch.end)
                return
            if not self.end_step(batch):
                return
            now = batch.end  # back-to-back: the next step starts when this one ends
        if not self._start_step(now) and expired:
            self.output.emit([], [], with_stats=True)

    def end_step(self, batch: StepInFlight) -> bool:
        """The timed step in flight ends (at `batch.end`): its work is applied. False: the engine
        drained with it."""
        timed = self.timed
        timed.in_flight = None
        timed.last_end = batch.end
        timed.after_dummy = batch.dummy
        if not batch.dummy:
            self.output.update_from_output(batch.scheduled, batch.pulled, batch.end, timed=True)
        return not self.lifecycle.drained()

    def start_step(self, now: float) -> bool:
        """Schedule (and, timed, put in flight) the engine's next step at `now`. False: no work."""
        return self._start_step(now)

    def read_inbox(self) -> None:
        """Apply the messages waiting in the inbox (a lockstep round reads every rank's inputs)."""
        if self._inbox:
            self._process_inbox()

    def has_unfinished_requests(self) -> bool:
        """Requests the engine core holds that are not finished (held in the frontend: not yet)."""
        return len(self.requests) > len(self.timed.arriving)

    def _start_step(self, now: float) -> bool:
        """Schedule a step at `now`; apply it at once (untimed) or put it in flight. False: no work."""
        if now < self._floor_until:
            return False  # the previous (untimed) step still takes its minimum time
        timed = self.latency.times_steps
        kvt = self.kv_transfer
        if timed:  # (pulls complete before scheduling; untimed, after: the order each mode always had)
            if self.timed.arriving:
                self.timed.release(now, self.scheduler, self.requests)
            if kvt.transfers.remaining:  # (a DP rank whose step another rank's round starts polls here)
                self._pulled += kvt.pop_pulled(now)
            pulled = kvt.complete_pulls(self._pulled, self.requests) if self._pulled else []
            # (the step runs anyway when KV pulls complete or cohort decodes are due)
            scheduled = self.timed.schedule(self.scheduler, now,
                                                 bool(pulled) or bool(self.cohort and self.cohort.members))
            if TRANSFER in map(_kind, scheduled):  # pulls run beside the steps
                for req, n, kind in scheduled:
                    if kind == TRANSFER:
                        kvt.schedule_pull(req, n, now)
                scheduled = [e for e in scheduled if e[2] != TRANSFER]
        else:
            scheduled = self.scheduler.schedule(now)
            pulled = kvt.complete_pulls(self._pulled, self.requests) if self._pulled else []
        self._pulled = []
        if self.output.steady.touched:  # (members preempted by the scheduling)
            self.output.steady.flush()
        if not scheduled and not pulled and not (self.cohort is not None and self.scheduler.cohort_decodes()):
            # (under SGLang's policy a step that only starts KV pulls runs no decodes: as the plain
            # path's, it is no step, and the decodes are scheduled again at once)
            # a DP rank of an MoE model runs a dummy step while the other ranks work
            return timed and self.lockstep is not None and self.lockstep.idle(self, now)
        self.step_counter += 1
        if logger.isEnabledFor(TRACE_LEVEL):
            log_step(self.engine_index, self.step_counter, scheduled, self.scheduler, self.block_pool.usage(),
                     TRACE_LEVEL)
        duration = 0.0
        if timed or self._step_observers:
            batch = compose(scheduled, pulled, self.timed.after_idle(now))
            if self.cohort is not None and self.scheduler.cohort_decodes():
                batch = self.cohort.extend(batch)
            if timed:
                duration = max(self.latency.step_duration(batch, self.timed.rng), 0.0) + self.admission.take_lora_time()
            for observe in self._step_observers:
                observe(StepRecord(self.step_counter, now, duration, batch))
        if timed:
            self.timed.in_flight = step = StepInFlight(now + duration, scheduled, pulled)
            if self.lockstep is not None:
                self.lockstep.joined(self, step, now)
        else:
            draining = self.lifecycle.draining_deadline is not None
            burst = self._bursts(scheduled, draining) if not pulled else 1
            self.step_counter += burst - 1
            self.output.update_from_output(scheduled, pulled, now, burst)
            if self._step_floor:
                # from the step's end (its outputs' timestamp), not its start: steps that the
                # machine slowed down are stretched, never followed by a shorter one
                self._floor_until = self.clock.now() + self._step_floor
            if draining:
                self.lifecycle.drained()
        return True

    # --- timing-only decodes (decode_cohort.py) --------------------------------------------------
    def fast_forward(self, horizon: float) -> int:
        """Run, at once, the cohort-only steps of this engine that end before `horizon` (when its
        driver knows no input arrives: the offline simulator), stopping before a step that samples a
        last token (`DecodeCohort.run_alone`); a step whose blocks do not all fit runs the plain
        way. Returns the steps."""
        cohort, timed = self.cohort, self.timed
        batch = timed.in_flight
        if not self.may_fast_forward() or batch is None or batch.scheduled or batch.pulled or batch.end >= horizon:
            return 0
        quiet = self._quiet_until()
        if quiet is None:
            return 0
        horizon = min(horizon, quiet)  # (a held request joins the steps that start from then on)
        if batch.end >= horizon:
            return 0
        pulls = self._pulls_done if self.kv_transfer.transfers.remaining else None
        steps, now, end, plain = cohort.run_alone(batch.end, horizon, self.kv.pool,
                                                  self.scheduler.engine_policy.on_step,
                                                  self.latency, timed.rng, self.admission, pulls)
        if plain:  # the next step preempts, or takes a pulled request: the plain way
            self._end_fast_run(now, steps - 1)
            timed.in_flight = None
            self._start_step(now)
        elif steps:
            batch.end = end  # (the step in flight: nothing scheduled in it but the cohort)
            self._end_fast_run(now, steps)
        return steps

    def _pulls_done(self, now: float) -> bool:
        """At a step boundary of a fast run: take the KV pulls done by `now`, as `_step` does at
        every boundary (the link's shares advance with the same arithmetic); True when one is."""
        done = self.kv_transfer.pop_pulled(now)
        if done:
            self._pulled += done
        return bool(done)

    def may_fast_forward(self) -> bool:
        """Whether `fast_forward` may run steps ahead at all: timing-only decodes, some running,
        and no other DP rank to keep in step."""
        return self.cohort is not None and bool(self.cohort.members) and self.lockstep is None

    def _quiet_until(self) -> float | None:
        """Until when nothing but the cohort's decodes can happen in this engine's steps (until an
        input): a step that starts before then schedules the cohort alone. None: something else may
        happen now; inf: nothing is held. A request held in the frontend (`timed.arriving`, released
        at the first step that starts at its time or later) or hidden by the input gate (async
        scheduling's look-ahead, the input path's delay: left out of the steps that start before its
        time) waits for that time; any other work (a waiting request the gate does not hide, a
        prefill, a plain decode, a drain, a pause) ends the run at once. A KV pull in flight does
        not: the run takes it at the step boundary where the plain steps would (`_pulls_done`)."""
        sched, life, kvt, timed = self.scheduler, self.lifecycle, self.kv_transfer, self.timed
        if (self._inbox or sched.prefilling or sched.decode_heap or sched.bootstrapping
                or life.draining_deadline is not None or life.frozen_at is not None or life.stopped
                or kvt.holds or self._pulled or timed.unread
                or self._step_observers or logger.isEnabledFor(TRACE_LEVEL)):
            return None
        until = timed.arriving[0][0] if timed.arriving else math.inf  # (released in order, FIFO)
        if sched.waiting:
            hidden = timed.gate.hidden
            for req in sched.waiting:
                t = hidden.get(req.request_id)
                if t is None:
                    return None
                until = min(until, t)
        return until

    def _end_fast_run(self, now: float, priced: int) -> None:
        """The engine's clock and counters after fast-forwarded steps, the last ending at `now`
        (`priced`: the steps that started)."""
        self.timed.last_end = now
        self.timed.count_decode_steps(priced)
        self.step_counter += priced
        self.clock.advance_to(now)
