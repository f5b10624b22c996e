"""The estimator on its kernel tables cut to one target (perf/compact.py), loaded without the
SDK's Python layer (perf/native.py), prices every step exactly as the estimator on the whole
tables does: dense, MoE, MLA (on B300's borrowed tables) and FP8 targets, hostile compositions.
These fail if aiconfigurator-core's loaders start reading a column or key the cut drops (the
cut is then refused and the target reads the whole tables: `_cut_handle` asserts it is used)."""

from __future__ import annotations

import functools
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_vcr.engine.latency.aic import StepPricer
from vllm_vcr.perf import aic, compact
from vllm_vcr.perf.native import NativeHandle
from vllm_vcr.perf.spec_cache import KeptPrices

from .conftest import LLAMA_8B, needs_aic

pytestmark = needs_aic

TARGETS = {
    "dense": aic.AicTarget(LLAMA_8B, "h100_sxm"),
    "moe": aic.AicTarget("Qwen/Qwen3-30B-A3B", "h100_sxm", tensor_parallel_size=2),
    "mla": aic.AicTarget("moonshotai/Kimi-K2.5", "b300_sxm", tensor_parallel_size=4, gemm_quant="nvfp4",
                         moe_quant="nvfp4"),
    "fp8": aic.AicTarget("nvidia/Llama-3.1-8B-Instruct-FP8", "h100_sxm"),
}
_CACHE = os.path.join(tempfile.gettempdir(), f"vllm-vcr-compact-test-{os.getpid()}")  # made by the code


@pytest.fixture(scope="module", autouse=True)
def _cache_removed_after():
    yield
    _whole_handle.cache_clear()
    _cut_handle.cache_clear()
    shutil.rmtree(_CACHE, ignore_errors=True)


class _Env:
    """The perf cache on (in this module's directory) or off, for one block."""

    def __init__(self, on: bool) -> None:
        self.on = on

    def __enter__(self) -> None:
        self.saved = {k: os.environ.get(k) for k in ("VLLM_VCR_CACHE_DIR", "VLLM_VCR_PERF_CACHE")}
        os.environ["VLLM_VCR_CACHE_DIR"] = _CACHE
        os.environ["VLLM_VCR_PERF_CACHE"] = "1" if self.on else "0"
        aic._compiled.cache_clear()

    def __exit__(self, *exc: object) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        aic._compiled.cache_clear()


def target_spec(name: str, tmp_path, monkeypatch):
    """A call that compiles TARGETS[name] with the SDK's own compile and returns the spec's bytes
    (the borrowed-table overlay B300 needs made under tmp_path)."""
    from aiconfigurator_core.sdk.engine import compile_engine

    from vllm_vcr.perf.catalog import configure_data_roots
    from vllm_vcr.perf.tables import borrowed_tables, systems_path

    monkeypatch.setenv("VLLM_VCR_CACHE_DIR", str(tmp_path))
    configure_data_roots()
    t = TARGETS[name].resolved()
    systems = systems_path(t.gpu, t.backend, borrowed_tables(t.model, t.gpu, t.backend))
    return lambda: compile_engine(t.model, t.gpu, t.backend, backend_version=t.backend_version,
                                  systems_path=systems, **t.compile_kwargs())


@functools.lru_cache(maxsize=None)
def _whole_handle(name: str):
    """The estimator as compiled, on the whole tables (the cache off: nothing cut)."""
    with _Env(on=False):
        handle = aic.compile_target(TARGETS[name])
    assert not isinstance(handle, KeptPrices) and not isinstance(handle, NativeHandle)
    return handle


@functools.lru_cache(maxsize=None)
def _cut_handle(name: str):
    """The estimator a later process loads: its kept spec, on the cut tables."""
    with _Env(on=True):
        aic.compile_target(TARGETS[name])  # compiles, keeps the spec, makes and checks the cut
    with _Env(on=True):
        kept = aic.compile_target(TARGETS[name])
        handle = kept.handle if isinstance(kept, KeptPrices) else kept
    assert isinstance(handle, NativeHandle)
    assert "aic-compact" in (handle._systems_path or ""), "the cut tables were refused"
    return handle


ROWS = st.lists(st.tuples(st.integers(0, 1024), st.integers(1, 32768), st.integers(1, 8), st.integers(0, 16384),
                          st.integers(0, 16384)), min_size=1, max_size=12)


def _prices(handle, rows) -> list:
    pricer = StepPricer(handle)
    rows = [(d, ctx, p, tokens, prefix) if tokens else (max(d, 1), ctx) for d, ctx, p, tokens, prefix in rows]
    return [pricer._price(*r) for r in rows]


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_the_cut_tables_price_the_check_grid_as_the_whole_ones(name):
    whole, cut = _whole_handle(name), _cut_handle(name)
    assert compact._answers(cut) == compact._answers(whole)
    grid = [(d, ctx, 0, 0, 0) for d in (1, 7, 64, 300) for ctx in (1, 100, 1024, 7000)]
    grid += [(d, ctx, p, tokens, prefix) for d in (0, 5, 200) for ctx in (16, 1500) for p in (1, 3)
             for tokens in (3, 129, 2048, 8192) for prefix in (0, 512)]
    assert _prices(cut, grid) == _prices(whole, grid)


@pytest.mark.parametrize("name", sorted(TARGETS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=ROWS)
def test_the_cut_tables_price_any_step_as_the_whole_ones(name, rows):
    assert _prices(_cut_handle(name), rows) == _prices(_whole_handle(name), rows)


def test_the_dense_cut_keeps_only_its_precision_head_size_and_read_columns():
    import pyarrow.parquet as pq

    systems = Path(_cut_handle("dense")._systems_path)
    gemm = pq.read_table(next(systems.glob("data/h100_sxm/gemm/vllm/*/gemm_perf.parquet")))
    assert tuple(gemm.column_names) == compact.GEMM_COLUMNS
    assert set(gemm["gemm_dtype"].to_pylist()) == {"bfloat16"}
    ctx = pq.read_table(next(systems.glob("data/h100_sxm/attention/vllm/*/context_attention_perf.parquet")))
    assert set(ctx["head_dim"].to_pylist()) == {128} and set(ctx["kv_cache_dtype"].to_pylist()) == {"bfloat16"}
    # every other table is the package's own file
    moe = next(systems.glob("data/h100_sxm/moe"))
    assert moe.is_symlink()


def test_a_cut_that_prices_otherwise_is_refused_and_the_whole_tables_serve(tmp_path, monkeypatch):
    """A cut that drops what the target reads (its GEMMs' bfloat16 rows) fails the check: the
    target keeps the whole tables and its prices."""
    monkeypatch.setenv("VLLM_VCR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VLLM_VCR_PERF_CACHE", raising=False)
    wrong = (compact.Cut("gemm", "gemm_perf.parquet", compact.GEMM_COLUMNS, (("gemm_dtype", ("fp8",)),)),)
    monkeypatch.setattr(compact, "plans", lambda *a: [wrong])
    aic._compiled.cache_clear()
    try:
        aic.compile_target(TARGETS["dense"])
        (d,) = (tmp_path / "aic-compact").iterdir()
        assert (d / "unusable").is_file() and not (d / "ok").exists()
        aic._compiled.cache_clear()
        kept = aic.compile_target(TARGETS["dense"])
        handle = kept.handle if isinstance(kept, KeptPrices) else kept
        assert handle._systems_path is None  # the package's own tables
        grid = [(1, 1, 0, 0, 0), (64, 2048, 0, 0, 0), (5, 1500, 3, 2048, 512)]
        assert _prices(handle, grid) == _prices(_whole_handle("dense"), grid)
    finally:
        aic._compiled.cache_clear()


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_the_native_handle_hands_other_queries_to_the_sdk_on_the_cut_tables_alike(name):
    """The silicon validation's queries (`run_static`, `predict_*`) go to an `EngineHandle` on
    the same cut tables, and answer as on the whole ones."""
    whole, cut = _whole_handle(name), _cut_handle(name)
    for b, isl, osl in ((1, 128, 2), (4, 1000, 100), (64, 3000, 500)):
        assert cut.run_static(batch_size=b, isl=isl, osl=osl) == whole.run_static(batch_size=b, isl=isl, osl=osl)
        assert cut.predict_prefill_latency(b, isl) == whole.predict_prefill_latency(b, isl)
        assert cut.predict_decode_latency(b, isl, osl) == whole.predict_decode_latency(b, isl, osl)
    native = NativeHandle(bytes(whole.spec_bytes))  # the package's tables
    assert native.run_static(batch_size=4, isl=1000, osl=100) == whole.run_static(batch_size=4, isl=1000, osl=100)


def test_the_estimator_whose_internals_the_cut_relies_on_is_pinned():
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    pin = re.search(r'"aiconfigurator-core>=([\d.]+),<([\d.]+)"', text)
    assert pin, "aiconfigurator-core needs an upper bound: perf/compact.py and perf/native.py rely on its internals"
    from importlib.metadata import version

    installed = tuple(int(x) for x in version("aiconfigurator-core").split(".")[:2])
    assert installed < tuple(int(x) for x in pin.group(2).split(".")[:2])
