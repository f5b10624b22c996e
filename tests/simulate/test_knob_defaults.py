"""`simulate` without a perf model: the latency knobs at `serve`'s defaults, said once, and a report
whose numbers mean something (no rate over zero simulated time). Through the real CLI process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from vllm_vcr.engine.config import LATENCY_FIELDS, EngineConfig
from vllm_vcr.engine_cli import LATENCY_FLAGS, add_engine_args
from vllm_vcr.testing.waits import scaled


def _simulate(tmp_path: Path, *flags: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "vllm_vcr", "simulate", "--num-requests", "40", "--concurrency", "4",
           "--isl", "128", "--osl", "16", "--no-progress", "--no-figures", "-o", str(out), *flags]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MOCK_")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(120), env={**clean, **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads((out / "report.json").read_text())


def test_the_knob_flags_default_to_the_engine_config_defaults_serve_uses():
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns = p.parse_args([])
    assert {f for f, _ in LATENCY_FLAGS.values()} == set(LATENCY_FIELDS)
    for flag, (field, env) in LATENCY_FLAGS.items():
        if env not in os.environ:
            assert getattr(ns, field) == getattr(EngineConfig(), field), flag


def test_no_perf_model_and_no_knobs_warns_once_and_reports_no_rate(tmp_path):
    proc, report = _simulate(tmp_path)
    warnings = [line for line in proc.stderr.splitlines() if "no perf model" in line]
    assert len(warnings) == 1 and "WARN" in warnings[0], proc.stderr
    assert "serve's defaults" in warnings[0] and "--inter-token-latency 0" in warnings[0]
    assert "--perf-model aic" in warnings[0]
    assert report["requests"] == 40
    assert report["throughput"] == {"duration_s": 0.0, "requests_per_s": None, "output_tokens_per_s": None,
                                    "input_tokens_per_s": None}
    assert report["latency_ms"]["ttft"]["p99"] == 0.0 and report["latency_ms"]["tpot"]["p99"] == 0.0
    assert report["meta"]["latency_knobs"] == {f: getattr(EngineConfig(), f) for f in LATENCY_FIELDS}
    assert "throughput n/a" in proc.stdout and "e+" not in proc.stdout


def test_given_knobs_are_named_and_the_rest_are_serves_defaults(tmp_path):
    proc, report = _simulate(tmp_path, "--time-to-first-token", "50", "--inter-token-latency", "10")
    lines = [line for line in proc.stderr.splitlines() if "no perf model" in line]
    assert len(lines) == 1 and "WARN" not in lines[0], proc.stderr
    assert "--time-to-first-token 50, --inter-token-latency 10; at serve's defaults: " in lines[0]
    lat, th = report["latency_ms"], report["throughput"]
    assert abs(lat["ttft"]["p50"] - 50) < 2.5 and abs(lat["tpot"]["p50"] - 10) < 0.5
    # 40 requests of 16 tokens, 4 at a time: 10 rounds of 50 ms + 15 x 10 ms
    assert abs(th["duration_s"] - 10 * 0.2) < 0.1
    assert abs(th["output_tokens_per_s"] - 40 * 16 / th["duration_s"]) < 1e-6


def test_mock_environment_variables_set_the_same_defaults_for_simulate(tmp_path):
    proc, report = _simulate(tmp_path, env={"MOCK_ITL_MS": "4", "MOCK_TTFT_MS": "20"})
    assert "WARN" not in proc.stderr
    assert abs(report["latency_ms"]["tpot"]["p50"] - 4) < 0.2
    assert report["meta"]["latency_knobs"]["inter_token_latency"] == 4.0
