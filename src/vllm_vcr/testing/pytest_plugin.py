"""The pytest plugin (entry point `pytest11`, loaded wherever vllm-vcr is installed).

    @pytest.mark.vllm_vcr(inter_token_latency=5, max_num_seqs=4)
    def test_gateway(vllm_vcr_server):
        client = vllm_vcr_server.openai_client()

    @pytest.mark.parametrize("vllm_vcr_server", [{"failure_injection_rate": 1.0}], indirect=True)
    def test_retries(vllm_vcr_server): ...

The marker and an indirect parameter (a dict or a MockServerConfig) take MockServerConfig's
fields plus MockServer's `run_in` ("thread" or "subprocess"), `faults` (fault-script rules) and
`gauges` (scripted gauges); the parameter wins where both set a field. The
server is started for the test and stopped after it. Importing this module is cheap: pytest
imports it for every run in an environment where vllm-vcr is installed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import pytest

MARKER = "vllm_vcr"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}(**fields): configure the vllm_vcr_server fixture (MockServerConfig fields, run_in=, faults=, gauges=)")


def _options(request: pytest.FixtureRequest) -> dict[str, Any]:
    options: dict[str, Any] = {}
    marker = request.node.get_closest_marker(MARKER)
    if marker is not None:
        if marker.args:
            raise pytest.UsageError(f"@pytest.mark.{MARKER} takes keyword arguments only, got {marker.args!r}")
        options.update(marker.kwargs)
    param = getattr(request, "param", None)
    if param is not None:
        if dataclasses.is_dataclass(param):
            param = {f.name: getattr(param, f.name) for f in dataclasses.fields(param)
                     if getattr(param, f.name) != f.default}
        if not isinstance(param, dict):
            raise pytest.UsageError(f"vllm_vcr_server parameters must be dicts or MockServerConfig, got {param!r}")
        options.update(param)
    return options


@pytest.fixture
def vllm_vcr_server(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A running MockServer (vllm_vcr.MockServer), configured by @pytest.mark.vllm_vcr(...) or
    an indirect parameter; stopped after the test."""
    from .config import MockServerConfig
    from .server import MockServer

    options = _options(request)
    server_options = {k: options.pop(k) for k in _SERVER_OPTIONS if k in options}
    known = {f.name for f in dataclasses.fields(MockServerConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise pytest.UsageError(f"vllm_vcr_server: unknown option(s) {', '.join(unknown)}; "
                                f"use MockServerConfig fields, {', '.join(_SERVER_OPTIONS)}, or extra_args=[...]")
    try:
        server = MockServer(MockServerConfig(**options), **server_options)
    except ValueError as e:
        raise pytest.UsageError(f"vllm_vcr_server: {e}") from None
    with server:
        yield server


_SERVER_OPTIONS = ("run_in", "faults", "gauges")  # MockServer's own keywords, beside the config's fields
