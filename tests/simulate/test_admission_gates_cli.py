"""vLLM's admission gates through the `simulate` CLI: `--scheduler-reserve-full-isl` (on by
default) waits for a long prompt's whole sequence to fit, so a small KV cache preempts less than
with `--no-scheduler-reserve-full-isl`; `--max-num-active-seqs` below the concurrency makes requests
wait for a running slot; a value out of range is one line naming the flag."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from vllm_vcr.cli import main
from vllm_vcr.testing.waits import scaled

# 40 requests of 300 prompt tokens into 40 blocks of 16 tokens, chunks of 64: long prompts contend for the cache
RUN = ["--num-requests", "40", "--isl", "300", "--osl", "40", "--concurrency", "8", "--kv-cache-size", "40",
       "--max-num-batched-tokens", "64", "--inter-token-latency", "5", "--time-to-first-token", "20", "--seed", "1"]


def _report(tmp_path: Path, name: str, *flags: str) -> dict:
    out = tmp_path / name
    cmd = [sys.executable, "-m", "vllm_vcr", "simulate", "--no-progress", "--no-figures", "-o", str(out), *RUN, *flags]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MOCK_")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(180), env=clean)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["requests"] == 40
    return report


def _preemptions(tmp_path: Path, name: str, *flags: str) -> int:
    return _report(tmp_path, name, *flags)["preemptions"]["total"]


def test_the_full_sequence_gate_preempts_less(tmp_path):
    gated = _preemptions(tmp_path, "gated")
    chunked = _preemptions(tmp_path, "chunked", "--no-scheduler-reserve-full-isl")
    assert gated < chunked
    assert _preemptions(tmp_path, "watermark", "--watermark", "0.1") <= chunked


def test_a_watermark_out_of_range_is_a_cli_error_naming_the_flag(tmp_path, capsys):
    assert main(["simulate", "--num-requests", "4", "-o", str(tmp_path), "--no-progress", "--watermark", "1.5"]) == 2
    assert "--watermark must be in [0, 1), got 1.5" in capsys.readouterr().err


def test_fewer_active_sequences_than_users_queue_the_rest(tmp_path):
    """8 users, 2 running at once: the others wait for a slot, so the median TTFT grows."""
    free = _report(tmp_path, "free", "--kv-cache-size", "4000")["latency_ms"]["ttft"]["p50"]
    limited = _report(tmp_path, "limited", "--kv-cache-size", "4000", "--max-num-active-seqs", "2")
    assert limited["latency_ms"]["ttft"]["p50"] > 2 * free


def test_limits_out_of_range_are_cli_errors_naming_the_flag(tmp_path, capsys):
    for flags, message in ((["--max-num-seqs", "8", "--max-num-active-seqs", "9"],
                            "max_num_active_seqs (9) cannot be greater than max_num_seqs (8)."),
                           (["--max-num-scheduled-tokens", "0"], "--max-num-scheduled-tokens must be >= 1, got 0")):
        assert main(["simulate", "--num-requests", "4", "-o", str(tmp_path), "--no-progress", *flags]) == 2
        assert message in capsys.readouterr().err
