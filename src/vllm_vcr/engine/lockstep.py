"""Data-parallel ranks of an MoE model stepping in lockstep, as vLLM runs them.

vLLM serves an MoE model with `--data-parallel-size D` as D engine cores (`DPEngineCoreProc`,
vllm/v1/engine/core.py: only for MoE models; a dense model's DP ranks are independent engines)
whose every forward pass joins the MoE layers' collectives across the ranks. So the ranks step
together: while any rank has work, every rank runs a forward pass per step (a rank with nothing
scheduled runs a dummy batch, `execute_dummy_batch`: a one-token forward), and a step lasts as
long as the slowest rank's, so one rank's prefill stalls every rank's decodes. A wave of steps
starts when a rank gets work and ends at a step where no rank has unfinished requests; the
ranks agree on that only every `dp_sync_interval` steps (16) and after a wave's first step,
running dummy steps until then (`_has_global_unfinished_reqs`). That is vLLM's rule; an engine
type declares its own (`EnginePolicy.dp_lockstep`, engine/policy.py): SGLang's DP attention
gathers every rank's batch size before every forward, and runs one (an idle batch on the ranks
with nothing) only when some rank has a batch, so its rounds stop as soon as no rank schedules.

`DataParallelLockstep` ties the EngineCores of one process (and one clock) together that way:
at a step's end it ends every rank's step, then starts every rank's next one (each rank reads
its inputs first, as vLLM's busy loop does), and they all end at the longest rank's end. An
idle rank's step is the latency model's `dummy_step_duration`.

Ranks in separate processes (`serve --data-parallel-size D`: one engine-core process per rank)
step the same way through a coordinator (vLLM's DP coordinator plus its per-step all-reduce):
`RankLockstep` is one rank's side (it reports each step it starts and waits for the round's
end), `LockstepRounds` the coordinator's (it pairs the ranks' reports into rounds and decides
each round's end and the wave's). Both apply the same wave rule (`wave_check_due`). The
messages' transport is not the engine's (wire/lockstep.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from .policy import DP_SYNC_INTERVAL, LockstepRule
from .step import DummyStep, StepInFlight

__all__ = ["DP_SYNC_INTERVAL", "DataParallelLockstep"]


def lockstep_applies(core: Any) -> LockstepRule | None:
    """The rule by which `core` steps in lockstep with its DP peers, when it does: an MoE model
    with timed steps (`LatencyModel.data_parallel_lockstep`) on an engine type that steps such
    ranks together (`EnginePolicy.dp_lockstep`). None: it steps on its own."""
    if core.latency.times_steps and core.latency.data_parallel_lockstep:
        return core.scheduler.engine_policy.dp_lockstep
    return None


def wave_check_due(rounds: int, sync_interval: int = DP_SYNC_INTERVAL) -> bool:
    """After `rounds` steps of a wave the ranks agree whether any has unfinished requests (the
    wave ends when none has): after its first step and every `sync_interval`-th."""
    return rounds == 1 or rounds % sync_interval == 0


class DataParallelLockstep:
    """The step rounds of D engines. The cores call `joined` (a rank put a real step in flight),
    `idle` (a rank has nothing to schedule: a dummy step while a wave runs) and `advance` (a
    rank's step ended: the round ends for all); the round calls every rank's `read_inbox`,
    `end_step` and `start_step`."""

    def __init__(self, cores: list[Any], rule: LockstepRule = LockstepRule()) -> None:
        self.cores = cores
        self.rule = rule
        self.end: float | None = None  # the current round's end (None: no wave is running)
        self.rounds = 0  # steps of the current wave (vLLM's DPEngineCoreProc.step_counter)
        self.waves = 0  # waves started (for tests and reports)
        self._forming: list[Any] | None = None  # the round being formed: its ranks

    @classmethod
    def attach(cls, cores: list[Any]) -> DataParallelLockstep | None:
        """Tie `cores` (the DP ranks of one deployment, one clock) together when their latency
        model says the model is an MoE one with timed steps and their engine type steps such
        ranks together (`lockstep_applies`: the rule the group follows); None: they stay independent."""
        rules = {lockstep_applies(c) for c in cores}
        if len(cores) < 2 or len(rules) != 1 or None in rules:
            return None
        group = cls(cores, rules.pop())
        for core in cores:
            core.lockstep = group
        return group

    def _live(self, core: Any) -> bool:
        life = core.lifecycle
        return not life.stopped and life.frozen_at is None

    # --- called by a core ------------------------------------------------------------------------
    def joined(self, core: Any, step: StepInFlight, now: float) -> None:
        """`core` put a real step in flight at `now`."""
        if self._forming is not None:
            self._forming.append(core)
        elif self.end is not None and self.end > now:  # a rank back from a pause joins the round under way
            self._stretch([c for c in self.cores if c.timed.in_flight is not None], step.end)
        else:  # a wave starts: every other rank steps too
            self._form(now, [core], [c for c in self.cores if c is not core and c.timed.in_flight is None])
            self.waves += 1

    def idle(self, core: Any, now: float) -> bool:
        """`core` has nothing to schedule at `now`: while a wave runs it steps anyway (a dummy
        batch, nothing computed for any request). False: it stays idle."""
        if self._forming is None and (self.end is None or self.end <= now):
            return False
        core.timed.in_flight = DummyStep(now + core.latency.dummy_step_duration(core.timed.rng))
        if self._forming is not None:
            self._forming.append(core)
        else:
            self._stretch([c for c in self.cores if c.timed.in_flight is not None], core.timed.in_flight.end)
        return True

    def advance(self, core: Any, end: float) -> None:
        """`core`'s step in flight ends at `end`: when that is the round's end, every rank's step
        ends there and the next round starts (or the wave stops)."""
        if end != self.end:  # (not in the round: a rank that was paused) it goes on alone
            core.end_step(core.timed.in_flight)
            if not core.lifecycle.drained():
                core.start_step(end)
            return
        ranks = [c for c in self.cores if self._live(c) and c.timed.in_flight is not None
                 and c.timed.in_flight.end == end]
        going = [c for c in ranks if c.end_step(c.timed.in_flight)]
        self.rounds += 1
        # vLLM's ranks agree whether to go on (SGLang's gather their batches as the next round forms)
        if not self.rule.per_step and wave_check_due(self.rounds, self.rule.sync_interval):
            if not any(c.has_unfinished_requests() for c in self.cores):
                self.end, self.rounds = None, 0
                return
        self._form(end, [], [c for c in going if self._live(c)])

    # --- the round -------------------------------------------------------------------------------
    def _form(self, now: float, ranks: list[Any], others: list[Any]) -> None:
        """Start a round at `now` with `ranks` (in flight already) and `others`, each reading its
        inputs and scheduling its step (a dummy when it has nothing); all end with the longest."""
        self._forming = ranks
        try:
            for core in others:
                core.read_inbox()
                if self._live(core) and core.timed.in_flight is None:
                    core.start_step(now)  # (a rank with nothing to schedule comes back through `idle`)
        finally:
            self._forming = None
        self.end = None
        if self.rule.per_step and all(c.timed.in_flight.dummy for c in ranks):
            for core in ranks:  # no rank has a batch: none runs a forward, the wave is over
                core.timed.in_flight = None
            self.rounds = 0
            return
        self._stretch(ranks, now)

    def _stretch(self, ranks: list[Any], end: float) -> None:
        """Every rank's step in flight ends at the latest of theirs (and of `end`)."""
        for core in ranks:
            if core.timed.in_flight.end > end:
                end = core.timed.in_flight.end
        if self.end is not None and self.end > end:
            end = self.end
        for core in ranks:
            core.timed.in_flight.end = end
        self.end = end


# --- ranks in separate processes ---------------------------------------------------------------------
# A rank's messages to the coordinator: HELLO (it takes part), REPORT (seq, its step's own end,
# has unfinished requests) at each step it starts while a wave runs, LEAVE (it stops stepping).
# The coordinator's: START (a wave started: step too), GO (seq, the round's end), END (seq: the
# wave ended with that round; drop its dummy step). Ends are time.monotonic() times, one clock
# for every process of the machine.
HELLO, REPORT, LEAVE = "hello", "report", "leave"
START, GO, END = "start", "go", "end"
ROUND_WAIT = 5.0  # s: a rank whose round's end does not come by its own end + this goes on alone


class RankLockstep:
    """One rank's side of the lockstep across processes (the core's `lockstep`). `send(*message)`
    reaches the coordinator; the coordinator's messages come back through `on_message`, which
    must run in the core's turn (`EngineCore.call`)."""

    def __init__(self, core: Any, send: Callable[..., None], round_wait: float = ROUND_WAIT,
                 rule: LockstepRule = LockstepRule()) -> None:
        self.core = core
        self.send = send
        self.round_wait = round_wait
        self.rule = rule
        self.wave = False  # a wave is running (this rank steps, a dummy when it has nothing)
        self.rounds = 0
        self.waves = 0
        self.seq = 0  # the last step reported
        self.pending: StepInFlight | None = None  # that step, until the coordinator gives its end
        self.own_end = 0.0  # when that step would end alone
        self.left = False  # the rank stepped for the last time
        core.lockstep = self
        send(HELLO)

    def _live(self) -> bool:
        life = self.core.lifecycle
        return not life.stopped and life.frozen_at is None

    def _report(self, step: StepInFlight) -> None:
        self.seq += 1
        self.pending, self.own_end = step, step.end
        # what decides the wave's end: SGLang's ranks stop when no rank has a batch, vLLM's when
        # none has unfinished requests
        going = not step.dummy or (not self.rule.per_step and self.core.has_unfinished_requests())
        self.send(REPORT, self.seq, step.end, going)
        step.end += self.round_wait  # (bounded: a round whose end never comes ends this late)

    def joined(self, core: Any, step: StepInFlight, now: float) -> None:
        if not self.wave:
            self.wave, self.rounds = True, 0
            self.waves += 1
        self._report(step)

    def idle(self, core: Any, now: float) -> bool:
        if not self.wave:
            return False
        core.timed.in_flight = step = DummyStep(now + core.latency.dummy_step_duration(core.timed.rng))
        self._report(step)
        return True

    def advance(self, core: Any, end: float) -> None:
        self.pending = None
        self.rounds += 1
        if not core.end_step(core.timed.in_flight):
            self.leave()
            return
        if self._live():
            core.start_step(end)

    def leave(self) -> None:
        """The rank steps no more (drained, stopped): the others go on without it."""
        if not self.left:
            self.left = True
            self.send(LEAVE)
        self.wave, self.pending = False, None

    def on_message(self, kind: str, *args: Any) -> None:
        """A coordinator's message, in the core's turn."""
        core = self.core
        if kind == START:
            if not (self.wave or self.left) and core.timed.in_flight is None and self._live():
                self.wave, self.rounds = True, 0
                self.waves += 1
                core.start_step(core.clock.now())  # a real step or, with nothing to do, a dummy one
            return
        step = self.pending
        if step is None or args[0] != self.seq:
            return  # a round this rank no longer waits for
        self.pending = None
        if kind == GO:
            step.end = max(args[1], self.own_end)
        elif kind == END and step.dummy and core.timed.in_flight is step:
            core.timed.in_flight = None  # the wave ended before this dummy step
            self.wave, self.rounds = False, 0
        else:
            step.end = self.own_end


class LockstepRounds:
    """The coordinator's side: the ranks' reports in order, one round per report of every rank
    taking part; `hello`, `report` and `leave` return the messages to send, as (rank, message)."""

    def __init__(self, rule: LockstepRule = LockstepRule()) -> None:
        self.rule = rule
        self.queues: dict[int, deque[tuple[int, float, bool]]] = {}  # the ranks taking part
        self.wave = False
        self.rounds = 0
        self.waves = 0

    def hello(self, rank: int) -> list[tuple[int, tuple]]:
        self.queues.setdefault(rank, deque())
        return [(rank, (START,))] if self.wave else []

    def leave(self, rank: int) -> list[tuple[int, tuple]]:
        self.queues.pop(rank, None)
        return self._close()

    def report(self, rank: int, seq: int, end: float, unfinished: bool) -> list[tuple[int, tuple]]:
        out = self.hello(rank) if rank not in self.queues else []
        self.queues[rank].append((seq, end, unfinished))
        return out + self._close()

    def _close(self) -> list[tuple[int, tuple]]:
        out: list[tuple[int, tuple]] = []
        queues = self.queues
        while queues:
            if not self.wave:
                if not any(queues.values()):
                    break
                self.wave, self.rounds = True, 0  # a rank started a wave: every other one steps too
                self.waves += 1
                out += [(r, (START,)) for r, q in queues.items() if not q]
            if not all(queues.values()):
                break
            reports = {r: q.popleft() for r, q in queues.items()}
            done, self.rounds = self.rounds, self.rounds + 1
            due = self.rule.per_step or wave_check_due(done, self.rule.sync_interval)
            if done and due and not any(u for _, _, u in reports.values()):
                self.wave = False
                out += [(r, (END, seq)) for r, (seq, _, _) in reports.items()]
            else:
                end = max(e for _, e, _ in reports.values())
                out += [(r, (GO, seq, end)) for r, (seq, _, _) in reports.items()]
        return out
