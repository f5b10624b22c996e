"""`vllm-vcr serve` on the wire: raw SSE bytes, error bodies, headers, small endpoints."""

from __future__ import annotations

import json

import httpx
import pytest

MODEL = "vllm-vcr/sim"


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def sse_events(body: bytes) -> list[str]:
    text = body.decode()
    assert text.endswith("\n\n")
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


def test_chat_sse_sequence(http):
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.content)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    first = chunks[0]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]
    assert first["prompt_token_ids"] is None and first["prompt_text"] is None  # as vLLM 0.32 sends them
    body = chunks[1:-1]
    assert body, "content chunks expected"
    for c in body[:-1]:
        assert list(c["choices"][0]) == ["index", "delta", "logprobs", "finish_reason", "token_ids"]
        assert set(c["choices"][0]["delta"]) == {"content"}
        assert c["choices"][0]["finish_reason"] is None
    last = body[-1]["choices"][0]
    assert last["finish_reason"] == "length" and "stop_reason" in last
    assert "system_fingerprint" not in body[-1]  # with a usage chunk, the fingerprint goes there
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert usage["system_fingerprint"].startswith("vllm-")
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 4
    assert "cached_tokens" in usage["usage"]["prompt_tokens_details"]
    assert "usage" not in first  # only the trailing chunk carries usage without continuous stats
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1


def test_completion_sse_continuous_usage(http):
    r = http.post("/v1/completions", json={
        "model": MODEL, "prompt": "abc", "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    events = sse_events(r.content)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    token_chunks = [c for c in chunks if c["choices"]]
    counts = [c["usage"]["completion_tokens"] for c in token_chunks]
    assert counts == sorted(set(counts)) and counts[-1] == 3  # several tokens per chunk when the reader lags
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert list(token_chunks[0]["choices"][0]) == ["index", "text", "logprobs", "finish_reason", "stop_reason",
                                                   "prompt_token_ids", "token_ids"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_stream_without_usage_has_no_usage_chunk(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 2, "stream": True})
    events = sse_events(r.content)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["choices"] for c in chunks)
    assert chunks[-1]["system_fingerprint"].startswith("vllm-")  # no usage chunk: on the finish chunk


def test_malformed_json_400(http):
    r = http.post("/v1/chat/completions", content=b'{"model": "x", "messages": [',
                  headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == 400 and "json" in err["message"].lower()
    r = http.post("/v1/completions", content=b"[1, 2]")
    assert r.status_code == 400


def test_missing_field_and_wrong_type(http):
    r = http.post("/v1/chat/completions", json={"model": MODEL})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": "two"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.n"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and "stream" in r.json()["error"]["message"]


def test_fuzzed_bodies_never_500(http):
    bodies = [b"", b"null", b"{}", b'"str"', b'{"prompt": null}', b'{"prompt": [[]]}', b'{"prompt": [-1]}',
              b'{"prompt": [99999999]}', b'{"prompt": "x", "max_tokens": 1e400}', b'{"prompt": {"a": 1}}',
              b'{"messages": "hi"}', b'{"messages": [{"content": "no role"}]}',
              b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
              b'{"messages": [{"role": "user", "content": 5}]}', b'{"prompt": "x", "stop": [1, 2]}',
              b'{"prompt": "x", "top_logprobs": -3, "logprobs": true}', "{\"prompt\": \"\xff\"}".encode("latin-1")]
    for path in ("/v1/completions", "/v1/chat/completions"):
        for body in bodies:
            r = http.post(path, content=body)
            assert r.status_code < 500, (path, body, r.status_code, r.text)
            if r.status_code >= 400:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert http.get("/health").status_code == 200


def test_dp_rank_header(http):
    ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                   headers={"X-data-parallel-rank": "1"})
    assert ok.status_code == 200
    bad = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                    headers={"X-data-parallel-rank": "5"})
    assert bad.status_code == 400
    msg = bad.json()["error"]["message"]
    assert "5" in msg and "2" in msg


def test_priority_accepted_with_fcfs(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, "priority": 3})
    assert r.status_code == 200  # vLLM 0.32 accepts it (and ignores it under fcfs)


def test_small_endpoints(http):
    assert http.get("/health").status_code == 200
    v = http.get("/version").json()
    assert v["version"] == "0.32.0"
    assert http.get("/nope").status_code == 404
    assert http.get("/v1/completions").status_code == 405
    t = http.post("/tokenize", json={"model": MODEL, "prompt": "hello world", "add_special_tokens": False}).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 512
    d = http.post("/detokenize", json={"model": MODEL, "tokens": t["tokens"]}).json()
    assert d["prompt"] == "hello world"
    tc = http.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).json()
    assert tc["count"] > 3
    # as real vLLM: an id outside the vocabulary decodes to nothing, one beyond u32 is a 400
    assert http.post("/detokenize", json={"tokens": [10 ** 9]}).json() == {"prompt": ""}
    big = http.post("/detokenize", json={"tokens": [2 ** 40]})
    assert big.status_code == 400 and big.json()["error"]["message"] == "number too large to fit in target type"
    assert http.post("/detokenize", json={"tokens": [-1]}).json()["error"]["param"] == "body.tokens.0"


def metric_sums(http) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families(http.get("/metrics").text):
        for s in fam.samples:
            if "finished_reason" not in s.labels and "reason" not in s.labels:
                key = s.name + "".join(f"[{v}]" for k, v in sorted(s.labels.items()) if k == "source")
                sums[key] = sums.get(key, 0.0) + s.value
    return sums


def test_metrics_count_every_token_of_a_stream(http):
    """One token per SSE event, and /metrics counts each (most of a stream's tokens go from the
    engine's step straight to the stream, in no engine output: see AsyncEngine.push's `take`)."""
    before = metric_sums(http)
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "count me"}], "max_tokens": 12, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = [json.loads(e) for e in sse_events(r.content)[:-1]]
    content = [c for c in chunks if c["choices"] and "content" in c["choices"][0]["delta"]][1:]  # after the role
    assert [c["usage"]["completion_tokens"] for c in content] == list(range(1, 13))
    after = metric_sums(http)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["vllm:generation_tokens_total"] == 12
    assert delta["vllm:inter_token_latency_seconds_count"] == 11
    computed = delta["vllm:prompt_tokens_by_source_total[local_compute]"]
    assert delta["vllm:iteration_tokens_total_sum"] == computed + 12
    assert delta["vllm:request_generation_tokens_sum"] == 12


def test_cors_off_by_default_as_vllm(http):
    # vLLM's --allowed-origins defaults to none: a preflight is refused, no allow-origin header
    pre = http.options("/v1/chat/completions", headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 400 and pre.text == "Disallowed CORS origin"
    r = http.get("/v1/models", headers={"Origin": "http://example.com"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_request_id_from_header_or_body(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, "request_id": "abc"})
    assert r.json()["id"] == "cmpl-abc"
    r = http.post("/v1/chat/completions", headers={"X-Request-Id": "hdr1"},
                  json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    assert r.json()["id"] == "chatcmpl-hdr1"


def test_return_token_ids(http):
    tok = http.post("/tokenize", json={"model": MODEL, "prompt": "hello world"}).json()["tokens"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hello world", "max_tokens": 3,
                                           "return_token_ids": True}).json()
    c = r["choices"][0]
    assert c["prompt_token_ids"] == tok and len(c["token_ids"]) == 3
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                "max_tokens": 3, "return_token_ids": True}).json()
    assert len(r["choices"][0]["token_ids"]) == 3 and r["prompt_token_ids"]
    s = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                "max_tokens": 3, "return_token_ids": True, "stream": True})
    chunks = [json.loads(e) for e in sse_events(s.content)[:-1]]
    assert chunks[0]["prompt_token_ids"] == r["prompt_token_ids"]
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks[1:]) == 3
    s = http.post("/v1/completions", json={"model": MODEL, "prompt": "hello world", "max_tokens": 3,
                                           "return_token_ids": True, "stream": True})
    chunks = [json.loads(e) for e in sse_events(s.content)[:-1]]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == tok
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 3
