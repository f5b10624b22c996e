"""`inspect calibrate`: a recording made by a known engine is reproduced by the fitted model."""

from __future__ import annotations

import json
import random

from vllm_vcr.cli import main
from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.inspect.calibrate import simulate
from vllm_vcr.trace.io import write_trace
from vllm_vcr.trace.schema import TraceMeta, TraceRecord


def recording(tmp_path, n=300, seed=4):
    """A 'recording' produced by the simulator itself with noisy knobs, at Poisson arrivals."""
    rng = random.Random(seed)
    t = 0.0
    schedule = []
    for _ in range(n):
        t += rng.expovariate(20.0) * 1e3
        schedule.append(TraceRecord(prompt_tokens=rng.choice([64, 200, 700]), output_tokens=rng.randint(10, 40),
                                    ttft_ms=0.0, arrival_ms=t))
    knobs = EngineArgs(config=EngineConfig(time_to_first_token=40, time_to_first_token_std_dev=10,
                                           inter_token_latency=12, inter_token_latency_std_dev=3,
                                           log_requests=False, max_num_seqs=256))
    recs = simulate(schedule, knobs, 16)
    path = tmp_path / "rec.jsonl"
    write_trace(path, TraceMeta(source="test", block_size=16, max_num_seqs=256), recs)
    return path


def test_calibrate_passes_on_a_consistent_recording(tmp_path, capsys):
    path = recording(tmp_path)
    rc = main(["inspect", "calibrate", str(path), "--json", "-o", str(tmp_path / "figs")])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    assert out["verdict"] == "PASS"
    assert {r["metric"] for r in out["rows"]} == {"ttft_ms", "itl_ms"}
    assert (tmp_path / "figs" / "ttft_cdf.png").stat().st_size > 1000


def test_calibrate_fails_with_wrong_knobs(tmp_path, capsys):
    path = recording(tmp_path)
    rc = main(["inspect", "calibrate", str(path), "--json", "--knobs", "--time-to-first-token", "80",
               "--inter-token-latency", "12"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["verdict"] == "FAIL"
    ttft_p50 = next(r for r in out["rows"] if r["metric"] == "ttft_ms" and r["quantile"] == "p50")
    assert not ttft_p50["ok"]


def test_calibrate_names_a_missing_arrival_schedule(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(path, TraceMeta(), [TraceRecord(prompt_tokens=4, output_tokens=1, ttft_ms=1.0)])
    assert main(["inspect", "calibrate", str(path)]) == 2
    assert "arrival_ms" in capsys.readouterr().err
