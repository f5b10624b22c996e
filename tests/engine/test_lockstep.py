"""Data-parallel lockstep (engine/lockstep.py): the DP ranks of an MoE model step together, on
the virtual clock, driven by the simulator's event loop; a dense model's ranks stay independent."""

from __future__ import annotations

import asyncio
import heapq
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_vcr.engine.async_engine import AsyncEngine
from vllm_vcr.engine.clock import VirtualClock
from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.engine.core import EngineCore
from vllm_vcr.engine.latency import LatencyModel, StepBatch, zero_pacing
from vllm_vcr.engine.lockstep import (DP_SYNC_INTERVAL, DataParallelLockstep, LockstepRounds, RankLockstep,
                                      lockstep_applies)
from vllm_vcr.engine.policy import policy_for
from vllm_vcr.engine.types import EngineCoreRequest, SamplingParams
from vllm_vcr.simulate.driver import run_events
from vllm_vcr.testing.waits import scaled

MS = 1e-3


class Linear(LatencyModel):
    """10 ms + 1 ms per decode + 0.1 ms per prefill token; an MoE model or a dense one."""

    times_steps = True

    def __init__(self, moe: bool) -> None:
        self.data_parallel_lockstep = moe

    def step_duration(self, batch: StepBatch, rng: random.Random) -> float:
        return (10.0 + batch.num_decodes + 0.1 * batch.num_prefill_tokens) * MS

    def pacing(self, num_prompt_tokens, num_cached_tokens, num_running, rng):
        return zero_pacing(rng)


def _request(rid: str, prompt_len: int, max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=[7 + i % 1000 for i in range(prompt_len)],
                             sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _engines(moe: bool, ranks: int, engine_type: str):
    """`ranks` engines on one virtual clock with a linear step model; their token times by id."""
    clock = VirtualClock(0.0)
    args = EngineArgs(config=EngineConfig(max_num_batched_tokens=8192, max_num_seqs=64),
                      engine_type=engine_type).validate()
    times: dict[str, list[float]] = {}

    def sink(client, outs):
        for o in outs.outputs:
            times.setdefault(o.request_id, []).extend([outs.timestamp] * len(o.new_token_ids))

    model = Linear(moe)
    cores = [EngineCore(args, engine_index=i, clock=clock, latency=model, output_sink=sink) for i in range(ranks)]
    return clock, cores, times


def _arrivals(arrivals: list[tuple[float, int, str, int, int]], cores: list):
    """The arrivals' heap for run_events and its delivery to the rank each names."""
    heap = [(t, i, (rank, rid, p, n)) for i, (t, rank, rid, p, n) in enumerate(arrivals)]
    heapq.heapify(heap)

    def deliver(item, now):
        rank, rid, p, n = item
        cores[rank].add_request(_request(rid, p, n))

    return heap, deliver


def run_ranks(moe: bool, arrivals: list[tuple[float, int, str, int, int]], ranks: int = 2,
              engine_type: str = "vllm", ended: list | None = None):
    """`arrivals`: (time, rank, id, prompt, max tokens). Returns ({id: token times}, group, cores);
    `ended` gets (end, dummy) of every step the ranks end."""
    clock, cores, times = _engines(moe, ranks, engine_type)
    group = DataParallelLockstep.attach(cores)
    if ended is not None:
        for core in cores:
            def end_step(batch, _end_step=core.end_step):
                ended.append((round(batch.end, 9), batch.dummy))
                return _end_step(batch)
            core.end_step = end_step
    heap, deliver = _arrivals(arrivals, cores)

    run_events(clock, cores, heap, deliver)
    return times, group, cores


def gaps(ts: list[float]) -> list[float]:
    return [round(b - a, 9) for a, b in zip(ts, ts[1:])]


# rank 0 decodes a short request from t=0; a 4000-token prompt reaches rank 1 at 30 ms
WORK = [(0.0, 0, "short", 20, 12), (0.030, 1, "long", 4000, 3)]


def test_one_ranks_prefill_stalls_the_other_ranks_decodes_in_an_moe_model():
    times, group, _ = run_ranks(True, WORK)
    assert group is not None
    short, long = times["short"], times["long"]
    # round 1: rank 0's 20-token prefill (12 ms) beside rank 1's dummy step (one decode token: 11 ms);
    # then decode rounds of 11 ms; the long prompt, arriving mid-round at 30 ms, starts at the
    # round's end (34 ms) and its 400 ms prefill is the round every rank waits for
    assert round(short[0], 9) == 0.012
    assert gaps(short)[:2] == [0.011, 0.011]
    assert round(long[0], 9) == round(0.034 + 0.410, 9)
    assert round(0.034 + 0.410, 9) in [round(t, 9) for t in short]  # rank 0's token comes with it
    assert max(gaps(short)) == 0.410
    # every token of both ranks lands on the rounds' common ends
    assert {round(t, 9) for t in long} <= {round(t, 9) for t in short} | {round(long[-1], 9)}
    assert group.end is None and group.rounds == 0  # the wave ended
    assert group.waves == 1


def test_a_dense_models_ranks_stay_independent():
    times, group, cores = run_ranks(False, WORK)
    assert group is None and all(c.lockstep is None for c in cores)
    short, long = times["short"], times["long"]
    assert round(long[0], 9) == round(0.030 + 0.410, 9)  # at once: rank 1 was idle
    assert set(gaps(short)) == {0.011}  # rank 0 never waits for rank 1


def test_idle_ranks_keep_stepping_until_the_ranks_agree_the_wave_is_over():
    """After the last request ends the ranks run dummy steps up to the next sync (every 16th
    step, and the wave's first): a request arriving then waits for the dummy step's end."""
    # one request of 3 tokens: rounds 1..3 (12 ms prefill, 11 ms decodes: ends at 34 ms), then
    # dummy rounds to round 16 (13 x 11 ms: 177 ms); a second request at 100 ms joins that wave
    times, group, cores = run_ranks(True, [(0.0, 0, "a", 20, 3), (0.100, 1, "b", 20, 2)])
    a, b = times["a"], times["b"]
    assert [round(t, 9) for t in a] == [0.012, 0.023, 0.034]
    # the dummy rounds end at 45, 56, ..., 100 is inside the one ending at 111 ms
    assert round(b[0], 9) == round(0.111 + 0.012, 9)
    assert group.waves == 1 and group.end is None
    assert DP_SYNC_INTERVAL == 16


def test_a_single_request_wave_stops_after_its_first_step_sync():
    """The ranks agree after a wave's first step too: an idle group does not run on for 16 steps
    when its only work ended in one step."""
    times, group, cores = run_ranks(True, [(0.0, 0, "a", 20, 1), (0.020, 1, "b", 20, 1)])
    # round 1 (12 ms) ends the only request: no rank has work, the wave stops; b opens a new one at once
    assert [round(t, 9) for t in times["a"]] == [0.012]
    assert [round(t, 9) for t in times["b"]] == [round(0.020 + 0.012, 9)]
    assert group.waves == 2


def test_sglang_ranks_of_an_moe_model_step_together_every_step_and_only_while_one_has_a_batch():
    """SGLang's DP attention: one rank's prefill stretches the other's decode step, an idle rank
    runs an idle batch beside a busy one, and the rounds stop as soon as no rank has a batch (no
    16-step wave: a request arriving after the work ended starts at once)."""
    times, group, cores = run_ranks(True, WORK, engine_type="sglang")
    assert group is not None and group.rule.per_step
    short, long = times["short"], times["long"]
    # as vLLM's: rank 0's prefill beside rank 1's idle batch (12 ms), decode rounds of 11 ms; the
    # long prompt arrives mid-round (30 ms) and its 400 ms prefill is the next round's length
    assert round(short[0], 9) == 0.012
    assert gaps(short)[:2] == [0.011, 0.011]
    assert round(long[0], 9) == round(0.034 + 0.410, 9)
    assert max(gaps(short)) == 0.410 and round(0.034 + 0.410, 9) in [round(t, 9) for t in short]
    assert group.end is None and all(c.timed.in_flight is None for c in cores)

    times, group, cores = run_ranks(True, [(0.0, 0, "a", 20, 3), (0.100, 1, "b", 20, 2)], engine_type="sglang")
    assert [round(t, 9) for t in times["a"]] == [0.012, 0.023, 0.034]
    assert round(times["b"][0], 9) == round(0.100 + 0.012, 9)  # no idle rounds after a's end: b starts at once
    assert group.waves == 2


def test_sglang_ranks_of_a_dense_model_stay_independent():
    times, group, cores = run_ranks(False, WORK, engine_type="sglang")
    assert group is None and all(c.lockstep is None for c in cores)
    assert round(times["long"][0], 9) == round(0.030 + 0.410, 9)
    assert set(gaps(times["short"])) == {0.011}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 400), st.integers(0, 2), st.integers(1, 3000), st.integers(1, 12)),
                min_size=1, max_size=10))
def test_sglang_ranks_finish_every_request_and_never_run_a_round_of_idle_batches_alone(arrivals):
    """Three SGLang MoE ranks, random arrivals: every request gets all its tokens, every round
    end is some request's token time (no round of idle batches only), and the group ends idle."""
    work = [(ms * MS, rank, f"r{i}", prompt, n) for i, (ms, rank, prompt, n) in enumerate(arrivals)]
    ended: list = []
    times, group, cores = run_ranks(True, work, ranks=3, engine_type="sglang", ended=ended)
    assert {rid: len(ts) for rid, ts in times.items()} == {f"r{i}": a[3] for i, a in enumerate(arrivals)}
    rounds: dict[float, list[bool]] = {}
    for end, dummy in ended:
        rounds.setdefault(end, []).append(dummy)
    assert all(not all(dummies) for dummies in rounds.values())  # some rank had a batch in every round
    assert any(len(d) == 3 for d in rounds.values())  # the ranks stepped together
    assert group.end is None and all(c.timed.in_flight is None for c in cores)


def test_serves_in_process_engines_are_tied_when_the_model_is_moe():
    args = EngineArgs().validate()
    for moe in (True, False):
        engine = AsyncEngine(args, 2, clock=VirtualClock(0.0), latency=Linear(moe))
        groups = {id(c.lockstep) for c in engine.engines}
        assert (len(groups) == 1 and engine.engines[0].lockstep is not None) if moe else \
            all(c.lockstep is None for c in engine.engines)


@pytest.mark.parametrize("engine_type", ["vllm", "sglang"])
async def test_on_the_real_clock_serves_ranks_step_together(engine_type):
    """serve's in-process engines (AsyncEngine, the real clock): a 2000-token prefill on rank 1
    (210 ms of step) holds rank 0's decodes, and both requests finish (either engine type's rule)."""
    engine = AsyncEngine(EngineArgs(config=EngineConfig(max_num_batched_tokens=8192, log_requests=False),
                                    engine_type=engine_type).validate(), 2, latency=Linear(True))
    stamps: dict[int, list[float]] = {0: [], 1: []}
    engine.add_output_listener(lambda i, outs: stamps[i].append(outs.timestamp) if outs.outputs else None)
    await engine.start()
    try:
        async def collect(rid, prompt, tokens, rank, after):
            await asyncio.sleep(after)
            r = _request(rid, prompt, tokens)
            r.data_parallel_rank = rank
            return [o async for o in engine.generate(r)]

        short, long = await asyncio.wait_for(asyncio.gather(
            collect("short", 8, 40, 0, 0.0), collect("long", 2000, 2, 1, 0.05)), scaled(30))
    finally:
        await engine.stop(0)
    assert short[-1].finish_reason is not None and long[-1].finish_reason is not None
    # rank 0 waited for rank 1's prefill (210 ms; a token stamped late by a busy loop can shorten
    # the gap after it, so the bound is below the step, still far above a decode step's few ms)
    assert max(gaps(stamps[0])) >= 0.15


_ARRIVAL = st.tuples(st.integers(0, 400), st.integers(0, 2), st.integers(1, 3000), st.integers(1, 12))


def _assert_each_request_steps_with_every_rank(times: dict[str, list[float]], arrivals: list) -> None:
    """Every request has all its tokens, and between its first and last one a token at every
    instant any rank emitted one (its rank stepped with theirs)."""
    assert {rid: len(ts) for rid, ts in times.items()} == {f"r{i}": a[3] for i, a in enumerate(arrivals)}
    ends = sorted({round(t, 9) for ts in times.values() for t in ts})
    for ts in times.values():
        mine = {round(t, 9) for t in ts}
        first, last = round(ts[0], 9), round(ts[-1], 9)
        assert all(e in mine for e in ends if first < e < last)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_ARRIVAL, min_size=1, max_size=10))
def test_while_a_request_decodes_it_gets_a_token_at_every_step_end_of_every_rank(arrivals):
    """Three MoE ranks, random arrivals: every request ends with all its tokens, and a request
    between its first and last token has a token at every instant any rank emitted one (its
    rank stepped with theirs); the wave ends when the work does."""
    work = [(ms * MS, rank, f"r{i}", prompt, n) for i, (ms, rank, prompt, n) in enumerate(arrivals)]
    times, group, _ = run_ranks(True, work, ranks=3)
    _assert_each_request_steps_with_every_rank(times, arrivals)
    assert group.end is None


# --- ranks in separate processes: each rank's RankLockstep and the coordinator's LockstepRounds --
def run_ranks_apart(moe: bool, arrivals: list[tuple[float, int, str, int, int]], ranks: int = 2,
                    engine_type: str = "vllm"):
    """As run_ranks, each core with its own RankLockstep and one LockstepRounds between them (the
    messages delivered at once, between the cores' turns: the transport of wire/lockstep.py
    without its latency). Returns ({id: token times}, coordinator, rank lockstep objects)."""
    clock, cores, times = _engines(moe, ranks, engine_type)
    rule = policy_for(engine_type).dp_lockstep
    coordinator = LockstepRounds(rule)
    to_coordinator: list[tuple] = []
    to_ranks: list[tuple] = []
    links = [RankLockstep(core, lambda *msg, r=i: to_coordinator.append((r, msg)), rule=rule)
             for i, core in enumerate(cores) if lockstep_applies(core)]

    def flush(now: float) -> None:
        while to_coordinator or to_ranks:
            while to_coordinator:
                rank, (kind, *rest) = to_coordinator.pop(0)
                to_ranks.extend(getattr(coordinator, kind)(rank, *rest))
            while to_ranks:
                rank, msg = to_ranks.pop(0)
                links[rank].on_message(*msg)

    heap, deliver = _arrivals(arrivals, cores)

    flush(0.0)
    run_events(clock, cores, heap, deliver, flush)
    return times, coordinator, links


@pytest.mark.parametrize("engine_type", ["vllm", "sglang"])
@pytest.mark.parametrize("work", [WORK, [(0.0, 0, "a", 20, 3), (0.100, 1, "b", 20, 2)],
                                  [(0.0, 0, "a", 20, 1), (0.020, 1, "b", 20, 1)]])
def test_ranks_apart_step_as_the_ranks_of_one_process(work, engine_type):
    """The same rounds, the same wave ends, the same token times, by either engine type's rule."""
    together, group, _ = run_ranks(True, work, engine_type=engine_type)
    apart, coordinator, links = run_ranks_apart(True, work, engine_type=engine_type)
    assert apart == together
    assert coordinator.waves == group.waves and not coordinator.wave
    assert all(not link.wave and link.pending is None for link in links)


def test_a_dense_models_ranks_apart_never_report():
    apart, coordinator, links = run_ranks_apart(False, WORK)
    together, _, _ = run_ranks(False, WORK)
    assert links == [] and coordinator.queues == {} and apart == together


def test_a_rank_that_leaves_no_longer_holds_the_others():
    """A rank that stops (drained, dead) leaves: the rounds go on with the others at their own ends."""
    rounds = LockstepRounds()
    assert rounds.hello(0) == [] and rounds.hello(1) == []
    assert rounds.report(0, 1, 0.5, True) == [(1, ("start",))]
    assert rounds.leave(1) == [(0, ("go", 1, 0.5))]
    assert rounds.report(0, 2, 0.9, True) == [(0, ("go", 2, 0.9))]


def test_a_round_whose_end_never_comes_ends_late_not_never():
    """The coordinator's reply lost (a peer gone): the rank's step ends ROUND_WAIT after its own end."""
    times: list[float] = []
    core = EngineCore(EngineArgs().validate(), clock=VirtualClock(0.0), latency=Linear(True),
                      output_sink=lambda client, outs: times.extend(outs.timestamp for _ in outs.outputs))
    RankLockstep(core, lambda *msg: None, round_wait=1.0)
    core.add_request(_request("a", 20, 2))
    core.run_until_idle(until=10.0)
    assert [round(t, 9) for t in times] == [1.012, 2.023]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_ARRIVAL, min_size=1, max_size=8))
def test_ranks_apart_give_every_request_a_token_at_every_step_end(arrivals):
    """The invariant of the ranks of one process holds for ranks apart: three MoE ranks, random
    arrivals, every request complete and stepping with every other rank; the waves end."""
    work = [(ms * MS, rank, f"r{i}", prompt, n) for i, (ms, rank, prompt, n) in enumerate(arrivals)]
    times, coordinator, links = run_ranks_apart(True, work, ranks=3)
    _assert_each_request_steps_with_every_rank(times, arrivals)
    assert not coordinator.wave and all(link.pending is None for link in links)
