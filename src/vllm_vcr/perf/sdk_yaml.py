"""aiconfigurator-core's YAML reads on libyaml while the estimator compiles.

Compiling an estimator (`EngineHandle.compile`) parses the package's YAML (its systems'
specs, the version slots, every table directory's collection sidecar and the reuse manifest,
some of them many times) with PyYAML's pure-Python `safe_load`: ~0.5 CPU s of a compile. The
libyaml parser (`CSafeLoader`, PyYAML's own C binding) builds the same objects ~8x faster.
`c_yaml()` points the SDK modules that read YAML at it for the duration of a compile and puts
them back after; without libyaml it changes nothing. tests/perf/test_sdk_yaml.py checks
that every YAML file the package ships loads to equal objects both ways and that a compile
gives the same spec bytes; the module names are the package's internals, pinned below 0.13
in pyproject.toml. PyYAML is imported by the first compile, not with this module: a run whose
estimator loads from its kept spec reads no YAML.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from typing import Any, Iterator

# the SDK modules that `import yaml` and read the package's files with it
SDK_MODULES = ("aiconfigurator_core.sdk.perf_database", "aiconfigurator_core.sdk.attention_lanes",
               "aiconfigurator_core.sdk.operations.base", "aiconfigurator_core.sdk.utils")


def _c_safe_load(stream: Any) -> Any:
    import yaml

    return yaml.load(stream, Loader=yaml.CSafeLoader)


def _c_load(stream: Any, Loader: Any = None) -> Any:  # noqa: N803 - PyYAML's keyword
    import yaml

    return yaml.load(stream, Loader=yaml.CSafeLoader if Loader in (None, yaml.SafeLoader) else Loader)


class _CYaml(types.ModuleType):
    """PyYAML with `safe_load` (and `load` with the safe loader) on libyaml."""

    def __init__(self) -> None:
        super().__init__("yaml")
        self.safe_load = _c_safe_load
        self.load = _c_load

    def __getattr__(self, name: str) -> Any:
        import yaml

        return getattr(yaml, name)


@contextlib.contextmanager
def c_yaml() -> Iterator[None]:
    """The SDK's YAML reads on libyaml within the block (unchanged without it)."""
    import yaml

    if not getattr(yaml, "__with_libyaml__", False):
        yield
        return
    shim, swapped = _CYaml(), []
    for name in SDK_MODULES:
        module = sys.modules.get(name) or importlib.import_module(name)
        if getattr(module, "yaml", None) is yaml:
            module.yaml = shim
            swapped.append(module)
    try:
        yield
    finally:
        for module in swapped:
            module.yaml = yaml
