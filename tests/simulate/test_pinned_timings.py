"""The simulated timings are pinned: a few small `simulate` runs (same seed) must report the same
TTFT/TPOT/ITL/E2E quantiles, preemptions, prefix hits, KV usage and steps as when these numbers
were recorded (before the simulator's speed work: lazy KV pool, lazy prompt-block hashing,
estimator caches). A speed change that moves a simulated time fails here.

Both paths are pinned (tests/engine/test_decode_cohort.py holds them equal request by request;
only the KV-usage peak may differ, as the timing-only timeline is sampled at the steps with
outputs). `pressure` runs vLLM's full-sequence admission gate (`scheduler_reserve_full_isl`, the
default: 55 preemptions), `pressure_chunk_admission` the same run with a request admitted once its
first chunk fits (69)."""

from __future__ import annotations

import pytest

from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.perf.aic import AicTarget
from vllm_vcr.simulate import driver as driver_mod
from vllm_vcr.simulate.report import build_report
from vllm_vcr.simulate.runner import simulate
from vllm_vcr.simulate.workload import LengthDist, SyntheticWorkload

from ..engine.test_decode_cohort import _latency

SCENARIOS = {
    # KV pressure: preemptions, resumes that find their own blocks (vLLM's full-sequence admission gate)
    "pressure": (dict(kv=160, block=16, budget=512, seqs=32, engines=1, router="round_robin"),
                 dict(num_requests=120, isl="lognormal:200:120", osl="uniform:20:200", concurrency=24, seed=5)),
    # the same without the gate (--no-scheduler-reserve-full-isl: a request starts when its first chunk fits)
    "pressure_chunk_admission": (dict(kv=160, block=16, budget=512, seqs=32, engines=1, router="round_robin",
                                      full_isl=False),
                                 dict(num_requests=120, isl="lognormal:200:120", osl="uniform:20:200", concurrency=24,
                                      seed=5)),
    # shared prefixes through the KV-prefix router on two engines, chunked prefills
    "prefix": (dict(kv=400, block=16, budget=256, seqs=16, engines=2, router="kv"),
               dict(num_requests=150, isl="uniform:100:600", osl="exp:40", concurrency=16, seed=7,
                    num_prefixes=3, prefix_len=160)),
    # the real estimator (Llama-3.1-8B on one H100), a KV pool small enough to preempt, shared prefixes
    "aic": (dict(kv=1500, block=16, budget=8192, seqs=1024, engines=1, router="round_robin", aic=True),
            dict(num_requests=160, isl="lognormal:1024:512", osl="lognormal:256:128", concurrency=32, seed=3,
                 num_prefixes=4, prefix_len=512)),
}


def _digest(report: dict) -> dict:
    lat = {k: {q: round(v, 6) for q, v in s.items()} for k, s in report["latency_ms"].items()}
    eng = [(e["requests"], round(e["max_kv_usage"], 9), e["max_waiting"], e["preemptions"], e["steps"])
           for e in report["engines"]]
    return {"latency_ms": lat, "preemptions": report["preemptions"]["total"],
            "prefix_cache_hit_rate": round(report["prefix_cache_hit_rate"], 9), "engines": eng,
            "duration_s": round(report["throughput"]["duration_s"], 9)}


def run_scenario(name: str, timing_only: bool) -> dict:
    eng, wl = SCENARIOS[name]
    cfg = EngineConfig(max_num_seqs=eng["seqs"], max_num_batched_tokens=eng["budget"])
    # the host overhead spelt out: the numbers pin the engine, not the fitted default (perf/aic.py)
    perf = AicTarget("meta-llama/Llama-3.1-8B-Instruct", "h100_sxm", step_overhead_ms=1.75,
                     per_seq_overhead_ms=0.0, frontend_ms=0.0, frontend_ms_per_1k_tokens=0.0,
                     frontend_ms_per_request=0.0).to_dict() if eng.get("aic") else None
    args = EngineArgs(config=cfg, kv_cache_size=eng["kv"], tokens_per_block=eng["block"], perf_model=perf,
                      advertised_max_model_len=1 << 20, scheduler_reserve_full_isl=eng.get("full_isl", True)).validate()
    w = dict(wl, isl=LengthDist.parse(wl["isl"], "--isl"), osl=LengthDist.parse(wl["osl"], "--osl"), arrival="closed")
    sim = simulate(args, SyntheticWorkload(**w), engines=eng["engines"], router=eng["router"],
                   concurrency=w["concurrency"], timing_only=timing_only)
    return _digest(build_report(sim))


# recorded on commit 134eb42 (before the speed work)
PINNED: dict[str, dict] = {'aic': {'latency_ms': {'ttft': {'mean': 206.018268,
                                 'p50': 99.141629,
                                 'p90': 485.830842,
                                 'p95': 603.718322,
                                 'p99': 807.213856},
                        'tpot': {'mean': 11.227863,
                                 'p50': 11.276441,
                                 'p90': 11.961981,
                                 'p95': 12.335387,
                                 'p99': 12.751329},
                        'e2e': {'mean': 2757.776496,
                                'p50': 2516.22251,
                                'p90': 4658.632706,
                                'p95': 5164.450577,
                                'p99': 6906.263388},
                        'itl': {'mean': 11.143657,
                                'p50': 10.154732,
                                'p90': 10.255656,
                                'p95': 15.692592,
                                'p99': 38.61073}},
         'preemptions': 24,
         'prefix_cache_hit_rate': 0.453765694,
         'engines': [(160, 1.0, 25, 24, 1728)],
         'duration_s': 18.196606911},
 'prefix': {'latency_ms': {'ttft': {'mean': 20.515109,
                                    'p50': 15.449334,
                                    'p90': 30.337248,
                                    'p95': 44.944266,
                                    'p99': 60.55994},
                           'tpot': {'mean': 7.199401,
                                    'p50': 7.223866,
                                    'p90': 7.466991,
                                    'p95': 7.684493,
                                    'p99': 8.229634},
                           'e2e': {'mean': 275.696819,
                                   'p50': 181.649687,
                                   'p90': 608.890364,
                                   'p95': 884.991811,
                                   'p99': 1267.112031},
                           'itl': {'mean': 7.110767,
                                   'p50': 7.1044,
                                   'p90': 8.079384,
                                   'p95': 8.55381,
                                   'p99': 8.768933}},
            'preemptions': 0,
            'prefix_cache_hit_rate': 0.425395724,
            'engines': [(57, 0.475, 5, 0, 442), (93, 0.44, 6, 0, 497)],
            'duration_s': 3.374900807},
 'pressure_chunk_admission': {'latency_ms': {'ttft': {'mean': 1279.568239,
                                      'p50': 1296.611286,
                                      'p90': 2113.404825,
                                      'p95': 2178.244653,
                                      'p99': 2308.981699},
                             'tpot': {'mean': 7.453169,
                                      'p50': 7.045196,
                                      'p90': 8.915344,
                                      'p95': 9.44105,
                                      'p99': 11.231282},
                             'e2e': {'mean': 2104.806433,
                                     'p50': 2209.742589,
                                     'p90': 2922.877013,
                                     'p95': 3213.31577,
                                     'p99': 3473.681321},
                             'itl': {'mean': 7.34906,
                                     'p50': 6.9292,
                                     'p90': 7.0356,
                                     'p95': 7.1484,
                                     'p99': 10.59474}},
              'preemptions': 69,
              'prefix_cache_hit_rate': 0.0,
              'engines': [(120, 1.0, 21, 69, 1674)],
              'duration_s': 11.58080588},
 'pressure': {'latency_ms': {'ttft': {'mean': 1279.583873,
                                      'p50': 1300.817629,
                                      'p90': 2116.016495,
                                      'p95': 2170.418869,
                                      'p99': 2301.703181},
                             'tpot': {'mean': 7.450035,
                                      'p50': 7.029948,
                                      'p90': 8.87584,
                                      'p95': 9.701573,
                                      'p99': 11.370908},
                             'e2e': {'mean': 2102.480756,
                                     'p50': 2208.499692,
                                     'p90': 2909.001181,
                                     'p95': 3210.063362,
                                     'p99': 3466.388799},
                             'itl': {'mean': 7.32821, 'p50': 6.9292, 'p90': 7.0356, 'p95': 7.0984, 'p99': 10.50514}},
              'preemptions': 55,
              'prefix_cache_hit_rate': 0.0,
              'engines': [(120, 1.0, 21, 55, 1673)],
              'duration_s': 11.565644157}}
# the timing-only path samples its timeline at the steps with outputs: its KV-usage peak may be lower
TIMING_ONLY: dict[str, dict] = {'prefix': {'engines': [(57, 0.475, 5, 0, 442), (93, 0.4375, 6, 0, 497)]}}


@pytest.mark.parametrize("timing_only", [False, True])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_simulated_timings_are_unchanged(monkeypatch, name, timing_only):
    if SCENARIOS[name][0].get("aic"):
        pytest.importorskip("aiconfigurator_core", reason="the aic extra is not installed: pip install 'vllm-vcr[aic]'")
    else:  # a stand-in estimator: step times linear in what the step computes
        monkeypatch.setattr(driver_mod, "engine_inputs", lambda a: {"latency": _latency()})
    want = {**PINNED[name], **TIMING_ONLY.get(name, {})} if timing_only else PINNED[name]
    assert run_scenario(name, timing_only) == want
