"""Prefill/decode disaggregation on the virtual clock: prefill workers and decode workers, each
its own `EngineCore` (the same engine as `serve`), and the KV transfer between them.

A request goes to a prefill worker (picked by the router: round robin unless asked otherwise) with
`do_remote_decode`: the prefill worker computes the prompt, holds its KV and answers with the
transfer parameters. The request then goes to a decode worker (picked by that side's router) with
`do_remote_prefill`: the decode worker allocates the
prompt's blocks, pulls its KV over the link (engine/kv_transfer.py: the request's
`kv_bytes_per_token` x prompt tokens at `kv_transfer_bandwidth`, shared by the pulls in flight
on that worker) and decodes. When a pull completes the prefill worker frees the held blocks. The
client's first token is the decode worker's first: TTFT = prefill (queueing included) + transfer
+ the decode worker's first step. A worker of attention DP D is D engines (its ranks) that step
together when the model is an MoE one, by the engine type's rule (engine/lockstep.py), as one
deployment's DP ranks do; the workers step independently of each other.

As `simulate`'s, the engines run timing-only decodes whenever their steps are timed
(engine/decode_cohort.py): a decode worker's requests decode as a cohort once their KV is pulled
and their first token sampled, and nothing is emitted between a request's first and last token.
`timing_only=False` runs every token as an output: the same times, finishes and preemptions.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Callable

from ..engine.clock import VirtualClock
from ..engine.config import EngineArgs
from ..engine.core import EngineCore
from ..engine.lockstep import DataParallelLockstep
from ..engine.types import EngineCoreOutputs, EngineCoreRequest, SamplingParams
from .driver import (START, RequestRecord, Timeline, _rare_collections, first_arrivals, listen_for_silent_tokens,
                     run_engines, timed_engine_inputs)
from .router import make_router
from .workload import SimRequest


@dataclass(frozen=True)
class Disaggregation:
    """A disaggregated deployment as `simulate(..., disagg=)` takes it: its prefill side
    (`prefill_workers` workers of `prefill_ranks` attention-DP ranks, each an engine of
    `prefill_args`, worker_type prefill) and how many decode workers it has (their engine args and
    ranks are the ones `simulate` is given)."""

    prefill_args: EngineArgs
    prefill_workers: int = 1
    prefill_ranks: int = 1
    decode_workers: int = 1


class DisaggSimulation:
    """`prefill_workers` engines of `prefill_args` (worker_type prefill) and `decode_workers` of
    `decode_args` (worker_type decode) on one virtual clock, `prefill_dp` and `decode_dp` consecutive
    engines of a side being one worker's attention-DP ranks; `done` holds the requests' records
    (their `engine`: the decode engine's index in `cores`, the prefill engines first)."""

    def __init__(self, prefill_args: EngineArgs, decode_args: EngineArgs, prefill_workers: int, decode_workers: int,
                 workload, *, concurrency: int = 0, prefill_dp: int = 1, decode_dp: int = 1,
                 timing_only: bool | None = None, progress: Callable[[int], None] | None = None,
                 router: str = "round_robin") -> None:
        if prefill_args.worker_type != "prefill" or decode_args.worker_type != "decode":
            raise ValueError("prefill_args must be a prefill worker's, decode_args a decode worker's")
        self.clock = VirtualClock(START)
        self.workload = workload
        self.concurrency = concurrency
        self.records: dict[str, RequestRecord] = {}  # decode side, by request id
        self.prompts: dict[str, SimRequest] = {}  # requests between arrival and their decode worker
        self.prefill_of: dict[str, int] = {}  # request id -> the prefill worker holding its KV
        self.prefill_done: dict[str, float] = {}  # request id -> when its prefill worker answered
        self.done: list[RequestRecord] = []
        self._progress = progress
        self.timeline = Timeline.of_engines(prefill_workers + decode_workers)
        # (a prefill worker's requests end at their first token: it decodes nothing, timing-only or not)
        p_inputs, p_timed, _ = timed_engine_inputs(prefill_args, timing_only)
        d_inputs, self.timing_only, d_counted = timed_engine_inputs(decode_args, timing_only)
        self.prefill = [EngineCore(prefill_args, engine_index=i, clock=self.clock, output_sink=self._prefill_sink(i),
                                   timing_only=p_timed, **p_inputs) for i in range(prefill_workers)]
        self.decode = [EngineCore(decode_args, engine_index=i, clock=self.clock, output_sink=self._decode_sink(i),
                                  timing_only=self.timing_only, **d_inputs) for i in range(decode_workers)]
        # a decode worker may take over the prompt list it is given (its prefill worker copied it)
        listen_for_silent_tokens(self.decode, self.records, d_counted and getattr(workload, "fresh_prompts", False))
        for cores, dp in ((self.prefill, prefill_dp), (self.decode, decode_dp)):
            for first in range(0, len(cores), max(dp, 1)):  # a worker's ranks (an MoE model's step together)
                DataParallelLockstep.attach(cores[first:first + dp])
        self.cores = self.prefill + self.decode
        self.served = [0] * len(self.cores)  # requests each engine was given (prefill engines first)
        for core in self.decode:
            core.kv_transfer.add_pulled_listener(self._pulled)
        # each side's router over its engines (routers.py: a KV-aware one remembers the prompts it sent
        # where, as the prefix caches of that side hold them)
        self.routers = [make_router(router, len(side), block_size=a.tokens_per_block, capacity_blocks=a.kv_cache_size)
                        for side, a in ((self.prefill, prefill_args), (self.decode, decode_args))]
        self._arrivals: list[tuple[float, int, SimRequest]] = []
        self._seq = 0
        self.wall_s = 0.0

    # --- the two sides ------------------------------------------------------------------------------
    def _stats(self, engine: int, outs: EngineCoreOutputs) -> None:
        stats = outs.scheduler_stats
        if stats is not None:
            self.timeline.record(engine, outs.timestamp, stats)

    def _prefill_sink(self, engine: int):
        def sink(client: int, outs: EngineCoreOutputs) -> None:
            self._stats(engine, outs)
            for o in outs.outputs:
                if o.prefill_stats is not None and o.request_id in self.records:  # (the prefill side's cache hits)
                    self.records[o.request_id].cached = o.prefill_stats.num_cached_tokens or 0
                if o.finish_reason is not None and o.kv_transfer_params and o.request_id in self.prompts:
                    req = self.prompts.pop(o.request_id)
                    self.routers[0].on_finish(engine, len(req.prompt), 1)
                    self._to_decode(req, o.kv_transfer_params, outs.timestamp)
        return sink

    def _decode_sink(self, engine: int):
        def sink(client: int, outs: EngineCoreOutputs) -> None:
            self._stats(len(self.prefill) + engine, outs)
            t = outs.timestamp
            for o in outs.outputs:
                rec = self.records.get(o.request_id)
                if rec is None:
                    continue
                if o.new_token_ids:
                    rec.add_tokens(len(o.new_token_ids), t)
                if o.finish_reason is not None:
                    self._finish(rec, t, o.finish_reason)
        return sink

    def _pulled(self, params: dict) -> None:
        """A decode worker has the prompt's KV: the prefill worker frees its copy."""
        rid = params.get("remote_request_id")
        p = self.prefill_of.pop(rid, None)
        if p is not None:
            self.prefill[p].release_kv_hold(rid)

    def _to_decode(self, req: SimRequest, params: dict, now: float) -> None:
        d = self.routers[1].route(req.prompt)
        self.routers[1].on_start(d, req.prompt, req.max_tokens)
        self.prefill_done[req.request_id] = now
        rec = self.records[req.request_id]
        rec.engine = len(self.prefill) + d
        self.served[rec.engine] += 1
        sp = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True, extra_args={"kv_transfer_params": params})
        self.decode[d].add_request(EngineCoreRequest(request_id=req.request_id, prompt_token_ids=req.prompt,
                                                     sampling_params=sp, arrival_time=now))

    def _finish(self, rec: RequestRecord, t: float, reason) -> None:
        rec.end = t
        rec.finish = str(getattr(reason, "name", reason)).lower()
        del self.records[rec.request_id]
        self.routers[1].on_finish(rec.engine - len(self.prefill), rec.prompt_len, rec.max_tokens)
        self.done.append(rec)
        if self.workload.closed_loop:
            nxt = self.workload.next_closed()
            if nxt is not None:
                self._push(t, nxt)
        if self._progress is not None:
            self._progress(len(self.done))

    # --- arrivals -------------------------------------------------------------------------------------
    def _push(self, t: float, req: SimRequest) -> None:
        self._seq += 1
        heapq.heappush(self._arrivals, (t, self._seq, req))

    def _deliver(self, req: SimRequest, now: float) -> None:
        p = self.routers[0].route(req.prompt)
        self.routers[0].on_start(p, req.prompt, 1)
        self.prompts[req.request_id] = req
        self.prefill_of[req.request_id] = p
        self.served[p] += 1
        self.records[req.request_id] = RequestRecord(req.request_id, -1, len(req.prompt), req.max_tokens, now)
        sp = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True,
                            extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        self.prefill[p].add_request(EngineCoreRequest(request_id=req.request_id, prompt_token_ids=req.prompt,
                                                      sampling_params=sp, arrival_time=now))

    # --- the loop ---------------------------------------------------------------------------------------
    def run(self) -> "DisaggSimulation":
        with _rare_collections():
            wall = time.perf_counter()
            first_arrivals(self.workload, self.concurrency, self._push)
            run_engines(self.clock, self.cores, self._arrivals, self._deliver, self.timing_only)
            self.wall_s = time.perf_counter() - wall
        return self
