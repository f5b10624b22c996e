"""The start-up warm-up runs before `serve` listens and says ready, and leaves no trace: no
request counted in /metrics or the engines' stats."""

from __future__ import annotations

import logging

import httpx

from tests.conftest import scaled
from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.frontend.tokenizer import load_tokenizer
from vllm_vcr.http.serving_base import ServeSettings
from vllm_vcr.serve import warmup

MODEL = "vllm-vcr/sim"


def _counted(metrics: str) -> float:
    """Requests and tokens /metrics has counted (every series of the counting families)."""
    families = ("vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                "vllm:e2e_request_latency_seconds_count")
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.split("{", 1)[0] in families)


def test_the_warm_up_runs_before_ready_and_is_counted_nowhere(serve_process, serve_harness):
    control = serve_harness.free_port()
    sp = serve_process("--startup-time", "0.3", "--control-address", f"127.0.0.1:{control}")
    log = sp.log()
    assert log.index("simulating model loading") < log.index("warmed up in") < log.index("ready in")
    stats = f"http://127.0.0.1:{control}/stats"
    assert httpx.get(stats, timeout=5).json()["requests_received"] == 0
    assert _counted(httpx.get(sp.url + "/metrics").text) == 0
    # ... while a real request is counted by both (the checks above can fail)
    r = httpx.post(sp.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=15)
    assert r.status_code == 200
    assert _counted(httpx.get(sp.url + "/metrics").text) > 0
    assert httpx.get(stats, timeout=5).json()["requests_received"] == 1


async def test_the_warm_up_requests_succeed(caplog):
    tok = load_tokenizer()
    args = EngineArgs(config=EngineConfig(failure_injection_rate=1.0), vocab_size=tok.vocab_size,
                      eos_token_id=tok.eos_token_id, startup_time=30.0,
                      latency_trace="recorded.jsonl").validate()  # none of which the throwaway engine takes
    with caplog.at_level(logging.DEBUG, logger="vllm_vcr.serve"):
        took = await warmup.warm_up(args, tok, ServeSettings(api_keys=["sk-1"]))
    said = [r.getMessage() for r in caplog.records if r.name == "vllm_vcr.serve"]
    assert not [m for m in said if "answered" in m or "failed" in m], said
    assert took < scaled(5.0)  # no loading time, no latency


FIRST_REQUESTS = {  # (a JSON schema first: a tool call's arguments, made off the loop, would import for it)
    "json schema": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
    "completion": ("/v1/completions", {"prompt": "hi", "stream": True, "logprobs": 2}),
    "tools": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
                                       "tools": [{"type": "function", "function": {
                                           "name": "f", "parameters": {"type": "object", "properties": {
                                               "a": {"type": "string"}}}}}]}),
    "choice": ("/v1/completions", {"prompt": "hi", "structured_outputs": {"choice": ["yes", "no"]}}),
    "responses": ("/v1/responses", {"input": "hi", "stream": True}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
}


def test_the_first_request_of_each_kind_does_not_stall_the_loop(serve_process, serve_harness):
    """First-use work (lazy imports, tables built on first use) done on the event loop holds every
    other client: the warm-up does it before the port listens. Read in CPU time of the loop's
    thread (GET /stats/loop), which a loaded machine does not inflate; an idle loop's longest
    wait is well under a millisecond, importing jsonschema there took ~37 ms."""
    control = f"http://127.0.0.1:{serve_harness.free_port()}"
    sp = serve_process("--inter-token-latency", "0", "--time-to-first-token", "0", "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes", "--control-address", control[len("http://"):])
    assert httpx.get(control + "/stats/loop").json()["watching"]
    stalls = {}
    for kind, (path, body) in FIRST_REQUESTS.items():
        httpx.post(control + "/stats/reset").raise_for_status()
        r = httpx.post(sp.url + path, json={"model": MODEL, "max_tokens": 4, **body}, timeout=scaled(30))
        assert r.status_code == 200, (kind, r.text)
        stalls[kind] = httpx.get(control + "/stats/loop").json()["longest_stall_ms"]
    assert max(stalls.values()) < 15, stalls
