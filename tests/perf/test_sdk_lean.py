"""The estimator's compile and KV estimate without their unread work (perf/sdk_lean.py): the same
spec bytes and the same KV estimate as the SDK's own paths for dense, MoE, MLA and FP8 targets;
the two views of an attention table load equal lane densities wherever the resolver gives them
the same sources, over every system and backend the package ships; pandas is not executed by
the KV estimate and loads whole when used after it."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from vllm_vcr.perf import sdk_lean
from vllm_vcr.perf.catalog import configure_data_roots, package_root
from vllm_vcr.perf.sdk_yaml import c_yaml

from .conftest import needs_aic
from .test_compact_tables import ROWS, TARGETS, _Env, _prices, _whole_handle, target_spec

pytestmark = needs_aic

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _fresh_sdk_caches() -> None:
    """The SDK's probe handles and the densities memoised on its databases dropped (its own lever)."""
    from aiconfigurator_core.sdk import engine

    engine._clear_probe_handle_cache()


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_a_lean_compile_gives_the_same_spec_bytes(name, tmp_path, monkeypatch):
    from aiconfigurator_core.sdk import engine_table_view

    compile_spec = target_spec(name, tmp_path, monkeypatch)

    def spec() -> bytes:
        _fresh_sdk_caches()
        return compile_spec()

    own_views = []  # densities the SDK loaded for the version's own rows
    density = engine_table_view.fetch_attention_lane_density

    def counted(database, attribute, *, shared_layer=None):
        if shared_layer is False:
            own_views.append(attribute)
        return density(database, attribute, shared_layer=shared_layer)

    monkeypatch.setattr(engine_table_view, "fetch_attention_lane_density", counted)
    plain = spec()
    asked = len(own_views)
    with c_yaml(), sdk_lean.lean_compile():
        lean = spec()
    assert lean == plain
    assert asked > 0 or name == "mla"  # (MLA attention is priced from module tables, without lanes)
    assert len(own_views) == asked, "the lean compile loaded an attention table twice"
    assert engine_table_view.fetch_attention_lane_density is counted  # put back


@functools.lru_cache(maxsize=None)
def _sdk_handle(name: str):
    """The estimator compiled by the SDK's own path alone (no libyaml, nothing skipped), on the
    tables the perf model's compile reads."""
    from aiconfigurator_core.sdk.engine import EngineHandle

    from vllm_vcr.perf.tables import borrowed_tables, systems_path

    with _Env(on=False):
        configure_data_roots()
        t = TARGETS[name].resolved()
        systems = systems_path(t.gpu, t.backend, borrowed_tables(t.model, t.gpu, t.backend))
        _fresh_sdk_caches()
        return EngineHandle.compile(t.model, t.gpu, t.backend, backend_version=t.backend_version,
                                    systems_path=systems, **t.compile_kwargs())


@pytest.mark.parametrize("name", sorted(TARGETS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=ROWS)
def test_the_perf_models_compile_prices_any_step_as_the_sdks_own(name, rows):
    """`compile_target` with nothing kept (the lean compile) against the SDK's plain compile."""
    ours, sdk = _whole_handle(name), _sdk_handle(name)
    assert bytes(ours.spec_bytes) == bytes(sdk.spec_bytes)
    assert _prices(ours, rows) == _prices(sdk, rows)


def _databases():
    """A database of every (system, backend) with data in the package."""
    from aiconfigurator_core.sdk.perf_database import get_database, get_version_slots

    configure_data_roots()
    systems = sorted(p.stem for p in (package_root() / "systems").glob("*.yaml")
                     if (package_root() / "systems" / "data" / p.stem).is_dir())
    out = []
    for system in systems:
        for backend in ("vllm", "sglang", "trtllm"):
            if not (get_version_slots(system, backend) or {}).get("current"):
                continue
            db = get_database(system, backend, "current")
            if db is not None:
                out.append(db)
    return out


def test_the_two_views_of_a_table_with_the_same_sources_load_equal_densities():
    from aiconfigurator_core.sdk.engine_table_view import fetch_attention_lane_density

    same = differ = 0
    with c_yaml():
        databases = _databases()
    assert len(databases) >= 10
    for db in databases:
        assert db.enable_shared_layer
        for attribute, filename in sdk_lean.DENSITY_TABLES.items():
            if sdk_lean.table_sources(db, filename, True) != sdk_lean.table_sources(db, filename, False):
                differ += 1
                continue
            same += 1
            shared = fetch_attention_lane_density(db, attribute)
            own = fetch_attention_lane_density(db, attribute, shared_layer=False)
            assert own == shared, (db.system, db.backend, db.version, attribute)
        _fresh_sdk_caches()  # (each probe pins its tables)
    assert same >= 10


def test_the_source_sweep_is_kept_under_strict_provenance():
    from aiconfigurator_core.sdk.perf_database import PerfDatabase

    swept = []

    class Db:
        def __init__(self, strict: bool) -> None:
            self.strict_provenance = strict

    original = PerfDatabase._materialize_source_reports
    PerfDatabase._materialize_source_reports = lambda self: swept.append(self)
    try:
        with sdk_lean.lean_compile():
            lax, strict = Db(False), Db(True)
            PerfDatabase._materialize_source_reports(lax)
            PerfDatabase._materialize_source_reports(strict)
    finally:
        PerfDatabase._materialize_source_reports = original
    assert swept == [strict]


_ESTIMATES = """
import json, sys
if sys.argv[1] == "pandas-first":
    import pandas
from vllm_vcr.perf import kv_sizing
from tests.perf.test_compact_tables import TARGETS
out = {}
for name, target in sorted(TARGETS.items()):
    t = target.resolved()
    est = kv_sizing._estimate(t, 8192, 256, 0.9)
    out[name] = {k: v for k, v in est.items() if not callable(v)}
out["pandas executed"] = "pandas.core" in sys.modules
print(json.dumps(out, sort_keys=True, default=repr))
"""


def _run(code: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, str(Path(SRC).parent)]), "VLLM_VCR_PERF_CACHE": "0"}
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600,
                         check=True, cwd=str(Path(SRC).parent))
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_kv_estimate_is_the_same_without_pandas():
    plain = _run(_ESTIMATES, "pandas-first")
    lean = _run(_ESTIMATES, "lean")
    assert plain.pop("pandas executed") is True
    assert lean.pop("pandas executed") is False
    assert sorted(lean) == sorted(TARGETS)
    assert lean == plain


_PANDAS_AFTER = """
import json, sys, typing
from vllm_vcr.perf.sdk_lean import import_memory
import_memory()
before = "pandas.core" in sys.modules
import pandas as pd  # an import statement leaves it unexecuted
still = "pandas.core" in sys.modules
frame = pd.DataFrame({"a": [1, 2]})
from pandas import Series
from aiconfigurator_core.sdk.inference_summary import InferenceSummary
hints = typing.get_type_hints(InferenceSummary.set_summary_df)
print(json.dumps({"before": before, "after import": still, "sum": int(frame["a"].sum()),
                  "series": Series([3]).tolist(), "hint": hints["summary_df"] is pd.DataFrame,
                  "module": type(sys.modules["pandas"]).__name__}))
"""


def test_pandas_loads_whole_at_its_first_use_after_the_kv_estimators_import():
    r = _run(_PANDAS_AFTER)
    assert r == {"before": False, "after import": False, "sum": 3, "series": [3], "hint": True, "module": "module"}


def test_the_internals_relied_on_are_there():
    import importlib.util

    import aiconfigurator_core
    from aiconfigurator_core.sdk import engine_table_view
    from aiconfigurator_core.sdk.perf_database import PerfDatabase

    assert callable(engine_table_view.fetch_attention_lane_density)
    assert callable(PerfDatabase._materialize_source_reports)
    assert callable(aiconfigurator_core.resolve_op_sources_report_json)
    assert isinstance(importlib.util._LazyModule, type)
    import aiconfigurator_core.sdk.operations.attention as attention

    text = Path(attention.__file__).read_text()
    assert "fetch_attention_lane_density(database, table_attr, shared_layer=False)" in text
