"""vLLM's validation and small surfaces on `serve`: the values were read off the real
0.32 frontend (tests/conformance/test_differential.py diffs them against it when installed)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.conftest import wait_until

MODEL = "vllm-vcr/sim"
FAST = ["--inter-token-latency", "1", "--time-to-first-token", "2"]

MEDIA = "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
CHAT = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def flagged(serve_harness, tmp_path_factory):
    """vLLM's frontend flags on: request-id headers, one allowed origin, load tracking."""
    log = tmp_path_factory.mktemp("flagged") / "serve.log"
    sp = serve_harness.ServeProcess(["--inter-token-latency", "20", "--enable-request-id-headers",
                                     "--allowed-origins", '["http://ok.example"]', "--enable-server-load-tracking"],
                                    log_path=log).wait_ready()
    yield sp
    sp.stop()


def err(r: httpx.Response) -> dict:
    return r.json()["error"]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
    ("/tokenize", {"prompt": "x"}),
    ("/detokenize", {"tokens": [1]}),
])
@pytest.mark.parametrize("content_type", ["text/plain", "", "application/x-www-form-urlencoded"])
def test_body_that_is_not_json_is_unsupported_media_type(http, path, body, content_type):
    r = http.post(path, content=json.dumps({"model": MODEL, **body}), headers={"content-type": content_type})
    assert r.status_code == 400
    assert err(r) == {"message": MEDIA, "type": "Bad Request", "param": None, "code": 400}


def test_json_with_charset_is_json(http):
    r = http.post("/tokenize", content=b'{"prompt": "x"}', headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_vllm_request_checks(http):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [], "max_tokens": 3})
    assert r.status_code == 400 and err(r) == {
        "message": "Cannot apply chat template to an empty conversation. Provide at least one message.",
        "type": "BadRequestError", "param": None, "code": 400}
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        r = http.post(path, json={"model": MODEL, **body, "max_tokens": 3, "n": 2, "temperature": 0})
        assert r.status_code == 400 and err(r)["message"] == "n must be 1 when using greedy sampling, got 2."
        r = http.post(path, json={"model": MODEL, **body, "max_tokens": 3, "stream": True, "prompt_logprobs": 1})
        assert r.status_code == 400 and err(r) == {
            "message": "`prompt_logprobs` are not available when `stream=True`. (parameter=prompt_logprobs)",
            "type": "BadRequestError", "param": "prompt_logprobs", "code": 400}
        r = http.post(path, json={"model": MODEL, **body, "max_tokens": 3, "prompt_logprobs": 21})
        assert r.status_code == 400 and err(r)["message"].startswith("Requested prompt logprobs of 21")
        r = http.post(path, json={"model": MODEL, **body, "max_tokens": 3, "stream": True, "stream_interval": 0})
        assert r.status_code == 400 and err(r)["param"] == "body.stream_interval"


def test_trailing_slash_redirects_like_starlette(http):
    r = http.post("/v1/completions/?x=1", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 307 and r.content == b""
    assert r.headers["location"] == str(http.base_url).rstrip("/") + "/v1/completions?x=1"
    assert "content-type" not in r.headers
    assert http.get("/health/").status_code == 307
    assert http.get("/nope/").status_code == 404


def test_load_is_zero_without_tracking_and_reset_prefix_cache_is_a_dev_route(http):
    assert http.get("/load").json() == {"server_load": 0}
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "cache me " * 20, "max_tokens": 2}
                     ).status_code == 200
    # vLLM registers /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1 (test_sleep_and_management.py)
    assert http.post("/reset_prefix_cache").status_code == 404


def test_x_request_id_on_every_response(flagged):
    with httpx.Client(base_url=flagged.url, timeout=30) as c:
        assert c.get("/health", headers={"x-request-id": "mine"}).headers["x-request-id"] == "mine"
        generated = c.get("/v1/models").headers["x-request-id"]
        assert len(generated) == 32 and int(generated, 16) >= 0  # uuid4 hex
        assert "x-request-id" in c.get("/nope").headers  # errors too
        assert "x-request-id" in c.post("/v1/completions", json={"model": "other", "prompt": "x"}).headers
        with c.stream("POST", "/v1/completions", headers={"x-request-id": "s1"},
                      json={"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}) as r:
            assert r.headers["x-request-id"] == "s1"
            body = r.read()
        assert body.endswith(b"data: [DONE]\n\n")


def test_cors_from_allowed_origins(flagged):
    with httpx.Client(base_url=flagged.url, timeout=30) as c:
        pre = c.options("/v1/chat/completions", headers={
            "Origin": "http://ok.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,authorization"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "http://ok.example"
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        ok = c.get("/v1/models", headers={"Origin": "http://ok.example"})
        assert ok.headers["access-control-allow-origin"] == "http://ok.example"
        other = c.get("/v1/models", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        refused = c.options("/v1/models", headers={"Origin": "http://evil.example",
                                                     "Access-Control-Request-Method": "GET"})
        assert refused.status_code == 400


def test_load_counts_generation_requests_in_flight(flagged):
    with httpx.Client(base_url=flagged.url, timeout=30) as c:
        assert c.get("/load").json() == {"server_load": 0}
        started = threading.Event()

        def slow() -> None:
            with c.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": "x", "max_tokens": 60, "ignore_eos": True, "stream": True}) as r:
                started.set()
                r.read()

        t = threading.Thread(target=slow)
        t.start()
        started.wait(10)
        during = c.get("/load").json()["server_load"]
        t.join(30)
        assert during == 1
        assert c.get("/load").json() == {"server_load": 0}


def test_logprobs_as_vllm_shapes_them(http):
    # completions: logprobs=0 still lists the sampled token; k gives up to k+1 entries (the sampled
    # token and the top k), and the sampled token's entry is its own logprob
    c = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 6, "logprobs": 0}).json()
    lp = c["choices"][0]["logprobs"]
    assert [len(t) for t in lp["top_logprobs"]] == [1] * 6
    c = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 40, "logprobs": 2,
                                           "ignore_eos": True}).json()
    lp = c["choices"][0]["logprobs"]
    sizes = {len(t) for t in lp["top_logprobs"]}
    assert sizes <= {2, 3} and 3 in sizes  # over 40 tokens some sampled token ranks below the top 2
    for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[tok] == val
    greedy = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 10, "logprobs": 2,
                                                "temperature": 0}).json()
    assert {len(t) for t in greedy["choices"][0]["logprobs"]["top_logprobs"]} <= {2}


def test_prompt_logprobs_in_completions_and_chat(http):
    tok = http.post("/tokenize", json={"model": MODEL, "prompt": "hello world"}).json()["tokens"]
    c = http.post("/v1/completions", json={"model": MODEL, "prompt": "hello world", "max_tokens": 2,
                                           "prompt_logprobs": 1}).json()
    plp = c["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(tok) and plp[0] is None
    for pos, entry in zip(tok[1:], plp[1:]):
        assert str(pos) in entry and 1 <= len(entry) <= 2
        assert set(entry[str(pos)]) == {"logprob", "rank", "decoded_token"}
    ch = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                 "prompt_logprobs": 0}).json()
    assert ch["prompt_logprobs"][0] is None and all(len(e) == 1 for e in ch["prompt_logprobs"][1:])
    # chat echo asks the engine for prompt logprobs (top_logprobs of them, 0 by default)
    echo = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [*CHAT, {"role": "assistant", "content": "hi"}], "max_tokens": 2, "echo": True,
        "add_generation_prompt": False}).json()
    assert echo["prompt_logprobs"] and echo["prompt_logprobs"][0] is None
    plain = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2}).json()
    assert plain["prompt_logprobs"] is None


def _success(metrics_text: str, reason: str) -> float:
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("vllm:request_success_total{") and f'finished_reason="{reason}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_stop_string_finish_counts_as_stop_and_vllm_families(echo_server):
    with httpx.Client(base_url=echo_server.url, timeout=30) as c:
        before = c.get("/metrics").text
        for stream in (False, True):
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "one two three four five six",
                                                "max_tokens": 30, "stop": ["four"], "stream": stream})
            assert r.status_code == 200
        # (a stream's request is counted as it ends, which may come just after its last byte)
        def counted() -> str | None:
            text = c.get("/metrics").text
            return text if _success(text, "stop") - _success(before, "stop") >= 2 else None

        after = wait_until(counted, 10, "both requests counted")
    assert _success(after, "stop") - _success(before, "stop") == 2
    assert _success(after, "length") == _success(before, "length")
    assert 'vllm:admission_rejections_total{model_name="vllm-vcr/sim",reason="max_num_queued_reqs"} 0.0' in after
    for fam in ("flops", "read_bytes", "write_bytes"):
        assert f"vllm:estimated_{fam}_per_gpu_total{{" in after


def test_stream_interval_batches_tokens_per_event(serve_process):
    sp = serve_process(*FAST, "--mode", "echo", "--stream-interval", "4")
    words = " ".join(f"w{i}" for i in range(40))
    r = httpx.post(sp.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": words, "max_tokens": 14, "ignore_eos": True, "stream": True,
        "return_token_ids": True})
    events = [json.loads(b[6:]) for b in r.text.split("\n\n") if b.startswith("data: {")]
    sizes = [len(e["choices"][0]["token_ids"]) for e in events if e["choices"] and e["choices"][0]["token_ids"]]
    assert sum(sizes) == 14
    # the first output goes at once, later ones wait for 4 tokens (more when outputs merged), the last at once
    assert all(s >= 4 for s in sizes[1:-1]) and len(sizes) <= 5
    # a request may raise it, never lower it
    r = httpx.post(sp.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": words, "max_tokens": 14, "ignore_eos": True, "stream": True,
        "return_token_ids": True, "stream_interval": 6})
    events = [json.loads(b[6:]) for b in r.text.split("\n\n") if b.startswith("data: {")]
    sizes = [len(e["choices"][0]["token_ids"]) for e in events if e["choices"] and e["choices"][0]["token_ids"]]
    assert sum(sizes) == 14 and all(s >= 6 for s in sizes[1:-1]) and len(sizes) <= 4


def _token_events(text: str) -> list[int]:
    events = [json.loads(b[6:]) for b in text.split("\n\n") if b.startswith("data: {")]
    return [len(e["choices"][0]["token_ids"]) for e in events if e["choices"] and e["choices"][0].get("token_ids")]


def test_one_sse_event_per_token_at_the_defaults(serve_process):
    """Latency 0, --stream-interval 1: every token its own event, as a real engine's steps give."""
    echo_server = serve_process("--mode", "echo")
    words = " ".join(f"w{i}" for i in range(40))
    for path, body in (("/v1/completions", {"prompt": words}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": words}]})):
        r = httpx.post(echo_server.url + path, timeout=30, json={
            "model": MODEL, **body, "max_tokens": 12, "ignore_eos": True, "stream": True, "return_token_ids": True})
        assert _token_events(r.text) == [1] * 12
