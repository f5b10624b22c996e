"""Conformance tests: `vllm-vcr play` behind real vLLM frontends (0.32 CPU build, 0.33).

They run whenever scripts/install-peers.sh has installed the peers (cached under
$VLLM_VCR_PEERS, default ~/.cache/vllm-vcr/peers) and are skipped with the reason otherwise.
VLLM_VCR_CONFORMANCE=0 skips them even when installed; VLLM_VCR_CONFORMANCE_VERSIONS=0.32 (comma
list) limits the versions.
"""

from __future__ import annotations

import os

import pytest

from . import peers


def _versions() -> list[str]:
    want = os.environ.get("VLLM_VCR_CONFORMANCE_VERSIONS")
    if not want:
        return list(peers.VERSIONS)
    return [v.strip() for v in want.split(",") if v.strip()]


def pytest_generate_tests(metafunc):
    if "vllm_version" in metafunc.fixturenames:
        metafunc.parametrize("vllm_version", _versions(), scope="module")


_WIDE_SCOPES = ("module", "package", "session")


def module_params(item) -> tuple:
    """The item's parameters of module scope or wider (the version, a fixture's parser, ...), by
    name and value: the items that share them share their stacks."""
    spec = getattr(item, "callspec", None)
    scopes = getattr(spec, "_arg2scope", None) or {}  # (pytest's record of each parameter's scope)
    wide = sorted((name != "vllm_version", name, repr(spec.params[name])) for name, scope in scopes.items()
                  if getattr(scope, "value", scope) in _WIDE_SCOPES and name in spec.params)
    return tuple(wide)  # the version first: most of a module's stacks are per version


def group_by_module_params(items: list) -> None:
    """Within each conformance module, the items that share their module-scoped parameters run together, so
    each real stack starts once. pytest's own ordering mixes a version parametrized from here
    with a fixture's own parameters and a test's, and started some stacks three times (a real
    vLLM frontend is ~12 s to start). Stable: the order within a group is kept; other modules'
    items keep their places."""
    slots: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        if item.get_closest_marker("conformance") is not None:
            slots.setdefault(item.nodeid.split("::", 1)[0], []).append(i)
    for positions in slots.values():
        mine = sorted((items[i] for i in positions), key=module_params)
        for i, item in zip(positions, mine):
            items[i] = item


@pytest.hookimpl(trylast=True)  # after pytest's own reordering
def pytest_collection_modifyitems(config, items):
    group_by_module_params(items)
    disabled = os.environ.get("VLLM_VCR_CONFORMANCE", "").strip() == "0"
    for item in items:
        if item.get_closest_marker("conformance") is None:
            continue
        if disabled:
            item.add_marker(pytest.mark.skip(reason="VLLM_VCR_CONFORMANCE=0"))
            continue
        params = getattr(item, "callspec", None)
        version = params.params.get("vllm_version") if params else None
        versions = [version] if version else list(peers.VERSIONS)
        reasons = [r for v in versions if (r := peers.missing_reason(v))]
        if reasons:
            item.add_marker(pytest.mark.skip(reason=reasons[0]))


def pytest_report_header(config):
    have = [v for v in peers.VERSIONS if peers.installed(v)]
    if have:
        return f"conformance peers: vLLM {', '.join(have)} in {peers.CACHE}"
    return (f"conformance peers: none in {peers.CACHE} (conformance tests will be skipped; "
            f"scripts/install-peers.sh installs them)")
