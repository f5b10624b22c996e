"""aiconfigurator-core's compile and KV estimate without the work whose result a run never reads.

Compiling an estimator (`EngineHandle.compile`) orders each attention op's kernel lanes by how
much data each lane holds (`operations/attention.py::resolved_lane_order_for_op`): it loads the
attention table in a probe engine twice, once as the shared view (the version's rows and the
rows it inherits from sibling versions) and once as the version's own rows alone, ~0.14 CPU s a
load. When the two views read the same source files with the same lane filters (the package's
resolver says which: `resolve_op_sources_report_json`), they load the same table, so their
densities are equal; `lean_compile()` then answers the second from the first. Before its first
probe the SDK also resolves the sources of all its ~40 table kinds once more, for diagnostics
only (`PerfDatabase._materialize_source_reports`: `data_provenance` and resolver warnings the
engine does not read; ~0.2 CPU s); `lean_compile()` skips that sweep unless provenance is
strict (`AIC_STRICT_PROVENANCE`), where the sweep may refuse a database. `defer_network()`
defers the standard library's `urllib.request`, which the SDK imports at its top to fetch model
configs from the network, which a bundled model never does.

The KV-cache estimate (`sdk/memory.py`) is plain arithmetic on the model and the system spec,
but importing it imports pandas (~0.3 CPU s) for DataFrame paths it never takes.
`import_memory()` imports it with pandas deferred (`importlib.util.LazyLoader`: the real
pandas loads at the first use of any of its names; an `import pandas` statement, which reads
only its `__spec__`, is not a use) and the SDK's `inference_summary` module,
whose method annotations name `pd.DataFrame` at definition, compiled with postponed
annotations (PEP 563: the same code, its annotations kept as strings).

tests/perf/test_sdk_lean.py checks that compiles give the same spec bytes and estimates the
same numbers with and without these, for dense, MoE, MLA and FP8 targets, and that the two
views load equal densities wherever the resolver gives them the same sources in the shipped
data; the names are the package's internals, pinned below 0.13 in pyproject.toml.
"""

from __future__ import annotations

import __future__
import contextlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import threading
from typing import Any, Iterator

# attention table attribute -> its file (the tables whose lane density orders an op's lanes)
DENSITY_TABLES = {"_context_attention_data": "context_attention_perf.parquet",
                  "_generation_attention_data": "generation_attention_perf.parquet"}


def table_sources(database: Any, filename: str, shared_layer: bool) -> list[tuple[str, Any]]:
    """(path, lane filter) of each source file the engine loads `filename` from for `database`'s
    system, backend and version, in the shared view or the version's own."""
    import aiconfigurator_core
    from aiconfigurator_core.sdk.operations.base import resolve_op_data_path

    root = os.path.join(database.systems_root, database.system_spec["data_dir"])
    report = json.loads(aiconfigurator_core.resolve_op_sources_report_json(
        database.systems_root, root, database.backend, database.version, filename,
        resolve_op_data_path(root, database.backend, database.version, filename),
        enable_shared_layer=shared_layer, strict=bool(database.strict_provenance)))
    return [(r["path"], r["ks_filter"]) for r in report["records"]]


@contextlib.contextmanager
def lean_compile() -> Iterator[None]:
    """Within the block, the SDK's compile loads each attention table once and skips its
    diagnostics-only source sweep (see the module's docstring)."""
    from aiconfigurator_core.sdk import engine_table_view
    from aiconfigurator_core.sdk.perf_database import PerfDatabase

    density, sweep = engine_table_view.fetch_attention_lane_density, PerfDatabase._materialize_source_reports

    def same_sources(database: Any, filename: str) -> bool:
        try:
            return table_sources(database, filename, True) == table_sources(database, filename, False)
        except Exception:  # noqa: BLE001 - the SDK's own path decides (and reports)
            return False

    def lane_density(database: Any, attribute: str, *, shared_layer: bool | None = None) -> Any:
        filename = DENSITY_TABLES.get(attribute)
        if shared_layer is False and database.enable_shared_layer and filename and same_sources(database, filename):
            return density(database, attribute)  # the shared view's: the same table
        return density(database, attribute, shared_layer=shared_layer)

    def sources_swept(self: Any) -> None:
        if self.strict_provenance:
            sweep(self)

    engine_table_view.fetch_attention_lane_density = lane_density
    PerfDatabase._materialize_source_reports = sources_swept
    try:
        yield
    finally:
        engine_table_view.fetch_attention_lane_density = density
        PerfDatabase._materialize_source_reports = sweep


MEMORY_MODULE = "aiconfigurator_core.sdk.memory"
SUMMARY_MODULE = "aiconfigurator_core.sdk.inference_summary"


class _PostponedAnnotations(importlib.machinery.SourceFileLoader):
    """A module's source compiled with `from __future__ import annotations` in effect."""

    def get_code(self, fullname: str) -> Any:
        path = self.get_filename(fullname)
        return compile(self.get_data(path), path, "exec", dont_inherit=True,
                       flags=__future__.annotations.compiler_flag)


_LAZY = importlib.util._LazyModule  # type: ignore[attr-defined]
_turning = threading.Lock()


class _Deferred(_LAZY):  # type: ignore[misc,valid-type]
    """LazyLoader's module, but for `__spec__`, which an `import` statement that finds the module
    in sys.modules reads (`_find_and_load`): reading it leaves the module unexecuted. Any other
    name turns it back into the interpreter's own lazy module, whose loading then runs as the
    standard library has it (from 3.12.3 it loads only a module whose class is exactly its own,
    under a lock)."""

    def __getattribute__(self, attr: str) -> Any:
        if attr == "__spec__":
            return object.__getattribute__(self, "__dict__")["__spec__"]
        with _turning:
            if object.__getattribute__(self, "__class__") is _Deferred:
                object.__setattr__(self, "__class__", _LAZY)
        return getattr(self, attr)


def _defer(name: str) -> None:
    """`name` in sys.modules as a lazy module: executed at the first use of one of its names (a
    submodule is also its package's attribute, as an import would make it)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        return
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    module.__class__ = _Deferred
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)


# imported at the top of the SDK's sdk/utils.py (through its model builders) for fetching a
# model's config from the Hugging Face Hub, which a bundled model never does; with it http.client
# and the e-mail parser: ~25 ms of a compile's start-up
NETWORK_MODULES = ("urllib.request",)


def defer_network() -> None:
    """The SDK's network modules deferred (see NETWORK_MODULES) unless already imported: the
    first use of one of their names imports them."""
    for name in NETWORK_MODULES:
        if name not in sys.modules:
            _defer(name)


def _import_postponed(name: str) -> None:
    spec = importlib.util.find_spec(name)
    if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
        importlib.import_module(name)
        return
    spec.loader = _PostponedAnnotations(spec.name, spec.origin)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, module)


def import_memory() -> Any:
    """The SDK's KV-cache estimator module, imported without executing pandas (see the docstring)."""
    if MEMORY_MODULE not in sys.modules:
        if "pandas" not in sys.modules:
            _defer("pandas")
        if SUMMARY_MODULE not in sys.modules:
            _import_postponed(SUMMARY_MODULE)
    return importlib.import_module(MEMORY_MODULE)
