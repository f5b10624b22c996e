"""Kernel tables priced from another GPU's (perf/tables.py): vLLM's MLA module on B300 from the
re-collected B200 tables, the reason checked against the tables the package ships, and the
overlay the estimator reads holding everything else as it is."""

from __future__ import annotations

import os

import pytest

from vllm_vcr.perf import aic
from vllm_vcr.perf.catalog import package_root
from vllm_vcr.perf.tables import borrowed_tables, systems_path, uses_mla

from .conftest import needs_aic

pytestmark = needs_aic

KIMI = "moonshotai/Kimi-K2.5"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_VCR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VLLM_VCR_PERF_CACHE", raising=False)
    aic._compiled.cache_clear()
    yield tmp_path
    aic._compiled.cache_clear()


def test_only_an_mla_model_on_b300_under_vllm_borrows():
    assert uses_mla(KIMI) and not uses_mla("MiniMaxAI/MiniMax-M2.5")
    assert borrowed_tables(KIMI, "b300_sxm", "vllm") == (("mla", "b200_sxm"),)
    assert borrowed_tables(KIMI, "b200_sxm", "vllm") == ()
    assert borrowed_tables(KIMI, "h200_sxm", "vllm") == ()
    assert borrowed_tables(KIMI, "b300_sxm", "sglang") == ()
    assert borrowed_tables("MiniMaxAI/MiniMax-M2.5", "b300_sxm", "vllm") == ()


def _ratio(family_dir: str, b300: str, b200: str) -> float:
    """Median B300/B200 latency over the shapes both tables measured."""
    pd = pytest.importorskip("pandas")
    data = package_root() / "systems" / "data"
    a = pd.read_parquet(data / "b200_sxm" / family_dir / b200)
    b = pd.read_parquet(data / "b300_sxm" / family_dir / b300)
    keys = [c for c in a.columns if c in b.columns and c not in ("latency", "device", "energy", "power")
            and a[c].dtype != float]
    m = a.merge(b, on=keys, suffixes=("_b200", "_b300"))
    assert len(m) > 100
    return float((m.latency_b300 / m.latency_b200).median())


def test_the_reason_holds_in_the_shipped_tables():
    """B200's vLLM MLA tables are the re-collected ones; B300's vLLM tables are far above them
    where the other frameworks' MLA tables on the same B300 are not (if a release re-collects
    B300, this fails and the borrowing goes)."""
    meta = package_root() / "systems" / "data" / "b200_sxm" / "mla" / "vllm" / "0.24.0" / "collection_meta.yaml"
    assert "Re-collected" in meta.read_text()
    for kind in ("generation", "context"):
        assert _ratio("mla/vllm/0.24.0", f"mla_{kind}_module_perf.parquet", f"mla_{kind}_module_perf.parquet") > 1.5
        assert 0.8 < _ratio("mla/trtllm/1.3.0rc20", f"mla_{kind}_module_perf.parquet",
                            f"mla_{kind}_module_perf.parquet") < 1.1
        assert 0.8 < _ratio("mla/sglang/0.5.14", f"{kind}_mla_perf.parquet", f"{kind}_mla_perf.parquet") < 1.1


def _mla_ms(gpu: str) -> float:
    t = aic.AicTarget(KIMI, gpu, tensor_parallel_size=4, gemm_quant="nvfp4", moe_quant="nvfp4",
                      kv_cache_quant="fp8")
    ops = aic.compile_target(t).decode_step_per_op(4, 1536, 2)
    return next(ms for name, ms, *_ in ops if name == "generation_mla_block")


def test_b300_prices_the_mla_module_as_b200_and_the_rest_as_its_own(cache):
    assert _mla_ms("b300_sxm") == pytest.approx(_mla_ms("b200_sxm"), rel=1e-9)
    # without the borrowing, B300's own table: about twice B200's at this shape
    t = aic.AicTarget(KIMI, "b300_sxm", tensor_parallel_size=4, gemm_quant="nvfp4", moe_quant="nvfp4",
                      kv_cache_quant="fp8").resolved()
    from aiconfigurator_core.sdk.engine import EngineHandle
    own = EngineHandle.compile(t.model, t.gpu, t.backend, **t.compile_kwargs()).decode_step_per_op(4, 1536, 2)
    assert next(ms for name, ms, *_ in own if name == "generation_mla_block") > 1.5 * _mla_ms("b200_sxm")


def test_the_overlay_links_every_other_table_to_the_package(cache):
    path = systems_path("b300_sxm", "vllm", (("mla", "b200_sxm"),))
    assert path.startswith(str(cache))
    assert systems_path("b300_sxm", "vllm", (("mla", "b200_sxm"),)) == path  # made once
    src = package_root() / "systems"
    data = os.path.join(path, "data")
    assert os.path.realpath(os.path.join(data, "b300_sxm", "mla", "vllm")) == str((src / "data/b200_sxm/mla/vllm").resolve())
    assert os.path.realpath(os.path.join(data, "b300_sxm", "mla", "sglang")) == str((src / "data/b300_sxm/mla/sglang").resolve())
    assert os.path.realpath(os.path.join(data, "b300_sxm", "moe")) == str((src / "data/b300_sxm/moe").resolve())
    assert os.path.realpath(os.path.join(data, "h200_sxm")) == str((src / "data/h200_sxm").resolve())
    assert sorted(os.listdir(path)) == sorted(p.name for p in src.iterdir())
    assert systems_path("b200_sxm", "vllm", ()) is None


def test_the_overlay_without_a_cache_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_VCR_PERF_CACHE", "0")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    path = systems_path("b300_sxm", "vllm", (("mla", "b200_sxm"),))
    assert path.startswith(str(tmp_path)) and os.path.isdir(os.path.join(path, "data", "b300_sxm", "mla", "vllm"))


def _moe(backend: str, version: str, gpu: str = "b200_sxm"):
    pd = pytest.importorskip("pandas")
    df = pd.read_parquet(package_root() / "systems" / "data" / gpu / "moe" / backend / version / "moe_perf.parquet")
    return df[(df.moe_dtype == "w4a8_mxfp4_mxfp8") & (df.distribution == "power_law_1.2")]


def test_mxfp8_moe_shapes_vllm_lacks_come_from_trtllms_tables_of_the_same_kernels():
    """Where vLLM's and TRT-LLM's B200 tables both measured MXFP4 x MXFP8 experts (the same
    TRT-LLM-gen kernels), they agree; gpt-oss's expert shape is only in TRT-LLM's (if a release
    adds it to vLLM's tables, this fails and the derivation goes)."""
    keys = ["hidden_size", "inter_size", "num_experts", "topk", "moe_tp_size", "moe_ep_size", "num_tokens"]
    vllm, trt = _moe("vllm", "0.24.0"), _moe("trtllm", "1.3.0rc20")
    m = vllm.merge(trt, on=keys, suffixes=("_vllm", "_trt"))
    assert len(m) > 300
    assert 0.85 < float((m.latency_trt / m.latency_vllm).median()) < 1.15
    assert not (vllm.hidden_size == 2880).any() and (trt.hidden_size == 2880).any()
    assert borrowed_tables("openai/gpt-oss-120b", "b200_sxm", "vllm", "w4a8_mxfp4_mxfp8") == (
        ("moe:w4a8_mxfp4_mxfp8", "trtllm"),)
    assert borrowed_tables("openai/gpt-oss-120b", "b200_sxm", "vllm", "w4a16_mxfp4") == ()
    assert borrowed_tables("openai/gpt-oss-120b", "h200_sxm", "vllm", "w4a8_mxfp4_mxfp8") == ()


def test_the_derived_moe_table_holds_vllms_rows_and_trtllms_at_both_layouts(cache):
    pd = pytest.importorskip("pandas")
    path = systems_path("b200_sxm", "vllm", (("moe:w4a8_mxfp4_mxfp8", "trtllm"),))
    own = pd.read_parquet(package_root() / "systems" / "data" / "b200_sxm" / "moe" / "vllm" / "0.24.0" / "moe_perf.parquet")
    got = pd.read_parquet(os.path.join(path, "data", "b200_sxm", "moe", "vllm", "0.24.0", "moe_perf.parquet"))
    pd.testing.assert_frame_equal(got.iloc[: len(own)].reset_index(drop=True), own.reset_index(drop=True))
    new = got.iloc[len(own):]
    assert set(new.hidden_size) == {2880} and set(new.moe_dtype) == {"w4a8_mxfp4_mxfp8"}
    assert set(new.framework) == {"VLLM"} and set(new.version) == {"0.24.0"}
    trt = _moe("trtllm", "1.3.0rc20")
    one = trt[(trt.hidden_size == 2880) & (trt.num_experts == 128) & (trt.moe_ep_size == 2)].set_index("num_tokens").latency
    for tp, ep in ((2, 1), (1, 2)):  # vLLM's sharded layout and the expert-parallel one, both as measured at EP 2
        rows = new[(new.num_experts == 128) & (new.moe_tp_size == tp) & (new.moe_ep_size == ep)
                   & (new.distribution == "power_law_1.2")].set_index("num_tokens").latency
        assert rows.sort_index().tolist() == one.sort_index().tolist()
    assert not new.duplicated(["num_tokens", "num_experts", "moe_tp_size", "moe_ep_size", "distribution"]).any()
    other = os.path.join(path, "data", "b200_sxm", "moe", "vllm", "0.19.0")
    assert os.path.realpath(other) == str((package_root() / "systems" / "data" / "b200_sxm" / "moe" / "vllm" / "0.19.0").resolve())
