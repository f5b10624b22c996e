"""The estimator's start-up results kept on disk (perf/spec_cache.py): a kept spec and KV
estimate give exactly what computing them gives; a damaged file is recomputed; the cache can be
turned off."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_vcr.engine.latency.aic import StepPricer
from vllm_vcr.perf import aic
from vllm_vcr.perf.kv_sizing import estimate_kv_capacity
from vllm_vcr.perf.spec_cache import KeptPrices

from .conftest import LLAMA_8B, needs_aic

pytestmark = needs_aic

# (decodes, their mean context, prefills, prefill tokens, prefill context): what the engine prices
GRID = [(d, ctx, 0, 0, 0) for d in (1, 7, 64, 300) for ctx in (1, 100, 1024, 7000)]
GRID += [(d, ctx, p, tokens, prefix) for d in (0, 5, 200) for ctx in (16, 1500) for p in (1, 3)
         for tokens in (3, 129, 2048, 8192) for prefix in (0, 512)]


def _fresh_handle():
    aic._compiled.cache_clear()
    return aic.compile_target(aic.AicTarget(LLAMA_8B, "h100_sxm"))


def _prices(handle) -> list:
    pricer = StepPricer(handle)
    return [pricer._price(*row) for row in GRID]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_VCR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VLLM_VCR_PERF_CACHE", raising=False)
    yield tmp_path / "aic-specs"
    aic._compiled.cache_clear()


def _kv():
    return estimate_kv_capacity(aic.AicTarget(LLAMA_8B, "h100_sxm", tensor_parallel_size=2), block_size=16,
                                gpu_memory_utilization=0.85, max_num_batched_tokens=4096, max_num_seqs=256)


def test_a_kept_spec_prices_every_step_as_the_compiled_one(cache, monkeypatch):
    monkeypatch.setenv("VLLM_VCR_PERF_CACHE", "0")
    compiled = _prices(_fresh_handle())
    assert not cache.exists()
    monkeypatch.delenv("VLLM_VCR_PERF_CACHE")
    first = _fresh_handle()  # compiles and keeps its spec
    kept = list(cache.glob("*.bin"))
    assert len(kept) == 1 and kept[0].read_bytes() == bytes(first.spec_bytes)
    assert _prices(first) == compiled
    loaded = _fresh_handle()  # loads the kept spec
    assert bytes(loaded.spec_bytes) == bytes(first.spec_bytes)
    assert _prices(loaded) == compiled


def test_a_damaged_spec_is_compiled_afresh_and_rewritten(cache):
    good = bytes(_fresh_handle().spec_bytes)
    (path,) = cache.glob("*.bin")
    for junk in (b"", b"\x00" * 17, good[: len(good) // 2]):
        path.write_bytes(junk)
        handle = _fresh_handle()
        assert bytes(handle.spec_bytes) == good and path.read_bytes() == good
        handle.decode_step_latency(8, 512, 2)


def test_other_targets_get_their_own_files(cache):
    _fresh_handle()
    aic.compile_target(aic.AicTarget(LLAMA_8B, "h100_sxm", tensor_parallel_size=2))
    assert len(list(cache.glob("*.bin"))) == 2


def test_the_kv_estimate_is_kept_exactly_and_a_foreign_file_is_ignored(cache, monkeypatch):
    monkeypatch.setenv("VLLM_VCR_PERF_CACHE", "0")
    computed = _kv()
    monkeypatch.delenv("VLLM_VCR_PERF_CACHE")
    assert _kv() == computed
    (path,) = cache.glob("*.json")
    assert _kv() == computed  # from the file
    kept = json.loads(path.read_text())
    kept["inputs"] = "something else"  # a file whose name collides: not used
    kept["result"]["total_kv_size_tokens"] = 16
    path.write_text(json.dumps(kept))
    assert _kv() == computed
    path.write_text("{not json")
    assert _kv() == computed and json.loads(path.read_text())["result"]["total_kv_size_tokens"] == computed.tokens


def _save_kept() -> None:
    """What the process does at exit: the handle's new price answers written back."""
    handle = aic.compile_target(aic.AicTarget(LLAMA_8B, "h100_sxm"))
    if isinstance(handle, KeptPrices):
        handle.save()


def test_kept_price_answers_are_the_estimators_and_a_warm_process_loads_no_estimator(cache, monkeypatch):
    monkeypatch.setenv("VLLM_VCR_PERF_CACHE", "0")
    computed = _prices(_fresh_handle())
    monkeypatch.delenv("VLLM_VCR_PERF_CACHE")
    first = _fresh_handle()  # nothing kept yet: the estimator is loaded at once
    assert isinstance(first, KeptPrices) and first._handle is not None
    assert _prices(first) == computed
    _save_kept()
    (path,) = cache.glob("*.json")
    warm = _fresh_handle()
    assert _prices(warm) == computed
    assert warm._handle is None  # every answer was kept: no kernel table was loaded
    assert warm.decode_step_latency(3, 4321, 2) == StepPricer(first.handle)._price(3, 4321)  # a new one loads it
    assert warm._handle is not None
    path.write_text("{not json")  # a damaged file: the estimator is loaded and answers
    assert _prices(_fresh_handle()) == computed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 512), st.integers(1, 20000), st.integers(1, 8), st.integers(0, 8192),
                          st.integers(0, 8192)), min_size=1, max_size=20))
def test_kept_prices_equal_the_estimators_for_any_step(cache, rows):
    """Hostile compositions (zero decodes, one-token chunks, long contexts), asked twice: once
    cold (the estimator answers and the answers are written), once from the kept file."""
    rows = [(d, ctx, p, tokens, prefix) if tokens else (max(d, 1), ctx) for d, ctx, p, tokens, prefix in rows]
    cold_pricer = StepPricer(_fresh_handle())
    cold = [cold_pricer._price(*r) for r in rows]
    _save_kept()
    warm = _fresh_handle()
    assert [StepPricer(warm)._price(*r) for r in rows] == cold
    assert warm._handle is None


def test_the_version_in_the_keys_is_the_installed_packages():
    """spec_key's version, read from the package's METADATA without importlib.metadata, is the one
    importlib.metadata reads (a kept file's name depends on it)."""
    from importlib import metadata

    from vllm_vcr.perf.spec_cache import aic_version

    assert aic_version() == metadata.version("aiconfigurator-core")
