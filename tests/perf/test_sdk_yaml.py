"""The estimator's YAML parsed by libyaml while it compiles (perf/sdk_yaml.py): every YAML file
the package ships loads to equal objects, and a compile gives the same spec bytes, as with
PyYAML's pure-Python parser."""

from __future__ import annotations

import importlib

import pytest
import yaml

from vllm_vcr.perf.catalog import package_root
from vllm_vcr.perf.sdk_yaml import SDK_MODULES, c_yaml

from .conftest import needs_aic
from .test_compact_tables import TARGETS, target_spec

pytestmark = [needs_aic, pytest.mark.skipif(not getattr(yaml, "__with_libyaml__", False), reason="no libyaml")]


def test_every_yaml_file_the_package_ships_loads_alike_both_ways():
    files = sorted(package_root().rglob("*.yaml")) + sorted(package_root().rglob("*.yml"))
    assert len(files) > 100
    for path in files:
        text = path.read_text(encoding="utf-8")
        assert yaml.load(text, Loader=yaml.CSafeLoader) == yaml.safe_load(text), path


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_a_compile_gives_the_same_spec_bytes(name, tmp_path, monkeypatch):
    spec = target_spec(name, tmp_path, monkeypatch)
    plain = spec()
    with c_yaml():
        fast = spec()
    assert fast == plain


def test_the_sdk_modules_get_pyyaml_back_and_read_through_libyaml_inside():
    modules = [importlib.import_module(m) for m in SDK_MODULES]
    assert all(m.yaml is yaml for m in modules)  # the names the shim relies on
    with c_yaml():
        assert all(m.yaml is not yaml for m in modules)
        assert modules[0].yaml.safe_load("a: [1, 2]") == {"a": [1, 2]}
        assert modules[0].yaml.load("a: 1", Loader=yaml.SafeLoader) == {"a": 1}
        assert modules[0].yaml.YAMLError is yaml.YAMLError
    assert all(m.yaml is yaml for m in modules)
