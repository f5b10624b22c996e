"""Start-up of `vllm-vcr simulate`: a run imports only what it uses. Each case runs the CLI in a
fresh interpreter (a real `simulate` process), checks that it wrote its report and lists the
modules it loaded: asyncio (the engines are stepped synchronously), the trace loaders of
`--latency-trace` / `--replay-*` / `--response-replay-trace`, and with `--perf-model aic` PyYAML
and importlib.metadata where the estimator loads from its kept spec, and the SDK's network
modules (urllib.request, http.client) where it is compiled. The modules a flag does use are
still loaded where it is given (the latency trace's loader, urllib.request's names on use)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ..perf.conftest import LLAMA_8B, needs_aic

ROOT = Path(__file__).resolve().parents[2]
SIMPLE_TRACE = ROOT / "tests" / "trace" / "fixtures" / "simple_trace.jsonl"

_RUN = """
import json, sys
from vllm_vcr import cli
try:
    rc = cli.main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
print(json.dumps({"rc": rc, "modules": sorted(sys.modules)}))
"""

LAZY = ("asyncio", "vllm_vcr.replay.latency_fit", "vllm_vcr.replay.planner", "vllm_vcr.replay.table",
        "vllm_vcr.trace.io")


def _simulate(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> set[str]:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "VLLM_VCR_CACHE_DIR": str(tmp_path / "cache"),
           **(env or {})}
    r = subprocess.run([sys.executable, "-c", _RUN, "simulate", *argv, "--num-requests", "10", "--concurrency", "2",
                        "--no-progress", "--no-figures", "-o", str(out)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["rc"] == 0, r.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["requests"] == 10
    return set(result["modules"])


def test_a_run_with_the_latency_knobs_imports_no_asyncio_and_no_trace_loader(tmp_path):
    loaded = _simulate(tmp_path, "--inter-token-latency", "10")
    assert "vllm_vcr.engine.core" in loaded and "numpy" in loaded  # (the check sees the run's modules)
    assert not loaded & set(LAZY), sorted(loaded & set(LAZY))


def test_a_latency_trace_still_loads_its_loader(tmp_path):
    loaded = _simulate(tmp_path, "--latency-trace", str(SIMPLE_TRACE))
    assert "vllm_vcr.replay.latency_fit" in loaded
    assert "asyncio" not in loaded


@needs_aic
def test_perf_model_runs_import_only_what_they_use(tmp_path):
    aic = [LLAMA_8B, "--perf-model", "aic", "--gpu", "h100_sxm"]
    compiled = _simulate(tmp_path, *aic, env={"VLLM_VCR_PERF_CACHE": "0"})  # the estimator compiled
    assert "aiconfigurator_core.sdk.engine" in compiled and "yaml" in compiled
    assert "http.client" not in compiled and "asyncio" not in compiled
    _simulate(tmp_path, *aic)  # keeps the spec, the KV estimate and the prices of these steps
    kept = _simulate(tmp_path, *aic)  # priced from them
    assert "vllm_vcr.perf.aic" in kept
    assert not kept & {"yaml", "importlib.metadata", "aiconfigurator_core.sdk.engine", "asyncio"}, \
        sorted(kept & {"yaml", "importlib.metadata", "aiconfigurator_core.sdk.engine", "asyncio"})
