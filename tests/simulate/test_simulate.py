"""`vllm-vcr simulate`: workloads, routers, the report; the engines are the serve/play EngineCore."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from vllm_vcr.cli import main
from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.simulate.runner import simulate
from vllm_vcr.simulate.workload import LengthDist, SyntheticWorkload, TraceWorkload


def _args(**kw) -> EngineArgs:
    fields = {k: kw.pop(k) for k in list(kw) if k in EngineConfig.__struct_fields__}
    cfg = EngineConfig(time_to_first_token=kw.pop("ttft", 50.0), inter_token_latency=kw.pop("itl", 10.0),
                       max_num_seqs=kw.pop("max_num_seqs", 64), **fields)
    return EngineArgs(config=cfg, advertised_max_model_len=8192, **kw).validate()


def test_cli_closed_loop_end_to_end_writes_report_and_figures(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["simulate", "--num-requests", "300", "--concurrency", "16", "--isl", "uniform:64:256", "--osl", "32",
               "--engine-count", "2", "--router", "least_loaded", "--time-to-first-token", "40",
               "--inter-token-latency", "5", "-o", str(out), "--no-progress"])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert report["requests"] == 300 and report["finish_reasons"] == {"length": 300}
    assert report["latency_ms"]["ttft"]["p50"] == pytest.approx(40, rel=0.05)
    assert report["latency_ms"]["tpot"]["p50"] == pytest.approx(5, rel=0.05)
    assert [e["requests"] for e in report["engines"]] == [150, 150]
    assert report["throughput"]["output_tokens_per_s"] > 0 and len(report["timeline"]["t_s"]) > 10
    assert (out / "latency.png").stat().st_size > 1000 and (out / "timeline.png").stat().st_size > 1000
    assert "TTFT" in capsys.readouterr().out


def test_bad_workload_flags_are_a_cli_error(tmp_path, capsys):
    assert main(["simulate", "--isl", "gauss:1:2", "-o", str(tmp_path), "--no-progress"]) == 2
    assert "--isl" in capsys.readouterr().err


def test_closed_loop_keeps_concurrency_users_busy():
    wl = SyntheticWorkload(num_requests=200, isl=LengthDist("fixed", 32), osl=LengthDist("fixed", 8),
                           arrival="closed", concurrency=10)
    sim = simulate(_args(), wl, concurrency=10)
    assert len(sim.done) == 200
    assert max(sim.timeline.running) == 10
    # closed loop: the next request of a user arrives when its previous one ends
    ends = sorted(round(r.end, 9) for r in sim.done)
    arrivals = sorted(round(r.arrival, 9) for r in sim.done)[10:]
    assert arrivals == ends[: len(arrivals)]


def test_poisson_and_bursty_arrivals_have_the_asked_rate_and_spread():
    def gaps(kind: str) -> list[float]:
        wl = SyntheticWorkload(num_requests=4000, isl=LengthDist("fixed", 8), osl=LengthDist("fixed", 1),
                               arrival=kind, request_rate=50.0, burstiness=4.0, seed=3)
        t = [r.arrival for r in wl.open_arrivals()]
        return [b - a for a, b in zip(t, t[1:])]

    for kind, cv2 in (("poisson", 1.0), ("bursty", 4.0)):
        g = gaps(kind)
        mean = statistics.fmean(g)
        assert mean == pytest.approx(1 / 50, rel=0.1)
        assert statistics.pvariance(g) / mean**2 == pytest.approx(cv2, rel=0.25)


def test_length_distributions_parse_and_draw_within_bounds():
    import random

    rng = random.Random(0)
    d = LengthDist.parse("uniform:10:20", "--isl")
    assert all(10 <= d.draw(rng) <= 20 for _ in range(200))
    ln = [LengthDist.parse("lognormal:500:200", "--osl").draw(rng) for _ in range(4000)]
    assert statistics.fmean(ln) == pytest.approx(500, rel=0.05)
    with pytest.raises(ValueError, match="--osl"):
        LengthDist.parse("normal:5", "--osl")


def _prefix_run(router: str):
    # 8 shared prefixes of 128 blocks; each engine's cache holds about 3 of them
    wl = SyntheticWorkload(num_requests=400, isl=LengthDist("fixed", 2100), osl=LengthDist("fixed", 4),
                           arrival="poisson", request_rate=100.0, num_prefixes=8, prefix_len=2048, seed=1)
    return simulate(_args(kv_cache_size=420), wl, engines=4, router=router)


def test_kv_prefix_router_finds_the_cached_prefixes():
    from vllm_vcr.simulate.report import build_report

    rr = build_report(_prefix_run("round_robin"))
    kv = build_report(_prefix_run("kv"))
    assert kv["prefix_cache_hit_rate"] > rr["prefix_cache_hit_rate"] + 0.2
    assert kv["prefix_cache_hit_rate"] > 0.5


def test_mooncake_trace_shares_blocks_by_hash_id(tmp_path):
    path = tmp_path / "mooncake.jsonl"
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]},
            {"timestamp": 100, "input_length": 1200, "output_length": 4, "hash_ids": [1, 2, 3]},
            {"timestamp": 250, "input_length": 600, "output_length": 4, "hash_ids": [7, 8]}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    wl = TraceWorkload.from_path(str(path))
    assert [r.arrival for r in wl.requests] == [0.0, 0.1, 0.25]
    assert [len(r.prompt) for r in wl.requests] == [1024, 1200, 600]
    assert wl.requests[1].prompt[:1024] == wl.requests[0].prompt
    sim = simulate(_args(), wl)
    cached = {r.request_id: r.cached for r in sim.done}
    assert cached["trace-1"] == 1024 and cached["trace-2"] == 0


def test_recorded_trace_replays_its_arrivals_and_lengths(tmp_path):
    path = tmp_path / "rec.jsonl"
    path.write_text("\n".join(json.dumps({"prompt_tokens": 40 + i, "output_tokens": 3, "ttft_ms": 1.0,
                                          "arrival_ms": 1000.0 + 20 * i}) for i in range(5)))
    sim = simulate(_args(), TraceWorkload.from_path(str(path)))
    done = sorted(sim.done, key=lambda r: r.arrival)
    assert [r.prompt_len for r in done] == [40, 41, 42, 43, 44]
    assert [round(r.arrival - done[0].arrival, 6) for r in done] == [0.0, 0.02, 0.04, 0.06, 0.08]
    assert all(r.num_out == 3 for r in done)


def test_report_quantiles_are_finite_and_ordered():
    from vllm_vcr.simulate.report import build_report

    wl = SyntheticWorkload(num_requests=100, isl=LengthDist("normal", 200, 50),
                           osl=LengthDist("exp", 20), arrival="poisson", request_rate=20.0)
    rep = build_report(simulate(_args(ttft=0.0, itl=3.0, prefill_time_per_token=0.1), wl))
    for key in ("ttft", "tpot", "e2e", "itl"):
        s = rep["latency_ms"][key]
        assert all(math.isfinite(v) for v in s.values())
        assert s["p50"] <= s["p90"] <= s["p99"]
