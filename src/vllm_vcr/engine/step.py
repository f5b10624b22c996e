"""What a step computes and, when steps are timed, the step in flight.

In per-request deadline timing (knob and cell models) a step takes no time: the core applies it
as soon as it is scheduled. When the latency model times steps (`LatencyModel.times_steps`, the
step-time model), a real vLLM engine's behaviour is kept: one batch per step, every running
decode plus the prefill chunks that fit the token budget; the step's duration comes from that
composition (`StepBatch`), and every request in it gets its token when the step ends. So a long
prefill stalls every decode's ITL, and a request arriving mid-step waits for the step to end
before it can be scheduled, and for the model's input delay (`InputGate`): one arriving just
before the step ends waits for one more step (the delay holds a request back only from a step
that runs anyway: at an idle engine, or when it is all the work there is, it runs at once).
Aborts during a step drop the request from the batch; a pause moves the step's end by the
paused time; KV pulls that complete mid-step join the next step. A model with a frontend delay
(`LatencyModel.frontend_delay`: the API server's work before the engine core sees a request)
holds each new request out of the scheduler until then (`TimedSteps.hold`, first in first out).
A model that schedules ahead (`LatencyModel.schedules_ahead`, vLLM's async scheduling: the next
step is scheduled while this one runs) keeps a request the core receives mid-step out of the
next step too: it joins the step after.
An SGLang engine with `--scheduler-recv-interval N` (`TimedSteps.schedule`, SGLang's
`SchedulerRecvSkipper`) reads its input socket only when a counter reaches N: each decode step
adds 1, a step with a prefill (or an idle loop) adds enough to read at once. A request that
reached the core while steps ran waits for that read: on average N/2 decode steps.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from typing import TYPE_CHECKING, Callable

from .latency import LatencyModel, StepBatch
from .request import Request
from .scheduler import DECODE, STEADY, TRANSFER, Scheduled, Scheduler

_UNREAD = float("inf")  # a request the scheduler has not read from its socket yet

if TYPE_CHECKING:
    from .config import EngineArgs, EngineConfig
    from .kv_cache_manager import KVCacheManager
    from .kv_transfer import KVTransfer

logger = logging.getLogger("vllm_vcr.engine")
_INSTANT = 1e-9  # seconds: "just after" a step's start (hidden while `until > now`)
MAX_BURST = 8  # zero-latency decode steps run as one (see Bursts.size)


def compose(scheduled: Scheduled, pulled: list[Request], after_idle: bool) -> StepBatch:
    """The step's composition, before its work is applied (KV pulls are not computed by the step)."""
    prefill_tokens = prefills = firsts = prefill_context = hits = 0
    contexts = []
    chunks = []
    for req, n, kind in scheduled:
        if kind == DECODE:
            contexts.append(req.num_tokens)
        elif kind == STEADY:  # a batch of decodes (steady_batch.py)
            contexts.extend(map(len, req.alls))
        elif kind != TRANSFER:
            prefills += 1
            prefill_tokens += n
            chunks.append(n)
            prefill_context += req.num_computed_tokens
            if req.num_computed_tokens == max(req.num_cached_tokens, 0):
                hits += req.num_computed_tokens  # its first chunk: what the prefix cache gave it
            if not req.output_token_ids and req.num_computed_tokens + n >= req.prefill_target:
                firsts += 1
    return StepBatch(len(pulled) + len(contexts), prefill_tokens, prefills, firsts, sum(contexts), after_idle,
                     prefill_context, hits, tuple(contexts), tuple(chunks))


class StepInFlight:
    """A timed step between its start and its end (its work is applied at `end`)."""

    __slots__ = ("end", "pulled", "scheduled")
    dummy = False

    def __init__(self, end: float, scheduled: Scheduled, pulled: list[Request]) -> None:
        self.end = end
        self.scheduled = scheduled
        self.pulled = pulled


class DummyStep(StepInFlight):
    """A data-parallel rank's forward pass with nothing scheduled (lockstep.py): it computes
    nothing for any request; the engine reads its inputs when it ends."""

    __slots__ = ()
    dummy = True

    def __init__(self, end: float) -> None:
        super().__init__(end, [], [])


class TimedSteps:
    """The state of timed steps: the step in flight, when the previous one ended, the input gate."""

    def __init__(self, latency: Callable[[], LatencyModel], seed: int, engine_index: int,
                 recv_interval: int = 1) -> None:
        self.rng = random.Random(f"steps/{seed}/{engine_index}")
        self.latency = latency
        self.gate = InputGate(lambda rng: latency().input_delay(rng), self.rng)
        self.in_flight: StepInFlight | None = None
        self.last_end: float | None = None
        self.after_dummy = False  # the previous step was a dummy one (lockstep.py): nothing was scheduled ahead
        self.arriving: deque[list] = deque()  # [visible at, request]: still in the frontend, FIFO
        # SGLang's --scheduler-recv-interval: requests in the socket, not read yet (id -> when the
        # input path has delivered it), the read counter, what the last step ran
        self.recv_interval = recv_interval
        self.unread: dict[str, float] = {}
        self._recv_counter = 0
        self._last_step_decode_only = False
        if recv_interval == 1:  # every step reads its inputs: the gate's batch as it is
            self.schedule = self.gate.schedule  # type: ignore[method-assign]

    def _leave_unread(self, request_id: str, delivered: float) -> None:
        self.unread[request_id] = delivered
        self.gate.hidden[request_id] = _UNREAD

    def schedule(self, sched: Scheduler, now: float, runs_anyway: bool) -> Scheduled:
        """The step's batch (`InputGate.schedule`), after the scheduler's read of its socket: with
        a receive interval N, requests delivered while steps ran are read only when the counter
        reaches N (a decode step adds 1; a step with a prefill, or waking up idle, reads at once)."""
        if self.recv_interval > 1:
            back_to_back = self.last_end == now
            self._recv_counter += 1 if back_to_back and self._last_step_decode_only else self.recv_interval
            if self._recv_counter >= self.recv_interval:
                self._recv_counter = 0
                hidden = self.gate.hidden
                for rid, delivered in list(self.unread.items()):
                    if delivered <= now:  # (one delivered after this read waits for the next)
                        del self.unread[rid]
                        hidden.pop(rid, None)
        scheduled = self.gate.schedule(sched, now, runs_anyway)
        if self.recv_interval > 1:
            prefill = False
            for req, _, kind in scheduled:
                if kind != DECODE and kind != STEADY and kind != TRANSFER:
                    prefill = True
                if self.unread and self.unread.pop(req.request_id, None) is not None:
                    self.gate.hidden.pop(req.request_id, None)  # nothing else to run: the idle loop read it
            self._last_step_decode_only = (bool(scheduled) or sched.cohort_decodes() > 0) and not prefill
            if self.unread:  # aborted before the read
                waiting = {r.request_id for r in sched.waiting}
                for rid in [rid for rid in self.unread if rid not in waiting]:
                    del self.unread[rid]
                    self.gate.hidden.pop(rid, None)
        return scheduled

    def count_decode_steps(self, k: int) -> None:
        """`k` decode-only steps started back to back without being scheduled here (a timing-only
        cohort's run, nothing unread): the read counter moves as their `schedule` calls would move it."""
        if self.recv_interval > 1 and k > 0:
            self._recv_counter = (self._recv_counter + k) % self.recv_interval
            self._last_step_decode_only = True

    def hold(self, req: Request, until: float) -> None:
        """Keep `req` from the scheduler until `until` (never before one that arrived before it)."""
        if self.arriving:
            until = max(until, self.arriving[-1][0])
        self.arriving.append([until, req])

    def release(self, now: float, sched: Scheduler, live: dict[str, Request]) -> None:
        """The held requests due by `now` join the scheduler's queue (aborted ones are gone)."""
        arriving = self.arriving
        # Released at the start of a step that follows another back to back, a request reached the
        # core while that one ran (the ones due earlier were released when it started): under
        # async scheduling this step was scheduled before then.
        ahead = self.last_end == now and not self.after_dummy and self.latency().schedules_ahead
        while arriving and arriving[0][0] <= now:
            req = arriving.popleft()[1]
            if live.get(req.request_id) is req:
                sched.add_waiting(req)
                if ahead:
                    self.gate.hide(req.request_id, now)
                if self.recv_interval > 1 and self.last_end == now:  # it reached the core mid-step
                    self._leave_unread(req.request_id, self.gate.hidden.get(req.request_id, now))

    def drop(self, req: Request) -> bool:
        """Forget a held request (aborted before the engine saw it); False: it was not held."""
        for i, (_, held) in enumerate(self.arriving):
            if held is req:
                del self.arriving[i]
                return True
        return False

    def next_release(self) -> float | None:
        return self.arriving[0][0] if self.arriving else None

    def after_idle(self, now: float) -> bool:
        """A step starting at `now` was woken up (nothing ran back to back before it)."""
        return self.last_end is None or now > self.last_end

    def on_arrival(self, request_id: str, now: float) -> None:
        if self.in_flight is not None:  # a request arriving mid-step waits for the input path
            if self.latency().schedules_ahead and not self.in_flight.dummy:  # the next step is already scheduled: the one after
                self.gate.hide(request_id, self.in_flight.end)
            else:
                self.gate.on_arrival(request_id, now)
            if self.recv_interval > 1:  # and for the scheduler to read its socket
                self._leave_unread(request_id, self.gate.hidden.get(request_id, now))

    def shift(self, delta: float) -> None:
        """The engine was paused for `delta` seconds: the step in flight ends that much later."""
        self.gate.shift(delta)
        self.unread = {rid: t + delta for rid, t in self.unread.items()}
        for entry in self.arriving:
            entry[0] += delta
        if self.in_flight is not None:
            self.in_flight.end += delta
        elif self.last_end is not None:
            self.last_end += delta


class InputGate:
    """Requests that arrived while a step ran stay invisible to the scheduler for the model's
    input delay (FIFO: a request is never seen before the one that arrived before it)."""

    def __init__(self, delay: Callable[[random.Random], float], rng: random.Random) -> None:
        self._delay = delay
        self._rng = rng
        self.hidden: dict[str, float] = {}  # request id -> when the scheduler may see it
        self._last_visible = 0.0

    def on_arrival(self, request_id: str, now: float) -> None:
        t = max(now + max(self._delay(self._rng), 0.0), self._last_visible)
        self._last_visible = t
        if t > now:
            self.hidden[request_id] = t

    def hide(self, request_id: str, step_start: float) -> None:
        """Keep the request out of the step that starts at `step_start` (it may join the next one)."""
        t = max(step_start + _INSTANT, self._last_visible)
        self._last_visible = t
        self.hidden[request_id] = t

    def shift(self, delta: float) -> None:
        if self.hidden:
            self.hidden = {rid: t + delta for rid, t in self.hidden.items()}
            self._last_visible += delta

    def schedule(self, sched: Scheduler, now: float, runs_anyway: bool) -> Scheduled:
        """The scheduler's batch without the requests the engine has not seen yet, unless they
        are all the work there is (then they are scheduled at once: at an idle engine the step's
        duration holds the input path)."""
        if self.hidden:
            self.hidden = {rid: t for rid, t in self.hidden.items() if t > now}
        if not self.hidden:
            return sched.schedule(now)
        hidden = [r for r in sched.waiting if r.request_id in self.hidden]
        if not hidden:
            return sched.schedule(now)
        sched.waiting = deque(r for r in sched.waiting if r.request_id not in self.hidden)
        try:
            scheduled = sched.schedule(now)
        finally:
            sched.waiting.extend(hidden)
        if scheduled or runs_anyway:
            return scheduled
        return sched.schedule(now)


class Bursts:
    """How many zero-latency decode steps an untimed step runs at once (`size`), from the engine's
    scheduler, KV transfers, KV cache, its args (`max_burst`) and its current config."""

    def __init__(self, args: EngineArgs, scheduler: Scheduler, kv_transfer: KVTransfer, kv: KVCacheManager,
                 config: Callable[[], EngineConfig]) -> None:
        self._args = args
        self._scheduler = scheduler
        self._kv_transfer = kv_transfer
        self._kv = kv
        self._config = config

    def size(self, scheduled: Scheduled, draining: bool) -> int:
        """The steps this one runs (1: just this one; always 1 unless EngineArgs.max_burst allows more).

        When every running request decodes with no gap between tokens and nothing else can enter
        before the next step (no waiting request, prefill, transfer, hold or drain deadline), the
        next steps happen at this same instant with the same batch: emitting k tokens per request
        now is what k steps would emit, in one output instead of k. The next step computes the
        k tokens (as after a recorded chunk), so k is capped by the token budget, and bursts
        stop while free KV blocks could not cover them (preemption stays step by step)."""
        max_burst = self._args.max_burst
        if max_burst < 2:
            return 1  # (what the checks below come to: k < 2)
        sched = self._scheduler
        kvt = self._kv_transfer
        n = len(scheduled)
        if n != len(sched.running) or sched.waiting or kvt.holds or kvt.transfers.remaining or draining:
            return 1
        for req, _, kind in scheduled:
            if kind != DECODE or not req.burstable or not req.output_token_ids:
                return 1  # (the first token is emitted on its own, as after a prefill)
        k = min(MAX_BURST, max_burst, sched.token_budget() // n)
        kv = self._kv
        if k < 2 or kv.pool.num_free_blocks < n * (kv.blocks_needed(k) + 1):
            return 1
        return k


def log_step(engine_index: int, step_counter: int, scheduled: Scheduled, sched: Scheduler, kv_usage: float,
             level: int) -> None:
    logger.log(level, "engine %d step %d: %s; running=%d waiting=%d kv_usage=%.3f", engine_index,
               step_counter, " ".join(f"{r.request_id}:{n}" for r, n, _ in scheduled),
               len(sched.running), len(sched.waiting), kv_usage)
