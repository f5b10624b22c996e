"""The `vllm serve` option table (src/vllm_vcr/serve/vllm_serve_args.json) against the installed
real vLLM releases: regenerated from each release's parser, every option, spelling, kind, value
type and choice must be in the table (scripts/update_vllm_serve_args.py rewrites it)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from vllm_vcr.serve.vllm_args import load_table, merge_dumps, spec_problems

from . import peers

pytestmark = pytest.mark.conformance

DUMP = Path(__file__).resolve().parents[2] / "scripts" / "dump_vllm_serve_args.py"


_DUMPS: dict[str, dict] = {}


def _dump(version: str) -> dict:
    if version in _DUMPS:
        return _DUMPS[version]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_") and k != "PYTHONPATH"}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
    out = subprocess.run([str(peers.venv(version) / "bin" / "python"), str(DUMP)], env=env, capture_output=True,
                         text=True, timeout=peers.scaled(600))
    assert out.returncode == 0, out.stderr[-2000:]
    _DUMPS[version] = json.loads(out.stdout)
    return _DUMPS[version]


def test_every_option_of_the_real_release_is_in_the_table(vllm_version):
    dump = _dump(vllm_version)
    assert len(dump["options"]) > 300
    problems = spec_problems(load_table(), dump)
    assert not problems, (f"vLLM {vllm_version} options the table lacks (run scripts/update_vllm_serve_args.py):\n"
                          + "\n".join(problems))
    assert ".".join(dump["vllm_version"].split(".")[:2]) in load_table()["vllm_versions"]


def test_the_check_catches_a_missing_option(vllm_version):
    """A release with an option the table has not heard of fails the check above."""
    dump = _dump(vllm_version)
    table = merge_dumps([dump])
    table["options"] = [o for o in table["options"] if o["dest"] != "max_num_seqs"]
    assert any(p.startswith("--max-num-seqs: missing") for p in spec_problems(table, dump))
