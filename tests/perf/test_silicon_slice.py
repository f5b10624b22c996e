"""The silicon validation on a small slice (the full table: bench/silicon_validation.py)."""

from __future__ import annotations

import pytest

from .conftest import needs_aic

pytestmark = needs_aic

SLICE = ("2026_04_06_llama_3_1_70b_h100_sxm_vllm_fp8_agg_1024x1024_c4_tp4_ep1_653",
         "2026_04_06_llama_3_1_70b_h100_sxm_vllm_fp8_agg_1024x1024_c4_tp8_ep1_725")


def _rows():
    from vllm_vcr.simulate.silicon import vllm_agg_rows

    return {r.id: r for r in vllm_agg_rows()}


def test_the_sample_has_the_vllm_aggregated_rows_and_a_declared_split():
    rows = _rows()
    assert len(rows) == 1328
    train = sum(1 for r in rows.values() if r.split == "train")
    assert 0.28 < train / len(rows) < 0.39


@pytest.mark.parametrize("row_id", SLICE)
def test_a_measured_deployment_is_reproduced_closely(row_id):
    from vllm_vcr.simulate.silicon import simulate_row, static_estimate, supported

    row = _rows()[row_id]
    assert supported(row) is None
    sim = simulate_row(row, step_overhead_ms=2.55, max_tokens=30_000)
    assert sim["preemptions"] == 0
    assert sim["tpot_ms"] == pytest.approx(row.tpot_ms, rel=0.25)
    assert sim["ttft_ms"] == pytest.approx(row.ttft_ms, rel=0.5)  # the engine's share, no frontend
    s_ttft, s_tpot = static_estimate(row)
    assert s_ttft > 0 and s_tpot > 0


def test_what_the_estimator_cannot_price_says_why():
    from vllm_vcr.simulate.silicon import supported

    gpt_oss = next(r for r in _rows().values() if r.model == "openai/gpt-oss-120b" and r.gpu == "h100_sxm")
    assert "fp4_tc_flops" in supported(gpt_oss)
