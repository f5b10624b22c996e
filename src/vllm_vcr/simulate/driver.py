"""The discrete-event driver: a workload through N EngineCores on one VirtualClock, a router in
the loop, no HTTP.

The engines are the same `EngineCore` that `serve` and `play` run (same scheduler, KV cache,
prefix cache, preemption and step timing); only the clock is virtual, so time jumps from one
event (an arrival, a step's end) to the next. Each turn: find the earliest event, move the clock
there, hand the requests due by then to the router and their engines, and let every engine run
whatever is due at that instant.
"""

from __future__ import annotations

import gc
import heapq
import math
import time
from array import array
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..engine.block_hash import ContentHasher
from ..engine.clock import VirtualClock
from ..engine.config import EngineArgs
from ..engine.core import EngineCore
from ..engine.decode_cohort import counted_token_source, timing_only_unsupported
from ..engine.lockstep import DataParallelLockstep
from ..engine.policy import policy_for
from ..engine.types import EngineCoreOutputs, EngineCoreRequest, SamplingParams
from ..gc_tuning import YOUNG_THRESHOLD
from ..replay.inputs import engine_inputs
from .router import Router
from .workload import SimRequest

START = 1000.0  # the virtual clock's origin (seconds); reported times are relative to it
_FINISH_NAMES: dict = {}  # finish reason -> its name in the report ("length", "stop", ...)


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    engine: int
    prompt_len: int
    max_tokens: int
    arrival: float
    first: float = math.nan
    end: float = math.nan
    last: float = math.nan
    num_out: int = 0
    cached: int = 0
    finish: str = ""
    times: array = field(default_factory=lambda: array("d"))  # of every token after the first

    def add_tokens(self, n: int, t: float, prefill_stats: Any = None) -> None:
        """n tokens arrived at t: the first stamps TTFT (and the prompt's cached tokens); a batch
        of several after it is spread evenly since the previous token."""
        if self.num_out == 0:
            self.first = t
            if prefill_stats is not None:
                self.cached = getattr(prefill_stats, "num_cached_tokens", 0) or 0
        else:
            last, gap = self.last, (t - self.last) / n
            for i in range(1, n):
                self.times.append(last + gap * i)
            self.times.append(t)
        self.num_out += n
        self.last = t

    def gaps(self) -> np.ndarray:
        """Every inter-token gap (seconds)."""
        return np.diff(np.frombuffer(self.times, dtype=np.float64), prepend=self.first)


@dataclass
class Timeline:
    """Per-engine samples at every step that reported scheduler stats."""

    t: array = field(default_factory=lambda: array("d"))
    engine: array = field(default_factory=lambda: array("i"))
    running: array = field(default_factory=lambda: array("i"))
    waiting: array = field(default_factory=lambda: array("i"))
    kv_usage: array = field(default_factory=lambda: array("d"))
    preemptions: list[int] = field(default_factory=list)  # per engine
    steps: list[int] = field(default_factory=list)  # per engine: its step counter

    @classmethod
    def of_engines(cls, n: int) -> "Timeline":
        return cls(preemptions=[0] * n, steps=[0] * n)

    def record(self, engine: int, t: float, stats: Any) -> None:
        """Engine `engine`'s scheduler stats of an output batch at `t`."""
        self.t.append(t - START)
        self.engine.append(engine)
        self.running.append(stats.num_running_reqs)
        self.waiting.append(stats.num_waiting_reqs)
        self.kv_usage.append(stats.kv_cache_usage)
        self.preemptions[engine] += stats.num_preemptions
        self.steps[engine] = stats.step_counter


@contextmanager
def _rare_collections():
    """Collect reference cycles less often during a run, at the serving processes' young threshold
    (gc_tuning.py): a run allocates many small objects that live long (blocks, requests, records),
    and at the default threshold (700) a tenth of its time went to the cyclic collector. The
    threshold is restored after. What the run allocated and still holds (the engines' KV blocks,
    the records: ~30,000 objects for 1,000 requests) would then be walked by the next young
    collection at once, and by a middle-generation one later, before it settles in the oldest
    generation: unless the process froze objects of its own (`gc.freeze`, which this would undo),
    it goes there at once (a freeze and an unfreeze: no walk, the young count back to zero)."""
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], YOUNG_THRESHOLD), *before[1:])
    try:
        yield
    finally:
        if gc.isenabled() and gc.get_freeze_count() == 0 and gc.get_count()[0] > before[0]:
            gc.freeze()
            gc.unfreeze()
        gc.set_threshold(*before)


def first_arrivals(workload: Any, concurrency: int, push: Callable[[float, Any], None]) -> None:
    """Push the workload's first arrivals: each closed-loop user's first request (spread over the
    workload's ramp-up), or every arrival of an open-loop workload."""
    if workload.closed_loop:
        users = max(concurrency, 1)
        ramp = getattr(workload, "ramp_up", 0.0)
        for i in range(users):
            req = workload.next_closed()
            if req is None:
                break
            push(START + ramp * i / users, req)
    else:
        for req in workload.open_arrivals():
            push(START + req.arrival, req)


def run_events(clock: Any, cores: list, arrivals: list, deliver: Callable[[Any, float], None],
               fast_forward: Callable[[float], None] | None = None) -> None:
    """The virtual clock's loop until nothing is left: advance to the next arrival (a heap of
    (time, seq, request)) or engine wake-up, deliver the arrivals due, run every engine due, then
    `fast_forward(now)` (timing-only runs). `deliver` may push new arrivals onto the heap."""
    while True:
        t = arrivals[0][0] if arrivals else math.inf
        for core in cores:
            w = core.next_wake()
            if w is not None and w < t:
                t = w
        if t == math.inf:
            return
        clock.advance_to(t)
        now = clock.now()
        while arrivals and arrivals[0][0] <= now:
            deliver(heapq.heappop(arrivals)[2], now)
        for core in cores:
            w = core.next_wake()
            if w is not None and w <= now:
                core.run_until_idle(until=now)
        if fast_forward is not None:
            fast_forward(now)


def run_engines(clock: Any, cores: list, arrivals: list, deliver: Callable[[Any, float], None],
                timing_only: bool) -> None:
    """`run_events` for a simulator's own engines, with `fast_forward` in timing-only runs, reading
    each engine's next wake-up only when it may have moved. An engine's state changes only when
    this loop runs it (`run_until_idle`, `fast_forward`) or when something posts to its inbox (an
    arrival, another engine's handoff, a KV hold to release: then it is due now, as `next_wake`
    says); so its wake-up is kept from its last run on and read again after the next. The shared
    clock moves nobody else's: an engine with work due now runs before the clock moves on. Not for
    DP ranks in lockstep, whose steps another rank runs: they go through `run_events`."""
    ff = (lambda now: fast_forward(cores, arrivals)) if timing_only else None
    if any(core.lockstep is not None for core in cores):
        run_events(clock, cores, arrivals, deliver, ff)
        return
    inboxes = [core.inbox.messages for core in cores]
    wakes = [_wake(core.next_wake()) for core in cores]
    engines = range(len(cores))
    while True:
        now = clock.now()
        t = arrivals[0][0] if arrivals else math.inf
        for i in engines:
            w = now if inboxes[i] else wakes[i]
            if w < t:
                t = w
        if t == math.inf:
            return
        clock.advance_to(t)
        now = clock.now()
        while arrivals and arrivals[0][0] <= now:
            deliver(heapq.heappop(arrivals)[2], now)
        for i in engines:
            if inboxes[i] or wakes[i] <= now:
                w = cores[i].run_until_idle(until=now)
                wakes[i] = math.inf if w is None else w
        if timing_only:
            fast_forward(cores, arrivals, wakes, inboxes)


def _wake(t: float | None) -> float:
    return math.inf if t is None else t


def timed_engine_inputs(args: EngineArgs, timing_only: bool | None) -> tuple[dict[str, Any], bool, bool]:
    """The engines' built inputs (engine_inputs), whether they run timing-only decodes (None: when
    they can: their steps are timed, nothing plans or replays their tokens), and whether their
    random outputs are counted instead of drawn (nothing reads the ids)."""
    inputs = engine_inputs(args)  # the latency model (perf model, trace) and other built inputs
    if timing_only is None:  # nothing reads the tokens: by default, when the engine can
        latency = inputs.get("latency")
        timing_only = latency is not None and not (inputs.keys() & {"planner", "replay_table"}) and \
            timing_only_unsupported(latency, policy_for(args.engine_type), args) is None
    counted = False
    if timing_only:  # no KV events leave the process: any content hash finds the same prefixes
        inputs["block_hasher"] = ContentHasher()
        if args.mode == "random" and not args.reasoning:  # nothing reads the ids: none are drawn
            inputs["token_source_factory"] = counted_token_source(args.vocab_size)
            counted = True
    return inputs, timing_only, counted


def listen_for_silent_tokens(cores: list, records: dict[str, RequestRecord], adopt_prompts: bool) -> None:
    """Each timing-only engine's decodes between a request's first and last token, produced without
    outputs (one per cohort step first..last), go to the request's record (`records`, by id, while
    it runs); `adopt_prompts`: the engines extend the prompt lists they are given instead of copying."""
    for core in cores:
        core.admission.adopt_prompts = adopt_prompts
        if core.cohort is None:
            continue
        step_ends = core.cohort.step_ends

        def on_tokens(req, first: int, last: int, step_ends: array = step_ends) -> None:
            rec = records.get(req.request_id)
            if rec is None:
                return
            rec.times.extend(step_ends[first - 1:last])
            rec.num_out += last - first + 1
            rec.last = step_ends[last - 1]

        core.cohort.on_tokens = on_tokens


def fast_forward(cores: list, arrivals: list, wakes: list[float] | None = None,
                 inboxes: list | None = None) -> None:
    """Let each timing-only engine run its decode-only steps up to the next event that could reach
    it: the next arrival (a heap of (time, seq, request)), or any other engine's next step end (a
    finish there may route a request here, a prefill worker's may hand it one). `wakes` and
    `inboxes`: `run_engines`'s kept wake-ups (inf: none) and the engines' inbox queues, the wake-up
    of an engine that ran ahead read again into `wakes`; without them every engine's is read."""
    first = arrivals[0][0] if arrivals else math.inf
    if len(cores) == 1:
        if cores[0].fast_forward(first) and wakes is not None:
            wakes[0] = _wake(cores[0].next_wake())
        return
    kept = wakes is not None
    for i, core in enumerate(cores):
        if not core.may_fast_forward():
            continue
        if wakes is None:  # (read again after an engine ran ahead: it moved the shared clock)
            wakes = [_wake(c.next_wake()) for c in cores]
        now = cores[0].clock.now()  # (an engine with inputs waiting is due now)
        horizon = first
        for j, w in enumerate(wakes):
            if j != i:
                if inboxes is not None and inboxes[j]:
                    w = now
                if w < horizon:
                    horizon = w
        if core.fast_forward(horizon):
            if kept:
                wakes[i] = _wake(core.next_wake())
            else:
                wakes = None


class Simulation:
    def __init__(self, args: EngineArgs, num_engines: int, router: Router, workload,
                 *, concurrency: int = 0, progress: Callable[[int], None] | None = None,
                 timing_only: bool | None = None) -> None:
        self.clock = VirtualClock(START)
        self.args = args
        self.router = router
        self.workload = workload
        self.concurrency = concurrency
        self.records: dict[str, RequestRecord] = {}
        self.done: list[RequestRecord] = []
        self.timeline = Timeline.of_engines(num_engines)
        self._progress = progress
        inputs, self.timing_only, counted = timed_engine_inputs(args, timing_only)
        self.cores = [EngineCore(args, engine_index=i, clock=self.clock, output_sink=self._sink(i),
                                 timing_only=self.timing_only, **inputs) for i in range(num_engines)]
        DataParallelLockstep.attach(self.cores)  # an MoE model's DP ranks step together, as in vLLM
        # a synthetic workload's prompt lists are made per request and never read after delivery: the
        # engines extend them instead of copying (not with a token source that reads the prompt)
        listen_for_silent_tokens(self.cores, self.records, counted and getattr(workload, "fresh_prompts", False))
        self._arrivals: list[tuple[float, int, SimRequest]] = []
        self._closed_loop = workload.closed_loop
        self._seq = 0
        self.wall_s = 0.0

    # --- outputs ---------------------------------------------------------------------------------
    def _sink(self, engine: int):
        def sink(client: int, outs: EngineCoreOutputs) -> None:
            self._on_outputs(engine, outs)
        return sink

    def _on_outputs(self, engine: int, outs: EngineCoreOutputs) -> None:
        t = outs.timestamp
        stats = outs.scheduler_stats
        if stats is not None:
            self.timeline.record(engine, t, stats)
        for o in outs.outputs:
            rec = self.records.get(o.request_id)
            if rec is None:
                continue
            if o.new_token_ids:
                rec.add_tokens(len(o.new_token_ids), t, o.prefill_stats)
            if o.finish_reason is not None:
                self._finish(rec, t, o.finish_reason)

    def _finish(self, rec: RequestRecord, t: float, reason) -> None:
        rec.end = t
        finish = _FINISH_NAMES.get(reason)
        if finish is None:
            name = getattr(reason, "name", None)
            finish = _FINISH_NAMES[reason] = (str(reason) if name is None else name).lower()
        rec.finish = finish
        del self.records[rec.request_id]
        self.done.append(rec)
        self.router.on_finish(rec.engine, rec.prompt_len, rec.max_tokens)
        if self._closed_loop:
            nxt = self.workload.next_closed()
            if nxt is not None:
                self._seq += 1
                heapq.heappush(self._arrivals, (t, self._seq, nxt))
        if self._progress is not None:
            self._progress(len(self.done))

    # --- arrivals --------------------------------------------------------------------------------
    def _push(self, t: float, req: SimRequest) -> None:
        self._seq += 1
        heapq.heappush(self._arrivals, (t, self._seq, req))

    def _deliver(self, req: SimRequest, now: float) -> None:
        engine = self.router.route(req.prompt)
        self.router.on_start(engine, req.prompt, req.max_tokens)
        self.records[req.request_id] = RequestRecord(req.request_id, engine, len(req.prompt), req.max_tokens, now)
        sp = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True)
        self.cores[engine].add_request(EngineCoreRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt, sampling_params=sp, arrival_time=now))

    # --- the loop --------------------------------------------------------------------------------
    def run(self) -> "Simulation":
        with _rare_collections():
            return self._run()

    def _run(self) -> "Simulation":
        wall = time.perf_counter()
        first_arrivals(self.workload, self.concurrency, self._push)
        run_engines(self.clock, self.cores, self._arrivals, self._deliver, self.timing_only)
        self.wall_s = time.perf_counter() - wall
        return self
