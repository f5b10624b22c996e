"""The silicon validation on a small slice (the full table: bench/silicon_validation.py)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from vllm_vcr.testing.waits import scaled

from .conftest import needs_aic

pytestmark = needs_aic
ROOT = Path(__file__).resolve().parents[2]

SLICE = ("2026_04_06_llama_3_1_70b_h100_sxm_vllm_fp8_agg_1024x1024_c4_tp4_ep1_653",
         "2026_04_06_llama_3_1_70b_h100_sxm_vllm_fp8_agg_1024x1024_c4_tp8_ep1_725")


def _rows():
    from vllm_vcr.simulate.silicon import vllm_agg_rows

    return {r.id: r for r in vllm_agg_rows()}


def _bench():
    spec = importlib.util.spec_from_file_location("silicon_validation", ROOT / "bench" / "silicon_validation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_frozen_split_is_whole_configuration_groups_by_its_seeded_rule():
    bench = _bench()
    rows, twins = bench.dedupe(list(_rows().values()))
    assert len(_rows()) == 1328 and twins > 0 and len(rows) == 1328 - twins
    frozen = json.loads(bench.SPLIT_FILE.read_text())
    assert frozen == bench.make_split(rows)  # the committed list is the rule's, nothing moved by hand
    named = [g for s in ("train", "dev", "test") for g in frozen[s]]
    assert len(named) == len(set(named)) == len({r.group for r in rows})  # each group on one side
    # every repeat of a configuration shares its group, and no measurement is kept twice
    seen = {(r.model, r.gpu, r.isl, r.osl, r.concurrency, r.ttft_ms, r.tpot_ms) for r in rows}
    assert len(seen) == len(rows)
    test_rows = sum(1 for r in rows if r.group in frozen["test"])
    assert 0.15 < test_rows / len(rows) < 0.45


def test_the_validation_command_runs_the_products_model_on_a_slice(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "silicon_validation.py"), "--split", "train",
                          "--group", "meta-llama/Llama-3.1-70B|b200_sxm|fp8|tp1", "--cheapest", "3", "--jobs", "1", "--results", str(tmp_path / "r.jsonl")],
                         capture_output=True, text=True, timeout=scaled(240), env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr[-2000:]
    all_row = next(line for line in out.stdout.splitlines() if line.startswith("| **all** | 3 |"))
    tpot_median = float(all_row.split("|")[3].strip(" %"))
    assert tpot_median < 15.0, all_row
    results = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    from vllm_vcr.simulate.silicon import HostTime

    assert all(r["host"] == HostTime.fitted().__dict__ for r in results)  # the defaults serve runs


@pytest.mark.parametrize("row_id", SLICE)
def test_a_measured_deployment_is_reproduced_closely(row_id):
    from vllm_vcr.simulate.silicon import HostTime, simulate_row, static_estimate, supported

    row = _rows()[row_id]
    assert supported(row) is None
    sim = simulate_row(row, host=HostTime.fitted(), max_tokens=30_000)
    assert sim["preemptions"] == 0
    assert sim["tpot_ms"] == pytest.approx(row.tpot_ms, rel=0.25)
    assert sim["ttft_ms"] == pytest.approx(row.ttft_ms, rel=0.5)  # the engine's share, no frontend
    s_ttft, s_tpot = static_estimate(row)
    assert s_ttft > 0 and s_tpot > 0


def test_gpt_oss_is_priced_at_its_checkpoints_mxfp4_whatever_the_samples_label():
    from vllm_vcr.simulate.silicon import supported

    for gpu in ("h100_sxm", "h200_sxm", "b200_sxm"):
        row = next(r for r in _rows().values() if r.model == "openai/gpt-oss-120b" and r.gpu == gpu)
        assert row.precision_label == "nvfp4" and row.moe_quant == "w4a16_mxfp4" and row.gemm_quant is None
        assert supported(row) is None


def test_what_the_estimator_cannot_price_says_why():
    from vllm_vcr.simulate.silicon import supported

    minimax = next(r for r in _rows().values() if r.model == "MiniMaxAI/MiniMax-M2.5" and r.gpu == "b300_sxm"
                   and r.precision_label == "fp8")
    # its block-scaled experts are priced from the block-scaled MoE tables, its GEMMs per tensor
    assert (minimax.gemm_quant, minimax.moe_quant) == ("fp8", "fp8_block") and supported(minimax) is None
    per_tensor = replace(minimax, moe_quant="fp8")
    assert "MoE data missing" in supported(per_tensor)  # no per-tensor FP8 MoE table for its shape on B300


def _row(**kw):
    from vllm_vcr.simulate.silicon import SiliconRow

    base = dict(id="r", model="meta-llama/Llama-3.1-70B", gpu="h100_sxm", backend_version="0.18.0", tp=4,
                attention_dp=1, moe_tp=None, moe_ep=None, gemm_quant="fp8", moe_quant=None, isl=1024, osl=1024,
                concurrency=16, ttft_ms=100.0, tpot_ms=10.0, source="source_file=2026-04-06.csv; image=x")
    return SiliconRow(**{**base, **kw})


def test_the_benchmark_harness_is_told_by_the_rows_source():
    assert _row().inferencex and _row().range_ratio == 0.8
    assert _row(source="db-dump/2026-04-27; vllm/vllm-openai:v0.19.0").inferencex
    gap = _row(source="source_file=/Users/x/aic-auto-gap-analysis/data/h100_sxm/vllm/0.12.0/Qwen_Qwen3-32B.csv")
    assert not gap.inferencex and gap.range_ratio == 1.0


def test_the_whole_benchmark_is_simulated_when_it_fits_else_two_waves_then_shorter_requests():
    from vllm_vcr.simulate.silicon import plan_for

    small = plan_for(_row(concurrency=2, osl=1024), max_tokens=40_000)
    assert (small.requests, small.osl) == (20, 1024)  # 10 * C, as InferenceX sends
    mid = plan_for(_row(concurrency=16, osl=1024), max_tokens=40_000)
    assert (mid.requests, mid.osl) == (39, 1024)  # fewer requests, at least two waves
    big = plan_for(_row(concurrency=256, isl=8192, osl=1024), max_tokens=40_000)
    assert big.requests == 512 and big.osl == 1024  # 4x the burst's 256 prefill steps caps the cut
    long = plan_for(_row(concurrency=64, osl=8192), max_tokens=40_000)
    assert long.requests == 128 and 256 <= long.osl < 8192
    steady = plan_for(_row(concurrency=4, source="kimi-gap.csv"), max_tokens=40_000)
    assert steady.requests == 16  # the users' first requests and as many measured


def test_the_benchmark_mean_counts_each_request_not_simulated_as_the_steady_state():
    from vllm_vcr.simulate.silicon import benchmark_means

    # 2 users: the first wave (burst) 10 and 30, then steady requests 4 and 6
    assert benchmark_means([10.0, 30.0, 4.0, 6.0], concurrency=2, total=20) == pytest.approx((40 + 18 * 5) / 20)
    assert benchmark_means([10.0, 30.0, 4.0, 6.0], concurrency=2, total=4) == pytest.approx(12.5)


def test_an_expert_parallel_row_is_the_one_engine_inferencex_launched():
    """`{tp: 4, ep: 4}` is `vllm serve -tp 4 --enable-expert-parallel` on 4 GPUs: the sample
    also spells it attention DP 4 × EP 16 with a per-rank batch; both spellings of one
    measurement map onto the same deployment and the benchmark's whole concurrency."""
    rows = _rows()
    dp_spelling = rows["minimaxm2_5_b200_vllm_fp8_agg_1024x1024_c64_cfg691"]
    tp_spelling = next(r for r in rows.values() if r.id.endswith("_1024x1024_c64_tp4_0_ep4_0_65"))
    for r in (dp_spelling, tp_spelling):
        assert (r.tp, r.attention_dp, r.moe_tp, r.moe_ep, r.concurrency) == (4, 1, 1, 4, 64)
    assert dp_spelling.tpot_ms == pytest.approx(tp_spelling.tpot_ms, rel=0.02)
    dp_attn = {(r.model, r.gemm_quant, r.tp, r.moe_ep) for r in rows.values() if r.inferencex and r.attention_dp > 1}
    assert dp_attn == {("MiniMaxAI/MiniMax-M2.5", "nvfp4", 1, 2)}  # only `{tp: 2, ep: 2, dp-attn: true}`


def test_a_gap_analysis_row_with_a_wider_moe_than_attention_is_data_parallel():
    qwen = [r for r in _rows().values() if r.model == "Qwen/Qwen3-235B-A22B-FP8" and r.moe_tp == 4]
    assert {(r.tp, r.attention_dp) for r in qwen} == {(1, 4), (2, 2), (4, 1)}


def test_vllms_default_token_budget_follows_the_version_that_ran():
    from vllm_vcr.simulate.silicon_harness import GIB, vllm_defaults

    assert vllm_defaults(180 * GIB, "0.19.0") == (1024, 8192)  # the >= 160 GiB tier came with 0.28
    assert vllm_defaults(180 * GIB, "0.28.0") == (1024, 16384)
    assert vllm_defaults(141 * GIB, "0.12.0") == (1024, 8192)
    assert vllm_defaults(48 * GIB, "0.12.0") == (256, 2048)


def test_a_rows_server_flags_are_those_of_the_script_that_measured_it():
    from vllm_vcr.simulate.silicon_harness import inferencex_flags

    llama = _row()  # 70b_fp8_h100: kv fp8, a budget of 8192, --max-num-seqs $CONC
    assert llama.server.kv_cache_fp8 and llama.server.max_num_batched_tokens == 8192
    assert llama.server.max_num_seqs_is_concurrency and llama.target().kv_cache_quant == "fp8"
    early = inferencex_flags("MiniMaxAI/MiniMax-M2.5", "b200_sxm", "fp8", "db-dump; measured=2026-03-11T00:00")
    late = inferencex_flags("MiniMaxAI/MiniMax-M2.5", "b200_sxm", "fp8", "db-dump; measured=2026-04-22T00:00")
    assert (early.kv_cache_fp8, early.gpu_memory_utilization, early.block_size) == (False, 0.95, 32)
    assert (late.kv_cache_fp8, late.gpu_memory_utilization, late.block_size) == (True, 0.9, 32)
    gap = _row(source="source_file=/Users/x/aic-auto-gap-analysis/data/h100_sxm/vllm/0.12.0/Qwen_Qwen3-32B.csv")
    assert gap.server == type(gap.server)()  # another harness: vLLM's defaults
    # gptoss_fp4_b200*.sh: MXFP4 experts on MXFP8 inputs (VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8=1) from
    # 2025-09-24, --max-num-seqs 512; kv fp8 from 2025-12-31; the Hopper scripts neither
    oss = "openai/gpt-oss-120b"
    nov = inferencex_flags(oss, "b200_sxm", None, "source_file=2026-04-06.csv; measured=2025-11-02T00:00:00.000Z")
    feb = inferencex_flags(oss, "b200_sxm", None, "source_file=2026-04-06.csv; measured=2026-02-25T00:00:00.000Z")
    assert (nov.moe_activation, nov.max_num_seqs, nov.kv_cache_fp8) == ("mxfp8", 512, False)
    assert (feb.moe_activation, feb.max_num_seqs, feb.kv_cache_fp8) == ("mxfp8", 512, True)
    assert inferencex_flags(oss, "h200_sxm", None, "source_file=2026-04-06.csv; measured=2026-02-25").moe_activation is None
    row = next(r for r in _rows().values() if r.model == oss and r.gpu == "b200_sxm" and r.server.kv_cache_fp8)
    t = row.target().resolved()
    assert (t.moe_quant, t.kv_cache_quant) == ("w4a8_mxfp4_mxfp8", "fp8")


def test_rows_whose_deployment_the_row_does_not_tell_are_named_and_not_simulated(tmp_path):
    # gptoss_fp4_h100_docker.sh ran its client at concurrency 512 from 2025-11-21 until 2025-12-08:
    # exactly the sample's nine gpt-oss H100 rows at 512 (TTFT 20-460 s at a small batch's TPOT)
    rows = _rows().values()
    unknown = sorted(r.id for r in rows if r.unknown_deployment)
    assert len(unknown) == 9 and all("gpt_oss_120b_h100" in i and "_c512_" in i for i in unknown)
    assert all(r.ttft_ms > 19_000 for r in rows if r.unknown_deployment)
    assert not any(r.unknown_deployment for r in rows if not (r.gpu == "h100_sxm" and r.concurrency == 512))
    # after the script's fix the same label is a deployment again
    after = _row(model="openai/gpt-oss-120b", concurrency=512, source="source_file=2026-04-06.csv; measured=2025-12-09")
    assert after.unknown_deployment is None
    bench = _bench()
    row = next(r for r in rows if r.unknown_deployment)
    try:
        res = bench._job((row.__dict__, bench.HostTime.fitted(), 40_000))  # (a pool worker's job, here in-process)
    finally:
        logging.disable(logging.NOTSET)  # (the job silences warnings for its worker process)
    assert "sim" not in res and "concurrency 512" in res["unknown_deployment"]
    text = bench.render("dev", [row], {row.id: res}, bench.HostTime.fitted(), "cmd", 0, 1)
    assert "0 simulated" in text and "1 whose deployment the row does not tell" in text
    assert "- openai/gpt-oss-120b on h100_sxm at concurrency 512: measured while the H100 script" in text


def test_a_block_fp8_checkpoint_is_priced_with_block_scaled_kernels_where_vllm_can_shard_it():
    rows = [r for r in _rows().values() if r.gpu == "h200_sxm"]
    qwen = [r for r in rows if r.model == "Qwen/Qwen3-235B-A22B-FP8"]
    assert qwen and all(r.gemm_quant == "fp8_block" for r in qwen)
    minimax_tp4 = [r for r in rows if r.model == "MiniMaxAI/MiniMax-M2.5" and r.tp == 4]
    minimax_tp8 = [r for r in rows if r.model == "MiniMaxAI/MiniMax-M2.5" and r.tp == 8]
    assert {r.moe_quant for r in minimax_tp4} == {"fp8_block"}  # 1536 / 4 = 3 blocks of 128
    assert {r.moe_quant for r in minimax_tp8} == {"fp8"}  # 1536 / 8 = 192: no block-scaled shard
    llama = [r for r in rows if r.model == "nvidia/Llama-3.1-8B-Instruct-FP8"]
    assert {r.gemm_quant for r in llama} == {"fp8"}  # a per-tensor FP8 checkpoint


def _bench_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "silicon_validation.py"
    spec = importlib.util.spec_from_file_location("silicon_validation", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_fit_recovers_a_planted_correction():
    """Rows whose measured TPOT is the GPU step plus a known correction: half of them with async
    scheduling, half MiniMax-M2.5 at TP 4 (the QK norm's all-reduce), half Qwen3-32B (a QK norm
    per head). The fit minimises the median |error|, so each part of the correction is pinned
    only by rows that are at least half of the set: these are."""
    import numpy as np

    from vllm_vcr.simulate.silicon import HostTime

    bench = _bench_module()
    planted = HostTime(1.0, 0.012, 0.2, 16.0, 15.0)
    rows, done = [], {}
    for model, layers, spans in (("MiniMaxAI/MiniMax-M2.5", 62, True), ("Qwen/Qwen3-32B", 64, False)):
        for version in ("0.12.0", "0.19.0"):
            for conc in (4, 32, 128):
                gpu_ms = 4.0 + 0.05 * conc
                row = _row(id=f"{model}-{version}-{conc}", model=model, tp=4, backend_version=version,
                           concurrency=conc, source="gap-analysis.csv")
                step = bench._step_ms(np.array([gpu_ms]), np.array([conc]), np.array([row.async_scheduling]),
                                      np.array([layers]), np.array([spans]), planted)[0]
                rows.append(replace(row, tpot_ms=float(step)))
                done[row.id] = {"id": row.id, "sim": {"tpot_ms": gpu_ms, "ttft_ms": 100.0,
                                                      "per_engine_concurrency": conc}}
    assert bench.fit_overhead(rows, done) == planted
