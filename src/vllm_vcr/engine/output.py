"""Output handling: a step's work applied at its end (`update_from_output`), each request's tokens
(append, check_stop) and its next deadline, and the step's outputs sent as one `EngineCoreOutputs`
batch per client."""

from __future__ import annotations

import logging
from operator import itemgetter
from typing import TYPE_CHECKING, Callable

from .request import Request, RequestStatus
from .scheduler import DECODE, DUE_SLACK, STEADY, TRANSFER, Scheduled, Scheduler
from .steady_batch import SteadyBatches
from .tokens import CountedTokens, RandomTokens
from .types import EngineCoreOutput, EngineCoreOutputs, FinishReason, PrefillStats, SchedulerStats

if TYPE_CHECKING:
    from .clock import Clock
    from .config import EngineConfig
    from .kv_cache_manager import KVCacheManager
    from .kv_transfer import KVTransfer
    from .stats import EngineStats

OutputSink = Callable[[int, EngineCoreOutputs], None]  # (client index, the batch for that client)

logger = logging.getLogger("vllm_vcr.engine")
_client_of, _item_of = itemgetter(0), itemgetter(1)  # of the (client index, output or request id) pairs


def check_stop(req: Request, num_out: int, new: list[int]) -> FinishReason:
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


def append_checked(req: Request, idx: int, count: int,
                   max_len: int) -> tuple[list[int], FinishReason | None, int | None]:
    """Append up to `count` tokens (output index `idx` on) from a source that may emit EOS or stop
    ids, checking each: the new tokens, and the finish reason and stop id if one ended the request."""
    source = req.token_source
    prompt_len = len(req.all_token_ids) - idx  # the context holds prompt_len + num_out tokens
    new: list[int] = []
    reason = stop_reason = None
    at_length = False
    for i in range(idx, idx + count):
        tok = source.next_token(i)
        new.append(tok)
        num_out = i + 1
        if num_out >= req.max_tokens or (max_len and prompt_len + num_out >= max_len):
            at_length = True
            break
        if num_out >= req.min_tokens:
            if tok == req.eos_token_id:
                reason = FinishReason.STOP
                break
            if tok in req.stop_ids:
                reason, stop_reason = FinishReason.STOP, tok
                break
    req.output_token_ids += new
    req.all_token_ids += new
    if at_length:  # (after appending: a modeled EOS replaces the last token everywhere)
        reason = check_stop(req, num_out, new)
    return new, reason, stop_reason


def steady_tokens(req: Request, max_len: int) -> int:
    """How many of the request's next tokens can take the steady path: all but its last (by
    max_tokens or the model's length), which must end it as an output with a finish reason."""
    left = req.max_tokens - len(req.output_token_ids) - 1
    if max_len:
        left = min(left, max_len - len(req.all_token_ids) - 1)
    return max(left, 0)


def prefill_stats(req: Request) -> PrefillStats:
    local = max(req.num_cached_tokens, 0)
    external = req.external_tokens
    return PrefillStats(
        num_prompt_tokens=req.num_prompt_tokens, num_computed_tokens=req.num_prompt_tokens - local - external,
        num_cached_tokens=local + external, num_local_cached_tokens=local, num_external_cached_tokens=external,
        num_cache_creation_tokens=req.num_prompt_tokens - local)


class OutputProcessor:
    """Appends tokens and builds outputs for one engine (`max_model_len` follows config patches).

    Its collaborators: the engine's scheduler, KV cache and KV transfers, its live requests (by
    id) and counters, its clock, its config (`config()`: the current one, patches included), where
    output batches go (`sink`) and the scheduler stats a batch carries (`scheduler_stats()`)."""

    def __init__(self, *, scheduler: Scheduler, kv: KVCacheManager, kv_transfer: KVTransfer,
                 requests: dict[str, Request], stats: EngineStats, clock: Clock, config: Callable[[], EngineConfig],
                 sink: OutputSink, engine_index: int, scheduler_stats: Callable[[], SchedulerStats]) -> None:
        self._scheduler = scheduler
        self._kv = kv
        self._kv_transfer = kv_transfer
        self._requests = requests
        self._stats = stats
        self._clock = clock
        self._config = config
        self._sink = sink
        self._engine_index = engine_index
        self._scheduler_stats = scheduler_stats
        self.max_model_len = config().max_model_len
        self._push_decode = scheduler.push_decode
        # a scheduler with its own push_decode (the decode cohort) sees every deadline through it
        self._push_next = scheduler.push_next_decode if type(scheduler).push_decode is Scheduler.push_decode \
            else scheduler.push_decode
        self.step_time = 0.0  # the clock when the step being applied ended (what a token sink is told)
        self.tokens_taken = 0  # by token sinks since the last batch went out
        self.steady = SteadyBatches(scheduler, kv, DUE_SLACK)

    def sample(self, req: Request, now: float, outputs: list, finished: list, burst: int = 1, silent: int = 0) -> None:
        """Append this step's token(s) (one, a recorded chunk or a zero-latency burst), check stop
        conditions, then finish the request or set its next deadline. `silent`: output tokens the
        request has beyond its lists (a timing-only cohort's finishing member, whose tokens before
        its last nothing reads: counted, never made; only a source that ends by length alone)."""
        source = req.token_source
        max_len = self.max_model_len
        idx = len(req.output_token_ids) + silent
        count = burst if burst > 1 else req.chunk
        new: list[int]
        reason: FinishReason | None
        stop_reason: int | None
        if req.pooling:  # a pooling request ends with its prefill: no token, finish STOP (vLLM)
            new = []
            reason, stop_reason = FinishReason.STOP, None
        elif type(source) is RandomTokens or type(source) is CountedTokens:  # only the length ends it
            reason = stop_reason = None
            out_ids = req.output_token_ids
            all_ids = req.all_token_ids
            limit = req.max_tokens - idx
            if max_len:
                limit = min(limit, max_len - len(all_ids) - silent)
            k = max(min(count, limit), 1)
            new = source.take(k) if type(source) is RandomTokens else source.take_from(idx, k)
            out_ids += new
            all_ids += new
            if k >= limit:
                reason = check_stop(req, idx + k, new)
        else:
            new, reason, stop_reason = append_checked(req, idx, count, max_len)
        events = req.pending_events
        if events:
            req.pending_events = []
        else:
            events = None
        if req.prefill_stats_sent:
            out = EngineCoreOutput(request_id=req.request_id, new_token_ids=new, events=events)
        else:  # the first output: its prefill's stats (and the request's trace headers)
            req.prefill_stats_sent = True
            out = EngineCoreOutput(request_id=req.request_id, new_token_ids=new, events=events,
                                   prefill_stats=prefill_stats(req), trace_headers=req.trace_headers or None)
        if reason is not None:
            params = self._kv_transfer.hold_for_decode(req, now) if req.remote_decode else None
            if params is not None and self._kv_transfer.awaits_handoff(req):
                # a bootstrap handoff's prefill: the token now, the finish once the handoff ends
                self._kv_transfer.park(req, reason, stop_reason, params)
                self._scheduler.remove(req, free_blocks=False)
                req.status = RequestStatus.HANDING_OFF
            else:
                out.finish_reason = reason
                out.stop_reason = stop_reason
                out.kv_transfer_params = params
                self.free_request(req, silent)
                finished.append((req.client_index, req.request_id))
        else:
            pacing = req.pacing
            if pacing.itl_std == 0.0:  # the common case, kept cheap
                gap = pacing.itl_mean
            else:
                gap, req.chunk = pacing.next_step()
            base = req.first_due if idx == 0 else req.next_due
            self._push_decode(req, base + gap)
            if req.steady_gap >= 0.0:
                req.steady_left = steady_tokens(req, max_len)
        outputs.append((req.client_index, out))

    def _steady_decode(self, req: Request, outputs: list) -> bool:
        """The steady decode (W2's per-event path), what `sample` does for it without its branches:
        one random token that does not end the request, the next deadline one fixed gap after the
        last. False (nothing done) for any other case.

        A request with a `token_sink` (an in-process reader: serve's streams) offers it the token
        first; taken, it is in no output, and the reader has told whoever counts tokens (the
        step's batch still goes out, for its stats). Such a token carries nothing but its id, so
        nothing else is lost; the hops it skips (an output struct, the batch's per-output sinks,
        the reader's queue) were most of a token's cost."""
        left = req.steady_left
        if left <= 0 or req.pending_events:
            return False
        req.steady_left = left - 1
        tok = next(req.token_source.ids)
        req.output_token_ids.append(tok)
        req.all_token_ids.append(tok)
        due = req.next_due + req.steady_gap
        sink = req.token_sink
        if sink is not None and sink(tok, self.step_time):
            self.tokens_taken += 1
            reader = req.batch_member
            if left > 1 and reader is not None and reader.ready():  # from its next token on, in a batch
                req.next_due = due
                self.steady.join(req, due, reader)
                return True
            self._push_next(req, due)
            return True
        self._push_next(req, due)
        outputs.append((req.client_index, EngineCoreOutput(request_id=req.request_id, new_token_ids=[tok])))
        return True

    def update_from_output(self, scheduled: Scheduled, pulled: list[Request], now: float, burst: int = 1,
                           timed: bool = False) -> None:
        """Apply a step's work at `now` (its end): prefill progress, tokens for the decodes and for
        every request whose prefill (or KV pull) completed, in one output batch."""
        if timed:  # requests aborted (or finished by a drain) while the step ran drop out (batches: their members)
            live, running = self._requests, RequestStatus.RUNNING
            pulled = [r for r in pulled if r.status is running and live.get(r.request_id) is r]
            scheduled = [e for e in scheduled if e[2] == STEADY
                         or (e[0].status is running and live.get(e[0].request_id) is e[0])]
        outputs: list = []
        finished: list = []
        self.step_time = self._clock.now()
        sample = self.sample
        for req in pulled:
            req.first_due = now
            sample(req, now, outputs, finished)
        kv = self._kv
        block_size = kv.block_size
        push = self._push_decode
        # a decode's usual token: the steady case first, `sample` (the general path) for the rest
        steady = self._steady_decode if burst == 1 else None
        for req, n, kind in scheduled:
            if kind == DECODE:
                if n:
                    req.num_computed_tokens += n
                    if req.num_computed_tokens // block_size > req.num_hashed_blocks:
                        kv.cache_computed_blocks(req)
                if steady is None or not steady(req, outputs):
                    sample(req, now, outputs, finished, burst)
                continue
            if kind == STEADY:
                req.apply(self, now, outputs, finished)
                continue
            if kind == TRANSFER:
                self._kv_transfer.schedule_pull(req, n, now)
                continue
            req.num_computed_tokens += n  # a prefill chunk
            kv.cache_computed_blocks(req)
            if req.is_prefilling:
                continue
            if req.output_token_ids:  # resumed after preemption: continue on its own schedule
                push(req, max(req.next_due, now))
                continue
            if timed:
                req.first_due = now
            if req.first_due <= now + DUE_SLACK:
                sample(req, now, outputs, finished)
            else:
                push(req, req.first_due)
        if self.steady.touched:
            self.steady.flush()
        if outputs or finished or self.tokens_taken:
            self.emit(outputs, finished, with_stats=True)

    def emit(self, outputs: list[tuple[int, EngineCoreOutput]], finished: list[tuple[int, str]],
             with_stats: bool) -> None:
        """Send this step's outputs, one batch per client; scheduler stats ride on the first."""
        ts = self._clock.now()
        self.tokens_taken = 0
        stats = self._scheduler_stats() if with_stats else None
        sink = self._sink
        index = self._engine_index
        # (map with itemgetter: the per-output passes run in C, not as comprehension bytecode)
        clients = set(map(_client_of, outputs))
        if finished:
            clients.update(map(_client_of, finished))
        if len(clients) <= 1:  # one client (always, in-process): no regrouping per output
            sink(clients.pop() if clients else 0,
                 EngineCoreOutputs(engine_index=index, outputs=list(map(_item_of, outputs)), scheduler_stats=stats,
                                   timestamp=ts, finished_requests=list(map(_item_of, finished)) or None))
            return
        by_client: dict[int, tuple[list[EngineCoreOutput], list[str]]] = {}
        for client, o in outputs:
            by_client.setdefault(client, ([], []))[0].append(o)
        for client, rid in finished:
            by_client.setdefault(client, ([], []))[1].append(rid)
        for client, (outs, fin) in by_client.items():
            sink(client, EngineCoreOutputs(engine_index=index, outputs=outs, scheduler_stats=stats,
                                           timestamp=ts, finished_requests=fin or None))
            stats = None

    def free_request(self, req: Request, silent: int = 0) -> None:
        """A request finished: it leaves the engine (its blocks stay if held for a decode side;
        `silent`: its output tokens beyond its list, see `sample`)."""
        rid = req.request_id
        self._requests.pop(rid, None)
        kv_transfer = self._kv_transfer
        held = rid in kv_transfer.holds
        self._scheduler.remove(req, free_blocks=not held)
        req.status = RequestStatus.FINISHED
        if not held:
            kv_transfer.end_handoff(rid)
        self._stats.requests_completed += 1
        if self._config().log_requests:
            logger.info("request %s finished: %d tokens", rid, req.num_output_tokens + silent)
