"""The shell examples of docs/faults.md and of control-api.md's fault section run as written
against a real `serve --control-address` (ports swapped for free ones)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _blocks() -> list[tuple[str, str]]:
    faults = (DOCS / "faults.md").read_text()
    control = (DOCS / "control-api.md").read_text()
    section = control.split("## Faults, fault scripts and gauges", 1)[1].split("\n## ", 1)[0]
    out = []
    for name, text in (("faults.md", faults), ("control-api.md", section)):
        for block in re.findall(r"```sh\n(.*?)```", text, re.S):
            if not block.lstrip().startswith("vllm-vcr serve"):  # the start-up line itself
                out.append((name, block))
    return out


@pytest.fixture(scope="module")
def served(serve_harness, tmp_path_factory):
    port = serve_harness.free_port()
    sp = serve_harness.ServeProcess(["--inter-token-latency", "0", "--control-address", f"127.0.0.1:{port}"],
                                    log_path=Path(tmp_path_factory.mktemp("docs")) / "serve.log").wait_ready()
    sp.control_port = port
    yield sp
    assert sp.stop() == 0


@pytest.mark.parametrize("doc,block", _blocks())
def test_example_runs(served, doc, block):
    if shutil.which("curl") is None:
        pytest.skip("curl not installed")
    script = block.replace("localhost:8001", f"localhost:{served.control_port}").replace(
        "localhost:8000", f"localhost:{served.port}")
    r = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (doc, block, r.stdout, r.stderr)
    # no control-API error answer ({"error": "..."} opening a line); the X-Return-Error example shows one on purpose
    assert not re.search(r'^\{"error"', r.stdout, re.M) or "X-Return-Error" in block, r.stdout
    subprocess.run(["curl", "-s", "-X", "DELETE", f"localhost:{served.control_port}/faults"], capture_output=True)
    subprocess.run(["curl", "-s", "-X", "PATCH", f"localhost:{served.control_port}/config", "-H",
                    "content-type: application/json", "-d", '{"http_error_rate": 0}'], capture_output=True)
