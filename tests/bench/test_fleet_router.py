"""bench/fleet_router.py at a tiny scale, through its command line: a fleet of 3 workers, 20
open-loop streaming requests, the direct arm always and the real vllm-router arm when
scripts/install-routers.sh installed it. Every request ends well, every worker is counted, the
workers' own /metrics view is read, the table prints, the figure draws, and nothing is left running."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import scaled, subprocess_env

BENCH = Path(__file__).resolve().parents[2] / "bench"
TINY = ["--workers", "3", "--requests", "20", "--rate", "40", "--ttft", "10", "--itl", "5", "--osl", "3",
        "--warmup", "3", "--settle", "0", "--poll-interval", "0.2"]


def _router_missing() -> str | None:
    sys.path.insert(0, str(BENCH))
    try:
        import fleet_router
    finally:
        sys.path.remove(str(BENCH))
    return fleet_router.router_missing()


def _run(tmp_path: Path, *args: str) -> tuple[list[dict], str]:
    out = tmp_path / "rows.json"
    proc = subprocess.Popen([sys.executable, str(BENCH / "fleet_router.py"), *TINY, "--json", str(out), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        stdout, stderr = proc.communicate(timeout=scaled(180))
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the script stops its fleet and router on SIGTERM
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"fleet_router.py did not finish:\n{stderr[-3000:]}")
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(out.read_text()), stdout


def _check(row: dict, arm: str) -> None:
    assert row["arm"] == arm and row["workers"] == 3
    assert row["ok"] == 20 and row["errors"] == 0, row["errors_by_kind"]
    pw = row["per_worker"]
    assert pw["total"] == 20 and pw["unserved"] == 0
    assert (pw["min"], pw["max"]) == (6, 7)  # round robin, by the router or by the client
    assert row["worker_failed"] == 0
    assert row["ttft_ms"]["n"] == 20 and row["itl_ms"]["n"] == 20 * 2  # 3 tokens: 2 gaps each
    assert row["output_tokens"] == 60
    assert row["server"]["ttft_mean_ms"] is not None and row["server"]["itl_mean_ms"] is not None
    assert row["cpu_us_per_request"]["fleet"] >= 0  # clock ticks of 10 ms: 20 requests may read 0
    assert row["fleet_exit"] == 0


def test_direct_arm_counts_every_worker_and_draws_the_figure(tmp_path):
    rows, table = _run(tmp_path, "--direct", "--transport", "raw")
    (row,) = rows
    _check(row, "direct")
    assert "router" not in row["cpu_pct"]
    assert "| direct | 3 |" in table and "target within 5 %" in table
    png = tmp_path / "growth.png"
    idle = [{"what": "fleet M=3", "workers": 3, "pss_per_worker_mb": 20.0, "idle_cpu_pct": 0.1, "startup_s": 2.0}]
    (tmp_path / "idle.json").write_text(json.dumps(idle))
    done = subprocess.run([sys.executable, str(BENCH / "fleet_router.py"), "--from-json", str(tmp_path / "rows.json"),
                           "--idle-json", str(tmp_path / "idle.json"), "--plot", str(png)],
                          capture_output=True, text=True, env=subprocess_env(), timeout=scaled(120))
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_router_arm_through_the_real_vllm_router(tmp_path):
    if why := _router_missing():
        pytest.skip(why)
    rows, table = _run(tmp_path, "--arms", "router")
    (row,) = rows
    _check(row, "router")
    assert row["router_exit"] is not None and "router" in row["cpu_us_per_request"]
    assert "| router | 3 |" in table
