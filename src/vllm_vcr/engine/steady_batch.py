"""Steady decodes stepped together: vLLM v1's persistent batch (`InputBatch`) for in-process readers.

A steady decode (random ids, one token per step, a fixed gap: `OutputProcessor._steady_decode`)
whose reader takes its tokens in the step (a token sink and a batch member: serve's streams)
joins a `SteadyBatch` after its first steady token. A batch's members have the same gap and the
same kind of reader, and deadlines within DUE_SLACK of each other; one entry in the scheduler's
decode lane stands for all of them, due at the earliest member's deadline (members the step
comes too early for wait on the plain path). A step of the batch draws, appends and hands over
its members' tokens as whole columns (`map` over parallel lists, the loops in C), not one
request at a time: per token that is most of what a stream costs at W2's scale. Nothing an
engine or a reader emits changes: each member's deadline moves by the same float additions as
on the plain path, so the same ids come at the same step times (tests/engine/test_steady_batch.py).

What a member leaves behind while in the batch: its computed count (len(all_token_ids) - 1
between steps) and its next deadline are brought up to date only when it leaves. A member leaves
(back to the plain path, which may bring it back) for its last token (that one is `sample`'s,
with its finish), when its reader declines a token, when it is aborted or preempted
(Scheduler.remove, _preempt), when the step's budget cannot take the whole batch, and at a block
boundary that the free blocks cannot cover with one to spare for each other running request (the
plain path then allocates in deadline order and preempts as it does). Between, its KV blocks are
taken and registered in the prefix cache at the steps the plain path would do it: members are
bucketed by the phase of their length, so a step visits only those at a boundary.
"""

from __future__ import annotations

import itertools
from array import array
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from .request import Request, RequestStatus
from .types import EngineCoreOutput

if TYPE_CHECKING:
    from .kv_cache_manager import KVCacheManager

_batch_seq = itertools.count(-1, -1)  # lane tie-breakers, apart from the requests' (positive) seqs


class BatchColumns(Protocol):
    """The readers' side of one batch, in the batch's member order."""

    def add(self, reader: Any) -> None: ...

    def drop(self, index: int) -> None:
        """Member `index` leaves: bring its reader's own state up to date, then forget it."""

    def take(self, tokens: list[int], ts: float) -> list[int] | None:
        """One token per member (the step's clock time `ts`): the indices of those whose reader
        declined its token (it goes out as an output), or None when every one was taken."""


class BatchReader(Protocol):
    """A request's `batch_member`: its reader, as a member of a batch."""
    kind: Any  # readers of one kind share batches (`new_columns` makes their columns)

    def ready(self) -> bool:
        """The reader can take tokens in a batch from the next step on."""

    def new_columns(self) -> BatchColumns: ...


class DecodeLane(Protocol):
    """The scheduler, as a batch uses it (scheduler.py's Scheduler): its running requests, and
    its decode heap and lane, where a batch (and a member leaving it) takes its place."""
    running: list[Request]

    def push_decode(self, req: Any, due: float) -> None: ...

    def push_next_decode(self, req: Any, due: float) -> None: ...


class StepSampler(Protocol):
    """The output processor, as a batch's step uses it (output.py's OutputProcessor)."""
    step_time: float  # the clock when the step being applied ended
    tokens_taken: int  # by token sinks since the last output batch

    def sample(self, req: Request, now: float, outputs: list, finished: list, burst: int = 1) -> None:
        """The general path for a request's token: its last steady one's successor, with its finish."""


class SteadyBatch:
    """Members' state in parallel lists; in the scheduler's lane it looks like a request (status,
    heap_gen, seq, next_due)."""

    status = RequestStatus.RUNNING  # (the lane's liveness check reads it; an empty batch has no entry)

    def __init__(self, batches: SteadyBatches, kind: Any, gap: float, columns: BatchColumns) -> None:
        self.batches = batches
        self.kind = kind
        self.gap = gap
        self.lo = self.hi = 0.0  # the earliest and latest member deadlines (at most DUE_SLACK apart)
        self.seq = next(_batch_seq)
        self.request_id = f"steady-batch{-self.seq}"  # (step logs name scheduled entries by it)
        self.heap_gen = 0
        self.step = 0  # batch steps applied
        self.scheduled = False  # in the step being run: nobody joins before it is applied
        self.columns = columns
        self.reqs: list[Request] = []
        self.ids: list[Any] = []  # the members' token iterators
        self.outs: list[list[int]] = []
        self.alls: list[list[int]] = []
        # each member's next deadline, moved by the gap each step as the plain path moves it (the
        # same float sums: the same steps, at the same clock times); C doubles side by side, not a
        # float object per member that is cold again by the batch's next step
        self.dues = array("d")
        self.phases: list[int] = []  # (len(all_token_ids) - step - 1) % block_size, fixed while a member
        self.leave_at: list[int] = []  # the step whose token is the member's last steady one, + 1
        self.buckets: list[list[Request]] = [[] for _ in range(batches.block_size)]
        self.leaving: dict[int, list[Request]] = {}

    @property
    def next_due(self) -> float:
        """The batch's deadline: its earliest member's."""
        return self.lo

    @next_due.setter
    def next_due(self, due: float) -> None:  # (the lane's push; shift_deadlines after a pause)
        if due != self.lo:
            delta = due - self.lo
            self.dues = array("d", [d + delta for d in self.dues])
            self.lo, self.hi = due, self.hi + delta

    def shift_due(self, delta: float) -> None:
        """Every member's deadline `delta` later (after a pause), as the plain path moves each one:
        d + delta, bit for bit (rounding is monotonic, so lo and hi stay the min and the max)."""
        self.dues = array("d", [d + delta for d in self.dues])
        self.lo, self.hi = self.lo + delta, self.hi + delta

    def __len__(self) -> int:
        return len(self.reqs)

    def fits(self, due: float) -> bool:
        if self.scheduled:
            return False  # (a joiner would get a second token in this step)
        return max(self.hi, due) - min(self.lo, due) <= self.batches.slack

    def add(self, req: Request, due: float, reader: BatchReader) -> None:
        if self.reqs:
            self.lo, self.hi = min(self.lo, due), max(self.hi, due)
        else:
            self.lo = self.hi = due
        req.steady_batch = self
        phase = (len(req.all_token_ids) - self.step - 1) % self.batches.block_size
        leave = self.step + req.steady_left + 1
        self.reqs.append(req)
        self.ids.append(req.token_source.ids)
        self.outs.append(req.output_token_ids)
        self.alls.append(req.all_token_ids)
        self.dues.append(due)
        self.phases.append(phase)
        self.leave_at.append(leave)
        self.buckets[phase].append(req)
        self.leaving.setdefault(leave, []).append(req)
        self.columns.add(reader)

    def leave(self, req: Request) -> None:
        """Take `req` out, its state brought up to date as after its last step in the batch."""
        i = self.reqs.index(req)
        req.steady_batch = None
        req.num_computed_tokens = len(req.all_token_ids) - 1
        req.next_due = self.dues[i]
        req.steady_left = max(self.leave_at[i] - self.step - 1, 0)  # the steady tokens it still had
        self.buckets[self.phases[i]].remove(req)
        leaving = self.leaving[self.leave_at[i]]
        leaving.remove(req)
        if not leaving:
            del self.leaving[self.leave_at[i]]
        for col in (self.reqs, self.ids, self.outs, self.alls, self.dues, self.phases, self.leave_at):
            del col[i]
        self.columns.drop(i)
        if not self.reqs:
            self.heap_gen += 1  # its lane entry, if any, goes stale
            self.batches.forget(self)
        else:
            lo = min(self.dues)
            self.hi = max(self.dues)
            if lo != self.lo:  # its earliest member left: a later place in the lane
                self.lo = lo
                self.batches.touched.append(self)

    def eject(self, req: Request, sched: DecodeLane) -> None:
        """Back to the plain path, due when it was."""
        self.leave(req)
        sched.push_decode(req, req.next_due)

    # --- a step ------------------------------------------------------------------------------------
    def schedule(self, sched: DecodeLane, budget: int, horizon: float) -> int:
        """The batch is due: its members' tokens for this step (their count), KV blocks included.
        0: it went back to the plain path whole (the budget cannot take it). Members not due by
        `horizon` (the step came early for them) wait on the plain path."""
        if self.hi > horizon:
            for req, due in list(zip(self.reqs, self.dues)):
                if due > horizon:
                    self.eject(req, sched)
        if len(self.reqs) > budget:
            for req in list(self.reqs):
                self.eject(req, sched)
            return 0
        kv = self.batches.kv
        bs = kv.block_size
        # members whose next token starts a block: len(all_token_ids) % bs == 1 this step
        due = [r for r in self.buckets[-self.step % bs] if len(r.all_token_ids) > len(r.blocks) * bs]
        if due:
            # the batch comes before or after other decodes of this step, not in their order: it
            # takes its blocks only when they leave one for each other running request too; else
            # (KV pressure) its members at a boundary take the plain path, in order, preempting as it does
            if len(due) + len(sched.running) - len(self.reqs) > kv.pool.num_free_blocks:
                for req in due:
                    self.eject(req, sched)
            else:
                for req, block in zip(due, kv.pool.allocate(len(due))):
                    req.blocks.append(block)
        self.scheduled = bool(self.reqs)
        return len(self.reqs)

    def apply(self, proc: StepSampler, now: float, outputs: list, finished: list) -> None:
        """The step ended at `now`: each member has one more token."""
        self.scheduled = False
        self.step = k = self.step + 1
        kv = self.batches.kv
        bs = kv.block_size
        for req in self.buckets[-k % bs]:  # their computed tokens fill a block: into the prefix cache
            n = req.num_computed_tokens = len(req.all_token_ids)
            if n // bs > req.num_hashed_blocks:
                kv.cache_computed_blocks(req)
        last = self.leaving.get(k)
        if last:  # their last steady token was the previous one: this one is `sample`'s
            for req in list(last):
                self.leave(req)
                req.num_computed_tokens += 1
                proc.sample(req, now, outputs, finished)
        reqs = self.reqs
        if not reqs:
            return
        gap = self.gap
        self.dues = array("d", map(gap.__add__, self.dues))  # (d + gap: the plain path's sum, bit for bit)
        self.lo += gap
        self.hi += gap
        tokens = list(map(next, self.ids))
        deque(map(list.append, self.outs, tokens), 0)
        deque(map(list.append, self.alls, tokens), 0)
        declined = self.columns.take(tokens, proc.step_time)
        proc.tokens_taken += len(tokens)
        if declined:  # as outputs, from the plain path on (in reverse: positions stay valid)
            proc.tokens_taken -= len(declined)
            sched = self.batches.sched
            for i in reversed(declined):
                req = reqs[i]
                self.leave(req)  # (its next deadline: the batch's has moved on)
                sched.push_next_decode(req, req.next_due)
                outputs.append((req.client_index, EngineCoreOutput(request_id=req.request_id,
                                                                   new_token_ids=[tokens[i]])))
        self.batches.touched.append(self)


class SteadyBatches:
    """An engine's steady batches: joining, and each step's re-entry into the lane."""

    def __init__(self, sched: DecodeLane, kv: KVCacheManager, slack: float) -> None:
        self.sched = sched
        self.kv = kv
        self.block_size = kv.block_size
        self.slack = slack
        self.forming: dict[tuple, SteadyBatch] = {}  # (kind, gap) -> the batch the next joiner tries
        self.live: dict[int, SteadyBatch] = {}  # by seq: every batch with members
        self.touched: list[SteadyBatch] = []  # batches that changed in this step (to the lane at its end)

    def join(self, req: Request, due: float, reader: BatchReader) -> None:
        """`req` took a steady token and has more: it decodes in a batch from its next one (due then)."""
        key = (reader.kind, req.steady_gap)
        batch = self.forming.get(key)
        if batch is None or not batch.fits(due):
            batch = self.forming[key] = SteadyBatch(self, reader.kind, req.steady_gap, reader.new_columns())
            self.live[batch.seq] = batch
        batch.add(req, due, reader)
        self.touched.append(batch)

    def forget(self, batch: SteadyBatch) -> None:
        """`batch` has no member left."""
        self.live.pop(batch.seq, None)
        key = (batch.kind, batch.gap)
        if self.forming.get(key) is batch:
            del self.forming[key]

    def flush(self) -> None:
        """End of a step: every batch that changed takes its (new) place in the lane."""
        push = self.sched.push_next_decode
        done = set()
        for batch in self.touched:
            if batch.reqs and batch.seq not in done and not batch.scheduled:
                done.add(batch.seq)
                batch.lo, batch.hi = min(batch.dues), max(batch.dues)  # (exact: the sums above may round)
                push(batch, batch.lo)  # (its older entry, if any, goes stale)
        self.touched.clear()

    def dissolve(self) -> None:
        """Every member back to the plain path (a config patch recounts their steady runs)."""
        for batch in list(self.live.values()):
            batch.scheduled = False
            for req in list(batch.reqs):
                batch.eject(req, self.sched)
        self.touched.clear()
