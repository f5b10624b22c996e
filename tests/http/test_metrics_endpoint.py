"""GET / POST / HEAD /metrics of a running `serve`, scraped as Prometheus scrapes: vLLM's content
types and names, the http_* series of its instrumentator, the process and python collectors."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

# Prometheus' default scrape Accept header (OpenMetrics first)
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
TEXT_1_0_0 = "text/plain; version=1.0.0; charset=utf-8"


@pytest.fixture(scope="module")
def tools_server(serve_harness, tmp_path_factory):
    sp = serve_harness.start_fast(tmp_path_factory, "metrics", "--mode", "echo", "--enable-auto-tool-choice",
                                  "--tool-call-parser", "hermes")
    yield sp
    sp.stop()


def _model(c: httpx.Client) -> str:
    return c.get("/v1/models").json()["data"][0]["id"]


def _families(text: str) -> dict[str, set[str]]:
    """{family name: its label names}"""
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        labels = out.setdefault(fam.name, set())
        for s in fam.samples:
            labels.update(k for k in s.labels if k not in ("le", "quantile"))
    return out


def test_prometheus_scrape_gets_the_text_format_with_vllm_names(tools_server):
    with httpx.Client(base_url=tools_server.url, timeout=30) as c:
        assert c.post("/v1/completions", json={"model": _model(c), "prompt": "a b c",
                                               "max_tokens": 3}).status_code == 200
        assert c.get("/no/such/route").status_code == 404
        r = c.get("/metrics", headers={"accept": PROMETHEUS_ACCEPT})
    assert r.status_code == 200
    assert r.headers["content-type"] == TEXT_1_0_0
    assert "content-encoding" not in r.headers
    text = r.text
    assert "# TYPE vllm:num_requests_running gauge" in text and "vllm_num_requests" not in text
    fams = _families(text)
    assert fams["http_requests"] == {"handler", "method", "status"}
    assert 'http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 1.0' in text
    assert 'http_requests_total{handler="none",method="GET",status="4xx"} 1.0' in text
    assert 'handler="/metrics"' not in text  # vLLM's instrumentator leaves /metrics, /health, ... out
    assert fams["http_request_size_bytes"] == {"handler"} and fams["http_response_size_bytes"] == {"handler"}
    assert fams["http_request_duration_seconds"] == {"handler", "method"}
    assert fams["http_request_duration_highr_seconds"] == set()
    les = [s.labels["le"] for f in text_string_to_metric_families(text)
           if f.name == "http_request_duration_highr_seconds" for s in f.samples if s.name.endswith("_bucket")]
    assert les[:3] == ["0.01", "0.025", "0.05"] and les[-2:] == ["60.0", "+Inf"] and len(les) == 22
    for name in ("process_cpu_seconds", "process_resident_memory_bytes", "process_open_fds", "python_info",
                 "python_gc_collections"):
        assert name in fams, name
    assert fams["vllm:tool_call_parser_invocations"] == {"model_name", "mode", "outcome", "request_type"}


def test_post_and_head_answer_as_prometheus_clients_asgi_app(tools_server):
    with httpx.Client(base_url=tools_server.url, timeout=30) as c:
        plain = c.post("/metrics", headers={"accept-encoding": "identity"})
        om = c.post("/metrics", headers={"accept": PROMETHEUS_ACCEPT, "accept-encoding": "gzip"})
        head = c.head("/metrics")
        get_head = c.get("/metrics")
    assert plain.status_code == om.status_code == head.status_code == 200
    assert plain.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "# TYPE vllm:num_requests_running gauge" in plain.text
    assert om.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert om.headers["content-encoding"] == "gzip"
    assert om.text.rstrip().endswith("# EOF")
    assert head.content == b"" and head.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert get_head.headers["content-type"] == TEXT_1_0_0


def test_tool_parser_invocations_are_counted(tools_server):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with httpx.Client(base_url=tools_server.url, timeout=30) as c:
        r = c.post("/v1/chat/completions", json={"model": _model(c), "messages": [{"role": "user", "content": "hi"}],
                                                 "tools": tools, "max_tokens": 3})
        assert r.status_code == 200
        text = c.get("/metrics").text
    total = sum(s.value for f in text_string_to_metric_families(text) if f.name == "vllm:tool_call_parser_invocations"
                for s in f.samples if s.name.endswith("_total") and s.labels["mode"] == "non_streaming"
                and s.labels["request_type"] == "chat_completions")
    assert total == 1
