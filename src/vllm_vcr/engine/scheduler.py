"""The scheduler: which requests run in a step and how many tokens each computes.

vLLM v1's shape: a waiting queue and a running list; a per-step token budget
(`max_num_batched_tokens`) spent on running requests first (due decodes, then unfinished
prefills, chunked and capped by `long_prefill_token_threshold`) and then on admitting waiting
requests while `max_num_seqs` allows; KV blocks are allocated per scheduled chunk, and a running
request that cannot get a block preempts the lowest-priority running request (recompute).

Time enters only through decode deadlines: a decoding request is schedulable once its
`next_due` has arrived (its pacing was fixed at admission by the latency model).
"""

from __future__ import annotations

import heapq
from collections import deque
from operator import attrgetter
from typing import Any, Callable

from .config import EngineConfig, running_limit, token_budget
from .kv_cache_manager import KVCacheManager
from .lora import admissible
from .policy import EnginePolicy, VLLMPolicy, reserve_tokens
from .request import Request, RequestStatus
from .steady_batch import SteadyBatch
from .types import EngineCoreEvent, EngineCoreEventType, PrefixCacheStats, SchedulerStats

_output_ids = attrgetter("output_token_ids")


def output_counts(reqs: list[Request]) -> list[int]:
    """Each request's output tokens so far (`num_output_tokens`, read from the lists in C)."""
    return list(map(len, map(_output_ids, reqs)))


PREFILL, DECODE, TRANSFER, STEADY = 0, 1, 2, 3
# (request, tokens, PREFILL | DECODE | TRANSFER), or (SteadyBatch, its members, STEADY): the first
# item is either, hence Any
Scheduled = list[tuple[Any, int, int]]
# Deadlines this close together are served in one step: fewer wake-ups, and early by at most this.
DUE_SLACK = 0.0002


class Scheduler:
    def __init__(self, config_ref: Callable[[], EngineConfig], kv: KVCacheManager, policy: str = "fcfs",
                 long_prefill_token_threshold: int = 0, engine_policy: EnginePolicy | None = None) -> None:
        self._config = config_ref
        self.kv = kv
        self.policy = policy
        self.engine_policy = engine_policy or VLLMPolicy()  # the engine type's scheduling decisions
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefilling: list[Request] = []  # running requests that were given a prefill chunk
        self.bootstrapping: dict[str, Request] = {}  # destination-first prefills waiting for their decoder
        self.decode_heap: list[tuple[float, int, int, Request]] = []
        # deadlines that arrive in order (a decode's next one, a fixed gap after the one just
        # served): a FIFO beside the heap, so the steady decode pays no heap push and pop
        self.decode_lane: deque[tuple[float, int, int, Request]] = deque()
        self.prefix_stats = PrefixCacheStats()
        self.num_preemptions = 0  # since the last stats report
        self.total_preemptions = 0
        self.on_admit: Callable[[Request, float], None] | None = None  # draws pacing
        self.on_preempt: Callable[[Request, float], None] | None = None  # cancels KV pulls
        self.chunked_prefill = True
        # vLLM's scheduler_reserve_full_isl: a waiting request's whole sequence must fit at admission
        self.reserve_full_isl = False
        self.watermark_blocks = 0  # vLLM's --watermark: blocks an admission beside running requests leaves free
        # the head of the waiting queue found no free blocks; retry only once blocks are freed
        self.admission_blocked = False
        self.max_loras = 0  # > 0: at most this many distinct LoRA adapters in the batch (vLLM's max_loras)
        self.num_skipped_waiting = 0  # waiting requests the last step deferred (their adapter did not fit)
        self.paused_new = False  # sleep/pause: admit nothing until resumed
        # vLLM's --max-num-active-seqs and --max-num-scheduled-tokens (None: max_num_seqs, max_num_batched_tokens)
        self.max_active_seqs: int | None = None
        self.max_scheduled_tokens: int | None = None

    def running_limit(self) -> int:
        """How many requests may run at once (vLLM's max_num_active_reqs)."""
        return running_limit(self._config(), self.max_active_seqs)

    def token_budget(self) -> int:
        """The tokens one step may schedule (vLLM's max_num_scheduled_tokens)."""
        return token_budget(self._config(), self.max_scheduled_tokens)

    # --- queues ------------------------------------------------------------------------------
    def add_waiting(self, req: Request) -> None:
        if req.status is RequestStatus.BOOTSTRAPPING:
            self.bootstrapping[req.request_id] = req
        else:
            self.waiting.append(req)

    def destination_joined(self, request_id: str) -> bool:
        """A destination-first prefill's decoder has joined: it is queued now (False: not parked)."""
        req = self.bootstrapping.pop(request_id, None)
        if req is None:
            return False
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        return True

    def push_decode(self, req: Request, due: float) -> None:
        req.next_due = due
        req.heap_gen += 1
        heapq.heappush(self.decode_heap, (due, req.seq, req.heap_gen, req))

    def push_next_decode(self, req: Request, due: float) -> None:
        """push_decode for a decode's next deadline: onto the lane when no entry there is due later
        (the heap and the lane together serve deadlines in exactly the heap's order)."""
        req.next_due = due
        gen = req.heap_gen = req.heap_gen + 1
        lane = self.decode_lane
        if not lane or lane[-1][0] < due or (lane[-1][0] == due and lane[-1][1] < req.seq):
            lane.append((due, req.seq, gen, req))
        else:
            heapq.heappush(self.decode_heap, (due, req.seq, gen, req))

    def shift_deadlines(self, delta: float) -> None:
        """Move every pending decode deadline later by `delta` (after a pause)."""
        shifted = []
        for due, seq, gen, req in (*self.decode_heap, *self.decode_lane):
            if req.status is RequestStatus.RUNNING and gen == req.heap_gen:
                req.shift_due(delta)
                shifted.append((req.next_due, seq, gen, req))
        heapq.heapify(shifted)
        self.decode_heap = shifted
        self.decode_lane.clear()

    def next_deadline(self) -> float | None:
        heap = self.decode_heap
        while heap:
            due, _, gen, req = heap[0]
            if req.status is RequestStatus.RUNNING and gen == req.heap_gen:
                break
            heapq.heappop(heap)
        lane = self.decode_lane
        while lane:
            due, _, gen, req = lane[0]
            if req.status is RequestStatus.RUNNING and gen == req.heap_gen:
                return due if not heap or due < heap[0][0] else heap[0][0]
            lane.popleft()
        return heap[0][0] if heap else None

    def has_immediate_work(self) -> bool:
        """Prefill chunks or admissions that the next step can do without waiting for a deadline."""
        if self.prefilling and any(r.status is RequestStatus.RUNNING and r.is_prefilling for r in self.prefilling):
            return True
        return (len(self.waiting) > self.num_skipped_waiting and not self.admission_blocked and not self.paused_new
                and len(self.running) < self.running_limit())

    def remove(self, req: Request, free_blocks: bool = True) -> None:
        """Take a request out of whichever queue holds it (finish or abort)."""
        if req.steady_batch is not None:
            req.steady_batch.leave(req)
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.num_skipped_waiting = 0  # its adapter may have left the batch: retry the deferred
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        elif req.status is RequestStatus.BOOTSTRAPPING:
            self.bootstrapping.pop(req.request_id, None)
        req.heap_gen += 1
        if free_blocks:
            self.kv.free(req)
            self.admission_blocked = False

    # --- one step ------------------------------------------------------------------------------
    def schedule(self, now: float) -> list[tuple[Request, int, int]]:
        """The step's batch. The engine policy decides its composition: vLLM runs due decodes, then
        prefill chunks, then admissions; SGLang runs prefills and admissions alone when there are
        any, and decodes only in a step without them."""
        policy = self.engine_policy
        policy.on_step()
        budget = self.token_budget()
        preemptions_before = self.total_preemptions
        if policy.extend_first:
            scheduled, budget = self._schedule_prefills([], budget, now)
            if self.total_preemptions == preemptions_before and self.waiting and not self.paused_new:
                scheduled, budget = self._schedule_waiting(scheduled, budget, now)
            if scheduled:
                return scheduled
            return self.without_victims(self._schedule_decodes([], budget, now)[0], preemptions_before)
        scheduled, budget = self._schedule_running([], budget, now)
        if self.total_preemptions != preemptions_before:
            return self.without_victims(scheduled, preemptions_before)  # no admissions, as vLLM
        if not self.waiting or self.paused_new:  # paused (vLLM's PAUSED_NEW): new requests queue
            return scheduled
        return self._schedule_waiting(scheduled, budget, now)[0]

    def without_victims(self, scheduled: Scheduled, preemptions_before: int) -> Scheduled:
        """The batch less the requests this step preempted after scheduling them (their blocks are
        gone: vLLM drops them from the step, SGLang retracts them before its forward)."""
        if self.total_preemptions == preemptions_before:
            return scheduled
        return [s for s in scheduled if s[0].status is RequestStatus.RUNNING]

    def _schedule_running(self, scheduled: Scheduled, budget: int, now: float) -> tuple[Scheduled, int]:
        """Running requests: due decodes (earliest deadline first), then unfinished prefills."""
        scheduled, budget = self._schedule_decodes(scheduled, budget, now)
        return self._schedule_prefills(scheduled, budget, now)

    def _schedule_decodes(self, scheduled: Scheduled, budget: int, now: float) -> tuple[Scheduled, int]:
        """Running requests whose next token is due (earliest first)."""
        heap = self.decode_heap
        lane = self.decode_lane
        horizon = now + DUE_SLACK
        block_size = self.kv.block_size
        running_status = RequestStatus.RUNNING
        heappop = heapq.heappop
        while budget > 0:  # the earlier of the heap's and the lane's heads, while due
            if lane and (not heap or lane[0] < heap[0]):
                if lane[0][0] > horizon:
                    break
                _, _, gen, req = lane.popleft()
            elif heap and heap[0][0] <= horizon:
                _, _, gen, req = heappop(heap)
            else:
                break
            if req.status is not running_status or gen != req.heap_gen:
                continue
            if type(req) is SteadyBatch:  # its members' decodes, at once (or back into the heap)
                n = req.schedule(self, budget, horizon)
                if n:
                    scheduled.append((req, n, STEADY))
                    budget -= n
                continue
            computed = req.num_computed_tokens
            need = len(req.all_token_ids) - computed  # 1, 0 before the first token, k after a chunk
            # a new block is needed only when the computed tokens cross a block boundary
            if need and computed + need > len(req.blocks) * block_size and \
                    not self._allocate_or_preempt(req, need, now):
                continue
            scheduled.append((req, need, DECODE))
            budget -= need or 1
        return scheduled, budget

    def _schedule_prefills(self, scheduled: Scheduled, budget: int, now: float) -> tuple[Scheduled, int]:
        """Running requests still in prefill (admission order), chunked by the budget."""
        running_status = RequestStatus.RUNNING
        threshold = self.long_prefill_token_threshold
        if self.prefilling:
            self.prefilling = [r for r in self.prefilling if r.status is running_status and r.is_prefilling]
        for req in list(self.prefilling):
            if budget <= 0:
                break
            if req.status is not running_status:
                continue
            n = self.engine_policy.chunk(req.prefill_target - req.num_computed_tokens, budget, self.kv.block_size)
            if threshold > 0:
                n = min(n, threshold)
            if n <= 0 or not self._allocate_or_preempt(req, n, now):
                continue
            scheduled.append((req, n, PREFILL))
            budget -= n
        return scheduled, budget

    def _schedule_waiting(self, scheduled: Scheduled, budget: int, now: float) -> tuple[Scheduled, int]:
        """Admit waiting requests while the budget, `max_num_seqs`, the KV pool and the policy
        allow. A request whose adapter would exceed max_loras is skipped and keeps its place in
        the queue, as vLLM's scheduler does."""
        loras = {r.lora_id for r in self.running if r.lora_id} if self.max_loras else None
        skipped: list[Request] = []
        try:
            return self._admit(scheduled, budget, now, loras, skipped)
        finally:
            if skipped:
                self.waiting.extendleft(reversed(skipped))
            self.num_skipped_waiting = len(skipped)

    def _admit(self, scheduled: Scheduled, budget: int, now: float, loras: set[int] | None,
               skipped: list[Request]) -> tuple[Scheduled, int]:
        kv = self.kv
        threshold = self.long_prefill_token_threshold
        policy = self.engine_policy
        max_num_seqs = self.running_limit()
        while self.waiting and budget > 0 and len(self.running) < max_num_seqs:
            req = self._peek_waiting()
            if loras is not None and not admissible(req.lora_id, loras, self.max_loras):
                self.waiting.remove(req)
                skipped.append(req)
                continue
            resumed = req.status is RequestStatus.PREEMPTED
            hits = kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else []
            num_hit_tokens = len(hits) * kv.block_size
            left = req.prefill_target - req.num_computed_tokens - num_hit_tokens
            pull = req.remote_prefill is not None and not req.output_token_ids
            # a remote-prefill request pulls its whole prompt's KV: blocks for all of it, no compute budget
            n = left if pull else policy.chunk(left, budget, kv.block_size)
            if threshold > 0 and not pull:
                n = min(n, threshold)
            if not self.chunked_prefill and not pull and n < left:
                break  # without chunked prefill a prompt is computed in one step or waits
            whole = req.num_tokens if self.reserve_full_isl and not pull else 0
            if (left > 0 and n <= 0) or not policy.can_admit(self, req, left) or not kv.allocate_slots(
                    req, n, hits, must_fit=whole, headroom=self.watermark_blocks if self.running else 0):
                self.admission_blocked = True
                break  # head of line waits for blocks, as vLLM's FCFS does
            self._start_running(req, hits, num_hit_tokens, resumed, now)
            if loras is not None and req.lora_id:
                loras.add(req.lora_id)
            if pull:
                scheduled.append((req, n, TRANSFER))
            elif n > 0:
                scheduled.append((req, n, PREFILL))
                self.prefilling.append(req)
                budget -= n
            else:  # nothing left to prefill (resumed with a full prefix hit)
                scheduled.append((req, 0, PREFILL))
        return scheduled, budget

    def _start_running(self, req: Request, hits: list, num_hit_tokens: int, resumed: bool, now: float) -> None:
        self.waiting.remove(req)
        req.num_computed_tokens += num_hit_tokens
        self._count_prefix_query(req, num_hit_tokens, resumed)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        req.pending_events.append(EngineCoreEvent(EngineCoreEventType.SCHEDULED, now))
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit_tokens
        if self.on_admit is not None:
            self.on_admit(req, now)

    def _peek_waiting(self) -> Request:
        if self.policy == "priority":
            return min(self.waiting, key=lambda r: (r.priority, r.arrival_time, r.seq))
        return self.waiting[0]

    def _count_prefix_query(self, req: Request, hit_tokens: int, resumed: bool) -> None:
        s = self.prefix_stats
        if resumed:
            s.preempted_requests += 1
            s.preempted_queries += req.num_tokens
            s.preempted_hits += hit_tokens
        else:
            s.requests += 1
            s.queries += req.num_tokens
            s.hits += hit_tokens

    def _allocate_or_preempt(self, req: Request, num_tokens: int, now: float) -> bool:
        """Allocate KV for `req`, preempting others (lowest priority last) until it fits.

        Returns False when `req` itself had to be preempted."""
        while not self.kv.allocate_slots(req, num_tokens):
            victim = self._pick_victim()
            self._preempt(victim, now)
            if victim is req:
                # the blocks it freed were its own: retrying before others free blocks would spin
                self.admission_blocked = True
                return False
        return True

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time, r.seq))
        return self.engine_policy.pick_victim(self.running, self.output_counts())

    def output_counts(self) -> list[int]:
        """Each running request's output tokens so far, in `running`'s order (what the engine
        policy weighs)."""
        return output_counts(self.running)

    def reserve_tokens(self, clip: int) -> int:
        """Σ over the running requests of the output each may still produce, at most `clip` each
        (SGLang's admission reserve, before its new-token ratio)."""
        return reserve_tokens(self.running, self.output_counts(), clip)

    def cohort_decodes(self) -> int:
        """Decodes of the step just scheduled that are not in its batch (a timing-only cohort's)."""
        return 0

    def _preempt(self, req: Request, now: float) -> None:
        if req.steady_batch is not None:
            req.steady_batch.leave(req)
        if self.on_preempt is not None:
            self.on_preempt(req, now)
        self.running.remove(req)
        self.kv.free(req)
        self.admission_blocked = False
        self.num_skipped_waiting = 0
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.heap_gen += 1
        req.num_preemptions += 1
        req.pending_events.append(EngineCoreEvent(EngineCoreEventType.PREEMPTED, now))
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        self.total_preemptions += 1
        self.engine_policy.on_retract()

    def make_stats(self, step_counter: int, kv_cache_usage: float) -> SchedulerStats:
        """The stats a step reports (preemptions and prefix-cache counts since the last report)."""
        n_pre, self.num_preemptions = self.num_preemptions, 0
        deferred = min(self.num_skipped_waiting, len(self.waiting))
        return SchedulerStats(num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting) - deferred,
                              num_skipped_waiting_reqs=deferred,
                              step_counter=step_counter, kv_cache_usage=kv_cache_usage,
                              prefix_cache_stats=self.take_prefix_stats(), num_preemptions=n_pre)

    def take_prefix_stats(self) -> PrefixCacheStats:
        s, self.prefix_stats = self.prefix_stats, PrefixCacheStats()
        return s
