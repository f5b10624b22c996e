"""Timing-only decodes (engine/decode_cohort.py): the cohort must change only what is emitted.

On the virtual clock, a simulation with timing-only engines and one with the plain engines must
give every request the same first-token, last-token and finish times, the same token count,
every inter-token gap, the same prefix hits and preemptions, the same steps, and leave every KV
block free, whatever the load (KV pressure, chunked prefill, shared prefixes, several engines).
"""

from __future__ import annotations

import math

import msgspec

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_vcr.engine.clock import VirtualClock
from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.engine.core import EngineCore
from vllm_vcr.engine.latency import AicStepLatency, KnobLatency, StepPricer
from vllm_vcr.engine.types import EngineCoreRequest, SamplingParams
from vllm_vcr.simulate import driver as driver_mod
from vllm_vcr.simulate.runner import simulate
from vllm_vcr.simulate.workload import LengthDist, SyntheticWorkload


class LinearKernels:
    """A stand-in for the compiled estimator: step times linear in what the step computes."""

    def decode_step_latency(self, batch: int, ctx: int, _osl: int) -> float:
        return 4.0 + 0.05 * batch + 0.0004 * batch * ctx

    def mixed_step_breakdown(self, tokens: int, decodes: int, dec_ctx: int, _osl: int, prefix: int):
        shared = 3.0 + 0.01 * (tokens + decodes)
        return 0.0, shared, 0.002 * tokens * (tokens + prefix) / 1024, 0.0004 * decodes * dec_ctx


def _latency(held: bool = False) -> AicStepLatency:
    """`held`: as the perf model's defaults have it, async scheduling (a request reaching the engine
    during a step waits for the step after the next) and the frontend's time (a request is held
    before the scheduler sees it): the cohort's runs stop at the time a held request may join."""
    if not held:
        return AicStepLatency(StepPricer(LinearKernels()), step_overhead_ms=1.5)
    return AicStepLatency(StepPricer(LinearKernels()), step_overhead_ms=1.5, async_scheduling=True,
                          async_exposed_ms=0.3, frontend_ms=2.0, frontend_ms_per_1k_tokens=9.5,
                          frontend_ms_per_request=0.4)


def _args(kv_blocks: int, block: int, budget: int, seqs: int, max_len: int = 0, engine_type: str = "vllm",
          recv_interval: int = 1) -> EngineArgs:
    cfg = EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len)
    return EngineArgs(config=cfg, kv_cache_size=kv_blocks, tokens_per_block=block, engine_type=engine_type,
                      scheduler_recv_interval=recv_interval, advertised_max_model_len=1 << 16).validate()


# the engine types timing-only decodes reproduce: vLLM's steps, and SGLang's (prefills alone, the
# new-token-ratio reserve, retraction, the scheduler's receive interval)
ENGINES = st.sampled_from([("vllm", 1), ("sglang", 1), ("sglang", 3), ("sglang", 30)])


def _run(monkeypatch, args, workload_kw, engines, router, timing_only, held=False):
    monkeypatch.setattr(driver_mod, "engine_inputs", lambda a: {"latency": _latency(held)})
    wl = SyntheticWorkload(**workload_kw)
    sim = simulate(args, wl, engines=engines, router=router, concurrency=workload_kw.get("concurrency", 1),
                   timing_only=timing_only)
    assert sim.timing_only is timing_only
    per_request = {r.request_id: (r.engine, r.first, r.last, r.end, r.num_out, r.cached, r.finish, list(r.gaps()))
                   for r in sim.done}
    for core in sim.cores:
        assert core.block_pool.num_free_blocks == core.block_pool.num_blocks
        assert not core.requests
    return sim, per_request


def _free_queues(sim) -> list[list[int]]:
    """Every engine's free block ids in eviction order at the end: the same on both paths when every
    block was taken and freed in the same order."""
    return [core.block_pool.free_queue() for core in sim.cores]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 40), isl=st.sampled_from(["uniform:1:120", "lognormal:60:40", "8"]),
       osl=st.sampled_from(["uniform:1:60", "exp:20", "1", "2"]), arrival=st.sampled_from(["closed", "poisson"]),
       concurrency=st.integers(1, 12), kv_blocks=st.integers(40, 200), block=st.sampled_from([4, 16]),
       budget=st.integers(32, 256), seqs=st.integers(1, 16), engines=st.integers(1, 2),
       prefixes=st.sampled_from([0, 2]), seed=st.integers(0, 3), max_len=st.sampled_from([0, 0, 96]),
       held=st.booleans(), engine=ENGINES)
def test_timing_only_decodes_change_nothing_but_the_outputs(monkeypatch, n, isl, osl, arrival, concurrency, kv_blocks,
                                                            block, budget, seqs, engines, prefixes, seed, max_len,
                                                            held, engine):
    args = _args(kv_blocks, block, budget, min(seqs, budget), max_len, *engine)
    wl = dict(num_requests=n, isl=LengthDist.parse(isl, "--isl"), osl=LengthDist.parse(osl, "--osl"), arrival=arrival,
              concurrency=concurrency, request_rate=200.0, num_prefixes=prefixes, prefix_len=24, seed=seed)
    router = "kv" if prefixes else "round_robin"
    plain, expected = _run(monkeypatch, args, wl, engines, router, False, held)
    fast, got = _run(monkeypatch, args, wl, engines, router, True, held)
    assert got == expected
    assert fast.timeline.preemptions == plain.timeline.preemptions
    assert fast.timeline.steps == plain.timeline.steps
    assert _free_queues(fast) == _free_queues(plain)
    assert len(got) == n


def test_kv_pressure_preempts_members_and_their_resume_finds_their_blocks(monkeypatch):
    # 24 blocks of 4 tokens for 6 requests growing to 80 tokens: preemption is certain
    args = _args(24, 4, 64, 6)
    wl = dict(num_requests=6, isl=LengthDist("fixed", 8), osl=LengthDist("fixed", 72), arrival="closed", concurrency=6)
    plain, expected = _run(monkeypatch, args, wl, 1, "round_robin", False)
    fast, got = _run(monkeypatch, args, wl, 1, "round_robin", True)
    assert sum(plain.timeline.preemptions) > 0
    assert got == expected and fast.timeline.preemptions == plain.timeline.preemptions
    assert _free_queues(fast) == _free_queues(plain)
    assert all(v[4] == 72 for v in got.values())


def _core(timing_only: bool) -> tuple[EngineCore, list]:
    batches: list = []
    args = _args(256, 16, 512, 16)
    core = EngineCore(args, clock=VirtualClock(0.0), output_sink=lambda c, o: batches.append(o), latency=_latency(),
                      timing_only=timing_only)
    return core, batches


def test_members_are_silent_between_first_and_last_token_and_an_abort_frees_them():
    core, batches = _core(True)
    for i in range(3):
        core.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=list(range(1 + i, 40 + i)),
                                           sampling_params=SamplingParams(max_tokens=30, ignore_eos=True)))
    core.run_until_idle(until=0.05)
    assert len(core.cohort) == 3 and core.block_pool.num_free_blocks < core.block_pool.num_blocks
    core.abort_requests(["r1"])
    core.run_until_idle()
    outs = [o for b in batches for o in b.outputs]
    sizes = {rid: [len(o.new_token_ids) for o in outs if o.request_id == rid] for rid in ("r0", "r1", "r2")}
    assert sizes["r0"] == sizes["r2"] == [1, 1]  # the first token, then the last (with its finish)
    assert sizes["r1"] == [1]
    assert not core.requests and core.block_pool.num_free_blocks == core.block_pool.num_blocks
    assert core.cohort.step == len(core.cohort.step_ends) and not core.cohort.members


@settings(max_examples=30, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 90), st.floats(0.0, 0.05)), min_size=1, max_size=12),
       kv_blocks=st.integers(12, 80))
def test_the_reserve_a_cohort_sums_is_the_plain_schedulers(reqs, kv_blocks):
    """SGLang's admission weighs Σ min(remaining output, clip) over the running requests: a cohort
    sums its members' from its context (and each one's when one exceeds the clip); at every step
    boundary, for any clip, it is what the plain engine's running requests give, one by one."""
    cores = []
    for timing_only in (False, True):
        args = _args(kv_blocks, 4, 64, 8, 0, "sglang")
        cores.append(EngineCore(args, clock=VirtualClock(0.0), latency=_latency(), timing_only=timing_only))
    events = sorted((t, i) for i, (_, _, t) in enumerate(reqs))
    for t in sorted({t for t, _ in events} | {0.002 * k for k in range(1, 200)}):
        for core in cores:
            for t_arr, i in events:
                if t_arr == t:
                    isl, osl, _ = reqs[i]
                    prompt = [5000 + 100 * i + j for j in range(isl)]
                    core.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                                                       sampling_params=SamplingParams(max_tokens=osl, ignore_eos=True)))
            core.run_until_idle(until=t)
        plain, fast = (c.scheduler for c in cores)
        assert [r.request_id for r in fast.running] == [r.request_id for r in plain.running]
        assert fast.output_counts() == plain.output_counts()
        for clip in (1, 3, 40, 4096):
            assert fast.reserve_tokens(clip) == plain.reserve_tokens(clip)


def test_timing_only_needs_timed_steps():
    args = _args(64, 16, 512, 16)
    with pytest.raises(ValueError, match="steps are not timed"):
        EngineCore(args, clock=VirtualClock(0.0), latency=KnobLatency(args.config), timing_only=True)
    core, _ = _core(True)
    with pytest.raises(ValueError, match="KV events"):
        core.attach_kv_events(object(), lambda events, t: None)


def test_the_simulator_uses_it_only_when_steps_are_timed(monkeypatch):
    wl = SyntheticWorkload(num_requests=20, isl=LengthDist("fixed", 16), osl=LengthDist("fixed", 8),
                           arrival="closed", concurrency=4)
    cfg = EngineConfig(time_to_first_token=10, inter_token_latency=2)
    sim = simulate(EngineArgs(config=cfg).validate(), wl, concurrency=4)
    assert not sim.timing_only and all(core.cohort is None for core in sim.cores)
    assert all(math.isfinite(r.end) for r in sim.done)


@pytest.mark.parametrize("prompt_len", [12, 11])  # 11: a block holds 3 prompt ids and the first output id
def test_identical_prompts_under_kv_pressure_keep_their_own_output_blocks(monkeypatch, prompt_len):
    # timing-only engines draw no ids (CountedTokens): requests with the same prompt, preempted with
    # outputs, must still not find each other's output blocks (as with random ids)
    from vllm_vcr.simulate.workload import SimRequest, TraceWorkload

    monkeypatch.setattr(driver_mod, "engine_inputs", lambda a: {"latency": _latency()})
    args = _args(30, 4, 64, 8)
    prompt = list(range(1, prompt_len + 1))

    def run(timing_only: bool):
        wl = TraceWorkload([SimRequest(f"r{i}", list(prompt), 70, arrival=0.001 * i) for i in range(8)])
        sim = simulate(args, wl, timing_only=timing_only)
        return sim, {r.request_id: (r.first, r.end, r.num_out, r.cached, list(r.gaps())) for r in sim.done}

    plain, expected = run(False)
    fast, got = run(True)
    assert sum(plain.timeline.preemptions) > 0 and fast.timeline.preemptions == plain.timeline.preemptions
    assert got == expected


def test_counted_tokens_spell_the_request_in_two_disjoint_ids():
    from vllm_vcr.engine.decode_cohort import CountedTokens

    seen = {}
    for seq in (0, 1, 2, 15999, 16000, 16001, 10**6):
        t = CountedTokens(seq, 32000)
        ids = t.take(5)
        assert ids == [t.next_token(i) for i in range(5)] and all(0 <= x < 32000 for x in ids)
        assert ids[0] < 16000 <= ids[1] and seen.setdefault(tuple(ids[:2]), seq) == seq
    # the first id alone (a block may hold only it) differs between requests close in arrival
    assert len({CountedTokens(seq, 32000).next_token(0) for seq in range(1000)}) == 1000


def _drive(timing_only: bool, args: EngineArgs, prompts: list[list[int]], max_tokens: list[int],
           arrivals: list[float], aborts: dict[int, float], **core_kw):
    """One engine on the virtual clock, requests added and aborted at their times, the cohort's
    decode-only steps run ahead to the next event as the simulator does. Per request: its first
    token's time, its finish (time, reason), its tokens (silent ones counted) and its prompt's cached
    tokens, unless aborted (then its first token's time and cached tokens)."""
    seen: dict[str, dict] = {}

    def sink(client, outs):
        for o in outs.outputs:
            r = seen.setdefault(o.request_id, {"first": None, "n": 0, "finish": None, "cached": None})
            if o.new_token_ids and r["first"] is None:
                r["first"] = outs.timestamp
            if o.prefill_stats is not None:
                r["cached"] = o.prefill_stats.num_cached_tokens
            r["n"] += len(o.new_token_ids)
            if o.finish_reason is not None:
                r["finish"] = (outs.timestamp, o.finish_reason)
                r["last"] = list(o.new_token_ids)

    clock = VirtualClock(0.0)
    core = EngineCore(args, clock=clock, output_sink=sink, latency=_latency(), timing_only=timing_only, **core_kw)
    if timing_only:
        def silent(req, first, last):
            seen[req.request_id]["n"] += last - first + 1
        core.cohort.on_tokens = silent
    events = sorted([(t, 0, i) for i, t in enumerate(arrivals)] + [(t, 1, i) for i, t in aborts.items()])
    for k, (t, kind, i) in enumerate(events):
        core.run_until_idle(until=t)
        if kind == 0:
            core.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=list(prompts[i]),
                                               sampling_params=SamplingParams(max_tokens=max_tokens[i],
                                                                              ignore_eos=True)))
        else:
            core.abort_requests([f"r{i}"])
        core.run_until_idle(until=t)
        if timing_only:
            core.fast_forward(events[k + 1][0] if k + 1 < len(events) else math.inf)
    core.run_until_idle()
    if timing_only:
        while core.fast_forward(math.inf):
            core.run_until_idle()
    core.run_until_idle()
    pool = core.block_pool
    assert not core.requests and pool.num_free_blocks == pool.num_blocks and pool._multi == 0
    # (the last token's id only with a factory's ids: plain random ids differ between the paths)
    result = {rid: (r["first"], r["finish"], r["n"], r["cached"], r.get("last") if core_kw else None)
              for rid, r in seen.items()
              if int(rid[1:]) not in aborts}
    firsts = {rid: (r["first"], r["cached"]) for rid, r in seen.items() if int(rid[1:]) in aborts}
    return result, firsts, core.scheduler.total_preemptions, pool.free_queue()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), n=st.integers(1, 14), kv_blocks=st.integers(18, 70), budget=st.integers(32, 160),
       seqs=st.integers(1, 10), max_len=st.sampled_from([0, 0, 80]), engine=ENGINES)
def test_aborts_shared_prefixes_and_preemption_change_nothing_but_the_outputs(data, n, kv_blocks, budget, seqs,
                                                                              max_len, engine):
    """Hostile inputs at the engine: a tiny KV cache (blocks of 4), prompts sharing prefixes (cache hits
    on blocks in use and on free ones), lognormal-ish lengths, requests aborted before, during or after
    their decodes: the timing-only engine gives every request the same first token, finish and token
    count, the same preemptions and prefix hits, and leaves the same free queue."""
    args = _args(kv_blocks, 4, budget, min(seqs, budget), max_len, *engine)
    prefixes = [list(range(100 * g + 1, 100 * g + 1 + 24)) for g in range(2)]
    prompts, max_tokens, arrivals, aborts = [], [], [], {}
    for i in range(n):
        shared = data.draw(st.sampled_from([None, 0, 1]), label=f"prefix{i}")
        cut = data.draw(st.integers(0, 24), label=f"cut{i}")
        own = data.draw(st.integers(1, 40), label=f"own{i}")
        prompt = (prefixes[shared][:cut] if shared is not None else []) + [1000 + 50 * i + j for j in range(own)]
        prompts.append(prompt)
        max_tokens.append(max(1, int(data.draw(st.floats(0.0, 5.0), label=f"osl{i}") ** 2.7)))
        arrivals.append(data.draw(st.floats(0.0, 0.3), label=f"arrival{i}"))
        if data.draw(st.booleans(), label=f"abort{i}"):
            aborts[i] = arrivals[i] + data.draw(st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.2]), label=f"after{i}")
    plain = _drive(False, args, prompts, max_tokens, arrivals, aborts)
    fast = _drive(True, args, prompts, max_tokens, arrivals, aborts)
    assert fast[0] == plain[0]  # every request not aborted: first token, finish, tokens, cached tokens
    assert fast[1] == plain[1]  # the aborted ones' first tokens and cached tokens (None: aborted before)
    assert fast[2:] == plain[2:]  # preemptions, free queue


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), n=st.integers(1, 10), kv_blocks=st.integers(18, 70), max_len=st.sampled_from([0, 40, 80]))
def test_a_finishing_members_silent_tokens_count_as_its_materialized_ones(data, n, kv_blocks, max_len):
    """A finishing cohort member's tokens before its last are counted, never made (`sample`'s
    `silent`): its last token's id (counted ids alternate by output index), its finish at
    max_tokens or the model's length, and the token count its finish logs are the plain path's."""
    import logging

    from vllm_vcr.engine.decode_cohort import counted_token_source

    args = _args(kv_blocks, 4, 64, 8, max_len)
    args.config.log_requests = True
    prompts, max_tokens, arrivals, aborts = [], [], [], {}
    for i in range(n):
        prompts.append([2000 + 50 * i + j for j in range(data.draw(st.integers(1, 39), label=f"isl{i}"))])
        max_tokens.append(data.draw(st.integers(1, 60), label=f"osl{i}"))
        arrivals.append(data.draw(st.floats(0.0, 0.2), label=f"arrival{i}"))
        if data.draw(st.integers(0, 3), label=f"abort{i}") == 0:
            aborts[i] = arrivals[i] + data.draw(st.sampled_from([0.0, 0.01, 0.05]), label=f"after{i}")

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.lines = []

        def emit(self, record):
            msg = record.getMessage()
            if "finished:" in msg:
                self.lines.append(msg)

    results = []
    logger = logging.getLogger("vllm_vcr.engine")
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        for timing_only in (False, True):
            handler = Lines()
            logger.addHandler(handler)
            try:
                results.append((_drive(timing_only, args, prompts, max_tokens, arrivals, aborts,
                                       token_source_factory=counted_token_source(32000)), sorted(handler.lines)))
            finally:
                logger.removeHandler(handler)
    finally:
        logger.setLevel(level)
    (plain, plain_log), (fast, fast_log) = results
    assert fast == plain
    assert fast_log == plain_log


def _disagg(monkeypatch, kv, block, budget, seqs, engine, workers, dp, moe, held, wl, timing_only, link=2.0):
    """A disaggregated run (simulate/disagg.py): prefill workers hand each prompt's KV to decode
    workers, which pull it over the link and decode; every record and every pool at the end."""
    from vllm_vcr.simulate.disagg import DisaggSimulation

    def latency(_args):
        lat = _latency(held)
        lat.data_parallel_lockstep = moe  # (an MoE model: a worker's DP ranks step together)
        return {"latency": lat}

    monkeypatch.setattr(driver_mod, "engine_inputs", latency)
    p_args, d_args = (msgspec.structs.replace(_args(kv[i], block, budget, seqs, 0, *engine), worker_type=worker,
                                                  kv_bytes_per_token=4096, kv_transfer_bandwidth=link).validate()
                      for i, worker in enumerate(("prefill", "decode")))
    sim = DisaggSimulation(p_args, d_args, workers[0] * dp[0], workers[1] * dp[1], SyntheticWorkload(**wl),
                           concurrency=wl["concurrency"], prefill_dp=dp[0], decode_dp=dp[1],
                           timing_only=timing_only).run()
    assert sim.timing_only is timing_only
    assert not sim.records and not sim.prompts
    for core in sim.prefill + sim.decode:
        assert core.block_pool.num_free_blocks == core.block_pool.num_blocks and not core.requests
    done = {r.request_id: (r.engine, r.first, r.last, r.end, r.num_out, r.finish, list(r.gaps())) for r in sim.done}
    return sim, done


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 30), isl=st.sampled_from(["uniform:1:120", "uniform:40:80", "17"]),
       osl=st.sampled_from(["uniform:1:60", "uniform:20:40", "1", "2"]), arrival=st.sampled_from(["closed", "poisson"]),
       concurrency=st.integers(1, 16), p_kv=st.integers(20, 120), d_kv=st.integers(0, 60),
       block=st.sampled_from([4, 16]), budget=st.integers(32, 256), seqs=st.integers(1, 16),
       workers=st.tuples(st.integers(1, 2), st.integers(1, 2)), dp=st.sampled_from([(1, 1), (1, 2), (2, 2)]),
       moe=st.booleans(), prefixes=st.sampled_from([0, 2]), seed=st.integers(0, 3), held=st.booleans(),
       engine=ENGINES, link=st.sampled_from([2.0, 0.05, 0.01]))
def test_a_disaggregated_runs_decode_workers_time_their_pulled_requests_alike(
        monkeypatch, n, isl, osl, arrival, concurrency, p_kv, d_kv, block, budget, seqs, workers, dp, moe, prefixes,
        seed, held, engine, link):
    """Decode workers whose requests arrive with a remote prefill (their KV pulled, then decoded in
    the cohort) against the plain path: the same times, gaps, finishes, preemptions and steps on
    every worker, and every worker's free blocks in the same eviction order at the end. On the
    slower links (a 100-token prompt's pull lasts ~8 steps at 0.05 GB/s) the cohort runs ahead while
    pulls are in flight and stops at the boundary where one completes."""
    wl = dict(num_requests=n, isl=LengthDist.parse(isl, "--isl"), osl=LengthDist.parse(osl, "--osl"), arrival=arrival,
              concurrency=concurrency, request_rate=200.0, num_prefixes=prefixes, prefix_len=24, seed=seed)
    # (a decode worker holds one longest request: 180 tokens; with few blocks more, it preempts)
    kw = dict(kv=(max(p_kv, 120 // block + 2), 180 // block + 2 + d_kv), block=block, budget=budget,
              seqs=min(seqs, budget), engine=engine, workers=workers, dp=dp, moe=moe, held=held, wl=wl, link=link)
    plain, expected = _disagg(monkeypatch, timing_only=False, **kw)
    fast, got = _disagg(monkeypatch, timing_only=True, **kw)
    assert got == expected and len(got) == n
    assert fast.timeline.preemptions == plain.timeline.preemptions
    assert fast.timeline.steps == plain.timeline.steps
    assert [c.block_pool.free_queue() for c in fast.prefill + fast.decode] == \
        [c.block_pool.free_queue() for c in plain.prefill + plain.decode]


@pytest.mark.parametrize("engine", [("vllm", 1), ("sglang", 1), ("sglang", 3)])
def test_a_decode_worker_short_of_blocks_preempts_pulled_requests_alike(monkeypatch, engine):
    wl = dict(num_requests=24, isl=LengthDist.parse("uniform:40:80", "--isl"),
              osl=LengthDist.parse("uniform:20:40", "--osl"), arrival="closed", concurrency=12, seed=1)
    kw = dict(kv=(60, 40), block=4, budget=128, seqs=16, engine=engine, workers=(2, 1), dp=(1, 1), moe=False,
              held=False, wl=wl)
    plain, expected = _disagg(monkeypatch, timing_only=False, **kw)
    fast, got = _disagg(monkeypatch, timing_only=True, **kw)
    assert sum(plain.timeline.preemptions) > 0 and fast.timeline.preemptions == plain.timeline.preemptions
    assert got == expected and fast.timeline.steps == plain.timeline.steps


@pytest.mark.xfail(strict=True, reason="a known difference of the disaggregated timing-only path: a decode worker's "
                   "cohort member that finishes at the step a 1-token request's KV pull completes frees its blocks one "
                   "step call earlier than on the plain path (same times, gaps and step counts; the final free queue's "
                   "order and later block ids differ)")
def test_a_pull_completing_at_a_cohort_finish_frees_in_the_plain_order(monkeypatch):
    wl = dict(num_requests=7, isl=LengthDist.parse("17", "--isl"), osl=LengthDist.parse("uniform:1:60", "--osl"),
              arrival="poisson", concurrency=1, request_rate=200.0, num_prefixes=0, prefix_len=24, seed=1)
    kw = dict(kv=(32, 47), block=4, budget=32, seqs=4, engine=("vllm", 1), workers=(1, 1), dp=(1, 2), moe=False,
              held=False, wl=wl, link=2.0)
    plain, expected = _disagg(monkeypatch, timing_only=False, **kw)
    fast, got = _disagg(monkeypatch, timing_only=True, **kw)
    assert got == expected and fast.timeline.steps == plain.timeline.steps
    assert [c.block_pool.free_queue() for c in fast.prefill + fast.decode] == \
        [c.block_pool.free_queue() for c in plain.prefill + plain.decode]
