"""Hostile strings through every streamed route of a real `vllm-vcr serve`.

A client controls several strings that come back inside streamed answers: the request id (the
body's `request_id`, or the `X-Request-Id` header), stop strings, the prompt, and the model name
the server answers to. Whatever they hold (quotes, backslashes, control characters, `%` signs as
a formatting template would read them, `</`, an SSE `data: ` line, non-ASCII text, emoji sent as
JSON surrogate-pair escapes, latin-1 bytes in a header), every streamed event must still be
well-formed: status 200, each `data:` line strict JSON (no raw control characters) in valid
UTF-8, the request id and model name reported exactly as sent, and never a 5xx. Checked on every
streamed route:

- /v1/chat/completions: plain, continuous usage, logprobs, two choices, tools offered with
  tool_choice "auto" and "required";
- /v1/completions: plain, echo, continuous usage, logprobs, two choices;
- /v1/responses and /v1/messages (Anthropic), streamed;
- SGLang's /generate (a second server, started with `--engine-type sglang`);
- the openai and anthropic SDKs reading a stream whose id is hostile.

And, with hostile ids and stop strings:

- the same seeded greedy request renders the same events (all but `created`) whichever way the
  server builds its chunks: a plain single-choice stream, and the same with a stop string that
  never matches;
- a stream adds up to the non-streamed answer: text, finish reason, stop reason and usage, also
  when a stop string does match;
- greedy sampling (temperature 0) reports the chosen token as the most likely one at every
  position, whether tools are offered or not;
- a lone surrogate (which a JSON escape can spell but UTF-8 cannot carry) is refused with a 4xx,
  never a 5xx.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st

from tests.reliability.hostile import DONE, ascii_header, hostile, hostile_char, hostile_header, parse_sse

# The model name the servers answer to: a quote, a backslash, `%`-format directives, `</`,
# non-ASCII text and control characters (a command-line argument cannot hold a NUL byte).
NAME = 'vcr "hostile" \\ %s%d%%(x)s é中😀 </script>\x01\t\x1f\x7f'

MAX_TOKENS = 24
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": 'Weather in a "city" \\ 100% </tool_call>',
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}]

# -- request ids: hostile strings (tests/reliability/hostile.py) in the body, the header or both --

@st.composite
def request_ids(draw) -> tuple[str | None, str | None]:
    """(body request_id, X-Request-Id header): one of them or both."""
    where = draw(st.sampled_from(["body", "header", "both"]))
    body = draw(hostile) if where != "header" else None
    header = draw(hostile_header) if where != "body" else None
    return body, header


# (no "explain" phase: it re-runs failing examples many times over, which costs server round trips)
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
                    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
FEW = settings(SETTINGS, max_examples=10)
QUOTE = ('a"b', None)  # the smallest id that must be escaped, in the body
QUOTE_HEADER = (None, 'a"b')


# -- servers and requests -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(serve_harness, tmp_path_factory):
    sp = serve_harness.start_fast(tmp_path_factory, "hostile-strings", "--served-model-name", NAME,
                                  "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                  "--auto-tool-call-probability", "0.5", "--enable-request-id-headers")
    yield sp
    sp.stop()


@pytest.fixture(scope="module")
def sglang(serve_harness, tmp_path_factory):
    sp = serve_harness.start_fast(tmp_path_factory, "hostile-strings-sglang", "--engine-type", "sglang",
                                  "--served-model-name", NAME)
    yield sp
    sp.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def post(client: httpx.Client, path: str, body: dict[str, Any], header_id: str | None = None,
         ascii_json: bool = True) -> httpx.Response:
    """POST `body` as JSON: ASCII with \\u escapes (emoji as surrogate pairs), or raw UTF-8."""
    headers = {"content-type": "application/json"}
    if header_id is not None:
        headers["x-request-id"] = header_id.encode("latin-1")
    return client.post(path, content=json.dumps(body, ensure_ascii=ascii_json).encode(), headers=headers)


def sse(r: httpx.Response, done: bool = True) -> list[tuple[str | None, dict[str, Any]]]:
    """The stream's events as (event name, parsed data); every line is checked."""
    assert r.status_code == 200, (r.status_code, r.text[:2000])
    events = parse_sse(r.content)
    saw_done = bool(events) and events[-1][1] == DONE
    assert saw_done == done, "[DONE] missing" if done else "unexpected [DONE]"
    return events[:-1] if saw_done else events


def chunks(r: httpx.Response) -> list[dict[str, Any]]:
    return [data for _, data in sse(r)]


def expected_id(prefix: str, body_id: str | None, header_id: str | None) -> str | None:
    """vLLM's order: the X-Request-Id header, else the body's request_id (else a random id)."""
    rid = header_id if header_id is not None else body_id
    return None if rid is None else prefix + rid


def check_ids(events: list[dict[str, Any]], prefix: str, body_id: str | None, header_id: str | None) -> None:
    want = expected_id(prefix, body_id, header_id)
    ids = {e["id"] for e in events}
    assert len(ids) == 1, ids
    if want is not None:
        assert ids == {want}
    assert {e["model"] for e in events} == {NAME}


def check_header_echo(r: httpx.Response, header_id: str | None) -> None:
    """--enable-request-id-headers: the response carries the request's own X-Request-Id."""
    if header_id is not None:
        assert [v for k, v in r.headers.raw if k.lower() == b"x-request-id"] == [header_id.encode("latin-1")]


def strip_created(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in e.items() if k != "created"} for e in events]


def content_of(events: list[dict[str, Any]], field: str, index: int = 0) -> str:
    out = []
    for e in events:
        for ch in e["choices"]:
            if ch["index"] == index:
                part = ch["delta"].get("content") if field == "delta" else ch["text"]
                out.append(part or "")
    return "".join(out)


def finish_of(events: list[dict[str, Any]], index: int = 0) -> tuple[Any, Any]:
    ends = [(ch["finish_reason"], ch.get("stop_reason")) for e in events for ch in e["choices"]
            if ch["index"] == index and ch["finish_reason"] is not None]
    assert len(ends) == 1, ends
    return ends[0]


def usage_counts(usage: dict[str, Any]) -> tuple[int, int, int]:
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


# -- /v1/chat/completions -----------------------------------------------------------------------

CHAT_VARIANTS = {
    "plain": {},
    "continuous-usage": {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    "logprobs": {"logprobs": True, "top_logprobs": 2},
    "n2": {"n": 2, "temperature": 1.0},
    "tools-auto": {"tools": TOOLS, "tool_choice": "auto"},
    "tools-required": {"tools": TOOLS, "tool_choice": "required"},
}


@pytest.mark.parametrize("variant", list(CHAT_VARIANTS))
@SETTINGS
@given(ids=request_ids(), stop=st.none() | hostile, prompt=hostile, seed=st.integers(0, 2**16),
       ascii_json=st.booleans())
@example(ids=QUOTE, stop=None, prompt="hi", seed=1, ascii_json=True)
@example(ids=QUOTE_HEADER, stop='"', prompt="hi", seed=1, ascii_json=False)
def test_chat_stream(http, variant, ids, stop, prompt, seed, ascii_json):
    body_id, header_id = ids
    body = {"model": NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "stream": True, "seed": seed, "temperature": 0, **CHAT_VARIANTS[variant]}
    if body_id is not None:
        body["request_id"] = body_id
    if stop is not None:
        body["stop"] = [stop]
    r = post(http, "/v1/chat/completions", body, header_id, ascii_json)
    events = chunks(r)
    check_ids(events, "chatcmpl-", body_id, header_id)
    check_header_echo(r, header_id)
    n = body.get("n", 1)
    for i in range(n):
        finish_of(events, i)
    if variant == "continuous-usage":
        assert "usage" in events[-1] and events[-1]["choices"] == []
        assert all(e.get("usage") for e in events)


# -- /v1/completions ----------------------------------------------------------------------------

COMPLETION_VARIANTS = {
    "plain": {},
    "echo": {"echo": True},
    "continuous-usage": {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    "logprobs": {"logprobs": 2},
    "n2": {"n": 2, "temperature": 1.0},
}


@pytest.mark.parametrize("variant", list(COMPLETION_VARIANTS))
@SETTINGS
@given(ids=request_ids(), stop=st.none() | hostile, prompt=hostile, seed=st.integers(0, 2**16),
       ascii_json=st.booleans())
@example(ids=QUOTE, stop=None, prompt="hi", seed=1, ascii_json=True)
@example(ids=QUOTE_HEADER, stop='"', prompt="hi", seed=1, ascii_json=False)
def test_completion_stream(http, variant, ids, stop, prompt, seed, ascii_json):
    body_id, header_id = ids
    body = {"model": NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True, "seed": seed,
            "temperature": 0, **COMPLETION_VARIANTS[variant]}
    if body_id is not None:
        body["request_id"] = body_id
    if stop is not None:
        body["stop"] = [stop]
    r = post(http, "/v1/completions", body, header_id, ascii_json)
    events = chunks(r)
    check_ids(events, "cmpl-", body_id, header_id)
    check_header_echo(r, header_id)
    for i in range(body.get("n", 1)):
        finish_of(events, i)
        if variant == "echo":
            assert content_of(events, "text", i).startswith(prompt)


# -- /v1/responses ------------------------------------------------------------------------------

@SETTINGS
@given(ids=request_ids(), stop=st.none() | hostile, prompt=hostile, seed=st.integers(0, 2**16),
       ascii_json=st.booleans())
@example(ids=QUOTE, stop=None, prompt="hi", seed=1, ascii_json=True)
@example(ids=QUOTE_HEADER, stop=None, prompt="hi", seed=1, ascii_json=True)
def test_responses_stream(http, ids, stop, prompt, seed, ascii_json):
    body_id, header_id = ids
    body = {"model": NAME, "input": prompt, "max_output_tokens": MAX_TOKENS, "stream": True, "seed": seed,
            "temperature": 0}
    if body_id is not None:
        body["request_id"] = body_id
    if stop is not None:
        body["stop"] = [stop]
    r = post(http, "/v1/responses", body, header_id, ascii_json)
    events = sse(r, done=False)
    kinds = [data["type"] for _, data in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert all(name == data["type"] for name, data in events)
    created, final = events[0][1]["response"], events[-1][1]["response"]
    if body_id is not None:  # the response id is the body's request_id
        assert created["id"] == final["id"] == body_id
    assert created["model"] == final["model"] == NAME
    streamed = "".join(data["delta"] for _, data in events if data["type"] == "response.output_text.delta")
    texts = [part["text"] for item in final["output"] if item["type"] == "message" for part in item["content"]]
    assert streamed == "".join(texts)


# -- /v1/messages (Anthropic) -------------------------------------------------------------------

@SETTINGS
@given(ids=request_ids(), stop=st.none() | hostile, prompt=hostile, system=st.none() | hostile,
       ascii_json=st.booleans())
@example(ids=QUOTE_HEADER, stop=None, prompt="hi", system=None, ascii_json=True)
@example(ids=(None, '\\"%s'), stop='"', prompt="hi", system='"', ascii_json=False)
def test_messages_stream(http, ids, stop, prompt, system, ascii_json):
    body_id, header_id = ids
    body: dict[str, Any] = {"model": NAME, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0}
    if body_id is not None:
        body["request_id"] = body_id
    if stop is not None:
        body["stop_sequences"] = [stop]
    if system is not None:
        body["system"] = system
    r = post(http, "/v1/messages", body, header_id, ascii_json)
    events = sse(r, done=False)
    kinds = [data["type"] for _, data in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert all(name == data["type"] for name, data in events)
    message = events[0][1]["message"]
    assert message["model"] == NAME
    if header_id is not None:
        assert message["id"].endswith(header_id)
    delta = [data for _, data in events if data["type"] == "message_delta"]
    assert len(delta) == 1
    if delta[0]["delta"]["stop_reason"] == "stop_sequence":
        assert delta[0]["delta"]["stop_sequence"] == stop


# -- SGLang's /generate -------------------------------------------------------------------------

@SETTINGS
@given(rid=st.none() | hostile, prompt=hostile, stop=st.none() | hostile, ascii_json=st.booleans())
@example(rid='a"b', prompt="hi", stop=None, ascii_json=True)
def test_sglang_generate_stream(sglang, rid, prompt, stop, ascii_json):
    body: dict[str, Any] = {"text": prompt, "stream": True, "sampling_params": {"max_new_tokens": MAX_TOKENS}}
    if rid is not None:
        body["rid"] = rid
    if stop is not None:
        body["sampling_params"]["stop"] = [stop]
    with httpx.Client(base_url=sglang.url, timeout=60) as c:
        r = post(c, "/generate", body, None, ascii_json)
    if stop is not None and r.status_code == 400:  # stop strings are refused there, in JSON
        assert "error" in json.loads(r.content.decode("utf-8"), strict=True)
        return
    events = chunks(r)
    assert events
    lengths = [len(e["output_ids"]) for e in events]
    assert lengths == sorted(lengths)
    ids = {e["meta_info"]["id"] for e in events}
    assert len(ids) == 1
    if rid is not None:
        assert ids == {rid}
    assert events[-1]["meta_info"]["finish_reason"] is not None


# -- one request, two ways of rendering it ------------------------------------------------------

@pytest.mark.parametrize("route", ["chat", "completions"])
@SETTINGS
@given(data=st.data(), ids=request_ids(), seed=st.integers(0, 2**16), usage=st.sampled_from([None, False, True]))
def test_fast_and_full_paths_render_alike(http, route, data, ids, seed, usage):
    """A plain single-choice stream, and the same request with a one-character stop string that
    never matches (it holds no text back, but every chunk is then built the general way)."""
    body_id, header_id = ids
    if route == "chat":  # (logprobs false, said explicitly, keeps the plain way)
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": False}
    else:
        path, body = "/v1/completions", {"prompt": "hi"}
    body.update(model=NAME, max_tokens=MAX_TOKENS, seed=seed, temperature=0)
    if body_id is not None:
        body["request_id"] = body_id
    full = post(http, path, body, header_id)
    assert full.status_code == 200, full.text
    answer = full.json()["choices"][0]
    text = answer["message"]["content"] if route == "chat" else answer["text"]
    stop = data.draw(hostile_char.filter(lambda c: c not in text), label="stop")
    body["stream"] = True
    if usage is not None:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": usage}
    plain = chunks(post(http, path, body, header_id))
    general = chunks(post(http, path, {**body, "stop": [stop]}, header_id))
    assert strip_created(plain) == strip_created(general)
    check_ids(plain, "chatcmpl-" if route == "chat" else "cmpl-", body_id, header_id)


# -- a stream adds up to the whole answer -------------------------------------------------------

@pytest.mark.parametrize("route", ["chat", "completions"])
@SETTINGS
@given(data=st.data(), ids=request_ids(), seed=st.integers(0, 2**16), n=st.sampled_from([1, 2]),
       extra_stop=st.none() | hostile)
def test_stream_adds_up_to_the_full_answer(http, route, data, ids, seed, n, extra_stop):
    body_id, header_id = ids
    chat = route == "chat"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": NAME, "max_tokens": MAX_TOKENS, "seed": seed, "n": n,
                            "temperature": 0 if n == 1 else 1.0}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    if body_id is not None:
        body["request_id"] = body_id

    def texts(answer: dict[str, Any]) -> list[str]:
        return [c["message"]["content"] if chat else c["text"] for c in answer["choices"]]

    first = post(http, path, body, header_id)
    assert first.status_code == 200, first.text
    # a stop string that matches: a piece of the first choice's text (when it has any)
    text = texts(first.json())[0]
    stops = [] if extra_stop is None else [extra_stop]
    if text and data.draw(st.booleans(), label="stop that matches"):
        start = data.draw(st.integers(0, len(text) - 1), label="start")
        stops.append(text[start:start + data.draw(st.integers(1, 4), label="length")])
    if stops:
        body["stop"] = stops
    whole = post(http, path, body, header_id)
    assert whole.status_code == 200, whole.text
    answer = whole.json()
    events = chunks(post(http, path, {**body, "stream": True, "stream_options": {"include_usage": True}},
                         header_id))
    check_ids(events, "chatcmpl-" if chat else "cmpl-", body_id, header_id)
    for c, want in zip(answer["choices"], texts(answer)):
        i = c["index"]
        assert content_of(events, "delta" if chat else "text", i) == want
        assert finish_of(events, i) == (c["finish_reason"], c["stop_reason"])
    assert usage_counts(events[-1]["usage"]) == usage_counts(answer["usage"])
    event(f"finish: {answer['choices'][0]['finish_reason']}")


# -- greedy logprobs ----------------------------------------------------------------------------

@pytest.mark.parametrize("tools", [False, True], ids=["no-tools", "tools"])
@SETTINGS
@given(seed=st.integers(0, 2**16), prompt=hostile)
@example(seed=3, prompt="weather?")
def test_greedy_logprobs_rank_the_chosen_token_first(http, tools, seed, prompt):
    """No request id is sent here: the point is the logprobs, with tools offered or not."""
    body: dict[str, Any] = {"model": NAME, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": 160, "seed": seed, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    if tools:
        body.update(tools=TOOLS, tool_choice="auto")
    events = chunks(post(http, "/v1/chat/completions", {**body, "stream": True}))
    streamed = [p for e in events for c in e["choices"] if c.get("logprobs") for p in c["logprobs"]["content"]]
    assert streamed
    for k, p in enumerate(streamed):
        best = max(t["logprob"] for t in p["top_logprobs"])
        assert p["logprob"] == best, f"position {k}: the chosen token {p['token']!r} ({p['logprob']}) is not " \
                                     f"the most likely one: {p['top_logprobs']}"
    whole = post(http, "/v1/chat/completions", body)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert streamed == choice["logprobs"]["content"]
    event("tool call" if choice["message"].get("tool_calls") else "text")


# -- lone surrogates ----------------------------------------------------------------------------

_SURROGATE = st.integers(0xD800, 0xDFFF).map(chr)


@pytest.mark.parametrize("route", ["chat", "completions", "responses", "messages", "generate"])
@FEW
@given(field=st.sampled_from(["request_id", "stop", "prompt"]), before=hostile, lone=_SURROGATE, after=hostile)
def test_lone_surrogates_are_refused_not_crashed(http, sglang, route, field, before, lone, after):
    s = before + lone + after  # sent as a \\udXXX escape: valid JSON, not valid Unicode
    if route == "generate":
        body: dict[str, Any] = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 4}}
        if field == "stop":
            body["sampling_params"]["stop"] = [s]
        else:
            body["rid" if field == "request_id" else "text"] = s
        with httpx.Client(base_url=sglang.url, timeout=60) as c:
            r = post(c, "/generate", body)
    else:
        path, body = {
            "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
            "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
            "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 4}),
            "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        }[route]
        body = {**body, "model": NAME, "stream": True}
        if field == "request_id":
            body["request_id"] = s
        elif field == "stop":
            body["stop_sequences" if route == "messages" else "stop"] = [s]
        elif route in ("chat", "messages"):
            body["messages"] = [{"role": "user", "content": s}]
        else:
            body["input" if route == "responses" else "prompt"] = s
        r = post(http, path, body)
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code == 200:  # taken after all: then the stream must be sound
        sse(r, done=route not in ("responses", "messages"))
    else:
        assert r.status_code == 400, r.text
        json.loads(r.content.decode("utf-8"), strict=True)


# -- the SDKs -----------------------------------------------------------------------------------

@FEW
@given(body_id=st.none() | hostile, header_id=st.none() | ascii_header, stop=st.none() | hostile)
@example(body_id='a"b', header_id=None, stop=None)
def test_openai_sdk_reads_the_stream(server, body_id, header_id, stop):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    extra_headers = {"X-Request-Id": header_id} if header_id is not None else None
    extra_body = {"request_id": body_id} if body_id is not None else None
    want = expected_id("chatcmpl-", body_id, header_id)
    got = []
    for chunk in client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_TOKENS, stream=True, seed=1,
            stop=[stop] if stop is not None else None, extra_body=extra_body, extra_headers=extra_headers):
        assert chunk.model == NAME
        got.append(chunk.id)
    assert len(set(got)) == 1
    if want is not None:
        assert set(got) == {want}


@FEW
@given(header_id=ascii_header, stop=st.none() | hostile)
@example(header_id='a"b', stop=None)
def test_anthropic_sdk_reads_the_stream(server, header_id, stop):
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    with client.messages.stream(model=NAME, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": "hi"}],
                                stop_sequences=[stop] if stop is not None else anthropic.NOT_GIVEN,
                                extra_headers={"X-Request-Id": header_id}) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.model == NAME and final.id.endswith(header_id)
    assert "".join(b.text for b in final.content if b.type == "text") == text


def test_the_hostile_model_name_is_served(http, sglang):
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [NAME]
    assert httpx.get(sglang.url + "/v1/models").json()["data"][0]["id"] == NAME
