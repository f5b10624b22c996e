"""Frontend flags of `vllm serve` a client sees: `--default-chat-template-kwargs` (the chat
template's variables a request's `chat_template_kwargs` override), `--exclude-tools-when-tool-choice-none`
and `--return-tokens-as-token-ids` (logprobs naming tokens `token_id:N`, a request's
`return_tokens_as_token_ids` deciding for itself).
tests/conformance compares both with the real frontends."""

from __future__ import annotations

import json
import re

import httpx
import openai

TEMPLATE = ("{% if greeting is defined %}{{ greeting }} {% endif %}{% if tools %}tools: {{ tools | length }} "
            "{% endif %}{% for m in messages %}{{ m['role'] }}: "
            "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
PLACEHOLDER = re.compile(r"token_id:\d+")


def test_template_defaults_and_token_id_logprobs(tmp_path, serve_process):
    template = tmp_path / "greeting.jinja"
    template.write_text(TEMPLATE)
    sp = serve_process("--served-model-name", "m", "--mode", "echo", "--inter-token-latency", "0", "--time-to-first-token", "0",
                       "--chat-template", str(template), "--default-chat-template-kwargs",
                       json.dumps({"greeting": "hey"}), "--return-tokens-as-token-ids",
                       "--exclude-tools-when-tool-choice-none")
    client = openai.OpenAI(base_url=sp.url + "/v1", api_key="x", max_retries=0)
    user = [{"role": "user", "content": "hi"}]

    def echoed(**extra) -> str:
        r = client.chat.completions.create(model="m", messages=user, max_tokens=6, extra_body={"ignore_eos": True,
                                                                                              **extra})
        return r.choices[0].message.content

    assert echoed().startswith("hey user")  # the server's variable
    assert echoed(chat_template_kwargs={"greeting": "yo"}).startswith("yo user")  # the request's wins
    tokens = httpx.post(sp.url + "/tokenize", json={"model": "m", "messages": user}, timeout=30).json()
    plain = httpx.post(sp.url + "/tokenize", json={"model": "m", "messages": user,
                                                   "chat_template_kwargs": {"greeting": ""}}, timeout=30).json()
    assert tokens["count"] > plain["count"]  # /tokenize renders with the server's variables too
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    assert not echoed(tools=[tool], tool_choice="none").startswith("hey tools")  # left out of the prompt

    r = client.chat.completions.create(model="m", messages=user, max_tokens=3, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert all(PLACEHOLDER.fullmatch(c.token) for c in content)
    assert all(PLACEHOLDER.fullmatch(t.token) and bytes(t.bytes).decode() == t.token
               for c in content for t in c.top_logprobs)  # (a top entry's bytes are its name's)
    r = client.chat.completions.create(model="m", messages=user, max_tokens=3, logprobs=True,
                                       extra_body={"return_tokens_as_token_ids": False})
    assert not any(PLACEHOLDER.fullmatch(c.token) for c in r.choices[0].logprobs.content)

    c = client.completions.create(model="m", prompt="hello there", max_tokens=3, logprobs=2, echo=True)
    lp = c.choices[0].logprobs
    assert all(PLACEHOLDER.fullmatch(t) for t in lp.tokens)
    assert all(PLACEHOLDER.fullmatch(k) for top in lp.top_logprobs[1:] for k in top)
    assert [b - a for a, b in zip(lp.text_offset, lp.text_offset[1:])] == [len(t) for t in lp.tokens[:-1]]


def test_disable_fastapi_docs_removes_the_docs_pages(serve_process):
    on = serve_process("--inter-token-latency", "0")
    off = serve_process("--inter-token-latency", "0", "--disable-fastapi-docs")
    for page in ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"):
        assert httpx.get(on.url + page, timeout=30).status_code == 200
        assert httpx.get(off.url + page, timeout=30).status_code == 404


def test_sse_keep_alive_comments_while_idle(serve_process):
    """`--sse-keep-alive-interval 1`: `: keep-alive` while a stream waits for its first token; the
    openai SDK reads past it."""
    sp = serve_process("--served-model-name", "m", "--time-to-first-token", "2200", "--inter-token-latency", "0",
                       "--sse-keep-alive-interval", "1")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    with httpx.stream("POST", sp.url + "/v1/chat/completions", json=body, timeout=60) as r:
        blocks = [b for b in r.read().decode().split("\n\n") if b]
    assert blocks[0] == ": keep-alive" and blocks[-1] == "data: [DONE]"
    client = openai.OpenAI(base_url=sp.url + "/v1", api_key="x", max_retries=0)
    chunks = list(client.completions.create(model="m", prompt="hi", max_tokens=2, stream=True))
    assert sum(len(c.choices[0].text) > 0 for c in chunks if c.choices) >= 1


def test_per_request_metrics_from_the_engine_timestamps(serve_process):
    """`--enable-per-request-metrics`: a response's `metrics` (vLLM's PerRequestMetrics) from the
    engine's own timestamps: the decode paced at the configured ITL, the first token at the TTFT."""
    sp = serve_process("--served-model-name", "m", "--time-to-first-token", "100", "--inter-token-latency", "20",
                       "--enable-per-request-metrics")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "ignore_eos": True}
    m = httpx.post(sp.url + "/v1/chat/completions", json=body, timeout=60).json()["metrics"]
    # 5 gaps paced at 20 ms: tokens are due on absolute deadlines, so a first token a loaded box
    # sends late shortens the gaps after it (the sum stays near 100 ms, not above it)
    assert 10.0 <= m["mean_itl_ms"] <= 500 and 50.0 <= m["generation_time_ms"] <= 2500
    assert 0 < m["time_to_first_token_ms"] <= 2000 and m["queue_time_ms"] >= 0 and m["tokens_per_second"] > 0
    assert httpx.post(sp.url + "/v1/chat/completions", json={**body, "n": 2}, timeout=60).json()["metrics"] is None
    client = openai.OpenAI(base_url=sp.url + "/v1", api_key="x", max_retries=0)
    chunks = list(client.chat.completions.create(model="m", messages=body["messages"], max_tokens=3, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 3 and chunks[-1].model_extra["metrics"]["mean_itl_ms"] >= 19.0
    # the Responses API: the response object's `metrics`, streamed (response.completed) or not
    resp = client.responses.create(model="m", input="hi", max_output_tokens=3)
    assert resp.model_extra["metrics"]["generation_time_ms"] >= 38.0
    done = [e for e in client.responses.create(model="m", input="hi", max_output_tokens=3, stream=True)
            if e.type == "response.completed"]
    assert done[0].response.model_extra["metrics"]["mean_itl_ms"] >= 19.0


def test_prefill_backlog_limit(serve_process):
    """`--max-num-queued-tokens 20`: a 12-token prompt waiting for its first token leaves room for
    one more request; the next, with 24 tokens in prefill, gets vLLM's 503 until a first token."""
    sp = serve_process("--served-model-name", "m", "--time-to-first-token", "3000", "--inter-token-latency", "0",
                       "--max-num-queued-tokens", "20")
    body = {"model": "m", "prompt": list(range(100, 112)), "max_tokens": 1, "stream": True}
    with httpx.Client(base_url=sp.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as first:
            assert first.status_code == 200
            with client.stream("POST", "/v1/completions", json=body) as second:
                assert second.status_code == 200
                third = client.post("/v1/completions", json={**body, "stream": False})
                assert third.status_code == 503
                assert third.json()["error"]["message"].startswith("The engine has reached its prefill token backlog")
                second.read()
            first.read()
        assert client.post("/v1/completions", json={**body, "stream": False}).status_code == 200  # room again
