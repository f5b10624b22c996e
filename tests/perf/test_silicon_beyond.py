"""The measured rows beyond aggregated vLLM (SGLang; prefill/decode disaggregation) on a small slice,
through the same code path as `bench/silicon_validation.py --rows sglang-agg|disagg`."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_vcr.testing.waits import scaled

from .conftest import needs_aic

pytestmark = needs_aic
ROOT = Path(__file__).resolve().parents[2]

# both in the train split of their row kind
SGLANG_ROW = "qwen_qwen3_32b_qwen_qwen3_32b_h100_sxm_sglang_agg_1024x128_c16_tp4_epnone_2"
DISAGG_ROW = "2026_03_25_deepseek_r1_h200_sxm_sglang_fp8_disagg_1024x1024_c1_tp8_0_ep1_0_918"


def _bench():
    spec = importlib.util.spec_from_file_location("silicon_validation", ROOT / "bench" / "silicon_validation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(kind: str, row_id: str):
    from vllm_vcr.simulate.silicon_beyond import rows_of_kind

    return next(r for r in rows_of_kind(kind) if r.id == row_id)


@pytest.mark.parametrize("kind", ["sglang-agg", "disagg"])
def test_the_frozen_split_of_each_row_kind_is_whole_groups_by_the_same_rule(kind):
    bench = _bench()
    rows, _ = bench.dedupe(bench.rows_of_kind(kind))
    frozen = json.loads(bench.split_file(kind).read_text())
    assert frozen == bench.make_split(rows)  # the committed list is the rule's
    named = [g for s in ("train", "dev", "test") for g in frozen[s]]
    assert len(named) == len(set(named)) == len({r.group for r in rows})
    vllm_groups = set(json.loads(bench.SPLIT_FILE.read_text())["train"])
    assert not vllm_groups & set(named)  # a kind's groups are its own


def test_an_sglang_row_spelled_tp_times_ep_runs_the_deployment_its_twins_name():
    """The sample spells SGLang's `--tp T --ep E` two ways: `T·E / T / E` (tp / MoE TP / MoE EP) in
    InferenceX's database dump and its 2026-04-06 export, `T / T÷E / E` in its other rows. The same
    measurement appears in both spellings; a row of the first runs its twin's deployment (not T·E
    GPUs of attention TP) and keeps its recorded group, the one the frozen split names."""
    import csv

    from vllm_vcr.simulate.silicon_beyond import _sample_path, sglang_agg_rows

    def measurement(r) -> tuple:
        return (r["model_path"], r["system"], int(r["isl"]), int(r["osl"]), float(r["silicon_ttft_ms"]),
                float(r["silicon_tpot_ms"]))

    with open(_sample_path(None), newline="") as f:
        raw = [r for r in csv.DictReader(f) if r["backend"] == "sglang" and r["mode"] == "agg"]
    spelled_by_sglang: dict[tuple, set] = {}
    for r in raw:
        if r["moe_tp_size"] == "1" or r["moe_ep_size"] == "1":
            spelled_by_sglang.setdefault(measurement(r), set()).add(
                (int(r["tp_size"]), int(r["moe_tp_size"]), int(r["moe_ep_size"])))
    by_id = {r["id"]: r for r in raw}
    split = json.loads(_bench().split_file("sglang-agg").read_text())
    named = {g for side in ("train", "dev", "test") for g in split[side]}
    mapped = [row for row in sglang_agg_rows() if row.recorded_group]
    twins = 0
    for row in mapped:
        r = by_id[row.id]
        assert row.tp * row.moe_ep == int(r["tp_size"]) and row.moe_tp == 1  # T·E / T / E -> T / 1 / E
        assert row.recorded_group == row.columns_group().replace(f"|tp{row.tp}", f"|tp{r['tp_size']}")
        assert row.group in named
        twin = spelled_by_sglang.get(measurement(r), set())
        if twin:
            assert twin == {(row.tp, row.moe_tp, row.moe_ep)}
            twins += 1
    assert len(mapped) == 172 and twins == 41  # 16/4/4, 64/8/8 and 4/2/2 rows; twins in 4/1/4 and 8/1/8


def test_an_sglang_row_runs_sglangs_scheduler_on_sglangs_kernel_data():
    from vllm_vcr.simulate.silicon import HostTime
    from vllm_vcr.simulate.silicon_beyond import SGLangRow, simulate_any, static_any, supported_any

    row = _row("sglang-agg", SGLANG_ROW)
    assert isinstance(row, SGLangRow) and row.group.startswith("sglang|")
    target = row.target(HostTime.fitted())
    assert target.backend == "sglang" and target.async_scheduling  # the overlap scheduler
    assert supported_any(row) is None
    sim = simulate_any(row, host=HostTime.fitted(), max_tokens=20_000)
    assert sim["engine_type"] == "sglang" and sim["max_num_batched_tokens"] == 8192  # H100: 8k chunks
    assert 0.7 < sim["mem_fraction"] < 0.9 and sim["preemptions"] == 0
    assert sim["tpot_ms"] == pytest.approx(row.tpot_ms, rel=0.35)
    s_ttft, s_tpot = static_any(row)
    assert s_ttft > 0 and s_tpot > 0


def test_sglang_rows_of_the_gap_analysis_harness_run_as_bursts_whose_waves_persist(monkeypatch):
    """The gap-analysis harness starts its users together. Under SGLang a wave's requests decode in
    lockstep and the next wave arrives together again, so the measured TTFT does not change with the
    output length (train rows: 493 / 528 / 413 ms at 128 / 256 / 512 tokens), and is several times
    what users started apart would wait. vLLM's rows of the same harness stay a steady state (vLLM
    mixes prefills into its decodes, so a wave's requests end at different steps)."""
    from vllm_vcr.simulate.silicon import HostTime, SiliconRow, plan_for, row_workload
    from vllm_vcr.simulate.silicon_beyond import SGLangRow, simulate_any

    short = _row("sglang-agg", SGLANG_ROW)
    long = _row("sglang-agg", "qwen_qwen3_32b_qwen_qwen3_32b_h100_sxm_sglang_agg_1024x512_c16_tp4_epnone_20")
    assert not short.inferencex and short.burst and short.range_ratio == 1.0
    assert row_workload(short, plan_for(short, 20_000)).ramp_up == 0.0
    vllm_gap = _row("vllm-agg", "qwen_qwen3_32b_qwen_qwen3_32b_h100_sxm_vllm_agg_1024x512_c16_tp8_epnone_21")
    assert not vllm_gap.inferencex and not vllm_gap.burst
    assert row_workload(vllm_gap, plan_for(vllm_gap, 20_000)).ramp_up > 0

    host = HostTime.fitted()
    burst = [simulate_any(r, host=host, max_tokens=20_000)["ttft_ms"] for r in (short, long)]
    assert burst[1] == pytest.approx(burst[0], rel=0.15)  # every wave a burst: the output length hardly matters
    for r, ttft in zip((short, long), burst):
        assert ttft == pytest.approx(r.ttft_ms, rel=0.25)
    monkeypatch.setattr(SGLangRow, "burst", property(SiliconRow.burst.fget))  # as a steady state instead
    assert row_workload(long, plan_for(long, 20_000)).ramp_up > 0
    steady = [simulate_any(r, host=host, max_tokens=20_000)["ttft_ms"] for r in (short, long)]
    for r, ttft in zip((short, long), steady):  # a steady state queues far less than these rows measured
        assert ttft < 0.3 * r.ttft_ms


def test_a_disaggregated_row_prices_both_sides_and_the_kv_transfer():
    from vllm_vcr.simulate.silicon import HostTime
    from vllm_vcr.simulate.silicon_beyond import DisaggRow, kv_link, simulate_any, supported_any

    row = _row("disagg", DISAGG_ROW)
    assert isinstance(row, DisaggRow) and row.engine_type == "sglang"
    # its columns say one TP-8 worker per side; InferenceX's recipe ran nine decode workers
    assert (row.prefill_workers, row.prefill_tp, row.decode_workers, row.tp) == (1, 8, 9, 8)
    assert row.group.endswith("p1x(tp8-dp1)|d1x(tp8-dp1)")
    assert row.prefill_target().backend == "sglang" and row.gemm_quant == "fp8_block"
    assert kv_link(row) == (50e9, "inter_node_bw")  # 16 GPUs: two H200 nodes, one 400 Gb/s NIC per GPU
    assert supported_any(row) is None
    sim = simulate_any(row, host=HostTime.fitted(), max_tokens=20_000)
    assert sim["disaggregated"] and sim["preemptions"] == 0
    assert sim["kv_bytes_per_token"] == (512 + 64) * 61 * 2  # the BF16 latent of 61 MLA layers
    assert sim["tpot_ms"] == pytest.approx(row.tpot_ms, rel=0.25)
    # the first token waits for the prefill worker, the transfer and the decode worker's first step
    assert sim["ttft_ms"] > sim["kv_transfer_ms_one_prompt"] + sim["tpot_ms"]


def test_the_kv_transfer_shows_in_ttft(monkeypatch):
    """The same disaggregated benchmark over a link 1000x slower: TTFT grows by the transfer of the
    prompts (InferenceX's lengths: uniform in [0.8, 1] x ISL, 0.9 x ISL on average)."""
    from dataclasses import replace

    from vllm_vcr.simulate import silicon_beyond as sb
    from vllm_vcr.simulate.silicon import HostTime

    row = replace(_row("disagg", DISAGG_ROW), osl=64)
    fast = sb.simulate_disagg_row(row, host=HostTime.fitted(), max_tokens=20_000)
    slow_link = sb.kv_link(row)[0] / 1000
    monkeypatch.setattr(sb, "kv_link", lambda r: (slow_link, "slow"))
    slow = sb.simulate_disagg_row(row, host=HostTime.fitted(), max_tokens=20_000)
    extra = slow["ttft_ms"] - fast["ttft_ms"]
    transfer = slow["kv_transfer_ms_one_prompt"] - fast["kv_transfer_ms_one_prompt"]
    assert transfer > 100 and extra == pytest.approx(0.9 * transfer, rel=0.1)
    assert slow["tpot_ms"] == pytest.approx(fast["tpot_ms"], rel=0.05)


@pytest.mark.parametrize("kind,group", [("sglang-agg", "Qwen/Qwen3-32B|h100_sxm|bf16|tp4"),
                                        ("disagg", "DeepSeek-R1|h200_sxm|fp8|p1x(tp8-dp1)")])
def test_the_validation_command_runs_each_row_kind_on_a_slice(tmp_path, kind, group):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "silicon_validation.py"), "--rows", kind, "--split",
                          "train", "--group", group, "--cheapest", "1", "--jobs", "1",
                          "--results", str(tmp_path / "r.jsonl")],
                         capture_output=True, text=True, timeout=scaled(300),
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| engine type, deployment |" in out.stdout
    label = "sglang, aggregated" if kind == "sglang-agg" else "sglang, disaggregated"
    assert f"| {label} | 1 |" in out.stdout, out.stdout[:2000]
    (res,) = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert "sim" in res and res["sim"]["engine_type"] == "sglang"


def test_an_inferencex_sglang_row_runs_its_scripts_server_flags():
    from vllm_vcr.simulate.silicon_beyond import SGLangFlags, _server_limits, sglang_agg_rows

    rows = [r for r in sglang_agg_rows() if r.inferencex and r.gpu == "b200_sxm" and "DeepSeek-R1" in r.model
            and r.precision_label == "nvfp4" and r.tp == 8 and r.attention_dp == 1]
    low = next(r for r in rows if r.concurrency < 16)
    high = next(r for r in rows if r.concurrency >= 16)
    # dsr1_fp4_b200.sh: --chunked-prefill-size 16384 --max-running-requests 256 --mem-fraction-static 0.85
    # --kv-cache-dtype fp8_e4m3 --scheduler-recv-interval 10 (below 16 users) / 30
    assert low.flags == SGLangFlags(16384, 256, 0.85, True, 10)
    assert high.flags.recv_interval == 30
    target = low.target().resolved()
    assert target.kv_cache_quant == "fp8"
    assert _server_limits(low, target) == (16384, 256, 0.85)
    gap = _row("sglang-agg", SGLANG_ROW)  # another harness: SGLang's defaults
    assert gap.flags == SGLangFlags() and gap.kv_cache_quant == "bfloat16"
