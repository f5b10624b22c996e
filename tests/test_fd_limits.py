"""serve's start-up for many connections: the open-file limit raised as vLLM raises it, and the
descriptor table sized up front (each growth of it stalls a threaded process for an RCU grace
period, inside the accept() of a burst of new connections)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from vllm_vcr.fd_limits import FD_TABLE_SIZE, TARGET_SOFT_LIMIT

_CHILD = """
import json, resource
from vllm_vcr.fd_limits import prepare_for_many_connections
def fd_size():
    return int(next(l for l in open("/proc/self/status") if l.startswith("FDSize:")).split()[1])
before = fd_size()
prepare_for_many_connections()
print(json.dumps({"before": before, "after": fd_size(), "limit": resource.getrlimit(resource.RLIMIT_NOFILE)}))
"""


def _run_with_limit(soft: int, hard: int | None = None) -> dict:
    """prepare_for_many_connections() in a child whose open-file limit starts at (soft, hard)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1] if hard is None else hard

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    out = subprocess.run([sys.executable, "-c", _CHILD], preexec_fn=lower, capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status is Linux's")
def test_the_soft_limit_is_raised_and_the_table_sized_once():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = TARGET_SOFT_LIMIT if hard == resource.RLIM_INFINITY else min(hard, TARGET_SOFT_LIMIT)
    r = _run_with_limit(256)
    assert r["limit"][0] == want
    assert r["after"] >= min(want, FD_TABLE_SIZE) > r["before"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status is Linux's")
def test_the_table_is_sized_to_the_limit_when_the_limit_is_lower():
    """A hard limit below the table size: the table reaches the limit, no further (nothing fails)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip("hard open-file limit below 1024")
    r = _run_with_limit(512, 1024)
    assert r["limit"] == [1024, 1024]
    assert r["after"] >= 1024 > r["before"]
