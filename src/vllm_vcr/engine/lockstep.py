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
idle rank's step is the latency model's `dummy_step_duration`. Engines in separate processes
(each with its own clock) are not tied: only engines sharing a clock step in lockstep.
"""

from __future__ import annotations

from typing import Any

from .policy import DP_SYNC_INTERVAL, LockstepRule
from .step import DummyStep, StepInFlight

__all__ = ["DP_SYNC_INTERVAL", "DataParallelLockstep"]


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
        model says the model is an MoE one with timed steps (`LatencyModel.data_parallel_lockstep`)
        and their engine type steps such ranks together (`EnginePolicy.dp_lockstep`, whose rule
        the group follows); None: they stay independent."""
        rules = {c.scheduler.engine_policy.dp_lockstep for c in cores}
        if len(cores) < 2 or len(rules) != 1 or None in rules \
                or not all(c.latency.times_steps and c.latency.data_parallel_lockstep for c in cores):
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
        if not self.rule.per_step and (self.rounds == 1 or self.rounds % self.rule.sync_interval == 0):
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
