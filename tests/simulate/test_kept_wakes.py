"""The simulators' event loop (`driver.run_engines`) reads an engine's next wake-up only after the
engine ran, or as "now" while its inbox holds messages; the plain loop (`driver.run_events`, with
`fast_forward` reading every engine's wake-up again) asks every engine at every turn. The two must
run the same simulation: every request's times, gaps and finish, every step's scheduler stats in
the timeline (so every output batch, in order), the steps, preemptions and each pool's free queue
at the end, aggregated or disaggregated, timing-only or plain, under KV pressure, with held
requests (frontend time, async scheduling), slow KV links and both engine types.
"""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_vcr.simulate import disagg as disagg_mod
from vllm_vcr.simulate import driver as driver_mod
from vllm_vcr.simulate.disagg import DisaggSimulation
from vllm_vcr.simulate.runner import simulate
from vllm_vcr.simulate.workload import LengthDist, SyntheticWorkload

from ..engine.test_decode_cohort import ENGINES, _args, _latency


def _asking_every_engine(clock, cores, arrivals, deliver, timing_only: bool) -> None:
    """The plain loop: every engine's wake-up read at every turn, and again after one ran ahead."""
    driver_mod.run_events(clock, cores, arrivals, deliver,
                          (lambda now: driver_mod.fast_forward(cores, arrivals)) if timing_only else None)


def _outcome(sim, cores) -> tuple:
    tl = sim.timeline
    done = sorted((r.request_id, r.engine, r.first, r.last, r.end, r.num_out, r.cached, r.finish, list(r.gaps()))
                  for r in sim.done)
    timeline = (list(tl.t), list(tl.engine), list(tl.running), list(tl.waiting), list(tl.kv_usage), tl.preemptions,
                tl.steps)
    return done, timeline, [c.block_pool.free_queue() for c in cores], [c.step_counter for c in cores]


def _both(monkeypatch, run) -> tuple[tuple, tuple]:
    kept = run()
    with monkeypatch.context() as m:
        m.setattr(driver_mod, "run_engines", _asking_every_engine)
        m.setattr(disagg_mod, "run_engines", _asking_every_engine)
        asked = run()
    return kept, asked


WORKLOADS = dict(n=st.integers(1, 30), isl=st.sampled_from(["uniform:1:120", "uniform:40:80", "17"]),
                 osl=st.sampled_from(["uniform:1:60", "exp:20", "1", "2"]),
                 arrival=st.sampled_from(["closed", "poisson"]), concurrency=st.integers(1, 12),
                 prefixes=st.sampled_from([0, 2]), seed=st.integers(0, 3))


def _workload(n, isl, osl, arrival, concurrency, prefixes, seed) -> dict:
    return dict(num_requests=n, isl=LengthDist.parse(isl, "--isl"), osl=LengthDist.parse(osl, "--osl"),
                arrival=arrival, concurrency=concurrency, request_rate=200.0, num_prefixes=prefixes, prefix_len=24,
                seed=seed)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(**WORKLOADS, kv_blocks=st.integers(40, 200), block=st.sampled_from([4, 16]), budget=st.integers(32, 256),
       seqs=st.integers(1, 16), engines=st.integers(1, 3), held=st.booleans(), engine=ENGINES,
       timing_only=st.booleans())
def test_kept_wake_ups_run_the_same_simulation(monkeypatch, n, isl, osl, arrival, concurrency, prefixes, seed,
                                               kv_blocks, block, budget, seqs, engines, held, engine, timing_only):
    monkeypatch.setattr(driver_mod, "engine_inputs", lambda a: {"latency": _latency(held)})
    args = _args(kv_blocks, block, budget, min(seqs, budget), 0, *engine)
    wl = _workload(n, isl, osl, arrival, concurrency, prefixes, seed)

    def run() -> tuple:
        sim = simulate(args, SyntheticWorkload(**wl), engines=engines, router="kv" if prefixes else "least_loaded",
                       concurrency=concurrency, timing_only=timing_only)
        return _outcome(sim, sim.cores)

    kept, asked = _both(monkeypatch, run)
    assert kept == asked and len(kept[0]) == n


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(**WORKLOADS, p_kv=st.integers(20, 120), d_kv=st.integers(0, 60), block=st.sampled_from([4, 16]),
       budget=st.integers(32, 256), seqs=st.integers(1, 16), workers=st.tuples(st.integers(1, 2), st.integers(1, 2)),
       held=st.booleans(), engine=ENGINES, link=st.sampled_from([2.0, 0.05, 0.01]), timing_only=st.booleans())
def test_kept_wake_ups_run_the_same_disaggregated_simulation(monkeypatch, n, isl, osl, arrival, concurrency, prefixes,
                                                             seed, p_kv, d_kv, block, budget, seqs, workers, held,
                                                             engine, link, timing_only):
    """Prefill workers post to the decode workers' inboxes (a prompt to decode) and decode workers
    to the prefill workers' (a KV hold to release), at the same instant as their own steps."""
    monkeypatch.setattr(driver_mod, "engine_inputs", lambda a: {"latency": _latency(held)})
    kv = (max(p_kv, 120 // block + 2), 180 // block + 2 + d_kv)
    p_args, d_args = (msgspec.structs.replace(_args(kv[i], block, budget, min(seqs, budget), 0, *engine),
                                              worker_type=worker, kv_bytes_per_token=4096,
                                              kv_transfer_bandwidth=link).validate()
                      for i, worker in enumerate(("prefill", "decode")))
    wl = _workload(n, isl, osl, arrival, concurrency, prefixes, seed)

    def run() -> tuple:
        sim = DisaggSimulation(p_args, d_args, workers[0], workers[1], SyntheticWorkload(**wl),
                               concurrency=concurrency, timing_only=timing_only).run()
        return _outcome(sim, sim.prefill + sim.decode)

    kept, asked = _both(monkeypatch, run)
    assert kept == asked and len(kept[0]) == n
