"""`serve` publishes /openapi.json for its routes, and schemathesis, generating requests from it,
finds no server error (5xx) on any route (the short run here; the long one behind `-m long`)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, assume, settings

schemathesis = pytest.importorskip("schemathesis",
                                   reason="schemathesis, a test dependency: pip install 'vllm-vcr[test]'")
from schemathesis.checks import not_a_server_error  # noqa: E402


@pytest.fixture(scope="module")
def fuzz_server(serve_harness, tmp_path_factory):
    # a small context and no latency: generated requests finish fast whatever they ask for
    log = Path(tmp_path_factory.mktemp("openapi")) / "serve.log"
    sp = serve_harness.ServeProcess(["--inter-token-latency", "0", "--time-to-first-token", "0",
                                     "--max-model-len", "64", "--engine-count", "2"], log_path=log).wait_ready()
    yield sp
    log_text = sp.log()
    assert sp.stop() == 0
    assert "Traceback" not in log_text, log_text[-3000:]


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


def test_openapi_lists_every_route(fuzz_server):
    doc = httpx.get(fuzz_server.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
                 "/metrics", "/version"):
        assert path in doc["paths"], path
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    assert "max_tokens" in doc["components"]["schemas"]["CompletionRequest"]["properties"]


schema = schemathesis.pytest.from_fixture("api_schema")


def _bounded(case) -> None:
    # thousands of choices per request are valid but only cost time; they are not what this looks for
    body = case.body if isinstance(case.body, dict) else {}
    n = body.get("n", 1)
    assume(not isinstance(n, int) or n <= 8)


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_error(case):
    _bounded(case)
    case.call_and_validate(checks=[not_a_server_error], timeout=30)


@pytest.mark.long
@schema.parametrize()
@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_error_long(case):
    _bounded(case)
    case.call_and_validate(checks=[not_a_server_error], timeout=60)
