"""Router suite: the real `vllm-router` and `smg` binaries in front of `vllm-vcr serve` workers.

It runs whenever scripts/install-routers.sh has installed the routers (a cached venv under
$VLLM_VCR_PEERS/routers, default ~/.cache/vllm-vcr/peers/routers) and is skipped with the reason
otherwise. VLLM_VCR_ROUTERS=0 skips it even when installed.
"""

from __future__ import annotations

import pytest

from . import harness


def pytest_collection_modifyitems(config, items):
    reason = harness.missing_reason()
    for item in items:
        if item.get_closest_marker("routers") is not None and reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_report_header(config):
    reason = harness.missing_reason()
    if reason is None:
        return f"routers: {(harness.VENV / '.vllm-vcr-ready').read_text().strip()} in {harness.VENV}"
    return f"routers: {reason} (the router suite will be skipped)"


@pytest.fixture
def fleet(tmp_path):
    f = harness.Fleet(tmp_path)
    yield f
    f.close()
