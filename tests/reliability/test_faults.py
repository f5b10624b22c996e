"""Injected faults through the real interfaces: `serve` with the control API, driven with the
openai SDK and httpx: HTTP failures, mid-stream faults, fault scripts, gauges."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from vllm_vcr.faults import FaultController, FaultSpecError, GaugeFunction, RequestInfo
from vllm_vcr.faults.rates import FaultRates

MODEL = "vllm-vcr/sim"
openai = pytest.importorskip("openai", reason="openai, a test dependency: pip install 'vllm-vcr[test]'")


# ---- the faults package on its own (no network) ----------------------------------------------------

class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _info(path="/v1/completions", headers=None, model="m") -> RequestInfo:
    return RequestInfo(path, headers or {}, lambda: model)


def test_script_order_count_expiry_and_match():
    clock = _Clock()
    c = FaultController(clock=clock)
    c.set_script({"rules": [
        {"match": {"header": {"x-test": "a"}}, "action": "http_error", "error": 401, "count": 1},
        {"match": {"model": "other"}, "action": "http_error", "error": "model_not_found"},
        {"match": {"path": "/v1/chat/*", "request_index": [2, 3]}, "action": "stall", "stall_ms": 5},
        {"action": "http_error", "error": "rate_limit", "count": 2, "expires_in": 10},
    ]})
    assert c.decide(_info(headers={b"x-test": b"a"})).failure.status == 401  # index 0
    assert c.decide(_info(headers={b"x-test": b"a"})).failure.status == 429  # rule 1 spent; index 1
    assert c.decide(_info("/v1/chat/completions")).action == "stall"  # index 2
    assert c.decide(_info(model="other")).failure.status == 404  # index 3, rule order wins
    left = c.describe_script()["rules"]
    assert [r["action"] for r in left] == ["http_error", "stall", "http_error"] and left[2]["remaining"] == 1
    clock.t += 11  # the 429 rule expires
    assert c.decide(_info()) is None
    assert c.stats()["faults_injected"] == {"http_error": 3, "stream_error": 0, "stall": 1, "reset": 0}


@pytest.mark.parametrize("rule,message", [
    ({"action": "http_error"}, "needs `error`"),
    ({"action": "http_error", "error": "teapot"}, "unknown error"),
    ({"action": "http_error", "error": 200}, "400-599"),
    ({"action": "stall"}, "stall_ms > 0"),
    ({"action": "reset", "count": 0}, "count must be at least 1"),
    ({"action": "reset", "match": {"request_index": [3, 1]}}, "request_index"),
])
def test_bad_rules_are_refused(rule, message):
    with pytest.raises(FaultSpecError, match=message):
        FaultController().set_script({"rules": [rule]})


def test_rates_are_drawn_reproducibly():
    def run(seed: int) -> list:
        c = FaultController(FaultRates(http_error_rate=0.3, http_error_types=["rate_limit", "unavailable"],
                                       stall_rate=0.2), seed=seed)
        return [None if (a := c.decide(_info())) is None else (a.action, a.failure and a.failure.status)
                for _ in range(200)]

    a = run(1)
    assert a == run(1) and a != run(2)
    http = sum(1 for x in a if x and x[0] == "http_error")
    assert 30 < http < 90 and {x[1] for x in a if x and x[0] == "http_error"} == {429, 503}


@pytest.mark.parametrize("spec,points", [
    ({"function": "constant", "value": 7}, [(0, 7), (100, 7)]),
    ({"function": "ramp", "start": 0, "end": 10, "period_s": 10}, [(0, 0), (5, 5), (10, 10), (30, 10)]),
    ({"function": "ramp", "start": 0, "end": 10, "period_s": 10, "repeat": True}, [(5, 5), (15, 5)]),
    ({"function": "sine", "min": 0, "max": 2, "period_s": 4}, [(0, 1), (1, 2), (3, 0)]),
    ({"function": "square", "min": 1, "max": 3, "period_s": 10, "duty": 0.3}, [(0, 3), (2.9, 3), (3.1, 1)]),
])
def test_gauge_functions(spec, points):
    fn = GaugeFunction(**spec).validate("vllm:num_requests_waiting")
    for t, want in points:
        assert fn.at(t) == pytest.approx(want)


# ---- through serve and the control API --------------------------------------------------------------

@pytest.fixture(scope="module")
def srv(serve_harness, tmp_path_factory):
    port = serve_harness.free_port()
    log = Path(tmp_path_factory.mktemp("faults")) / "serve.log"
    sp = serve_harness.ServeProcess(["--inter-token-latency", "10", "--time-to-first-token", "0",
                                     "--max-model-len", "2048", "--control-address", f"127.0.0.1:{port}"],
                                    log_path=log).wait_ready()
    sp.ctl = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
    yield sp
    sp.ctl.close()
    assert sp.stop() == 0


@pytest.fixture
def ctl(srv):
    c = srv.ctl
    c.delete("/faults")
    c.delete("/gauges")
    c.patch("/config", json={"http_error_rate": 0, "stream_error_rate": 0, "stall_rate": 0, "reset_rate": 0})
    c.post("/stats/reset")
    yield c
    c.delete("/faults")


@pytest.fixture
def client(srv):
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30) as c:
        yield c


def _idle_stats(ctl: httpx.Client) -> dict:
    for _ in range(200):
        s = ctl.get("/stats").json()
        if s["running"] == 0 and s["waiting"] == 0 and \
                s["requests_received"] == s["requests_completed"] + s["requests_failed"] + s["requests_aborted"]:
            return s
        time.sleep(0.02)
    raise AssertionError(s)


def test_fail_the_next_five_with_429_then_recover(srv, ctl, client):
    r = ctl.put("/faults", json={"rules": [{"action": "http_error", "error": "rate_limit", "count": 5,
                                            "retry_after": 3}]})
    assert r.status_code == 200 and r.json()["rules"][0]["remaining"] == 5
    for k in range(5):
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert e.value.response.headers["retry-after"] == "3"
        assert e.value.body["type"] == "RateLimitError"
        if k == 2:
            assert ctl.get("/faults").json()["rules"][0]["remaining"] == 2
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].finish_reason == "length"
    assert ctl.get("/faults").json() == {"rules": [], "requests_seen": 5}
    s = _idle_stats(ctl)
    assert s["faults_injected"]["http_error"] == 5 and s["faults_injected_total"] == 5
    assert s["requests_received"] == 1 == s["requests_completed"]  # the 429s never reached the engine


@pytest.mark.parametrize("kind,status,error_cls,words", [
    ("rate_limit", 429, "RateLimitError", "Rate limit reached"),
    ("unauthorized", 401, "AuthenticationError", None),
    ("context_length", 400, "BadRequestError", "maximum context length is 2048 tokens"),
    ("model_not_found", 404, "NotFoundError", "does not exist"),
    ("server_error", 500, "InternalServerError", "Internal server error"),
    ("unavailable", 503, "InternalServerError", "overloaded"),
])
def test_each_http_failure(srv, ctl, client, kind, status, error_cls, words):
    ctl.put("/faults", json={"rules": [{"action": "http_error", "error": kind, "count": 1}]})
    with pytest.raises(getattr(openai, error_cls)) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.status_code == status
    if words:
        assert words in e.value.message
    if status in (429, 503):
        assert e.value.response.headers["retry-after"] == "1"


def test_x_return_error_header(srv, ctl, client):
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_headers={"X-Return-Error": "502"})
    assert e.value.status_code == 502
    assert e.value.message.endswith("Simulated error triggered by X-Return-Error header (code 502)")
    r = httpx.post(srv.url + "/v1/completions", headers={"x-return-error": "soon"},
                   json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 400 and "X-Return-Error" in r.json()["error"]["message"]
    assert ctl.get("/stats").json()["requests_received"] == 0


def test_rates_from_patch_config(srv, ctl, client):
    cfg = ctl.patch("/config", json={"http_error_rate": 1.0, "http_error_types": ["unavailable"]}).json()
    assert cfg["http_error_rate"] == 1.0 and cfg["max_num_seqs"] > 0
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert ctl.patch("/config", json={"http_error_rate": 2}).status_code == 400
    assert ctl.patch("/config", json={"http_error_types": ["nope"]}).status_code == 400
    assert ctl.patch("/config", json={"http_error_rate": "x"}).status_code == 422
    ctl.patch("/config", json={"http_error_rate": 0})
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


def test_stream_error_after_k_tokens(srv, ctl, client):
    ctl.put("/faults", json={"rules": [{"action": "stream_error", "after_tokens": 3, "count": 1}]})
    texts = []
    with pytest.raises(openai.APIError) as e:
        for chunk in client.completions.create(model=MODEL, prompt="hi", max_tokens=20, stream=True):
            texts.append(chunk.choices[0].text)
    assert len(texts) == 3 and "Internal server error" in str(e.value)
    raw = httpx.post(srv.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True})
    assert raw.text.endswith("data: [DONE]\n\n")  # the rule was used up: a plain stream
    s = _idle_stats(ctl)
    assert s["faults_injected"]["stream_error"] == 1 and s["requests_aborted"] == 1


def test_reset_after_k_tokens(srv, ctl):
    ctl.put("/faults", json={"rules": [{"action": "reset", "after_tokens": 2, "match": {"path": "/v1/completions"}}]})
    chunks = []
    with pytest.raises(httpx.HTTPError):
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=10, json={
                "model": MODEL, "prompt": "hi", "max_tokens": 20, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line)
    assert len(chunks) == 2
    s = _idle_stats(ctl)
    assert s["faults_injected"]["reset"] == 1 and s["requests_aborted"] == 1


def test_stall_after_k_tokens(srv, ctl):
    ctl.put("/faults", json={"rules": [{"action": "stall", "stall_ms": 600, "after_tokens": 2, "count": 1}]})
    stamps = []
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=10, json={
            "model": MODEL, "prompt": "hi", "max_tokens": 5, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                stamps.append((time.monotonic(), line))
    assert stamps[-1][1] == "data: [DONE]"
    gaps = [b[0] - a[0] for a, b in zip(stamps, stamps[1:])]
    assert gaps[1] >= 0.55 and max(gaps[:1] + gaps[2:]) < 0.5, gaps
    assert _idle_stats(ctl)["requests_completed"] == 1


def test_match_on_model_header_and_index(srv, ctl, client):
    ctl.put("/faults", json={"rules": [
        {"match": {"header": {"x-tenant": "blue"}}, "action": "http_error", "error": 403},
        {"match": {"request_index": [1, 1]}, "action": "http_error", "error": "server_error"},
    ]})
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=1)  # index 0
    assert ok.choices
    with pytest.raises(openai.InternalServerError):  # index 1
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    with pytest.raises(openai.PermissionDeniedError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_headers={"x-tenant": "blue"})
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_headers={"x-tenant": "red"})


def test_fault_script_schema_errors(srv, ctl):
    assert ctl.put("/faults", json={"rules": [{"action": "explode"}]}).status_code == 422
    assert ctl.put("/faults", json={"rules": [{"action": "stall"}]}).status_code == 400
    assert ctl.put("/faults", content=b"[").status_code == 422
    assert ctl.get("/faults").json()["rules"] == []


def _gauge(metrics: str, name: str) -> list[float]:
    return [float(v) for v in re.findall(rf'^{re.escape(name)}\{{[^}}]*\}} (\S+)$', metrics, re.M)]


def test_scripted_gauges(srv, ctl):
    r = ctl.put("/gauges", json={"vllm:num_requests_waiting": {"function": "constant", "value": 42},
                                 "vllm:kv_cache_usage_perc": {"function": "square", "min": 0.1, "max": 0.9,
                                                              "period_s": 3600}})
    assert r.status_code == 200 and r.json()["vllm:num_requests_waiting"]["current"] == 42
    m = httpx.get(srv.url + "/metrics").text
    assert _gauge(m, "vllm:num_requests_waiting") == [42.0]
    assert _gauge(m, "vllm:kv_cache_usage_perc") == [0.9]
    assert ctl.get("/stats").json()["waiting"] == 0  # the engines are untouched
    assert ctl.put("/gauges", json={"vllm:kv_cache_usage_perc": {"function": "constant", "value": 3}}).status_code == 400
    assert ctl.put("/gauges", json={"vllm:made_up": {"function": "constant", "value": 1}}).status_code == 400
    assert ctl.put("/gauges", json={"vllm:num_requests_waiting": {"function": "spiral"}}).status_code == 422
    ctl.delete("/gauges")
    assert _gauge(httpx.get(srv.url + "/metrics").text, "vllm:num_requests_waiting") == [0.0]


def test_serve_flags_inject_by_rate(serve_process):
    sp = serve_process("--inter-token-latency", "0", "--http-error-rate", "1", "--http-error-types", "rate_limit")
    r = httpx.post(sp.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"


def test_bad_fault_flag_names_the_flag(serve_harness, tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "vllm_vcr", "serve", "--http-error-rate", "1.5"],
                         capture_output=True, text=True, env=serve_harness.subprocess_env(), timeout=60)
    assert out.returncode == 2 and "--http-error-rate" in out.stderr


@pytest.mark.parametrize("header", [{"x-€": "a"}, {"x tenant": "a"}, {"": "a"}, {"x-tenant": "bl\nue"},
                                    {"x-tenant": "€"}])
def test_a_header_http_cannot_carry_is_refused_and_requests_still_answer(srv, ctl, client, header):
    r = ctl.put("/faults", json={"rules": [{"match": {"header": header}, "action": "http_error",
                                            "error": "server_error"}]})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert "header" in r.json()["error"]
    assert ctl.get("/faults").json()["rules"] == []  # nothing installed
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).choices


def test_a_rule_that_fails_to_match_serves_the_request_unfaulted():
    import asyncio

    from vllm_vcr.http.faults_adapter import FaultGate

    c = FaultController()
    c.set_script({"rules": [{"match": {"header": {"x-tenant": "a"}}, "action": "http_error", "error": 500}]})
    c.script._live[0].rule.match.header = {"x-€": "a"}  # past validation: matching it raises
    sent = []

    async def send(message):
        sent.append(message)

    scope = {"path": "/v1/completions", "headers": [(b"x-tenant", b"a")]}
    assert asyncio.run(FaultGate(c).admit(scope, b"{}", send)) is send and sent == []


@pytest.mark.parametrize("retry_after,header", [(0.5, "1"), (0.01, "1"), (2.5, "3"), (3, "3"), (0, "0")])
def test_retry_after_is_the_delay_rounded_up_to_whole_seconds(srv, ctl, retry_after, header):
    ctl.put("/faults", json={"rules": [{"action": "http_error", "error": "rate_limit", "count": 1,
                                        "retry_after": retry_after}]})
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 429 and r.headers["retry-after"] == header

