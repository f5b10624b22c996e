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


def test_the_documented_demo_calibrates(tmp_path):
    """docs/inspect.md's commands, run as a user runs them: gen-demo, then calibrate on it."""
    import subprocess
    import sys

    def cli(*argv):
        return subprocess.run([sys.executable, "-m", "vllm_vcr", "inspect", *argv], cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)

    gen = cli("gen-demo", "-o", "demo.jsonl.gz", "--records", "200", "--seed", "0")
    assert gen.returncode == 0, gen.stderr
    cal = cli("calibrate", "demo.jsonl.gz", "-o", "calib/")
    assert cal.returncode == 0, cal.stdout + cal.stderr
    assert "verdict: PASS" in cal.stdout
    assert (tmp_path / "calib" / "ttft_cdf.png").is_file()
    js = cli("calibrate", "demo.jsonl.gz", "--json")
    out = json.loads(js.stdout)
    assert js.returncode == 0 and out["verdict"] == "PASS", out


def test_the_demo_records_the_concurrency_its_arrivals_imply():
    """A replay of the demo's arrivals sees as many requests in flight as each record says."""
    from vllm_vcr.inspect.gen_demo import gen_demo

    _, recs = gen_demo(records=300, seed=3)
    ends = [r.arrival_ms + r.ttft_ms + sum(r.itl_ms) for r in recs]
    for r in recs:
        in_flight = sum(1 for q, end in zip(recs, ends) if q.arrival_ms <= r.arrival_ms < end)
        assert r.concurrency == in_flight
    assert max(r.concurrency for r in recs) > 1


def test_a_difference_within_sampling_noise_is_no_miss():
    """Quantiles of two small samples of one distribution differ by chance; far apart ones fail."""
    from vllm_vcr.inspect.calibrate import compare

    rng = random.Random(1)

    def recs(mu, n=200):
        return [TraceRecord(prompt_tokens=8, output_tokens=2, ttft_ms=rng.lognormvariate(mu, 0.9), itl_ms=[5.0])
                for _ in range(n)]

    same = compare(recs(3.5), recs(3.5), 0.05, 0.10)
    assert all(r["ok"] for r in same), same
    apart = compare(recs(3.5), recs(4.2), 0.05, 0.10)
    assert not next(r for r in apart if r["metric"] == "ttft_ms" and r["quantile"] == "p50")["ok"]
