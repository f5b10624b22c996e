"""docs/testing.md's code runs as written: the MockServer example executes as it stands, and the
fixture examples are collected and run by pytest with the installed plugin, in a fresh process."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import ROOT

DOC = ROOT / "docs" / "testing.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_mockserver_example_runs_verbatim(capsys):
    code = python_blocks()[0]
    assert code.startswith("from vllm_vcr import MockServer")
    exec(compile(code, str(DOC), "exec"), {})
    printed = capsys.readouterr().out
    assert "'requests_received': 1" in printed, printed


def test_the_fixture_examples_run_verbatim_under_pytest(tmp_path):
    blocks = python_blocks()
    marker, with_faults = blocks[1], blocks[2]
    assert "vllm_vcr_server" in marker and "vllm_vcr_server" in with_faults
    test_file = tmp_path / "test_doc_fixture.py"
    test_file.write_text(marker + "\n\n" + with_faults)
    # a fresh pytest: the plugin comes from the installed package's pytest11 entry point
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                          str(test_file)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 passed" in out.stdout, out.stdout
