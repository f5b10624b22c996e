"""Timing-only decodes: the running decodes of a timed engine advanced as one cohort, at a cost per
step that does not grow with the batch (the offline simulator's fast path, `timing_only=True`).

With a step-time model (`times_steps`) and zero per-request pacing, every running request past its
prefill decodes one token in every step, and nothing reads the tokens of the steps in between
(the simulator only counts them). So a decode's state is a function of the step counter: after
`D` cohort steps a member that joined at step `d0` with `t0` tokens has `t0 + D - d0`. The cohort
keeps the members' summed context (for the step's price); the members by the phase of the step
(`D % block_size`) at which they need their next KV block, in the plain scheduler's decode order
(first-token time, then arrival), allocated then (in one call while the free blocks cover them,
else one by one through the scheduler's own allocation, so preemption is unchanged);
and a queue of the steps that sample each member's last token (done by the plain `sample`). A
member is materialized (its token ids, its computed count) only when it leaves: at its finish, or
when it is preempted. Prefills, admission, preemption, first and last tokens run the plain code.

What it does not do: the tokens between a request's first and last are not sent as outputs (the
simulator gets their step indices through `on_tokens`, their times from `step_ends`); output
blocks of a finishing request are not registered in the prefix cache (no later prompt can contain
its random ids; a preempted request's are, so its resume finds them); no KV events.
"""

from __future__ import annotations

import heapq
import math
import random
from array import array
from bisect import insort
from itertools import filterfalse
from typing import TYPE_CHECKING, Any, Callable, Protocol

from .block_pool import BlockPool
from .config import running_limit, token_budget
from .latency import AicStepLatency, StepBatch
from .output import OutputProcessor
from .policy import reserve_tokens
from .request import Request
from .scheduler import Scheduler, output_counts
from .tokens import CountedTokens, RandomTokens

if TYPE_CHECKING:
    from .config import EngineArgs
    from .latency import LatencyModel
    from .policy import EnginePolicy

TokensListener = Callable[[Request, int, int], None]  # (request, first step, last step) of silent tokens
# (request, tokens, now) -> False when the request itself was preempted: Scheduler's allocation
AllocateOrPreempt = Callable[[Request, int, float], bool]


class LoRACharge(Protocol):
    """Adapter loading time not yet charged to a step (admission.py's Admission)."""
    lora_time: float

    def take_lora_time(self) -> float: ...


def cohort_eligible(req: Request) -> bool:
    """A request whose decodes only the length can end, one token per step, with no gap of its own."""
    return (req.burstable and req.chunk == 1 and type(req.token_source) in _LENGTH_ONLY and not req.pooling
            and req.plan is None and not req.remote_decode)


def counted_token_source(vocab_size: int):
    """An EngineCore `token_source_factory`: `CountedTokens` for the requests that would draw plain
    random ids with nothing to end them but their length (None, the engine's own choice, otherwise)."""
    def factory(req: Request, rng) -> CountedTokens | None:
        sp = req.sampling_params
        if req.planned is not None or req.eos_at is not None or req.eos_token_id is not None or req.stop_ids \
                or sp.logit_bias or sp.allowed_token_ids:
            return None
        return CountedTokens(req.seq, vocab_size)
    factory.rng_free = True  # (it never reads the request's rng: admission seeds none for it)
    return factory


# a member: (d0, t0, gen, slot, bucket): the cohort step at which it joined, its tokens (prompt +
# output) then, its generation (invalidates its stale finish entry after it leaves and rejoins), its
# entry (due, seq, req) in its block-boundary bucket, and that bucket
_Member = tuple


class DecodeCohort:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.step = 0  # cohort steps taken (D)
        self.step_ends = array("d")  # step_ends[D - 1]: when cohort step D ended
        self.members: dict[Request, _Member] = {}
        self._tokens_minus_join = 0  # sum over members of (t0 - d0): their context is this + n * D
        # kept from the first `remaining_outputs` on (an engine policy that weighs reserves; None before):
        # the sum over members of (max_tokens + prompt), which less their context is the output they
        # may still produce, and (t0 - d0 - max_tokens - prompt, gen, req) per member, whose negation
        # less D is its remaining output: largest first, entries of members that left dropped on top
        self._limits: int | None = None
        self._most_left: list[tuple] | None = None
        # members by the phase (step % block_size) at which they need their next block, each bucket
        # in the plain decode order (due, seq): a member's tokens cross a block every block_size steps
        self._buckets: list[list[tuple]] = [[] for _ in range(block_size)]
        self._finishes: list[tuple] = []  # (step, due, seq, gen, req): its last token at step
        self._gen = 0
        self._prepared = -1  # the cohort step whose block allocations are done
        self.on_tokens: TokensListener | None = None
        # run_alone's step prices by (decodes, context), for a model whose step time is a function of
        # the composition alone (no draw from the rng), and only for that model object
        self._prices: dict[tuple[int, int], float] = {}
        self._priced_by: object = None

    def __len__(self) -> int:
        return len(self.members)

    def tokens(self, req: Request) -> int:
        d0, t0 = self.members[req][:2]
        return t0 + self.step - d0

    def join(self, req: Request, due: float, max_model_len: int) -> None:
        """`req` has sampled a token and decodes from the next step on."""
        self._gen = gen = self._gen + 1
        d0, t0 = self.step, len(req.all_token_ids)
        # steps until its tokens overflow its blocks: 0..block_size-1, as its blocks hold its computed tokens
        room = len(req.blocks) * self.block_size - t0 + 1
        if not 0 <= room < self.block_size:
            raise AssertionError(f"{req.request_id}: {len(req.blocks)} blocks for {t0 - 1} computed tokens")
        slot, bucket = (due, req.seq, req), self._buckets[(d0 + room) % self.block_size]
        insort(bucket, slot)
        self.members[req] = (d0, t0, gen, slot, bucket)
        self._tokens_minus_join += t0 - d0
        if self._limits is not None:
            limit = req.max_tokens + req.num_prompt_tokens
            self._limits += limit
            most = self._most_left
            if len(most) > 2 * len(self.members) + 64:  # (entries of members that left: rebuilt away)
                self._most_left = most = self._reserve_heap()
            heapq.heappush(most, (t0 - d0 - limit, gen, req))
        idx = len(req.output_token_ids)
        last = req.max_tokens - 1  # the output index whose sample ends it (see OutputProcessor.sample)
        if max_model_len:
            last = min(last, max_model_len - req.num_prompt_tokens - 1)
        heapq.heappush(self._finishes, (d0 + 1 + max(last - idx, 0), due, req.seq, gen, req))

    def leave(self, req: Request, materialize: bool, last: int | None = None, silent: bool = False) -> int:
        """Take `req` out; with `materialize`, its tokens and computed count catch up first (to
        cohort step `last`, default the current one): its source's ids, or with `silent` (it is
        finishing: nothing will hash or read them) only their count, which it returns (the tokens
        it has beyond its lists: `OutputProcessor.sample`'s `silent`)."""
        d0, t0, _, slot, bucket = self.members.pop(req)
        self._tokens_minus_join -= t0 - d0
        if self._limits is not None:
            self._limits -= req.max_tokens + req.num_prompt_tokens
        bucket.remove(slot)
        if not materialize:
            return 0
        if last is None:
            last = self.step
        k = t0 + last - d0 - len(req.all_token_ids)
        if k > 0:
            if not silent:
                new = req.token_source.take(k)
                req.output_token_ids += new
                req.all_token_ids += new
            if self.on_tokens is not None:
                self.on_tokens(req, last - k + 1, last)
        else:
            k = 0
        req.num_computed_tokens = len(req.all_token_ids) - 1 + (k if silent else 0)
        req.steady_left = 0  # counted before these tokens: `sample` counts it again
        return k if silent else 0

    def extend(self, batch: StepBatch) -> StepBatch:
        """The step's composition with the cohort's decodes (their count and summed context)."""
        n = len(self.members)
        if not n:
            return batch
        decodes, tokens, prefills, firsts, context, *rest = batch  # (a namedtuple's _replace is slow)
        return tuple.__new__(StepBatch, (decodes + n, tokens, prefills, firsts, context + self.context(), *rest))

    def context(self) -> int:
        """The members' summed tokens: the context their decodes attend to in the next step."""
        return self._tokens_minus_join + len(self.members) * self.step

    def remaining_outputs(self, clip: int) -> int | None:
        """Σ over members of the output each may still produce (max_tokens less its output so far,
        at least 1 while a member), or None when a member's exceeds `clip` (not summed here)."""
        if self._limits is None:
            self._limits = sum(r.max_tokens + r.num_prompt_tokens for r in self.members)
            self._most_left = self._reserve_heap()
        most, members = self._most_left, self.members
        while most:
            entry = most[0]
            m = members.get(entry[2])
            if m is not None and m[2] == entry[1]:
                if -entry[0] - self.step > clip:
                    return None
                break
            heapq.heappop(most)
        return self._limits - self.context()

    def _reserve_heap(self) -> list[tuple]:
        most = [(t0 - d0 - r.max_tokens - r.num_prompt_tokens, gen, r) for r, (d0, t0, gen, *_) in self.members.items()]
        heapq.heapify(most)
        return most

    def allocate(self, pool: BlockPool, allocate_or_preempt: AllocateOrPreempt, now: float) -> None:
        """Before scheduling step D+1: the members whose next token needs a new block get it, in the
        plain scheduler's decode order (`allocate_or_preempt`: the scheduler's, a member preempted
        there leaves through its preemption)."""
        if self._prepared == self.step or not self.members:
            # (the input gate may schedule twice in one step; with no member, nothing is prepared:
            # under SGLang's policy a request joins after a prefill step, with the step count unchanged)
            return
        if self.allocate_if_free(pool):
            return
        self._prepared = step = self.step
        # KV pressure: one by one, preempting as the plain scheduler does
        for _, _, req in list(self._buckets[step % self.block_size]):
            m = self.members.get(req)
            if m is None:
                continue  # preempted by an earlier member's allocation
            req.num_computed_tokens = m[1] + step - m[0] - 1
            allocate_or_preempt(req, 1, now)

    def allocate_if_free(self, pool: BlockPool) -> bool:
        """Before step D+1, when the free blocks cover every member at a block boundary: one block
        each, in decode order, in one call (what the plain loop takes). False: nothing was done."""
        due = self._buckets[self.step % self.block_size]
        if due:
            if len(due) > pool.num_free_blocks:
                return False
            for slot, block in zip(due, pool.allocate(len(due))):
                slot[2].blocks.append(block)
        self._prepared = self.step
        return True

    def next_finish(self) -> float:
        """The cohort step at which the next member samples its last token (inf: none)."""
        heap, members = self._finishes, self.members
        while heap:
            entry = heap[0]
            m = members.get(entry[4])
            if m is not None and m[2] == entry[3]:
                return entry[0]
            heapq.heappop(heap)
        return math.inf

    def advance(self, now: float) -> list[tuple[Request, int]]:
        """Cohort step D+1 ended at `now`: every member has one more token. Returns the members
        whose last token this step sampled, out of the cohort, each with its tokens up to it that
        are counted but not in its lists (`leave`'s `silent`)."""
        self.step = step = self.step + 1
        self.step_ends.append(now)
        heap, members = self._finishes, self.members
        done: list[tuple[Request, int]] = []
        while heap and heap[0][0] <= step:
            entry = heapq.heappop(heap)
            req = entry[4]
            m = members.get(req)
            if m is None or m[2] != entry[3]:
                continue
            silent = self.leave(req, materialize=True, last=step - 1, silent=True)  # the last token is `sample`'s
            req.num_computed_tokens += 1
            done.append((req, silent))
        return done

    def run_alone(self, end: float, horizon: float, pool: BlockPool, on_step: Callable[[], None],
                  latency: LatencyModel, rng: random.Random, lora: LoRACharge,
                  joins: Callable[[float], bool] | None = None) -> tuple[int, float, float, bool]:
        """The cohort's steps when nothing else runs (its engine knows no input arrives before
        `horizon`: the offline simulator), the first one starting at `end`, while they end before
        `horizon`, stopping before a step that samples a last token. Each step is what the plain
        loop would do (advance, block boundaries, a priced step: `on_step`, `latency.step_duration`
        with `rng`, `lora`'s loading time), without its generic scheduling. Cohorts in step repeat
        compositions (a closed loop's batches finish and refill alike), so with the perf model, whose
        step time is a function of the composition alone, a composition is priced once. `joins(t)`,
        asked at each step boundary t (each time the plain engine would look), says whether other
        work joins the step starting then (a KV pull completed). Returns (the steps that ended, when
        the last of them ended, when the step they started ends, plain): with plain, the next step
        starts at the last end the plain way (its blocks did not all fit: it preempts; or work
        joins it), and no step was started."""
        # nobody joins or leaves in these steps: the count, the next finish and the context's slope stay
        n = len(self.members)
        last_step = self.next_finish() - 2  # the last cohort step to run here (the next one samples a last token)
        if not n or self.step > last_step:
            return 0, end, end, False
        buckets, block_size = self._buckets, self.block_size
        step_ends, base = self.step_ends, self._tokens_minus_join
        first, step, now, steps = self.step, self.step, end, 0
        # nothing else takes or frees a block in these steps, so the blocks the members crossing a
        # boundary get (in step order, each step's in decode order) are taken in one call at the
        # end: the same blocks the free queue would give one step at a time
        free, wanted, plain = pool.num_free_blocks, 0, False
        step_duration = latency.step_duration
        prices = None
        if type(latency) is AicStepLatency:  # (exactly: a subclass may draw)
            if self._priced_by is not latency or len(self._prices) > 1 << 16:  # (a new model: a config patch)
                self._prices, self._priced_by = {}, latency
            prices = self._prices
        while end < horizon and step <= last_step:
            step += 1  # cohort step `step` ended at `end` (no member finishes here)
            step_ends.append(end)
            now = end
            steps += 1
            if joins is not None and joins(now):  # (a pulled request joins the next step)
                plain = True
                break
            due = buckets[step % block_size]
            if due:
                if wanted + len(due) > free:  # KV pressure: the plain step preempts
                    plain = True
                    break
                wanted += len(due)
            on_step()
            # = compose() + extend() of a step of the cohort's decodes alone
            context = base + n * step
            if prices is None:
                composition = tuple.__new__(StepBatch, (n, 0, 0, 0, context, False, 0, 0, (), ()))
                end = now + max(step_duration(composition, rng), 0.0)
            else:
                duration = prices.get((n, context))
                if duration is None:
                    composition = tuple.__new__(StepBatch, (n, 0, 0, 0, context, False, 0, 0, (), ()))
                    duration = prices[n, context] = max(step_duration(composition, rng), 0.0)
                end = now + duration
            if lora.lora_time:
                end += lora.take_lora_time()
        if wanted:
            blocks = iter(pool.allocate(wanted))
            for s in range(first + 1, step + 1 - plain):
                for slot in buckets[s % block_size]:
                    slot[2].blocks.append(next(blocks))
        if plain:
            self.step = step
            return steps, now, end, True
        if steps:
            self.step = self._prepared = step
        return steps, now, end, False


class CohortScheduler(Scheduler):
    """The shared scheduler with eligible decodes in a DecodeCohort instead of the decode heap. The
    cohort decodes in every step of vLLM's policy; in SGLang's (`extend_first`) only in the steps
    without a prefill (`cohort_step`), as the plain scheduler runs its decodes."""

    def __init__(self, cohort: DecodeCohort, max_model_len: Callable[[], int], *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cohort = cohort
        self.max_model_len = max_model_len
        self.cohort_step = True  # the step just scheduled runs the cohort's decodes

    def push_decode(self, req: Request, due: float) -> None:
        if cohort_eligible(req):
            req.next_due = due
            self.cohort.join(req, due, self.max_model_len())
        else:
            Scheduler.push_decode(self, req, due)

    def has_immediate_work(self) -> bool:
        return bool(self.cohort.members) or super().has_immediate_work()

    def output_counts(self) -> list[int]:
        members, step = self.cohort.members, self.cohort.step
        # a member's: its tokens at cohort step `step` (DecodeCohort.tokens), less its prompt
        return [len(r.output_token_ids) if (m := members.get(r)) is None else m[1] + step - m[0] - r.num_prompt_tokens
                for r in self.running]

    def cohort_decodes(self) -> int:
        return len(self.cohort.members) if self.cohort_step else 0

    def reserve_tokens(self, clip: int) -> int:
        members = self.cohort.members
        total = self.cohort.remaining_outputs(clip)
        if total is None:  # (a member's remaining output is clipped: each one's, as the plain scheduler)
            return super().reserve_tokens(clip)
        others = list(filterfalse(members.__contains__, self.running))
        return total + reserve_tokens(others, output_counts(others), clip) if others else total

    def remove(self, req: Request, free_blocks: bool = True) -> None:
        if req in self.cohort.members:
            self.cohort.leave(req, materialize=False)  # an abort (a finish has left already)
        Scheduler.remove(self, req, free_blocks)

    def _preempt(self, req: Request, now: float) -> None:
        if req in self.cohort.members:
            self.cohort.leave(req, materialize=True)
            self.kv.cache_computed_blocks(req)  # its resume finds them, as after plain decodes
        super()._preempt(req, now)

    def schedule(self, now: float) -> list:
        policy = self.engine_policy
        policy.on_step()
        if not self.running and not self.waiting:  # (nothing to decode, prefill or admit: an idle worker)
            self.cohort_step = True
            return []
        before = self.total_preemptions
        budget = self.token_budget()
        if policy.extend_first:  # prefills and admissions alone when there are any (Scheduler.schedule)
            scheduled, budget = self._schedule_prefills([], budget, now)
            if self.total_preemptions == before and self.waiting and not self.paused_new:
                scheduled, budget = self._schedule_waiting(scheduled, budget, now)
            self.cohort_step = not scheduled
            if scheduled:
                return scheduled
            self.cohort.allocate(self.kv.pool, self._allocate_or_preempt, now)
            scheduled = self._schedule_decodes([], budget - len(self.cohort.members), now)[0]
            return self.without_victims(scheduled, before)
        self.cohort.allocate(self.kv.pool, self._allocate_or_preempt, now)
        budget -= len(self.cohort.members)
        scheduled, budget = self._schedule_decodes([], budget, now)  # ineligible decodes, if any
        scheduled, budget = self._schedule_prefills(scheduled, budget, now)
        if self.total_preemptions != before:
            return self.without_victims(scheduled, before)
        if not self.waiting or self.paused_new:
            return scheduled
        return self._schedule_waiting(scheduled, budget, now)[0]


class CohortOutputProcessor(OutputProcessor):
    """Step ends: the cohort advances and its finishing members sample their last token first
    (as the plain path handles decodes before prefills), in the same output batch."""

    def __init__(self, cohort: DecodeCohort, **collaborators: Any) -> None:
        super().__init__(**collaborators)
        self.cohort = cohort
        self._pending: tuple[list, list] | None = None

    def update_from_output(self, scheduled, pulled, now: float, burst: int = 1, timed: bool = False) -> None:
        outputs: list = []
        finished: list = []
        if self._scheduler.cohort_step:  # (SGLang's prefill steps run no decodes)
            for req, silent in self.cohort.advance(now):
                self.sample(req, now, outputs, finished, 1, silent)
        self._pending = (outputs, finished) if outputs or finished else None
        OutputProcessor.update_from_output(self, scheduled, pulled, now, burst, timed)
        if self._pending is not None:
            self._pending = None
            self.emit(outputs, finished, with_stats=True)

    def emit(self, outputs, finished, with_stats: bool) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            outputs = pending[0] + outputs
            finished = pending[1] + finished
        OutputProcessor.emit(self, outputs, finished, with_stats)


_LENGTH_ONLY = (RandomTokens, CountedTokens)  # sources that never emit an ending id


def timing_only_unsupported(latency: LatencyModel, policy: EnginePolicy, args: EngineArgs) -> str | None:
    """Why an engine cannot run timing-only decodes (None: it can)."""
    if not latency.times_steps:
        return "steps are not timed (no step-time or perf model)"
    if not policy.decode_cohort:
        return f"the engine type {policy.name} does not support them"
    if running_limit(args.config, args.max_num_active_seqs) > token_budget(args.config, args.max_num_scheduled_tokens):
        return "more requests may run than a step schedules tokens (the budget could cut decodes)"
    return None
