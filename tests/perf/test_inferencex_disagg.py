"""InferenceX's dashboard rows of disaggregated deployments run the deployment of the recipe that
measured them (worker counts, DP attention, expert parallelism), not the one-worker reading of
their columns."""

from __future__ import annotations

import csv
from dataclasses import replace

from vllm_vcr.simulate.inferencex_disagg import recipe_point

from .conftest import needs_aic

DASH = "source_file=2026-03-25.csv; model=DeepSeek-R1; silicon_concurrency=1024"
R1 = "deepseek-ai/DeepSeek-R1"
WIDE_GB300 = "2026_03_25_deepseek_r1_gb300_sglang_fp8_disagg_8192x1024_c1024_tp8_0_ep8_0_818"
NARROW_GB300 = "2026_03_25_deepseek_r1_gb300_sglang_fp8_disagg_1024x1024_c32_tp4_0_ep1_0_"


def test_a_wide_dashboard_row_is_five_dep8_prefill_workers_and_one_dep32_decode_worker():
    pt = recipe_point(DASH, R1, "gb300", "fp8", 8192, 1024, 1024, prefill_gpus=8, prefill_ep=8, decode_gpus=32)
    assert pt is not None
    assert (pt.prefill.workers, pt.prefill.tp, pt.prefill.attention_dp, pt.prefill.ep) == (5, 1, 8, 8)
    assert (pt.decode.workers, pt.decode.tp, pt.decode.attention_dp, pt.decode.ep, pt.decode.moe_tp) == (1, 1, 32, 32, 1)


def test_a_low_latency_dashboard_row_has_its_recipes_four_decode_workers():
    pt = recipe_point(DASH, R1, "gb300", "fp8", 1024, 1024, 32, prefill_gpus=4, prefill_ep=1, decode_gpus=4)
    assert pt is not None and (pt.prefill.workers, pt.decode.workers) == (1, 4)
    assert (pt.decode.tp, pt.decode.attention_dp, pt.decode.moe_tp, pt.decode.ep) == (4, 1, 4, 1)


def test_no_recipe_or_recipes_that_disagree_leave_the_columns():
    # B200 FP8 1k/1k at 2048 users ran behind one prefill worker and behind two: not known which
    assert recipe_point(DASH, R1, "b200_sxm", "fp8", 1024, 1024, 2048, 8, 8, 8) is None
    # a concurrency no recipe point lists; a GPU count per worker no recipe has
    assert recipe_point(DASH, R1, "gb300", "fp8", 8192, 1024, 3000, 8, 8, 32) is None
    assert recipe_point(DASH, R1, "gb300", "fp8", 8192, 1024, 1024, 8, 8, 16) is None
    # rows whose columns give the workers (the database dump), and other models, are not touched
    assert recipe_point("db-dump/2026-04-27; config_id=505", R1, "gb300", "fp8", 8192, 1024, 1024, 8, 8, 32) is None
    assert recipe_point(DASH, "moonshotai/Kimi-K2.5", "gb300", "fp8", 8192, 1024, 1024, 8, 8, 32) is None


@needs_aic
def test_a_dashboard_row_keeps_its_recorded_group_and_runs_the_recipes_deployment():
    from vllm_vcr.simulate.silicon_beyond import disagg_rows

    row = next(r for r in disagg_rows() if r.id == WIDE_GB300)
    assert row.group == "disagg-sglang|deepseek-ai/DeepSeek-R1|gb300|fp8|p1x(tp8-dp1)|d1x(tp32-dp1)"
    assert (row.prefill_workers, row.prefill_tp, row.prefill_dp, row.prefill_moe_ep) == (5, 1, 8, 8)
    assert (row.decode_workers, row.tp, row.attention_dp, row.moe_ep) == (1, 1, 32, 32)
    assert row.gpus == 5 * 8 + 32


@needs_aic
def test_every_mapped_dashboard_row_agrees_with_its_twin_in_the_database_dump():
    """The sample holds some measurements twice: as a dashboard row and as a database-dump row that
    gives the worker counts and DP attention. Where the recipes map a dashboard row, the mapping
    is the twin's deployment."""
    from vllm_vcr.perf.catalog import package_root
    from vllm_vcr.simulate.silicon import _int
    from vllm_vcr.simulate.silicon_beyond import disagg_rows

    with open(package_root() / "systems" / "silicon_sample.csv", newline="") as f:
        dump = [r for r in csv.DictReader(f) if r["mode"] == "disagg" and r["silicon_data_source"].startswith("db-dump")]

    def key(gpu, isl, osl, ttft, tpot):
        return gpu, int(float(isl)), int(float(osl)), round(float(ttft), 3), round(float(tpot), 3)

    twins = {key(r["system"], r["isl"], r["osl"], r["silicon_ttft_ms"], r["silicon_tpot_ms"]): r for r in dump}
    checked = 0
    for row in disagg_rows():
        t = twins.get(key(row.gpu, row.isl, row.osl, row.ttft_ms, row.tpot_ms))
        if not row.recorded_group or t is None:
            continue
        want = (_int(t["prefill_num_workers"], 1), _int(t["prefill_tp_size"], 1), _int(t["prefill_attention_dp_size"], 1),
                _int(t["decode_num_workers"], 1), _int(t["decode_tp_size"], 1), _int(t["decode_attention_dp_size"], 1))
        got = (row.prefill_workers, row.prefill_tp, row.prefill_dp, row.decode_workers, row.tp, row.attention_dp)
        assert got == want, row.id
        checked += 1
    assert checked >= 40


@needs_aic
def test_the_decode_workers_share_the_benchmarks_users():
    """On the virtual clock: four decode workers of the low-latency recipe each carry a quarter of
    32 users, so the simulated TPOT is that of 8 users, not of 32 on one worker."""
    from vllm_vcr.simulate.silicon import HostTime
    from vllm_vcr.simulate.silicon_beyond import disagg_rows, simulate_disagg_row

    row = next(r for r in disagg_rows() if r.id.startswith(NARROW_GB300))
    assert row.decode_workers == 4
    row = replace(row, osl=32)
    four = simulate_disagg_row(row, host=HostTime.fitted(), max_tokens=20_000)
    one = simulate_disagg_row(replace(row, decode_workers=1), host=HostTime.fitted(), max_tokens=20_000)
    assert four["per_engine_concurrency"] == 8 and one["per_engine_concurrency"] == 32
    assert four["tpot_ms"] < one["tpot_ms"]
