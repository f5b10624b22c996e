"""`vllm-vcr simulate --num-prefill-workers`: a disaggregated deployment through the real CLI process
(prefill workers, decode workers, the KV pull between them), the same simulation the fidelity
harness runs for the measured disaggregated rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_vcr.cli import main
from vllm_vcr.testing.waits import scaled

from ..perf.conftest import needs_aic


def _simulate(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "vllm_vcr", "simulate", "--no-progress", "--no-figures", "-o", str(out), *flags]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MOCK_")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(180), env=clean)
    assert proc.returncode == 0, proc.stderr
    return json.loads((out / "report.json").read_text())


def test_a_request_is_prefilled_then_pulled_then_decoded(tmp_path):
    """Latency knobs, one request at a time: TTFT is the prefill worker's first token (40 ms) plus
    the pull of 128 tokens x 1 MB at 1 GB/s (128 ms); the decode worker paces the rest (10 ms)."""
    report = _simulate(tmp_path, "--num-prefill-workers", "2", "--num-decode-workers", "1", "--num-requests", "10",
                       "--concurrency", "1", "--isl", "128", "--osl", "16", "--time-to-first-token", "40",
                       "--inter-token-latency", "10", "--kv-bytes-per-token", "1000000",
                       "--kv-transfer-bandwidth", "1")
    assert report["requests"] == 10 and report["finish_reasons"] == {"length": 10}
    assert report["latency_ms"]["ttft"]["p50"] == pytest.approx(40 + 128, abs=0.5)
    # TTFT's two sides: the prefill worker's answer, then the pull and the decode worker's first token
    assert report["latency_ms"]["prefill"]["p50"] == pytest.approx(40, abs=0.5)
    assert report["latency_ms"]["handoff"]["p50"] == pytest.approx(128, abs=0.5)
    assert report["latency_ms"]["tpot"]["p50"] == pytest.approx(10, abs=0.1)
    assert [(e["worker_type"], e["requests"]) for e in report["engines"]] == \
        [("prefill", 5), ("prefill", 5), ("decode", 10)]
    d = report["meta"]["disaggregated"]
    assert (d["prefill_workers"], d["decode_workers"], d["kv_transfer_gb_s"], d["kv_bytes_per_token"]) == \
        (2, 1, 1.0, 1_000_000)
    assert report["engines"][2]["steps"] > report["engines"][0]["steps"]  # (the decode worker runs every token)


@needs_aic
@pytest.mark.parametrize("prefill_tp,decode_tp,pulled_tp", [(2, 1, 1), (1, 2, 1), (2, 2, 2)])
def test_with_the_perf_model_the_kv_is_the_busier_gpus_over_the_gpus_link(tmp_path, prefill_tp, decode_tp,
                                                                           pulled_tp):
    """Llama-3.1-8B (GQA) on H100: the KV bytes per token a pull moves are the larger of a prefill
    GPU's and a decode GPU's (a TP 2 GPU holds half of TP 1's heads: the end with fewer GPUs per
    worker has the busier link); the link is the node's NVLink (all GPUs in one node)."""
    from vllm_vcr.perf.aic import AicTarget
    from vllm_vcr.perf.catalog import kv_link
    from vllm_vcr.perf.kv_sizing import estimate_kv_capacity

    report = _simulate(tmp_path, "meta-llama/Llama-3.1-8B-Instruct", "--perf-model", "aic", "--gpu", "h100_sxm",
                       "--num-prefill-workers", "1", "--prefill-tensor-parallel-size", str(prefill_tp),
                       "--num-decode-workers", "2", "--tensor-parallel-size", str(decode_tp),
                       "--num-requests", "60", "--concurrency", "8", "--isl", "2000", "--osl", "64")
    d = report["meta"]["disaggregated"]
    assert d["prefill_perf_model"]["tensor_parallel_size"] == prefill_tp
    assert report["meta"]["perf_model"]["tensor_parallel_size"] == decode_tp
    per_token = {tp: estimate_kv_capacity(AicTarget("meta-llama/Llama-3.1-8B-Instruct", "h100_sxm",
                                                    tensor_parallel_size=tp).resolved(), block_size=16,
                                          gpu_memory_utilization=0.9, max_num_batched_tokens=8192,
                                          max_num_seqs=256).bytes_per_token for tp in (1, 2)}
    assert per_token[2] == per_token[1] // 2
    assert d["kv_bytes_per_token"] == per_token[pulled_tp]
    gpus = prefill_tp + 2 * decode_tp
    assert d["kv_transfer_gb_s"] * 1e9 == kv_link("h100_sxm", gpus)[0] and kv_link("h100_sxm", gpus)[1] == "intra_node_bw"
    assert [(e["worker_type"], e["requests"]) for e in report["engines"]] == [("prefill", 60), ("decode", 30),
                                                                              ("decode", 30)]
    ttft, tpot = report["latency_ms"]["ttft"]["p50"], report["latency_ms"]["tpot"]["p50"]
    assert 0 < tpot < ttft  # (a 2,000-token prefill and its pull against one decode step)


@pytest.mark.parametrize("flags,message", [
    (["--num-decode-workers", "2"], "--num-decode-workers: only for a disaggregated deployment"),
    (["--prefill-engine-count", "2"], "--prefill-engine-count: only for a disaggregated deployment"),
    (["--num-prefill-workers", "-1"], "--num-prefill-workers: must be >= 0"),
    (["--num-prefill-workers", "1", "--num-decode-workers", "0"], "--num-decode-workers: must be >= 1"),
    (["--num-prefill-workers", "1", "--worker-type", "decode"], "--worker-type: a disaggregated simulation sets"),
    (["--num-prefill-workers", "1", "--prefill-tensor-parallel-size", "2"],
     "--prefill-tensor-parallel-size: only with --perf-model"),
])
def test_disaggregation_flags_out_of_place_are_a_cli_error_naming_the_flag(tmp_path, capsys, flags, message):
    assert main(["simulate", "--num-requests", "4", "-o", str(tmp_path), "--no-progress", *flags]) == 2
    assert message in capsys.readouterr().err


def test_the_router_picks_the_worker_on_each_side(tmp_path):
    """Eight groups of requests sharing a 1,024-token prefix (512 blocks), two prefill workers of 320
    blocks: the KV-aware router keeps each group on the prefill worker that holds its prefix, round
    robin sends every group to both and their caches evict each other's prefixes."""
    flags = ["--num-prefill-workers", "2", "--num-decode-workers", "2", "--num-requests", "160", "--concurrency", "4",
             "--num-prefixes", "8", "--prefix-len", "1024", "--isl", "1100", "--osl", "8",
             "--time-to-first-token", "5", "--inter-token-latency", "5", "--kv-cache-size", "320"]
    rr = _simulate(tmp_path / "rr", *flags, "--router", "round_robin")
    kv = _simulate(tmp_path / "kv", *flags, "--router", "kv")
    assert rr["meta"]["router"] == "round_robin" and kv["meta"]["router"] == "kv"
    assert kv["prefix_cache_hit_rate"] > rr["prefix_cache_hit_rate"] + 0.15  # (the prefill workers' hits)
    assert [e["requests"] for e in rr["engines"]] == [80, 80, 80, 80]
    assert sum(e["requests"] for e in kv["engines"] if e["worker_type"] == "decode") == 160
