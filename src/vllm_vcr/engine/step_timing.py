"""Step-composed timing: the engine runs one batch at a time and its duration is drawn from a
step-time model (`--latency-trace` with a step model, see trace/step_model.py).

The deadline mode (core.py) gives every request its own TTFT and token gaps at admission, so
requests never slow each other down. A real vLLM engine runs one batch per step: every running
decode plus the prefill chunks that fit the token budget; the step's duration depends on that
composition, and every request in it gets its token when the step ends. So a long prefill
stalls every decode's ITL, and a request arriving mid-step waits for the step to end before it
can even be scheduled. Here:

1. at the step's start the scheduler picks the batch (vLLM's order: decodes, running prefills,
   admissions under `max_num_seqs` / `max_num_batched_tokens` / KV blocks);
2. the model draws the step's duration from the batch's composition (`StepBatch`);
3. when it ends, the batch is applied: prefill progress, the first token of every request whose
   prefill completed, one token for every decode, all in one output batch; the next step starts
   then, with whatever arrived in the meantime.

A request that arrives while a step runs becomes visible to the scheduler only after the model's
input delay (`input_delay`, optional: the real engine's input path), so one arriving just before
the step ends waits for one more step; the delay holds a request back only from a step that runs
anyway (at an idle engine, or when it is all the work there is, it is scheduled at once).

In this mode each request's own pacing is zero (tokens come only from steps), so every running
decode is due at every step. Aborts during a step drop the request from the batch; a pause moves
the step's end by the paused time; KV pulls that complete mid-step join the next step.
"""

from __future__ import annotations

import random
from collections import deque
from typing import TYPE_CHECKING, NamedTuple, Protocol

from .latency import RequestPacing
from .request import Request, RequestStatus
from .scheduler import DECODE, TRANSFER

if TYPE_CHECKING:
    from .core import EngineCore


class StepBatch(NamedTuple):
    """What one step computes: the features a step-time model may use."""

    num_decodes: int  # requests computing one (decode) token, incl. first tokens after a KV pull
    num_prefill_tokens: int  # prompt tokens computed by prefill chunks in this step
    num_prefills: int  # requests with a prefill chunk in this step
    num_first_tokens: int  # of those, the ones whose prefill completes (they sample a token)
    decode_context: int  # tokens of context the decodes attend to (sum of their lengths)
    after_idle: bool = False  # the engine had nothing to do before this step (it was woken up)
    prefill_context: int = 0  # tokens the prefill chunks' requests had computed before (prefix hits, chunks)


class StepTimeModel(Protocol):
    """A latency model that times steps instead of requests."""

    is_knob: bool

    def step_duration(self, batch: StepBatch, rng: random.Random) -> float:
        """Seconds (already divided by time_scale) the step computing `batch` takes."""
        ...


def is_step_model(latency: object) -> bool:
    return callable(getattr(latency, "step_duration", None))


def zero_pacing(rng: random.Random) -> RequestPacing:
    """A request's pacing in step mode: no delay of its own, every decode due at every step."""
    return RequestPacing(0.0, 0.0, 0.0, rng)


class _Batch:
    __slots__ = ("end", "pulled", "scheduled")

    def __init__(self, end: float, scheduled: list, pulled: list[Request]) -> None:
        self.end = end
        self.scheduled = scheduled
        self.pulled = pulled


class StepTimer:
    """Runs an EngineCore's steps as timed batches (hooked into EngineCore._step / _next_wake)."""

    def __init__(self, core: EngineCore, model: StepTimeModel) -> None:
        self.core = core
        self.model = model
        self.batch: _Batch | None = None  # the step in flight
        self._pulled: list[str] = []  # KV pulls completed since the last step started
        self._rng = random.Random(f"steps/{core.args.seed}/{core.engine_index}")
        self.num_steps = 0
        self._last_end: float | None = None  # when the previous step ended
        delay = getattr(model, "input_delay", None)
        self._input_delay = delay if callable(delay) else None
        self._visible: dict[str, float] = {}  # request id -> when the scheduler may see it
        self._last_visible = 0.0

    # --- hooks ---------------------------------------------------------------------------------
    def next_wake(self) -> float | None:
        core = self.core
        if self.batch is not None:
            wake = self.batch.end
            d = core._draining_deadline
            return d if d is not None and d < wake else wake
        now = core.clock.now()
        sched = core.scheduler
        if self._pulled or sched.has_immediate_work():
            return now
        wake = sched.next_deadline()  # every decode is due at once in this mode
        holds = min((d for _, d in core.kv_holds.values()), default=None)
        for t in (core._draining_deadline, core.transfers.next_completion(), holds):
            if t is not None and (wake is None or t < wake):
                wake = t
        return wake

    def step(self, now: float, pulled, expired: bool) -> None:
        """Called by EngineCore._step (not frozen, not past the drain deadline)."""
        if pulled:
            self._pulled.extend(pulled)
        b = self.batch
        if b is not None:
            if now < b.end:
                if expired:  # a KV hold expired mid-step: keep kv_cache_usage current
                    self.core._emit([], [], with_stats=True)
                return
            self.batch = None
            self._last_end = b.end
            self._finish(b)
            if self.core._stopped:
                return
            now = b.end  # back-to-back: the next step starts when this one ends
        started = self._start(now)
        if not started and expired:
            self.core._emit([], [], with_stats=True)

    def on_arrival(self, req: Request, now: float) -> None:
        """A request entered the waiting queue: while a step runs, it waits for the input delay."""
        if self._input_delay is None or self.batch is None:
            return
        # the input path is FIFO: a request is never seen before the one that arrived before it
        t = max(now + max(self._input_delay(self._rng), 0.0), self._last_visible)
        self._last_visible = t
        if t > now:
            self._visible[req.request_id] = t

    def shift(self, delta: float) -> None:
        """The engine was paused for `delta` seconds: the step in flight ends that much later."""
        if self._visible:
            self._visible = {rid: t + delta for rid, t in self._visible.items()}
            self._last_visible += delta
        if self.batch is not None:
            self.batch.end += delta
        elif self._last_end is not None:
            self._last_end += delta

    # --- one step ------------------------------------------------------------------------------
    def _start(self, now: float) -> bool:
        core = self.core
        requests = core.requests
        pulled: list[Request] = []
        for rid in self._pulled:
            req = requests.get(rid)
            if req is None or not req.transferring:
                continue
            # the KV is here: the request decodes its first token in this step
            req.transferring = False
            req.num_computed_tokens += req.external_tokens
            core.kv.cache_computed_blocks(req)
            if core.on_kv_pulled is not None:
                core.on_kv_pulled(req.remote_prefill)
            pulled.append(req)
        self._pulled = []
        scheduled = self._schedule(now, bool(pulled))
        decodes = len(pulled)
        prefill_tokens = prefills = firsts = context = prefill_context = 0
        compute = []
        for entry in scheduled:
            req, n, kind = entry
            if kind == TRANSFER:  # a KV pull starts now and runs beside the steps
                req.external_tokens = n
                if req.request_id not in core._kv_waits:
                    core._start_pull(req, now)
                continue
            compute.append(entry)
            if kind == DECODE:
                decodes += 1
                context += req.num_tokens
            else:
                prefills += 1
                prefill_tokens += n
                prefill_context += req.num_computed_tokens
                if not req.output_token_ids and req.num_computed_tokens + n >= req.prefill_target:
                    firsts += 1
        if not compute and not pulled:
            return False
        core._step_counter += 1
        self.num_steps += 1
        batch = StepBatch(decodes, prefill_tokens, prefills, firsts, context,
                          after_idle=self._last_end is None or now > self._last_end, prefill_context=prefill_context)
        self.batch = _Batch(now + max(self.model.step_duration(batch, self._rng), 0.0), compute, pulled)
        return True

    def _schedule(self, now: float, pulled: bool) -> list:
        """The scheduler's batch without the requests the engine has not seen yet, unless they
        are all the work there is (then they are scheduled at once: at an idle engine the step's
        duration holds the input path)."""
        sched = self.core.scheduler
        if self._visible:
            self._visible = {rid: t for rid, t in self._visible.items() if t > now}
        if not self._visible:
            return sched.schedule(now)
        hidden = [r for r in sched.waiting if r.request_id in self._visible]
        if not hidden:
            return sched.schedule(now)
        sched.waiting = deque(r for r in sched.waiting if r.request_id not in self._visible)
        try:
            scheduled = sched.schedule(now)
        finally:
            sched.waiting.extend(hidden)
        if scheduled or pulled:
            return scheduled
        return sched.schedule(now)

    def _finish(self, b: _Batch) -> None:
        """The step ends: apply its work and emit every token it produced, at its end time."""
        core = self.core
        now = b.end
        requests = core.requests
        kv = core.kv
        block_size = kv.block_size
        sample = core._sample
        outputs: list = []
        finished: list = []
        running = RequestStatus.RUNNING
        for req in b.pulled:
            if req.status is running and requests.get(req.request_id) is req:
                req.first_due = now
                sample(req, now, outputs, finished)
        for req, n, kind in b.scheduled:
            if req.status is not running or requests.get(req.request_id) is not req:
                continue  # aborted (or finished by a drain) while the step ran
            req.num_computed_tokens += n
            if kind == DECODE:
                if n and req.num_computed_tokens // block_size > req.num_hashed_blocks:
                    kv.cache_computed_blocks(req)
                sample(req, now, outputs, finished)
                continue
            kv.cache_computed_blocks(req)
            if req.is_prefilling:
                continue
            if not req.output_token_ids:
                req.first_due = now
                sample(req, now, outputs, finished)
            else:  # resumed after preemption: the next step decodes its pending token
                core.scheduler.push_decode(req, now)
        if outputs or finished:
            core._emit(outputs, finished, with_stats=True)
        if core._draining_deadline is not None and not requests:
            core._stopped = True
