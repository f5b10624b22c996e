"""`serve` publishes /openapi.json for its routes, and schemathesis, generating requests from it
with hostile header values beside them, finds no server error (5xx) on any route and no streamed
event that is not strict JSON (the short run here; the long one behind `-m long`)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st

from tests.reliability.hostile import FIGURES, hostile_header, parse_sse

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
    assert [m["id"] for m in httpx.get(fuzz_server.url + "/v1/models").json()["data"]] == [MODEL]
    doc = httpx.get(fuzz_server.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
                 "/metrics", "/version"):
        assert path in doc["paths"], path
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    assert "max_tokens" in doc["components"]["schemas"]["CompletionRequest"]["properties"]


schema = schemathesis.pytest.from_fixture("api_schema")

# Header values as `requests` sends them (text, latin-1, no CR/LF, no leading blank): hostile text,
# and control characters. X-Return-Error is left out: it asks for an error on purpose (docs/faults.md).
_ctl = st.lists(st.sampled_from([chr(c) for c in range(1, 0x20) if c not in (10, 13)] + ["\x7f", "a", '"', "\\"]),
                min_size=1, max_size=8).map(lambda cs: "a" + "".join(cs))
# (control characters, which the HTTP parser refuses with its plain-text 400, in one value of eight)
_value = st.sampled_from(range(8)).flatmap(
    lambda i: _ctl if i == 4 else st.integers(1000, 20000).map(lambda n: '\\"' * n) if i == 5 else hostile_header
).filter(lambda v: not v[0].isspace())  # (requests' own rule, which counts \xa0 and \x1c as blanks)
hostile_headers = st.dictionaries(
    st.sampled_from(["X-Request-Id", "Authorization", "X-Data-Parallel-Rank", "X-Output-Replay-Id", "Accept",
                     "Accept-Encoding", "User-Agent", "traceparent", "X-Custom"]), _value, max_size=3)


def every_event_is_json(ctx, response, case) -> None:
    """A schemathesis check: a streamed answer's every event is strict JSON (hostile.parse_sse)."""
    for name in ("schemathesis 5xx", "schemathesis events parsed"):
        FIGURES.setdefault(name, 0)
    FIGURES["schemathesis requests"] += 1
    ctype = (response.headers.get("content-type") or [""])[0]
    if response.status_code >= 500:
        FIGURES["schemathesis 5xx"] += 1
    if ctype.startswith("text/event-stream"):
        events = parse_sse(response.content)  # a stream cut short keeps its complete events only
        FIGURES["schemathesis events parsed"] += len(events)


MODEL = "vllm-vcr/sim"  # the name fuzz_server answers to


# What becomes of a generated body: kept; or cut down to its string values (in the request's own
# fields), with the served model, a prompt or message when it has none, streamed. Nearly every body
# as generated is refused before a stream starts (a generated model name alone is a 404).
VARIANTS = st.sampled_from(["generated", "streamed"])
_STREAMED = {"/v1/completions": ("prompt", "hi"), "/v1/chat/completions": ("messages", None),
             "/v1/responses": ("input", "hi"), "/v1/messages": ("messages", None)}


def _bounded(case, variant: str) -> None:
    # thousands of choices per request are valid but only cost time; they are not what this looks for
    body = case.body if isinstance(case.body, dict) else {}
    n = body.get("n", 1)
    assume(not isinstance(n, int) or n <= 8)
    if variant == "generated" or case.operation.path not in _STREAMED or not isinstance(case.body, dict):
        return
    doc = case.operation.schema.raw_schema
    ref = doc["paths"][case.operation.path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    fields = doc["components"]["schemas"].get(ref.get("$ref", "").rsplit("/", 1)[-1], {}).get("properties", {})
    kept = {k: v for k, v in body.items() if k in fields and isinstance(v, str)}
    texts = list(kept.values()) or ["hi"]
    field, default = _STREAMED[case.operation.path]
    kept.setdefault(field, default if default is not None else [{"role": "user", "content": texts[0]}])
    kept.update(model=MODEL, stream=True)
    kept["max_output_tokens" if case.operation.path == "/v1/responses" else "max_tokens"] = 4
    case.body = kept


@schema.parametrize()
@schema.given(headers=hostile_headers, variant=VARIANTS)
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_error(case, headers, variant):
    _bounded(case, variant)
    case.call_and_validate(headers=headers, checks=[not_a_server_error, every_event_is_json], timeout=30)


@pytest.mark.long
@schema.parametrize()
@schema.given(headers=hostile_headers, variant=VARIANTS)
@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_error_long(case, headers, variant):
    _bounded(case, variant)
    case.call_and_validate(headers=headers, checks=[not_a_server_error, every_event_is_json], timeout=60)
