"""Every event of every stream is checked: hypothesis-generated requests, with hostile strings in
every string field of the body and hostile header values, against every streamed route of a real
`vllm-vcr serve`.

Routes: /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages (Anthropic) and SGLang's
/generate (a second server started with `--engine-type sglang`). Body strings: the model, message
contents (plain and as parts), message and tool names, tool-call ids and arguments, tool names,
descriptions and parameter names, tool_choice names, stop strings, request_id, user, cache_salt,
response_format and text.format names, structured-output choices, logit_bias keys, chat template
kwargs, Anthropic system, metadata and tool_use/tool_result blocks, Responses instructions,
metadata, input items and previous_response_id, SGLang rid. Header values are raw bytes as a client
on a socket can send them (quotes, backslashes, NUL and other control characters, latin-1 and UTF-8
bytes, kilobytes long) in X-Request-Id, Authorization, X-Data-Parallel-Rank, X-Output-Replay-Id,
Accept, Accept-Encoding, User-Agent, traceparent and custom headers.

Each request fails the test when it gets a 5xx, when an answer that says it is JSON is not strict
JSON, or when any event of a stream is not (tests/reliability/hostile.py `parse_sse`: UTF-8, SSE
fields only, strict JSON, nothing after [DONE]) or the stream does not end as its route ends one.
Meanwhile a thread GETs /health every 50 ms, and the server's loop watch (GET /stats/loop on the
control API: CPU time the loop thread ran before it came back to a posted callback, so a loaded
machine that leaves the process waiting for a core does not count) must report no stall of 50 ms
or more. The figures are printed at the end of the run.

VLLM_VCR_FUZZ_EXAMPLES sets the examples per route (default 25; the figures in docs/reliability.md
come from a longer run).
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.conftest import scaled
from vllm_vcr.http.uvicorn_internals import MAX_HEAD_BYTES
from tests.reliability.hostile import (
    DONE,
    FIGURES,
    InvalidEvent,
    hostile,
    hostile_char,
    hostile_header,
    hostile_or_long,
    parse_sse,
    raw_header_value,
)

NAME = 'fuzz "model" \\ %s é中😀 </script>\x01'
EXAMPLES = int(os.environ.get("VLLM_VCR_FUZZ_EXAMPLES", "25"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much],
                    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
STALL_MS = 50.0


# -- servers, the /health probe and the loop watch ---------------------------------------------

class HealthProbe(threading.Thread):
    """GET /health every 50 ms on one kept-alive connection: answers, failures, the slowest."""

    def __init__(self, port: int) -> None:
        super().__init__(name="health-probe", daemon=True)
        self.port = port
        self.stopped = threading.Event()
        self.answers = 0
        self.failures: list[str] = []
        self.slowest = 0.0

    def _get(self, conn: http.client.HTTPConnection) -> int:
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        return r.status

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=scaled(30))
        while not self.stopped.wait(0.05):
            t0 = time.perf_counter()
            try:
                try:
                    status = self._get(conn)
                except (OSError, http.client.HTTPException):
                    # a kept-alive connection the server closed after its idle timeout (a probe
                    # thread the OS left waiting for seconds): once more on a new one
                    conn.close()
                    t0 = time.perf_counter()
                    status = self._get(conn)
            except (OSError, http.client.HTTPException) as e:
                self.failures.append(repr(e))
                conn.close()
                continue
            self.slowest = max(self.slowest, time.perf_counter() - t0)
            self.answers += 1
            if status != 200:
                self.failures.append(f"/health answered {status}")

    def stop(self) -> None:
        self.stopped.set()
        self.join(scaled(30))


class Watched:
    """A running server, its /health probe and its loop watch."""

    def __init__(self, sp: Any) -> None:
        self.sp = sp
        self.port = sp.port
        self.loop_stats()  # the first GET starts the watch
        self.probe = HealthProbe(sp.port)
        self.probe.start()

    def loop_stats(self) -> dict[str, Any]:
        r = httpx.get(self.sp.control + "/stats/loop", timeout=scaled(30))
        assert r.status_code == 200, r.text
        return r.json()

    def finish(self) -> dict[str, Any]:
        self.probe.stop()
        stats = self.loop_stats()
        FIGURES["longest loop stall (ms)"] = max(FIGURES.get("longest loop stall (ms)", 0.0),
                                                 stats["longest_stall_ms"])
        FIGURES["health probes"] += self.probe.answers
        FIGURES["slowest /health (ms, wall clock)"] = max(FIGURES.get("slowest /health (ms, wall clock)", 0.0),
                                                          round(self.probe.slowest * 1000, 1))
        return stats


@pytest.fixture(scope="module")
def openai_server(serve_harness, tmp_path_factory):
    sp = serve_harness.start_fast(tmp_path_factory, "stream-fuzz", "--served-model-name", NAME,
                                  "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                  "--auto-tool-call-probability", "0.5", "--enable-request-id-headers")
    w = Watched(sp)
    yield w
    w.probe.stop()
    log = sp.log()
    sp.stop()
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def sglang_server(serve_harness, tmp_path_factory):
    sp = serve_harness.start_fast(tmp_path_factory, "stream-fuzz-sglang", "--engine-type", "sglang",
                                  "--served-model-name", NAME)
    w = Watched(sp)
    yield w
    w.probe.stop()
    log = sp.log()
    sp.stop()
    assert "Traceback" not in log, log[-4000:]


# -- headers --------------------------------------------------------------------------------------

# X-Return-Error is left out: it asks the server for an error on purpose (docs/faults.md).
_HEADER_NAMES = ["x-request-id", "authorization", "x-data-parallel-rank", "x-output-replay-id", "accept",
                 "accept-encoding", "user-agent", "traceparent", "tracestate", "x-api-key", "anthropic-version",
                 "anthropic-beta", "openai-organization", "x-custom", "x-Custom-Header"]
_custom_name = st.text("abcdefghijklmnopqrstuvwxyz0123456789-_.!#$%&'*+^`|~", min_size=1, max_size=20).map(
    lambda s: "x-" + s)
# mostly values HTTP can carry (latin-1 text, UTF-8 text), now and then any bytes (which the HTTP
# parser may refuse with its plain-text 400)
_printable = hostile.map(lambda v: "".join(c for c in v if c == "\t" or (c >= " " and c != "\x7f")).strip(" \t"))
_latin1 = hostile_header.map(lambda v: v.encode("latin-1"))
_utf8 = _printable.filter(bool).map(lambda v: v.encode("utf-8"))
_header_value = st.sampled_from(range(12)).flatmap(
    lambda i: raw_header_value if i == 6 else _latin1 if i % 2 else _utf8)
headers_st = st.lists(st.tuples(st.one_of(st.sampled_from(_HEADER_NAMES), _custom_name), _header_value),
                      max_size=4, unique_by=lambda h: h[0].lower())


# -- one request, every event checked -------------------------------------------------------------

# the server echoes X-Request-Id as vLLM does, a hostile one of any length its request head may carry
# (up to uvicorn_internals.MAX_HEAD_BYTES); http.client reads response header lines of 64 KiB at most
http.client._MAXLINE = max(http.client._MAXLINE, 2 * MAX_HEAD_BYTES)


def _send(port: int, path: str, body: Any, headers: list[tuple[str, bytes]], ascii_json: bool
          ) -> tuple[int, str, bytes]:
    """POST `body` on a fresh connection with the headers as given (any byte but CR and LF)."""
    payload = json.dumps(body, ensure_ascii=ascii_json).encode("utf-8")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=scaled(60))
    try:
        conn.putrequest("POST", path, skip_accept_encoding=True)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(payload)))
        for name, value in headers:
            conn.putheader(name, value)
        conn.endheaders(payload)
        r = conn.getresponse()
        raw = r.read()
        return r.status, r.getheader("content-type", ""), raw
    finally:
        conn.close()


# how each route's stream ends: [DONE], or the type of its last event
_ENDS = {"openai": None, "responses": {"response.completed", "response.incomplete", "response.failed", "error"},
         "messages": {"message_stop", "error"}}


def check(port: int, path: str, body: Any, headers: list[tuple[str, bytes]], ascii_json: bool, kind: str) -> int:
    """Send, check the answer (and every event of a stream); the status."""
    for name in ("5xx", "invalid events", "events parsed"):
        FIGURES.setdefault(name, 0)
    status, ctype, raw = _send(port, path, body, headers, ascii_json)
    FIGURES["requests fuzzed"] += 1
    if status >= 500:
        FIGURES["5xx"] += 1
        raise AssertionError(f"{path} answered {status}: {raw[:1500]!r}\nbody: {body!r}\nheaders: {headers!r}")
    if ctype.startswith("text/event-stream"):
        assert status == 200, (status, raw[:500])
        try:
            events = parse_sse(raw)
        except InvalidEvent:
            FIGURES["invalid events"] += 1
            raise
        FIGURES["events parsed"] += len(events)
        FIGURES["streams"] += 1
        assert events, f"an empty stream from {path}"
        ends = _ENDS[kind]
        if ends is None:
            assert events[-1][1] == DONE, events[-3:]
            assert all(isinstance(data, dict) for _, data in events[:-1])
        else:
            assert all(isinstance(data, dict) and name == data.get("type") for name, data in events), events[:3]
            assert events[-1][1]["type"] in ends, [data.get("type") for _, data in events][-5:]
        return status
    if "json" in ctype:
        try:
            json.loads(raw.decode("utf-8"), strict=True)
        except ValueError as e:
            FIGURES["invalid events"] += 1
            raise AssertionError(f"{path} answered {status} with invalid JSON ({e}): {raw[:600]!r}") from None
    else:  # only the HTTP parser's own refusal of a malformed request is not JSON
        assert 400 <= status < 500, (status, ctype, raw[:500])
    FIGURES[f"answered {status // 100}xx"] += 1
    return status


# -- body strategies ------------------------------------------------------------------------------

# mostly the served name (a wrong one is a 404)
model_st = st.sampled_from(range(10)).flatmap(lambda i: hostile if i == 5 else st.just(NAME))


def rarely(draw, n: int) -> bool:
    """True about once in `n` draws (hypothesis favours the ends of a range: the middle is asked)."""
    return draw(st.sampled_from(range(n))) == n // 2
stop_st = st.one_of(st.none(), hostile_char, st.lists(st.one_of(hostile_char, hostile), min_size=1, max_size=4))
max_tokens_st = st.integers(1, 12)


def _optional(d: dict[str, Any], **kw: st.SearchStrategy) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({k: (v if isinstance(v, st.SearchStrategy) else st.just(v)) for k, v in d.items()},
                                 optional=kw)


_param_schema = st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "boolean"])},
                                      optional={"description": hostile, "title": hostile})
parameters_st = st.dictionaries(hostile, _param_schema, max_size=3).map(
    lambda props: {"type": "object", "properties": props, "required": list(props)[:1]})
arguments_st = st.one_of(hostile, st.dictionaries(hostile, hostile, max_size=3).map(json.dumps))

text_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": hostile_or_long}), min_size=1,
                      max_size=3)
content_st = st.one_of(hostile_or_long, text_parts)
tool_call_st = st.fixed_dictionaries({"id": hostile, "type": st.just("function"),
                                      "function": st.fixed_dictionaries({"name": hostile,
                                                                         "arguments": arguments_st})})
chat_message = st.one_of(
    _optional({"role": "user", "content": content_st}, name=hostile),
    _optional({"role": "system", "content": content_st}, name=hostile),
    _optional({"role": "assistant", "content": hostile}, name=hostile,
              tool_calls=st.lists(tool_call_st, min_size=1, max_size=2)),
    _optional({"role": "tool", "content": hostile, "tool_call_id": hostile}),
)
chat_messages = st.tuples(st.lists(chat_message, max_size=3),
                          _optional({"role": "user", "content": content_st}, name=hostile)).map(
    lambda t: [*t[0], t[1]])
openai_tools = st.lists(st.fixed_dictionaries(
    {"type": st.just("function"),
     "function": _optional({"name": hostile, "parameters": parameters_st}, description=hostile_or_long)}),
    min_size=1, max_size=3)
json_schema_format = _optional({"name": hostile, "schema": parameters_st}, description=hostile,
                               strict=st.booleans())
response_format_st = st.one_of(st.just({"type": "text"}), st.just({"type": "json_object"}),
                               json_schema_format.map(lambda js: {"type": "json_schema", "json_schema": js}))
structured_st = st.lists(hostile, min_size=1, max_size=3).map(lambda c: {"choice": c})


@st.composite
def tool_choice_for(draw, tools: list[dict[str, Any]], named: Any) -> Any:
    pick = draw(st.sampled_from(["auto", "none", "required", "named", "unknown"]))
    if pick in ("named", "unknown"):
        name = draw(hostile) if pick == "unknown" else draw(st.sampled_from(tools))["function"]["name"]
        return named(name)
    return pick


def _common(draw, body: dict[str, Any]) -> None:
    """Strings every OpenAI-style route takes (drawn or left out)."""
    for field, strategy in (("request_id", hostile), ("user", hostile), ("cache_salt", hostile),
                            ("stop", stop_st)):
        if draw(st.booleans()):
            body[field] = draw(strategy)
    if rarely(draw, 8):  # (keys that are no token id: a 400)
        body["logit_bias"] = draw(st.dictionaries(st.one_of(hostile, st.integers(0, 999).map(str)),
                                                  st.floats(-5, 5), max_size=2))


@st.composite
def chat_bodies(draw) -> dict[str, Any]:
    body: dict[str, Any] = {"model": draw(model_st), "messages": draw(chat_messages), "stream": True,
                            "max_tokens": draw(max_tokens_st), "seed": draw(st.integers(0, 2**16))}
    _common(draw, body)
    if draw(st.booleans()):
        body["tools"] = draw(openai_tools)
        body["tool_choice"] = draw(tool_choice_for(body["tools"], lambda n: {"type": "function",
                                                                              "function": {"name": n}}))
    elif draw(st.booleans()):
        body["response_format"] = draw(response_format_st)
    elif draw(st.booleans()):
        body["structured_outputs"] = draw(structured_st)
    if draw(st.booleans()):
        body["logprobs"], body["top_logprobs"] = True, draw(st.integers(0, 3))
    if draw(st.booleans()):
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": draw(st.booleans())}
    if draw(st.booleans()):
        body["n"] = 2
    if draw(st.booleans()):
        body["chat_template_kwargs"] = draw(st.dictionaries(hostile, hostile, max_size=2))
    return body


@st.composite
def completion_bodies(draw) -> dict[str, Any]:
    prompt = draw(st.one_of(hostile_or_long, st.lists(hostile, min_size=1, max_size=3)))
    body: dict[str, Any] = {"model": draw(model_st), "prompt": prompt, "stream": True,
                            "max_tokens": draw(max_tokens_st), "seed": draw(st.integers(0, 2**16))}
    _common(draw, body)
    if draw(st.booleans()):
        body["echo"] = True
    if draw(st.booleans()):
        body["logprobs"] = draw(st.integers(0, 3))
    if rarely(draw, 10):  # (refused with a 400, as vLLM does)
        body["suffix"] = draw(hostile)
    if draw(st.booleans()):
        body["structured_outputs"] = draw(structured_st)
    if draw(st.booleans()):
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": draw(st.booleans())}
    return body


_input_item = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant"]),
                           "content": st.one_of(hostile_or_long, st.lists(st.fixed_dictionaries(
                               {"type": st.just("input_text"), "text": hostile}), min_size=1, max_size=2))}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": hostile, "name": hostile,
                           "arguments": arguments_st}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": hostile, "output": hostile}),
)


@st.composite
def responses_bodies(draw) -> dict[str, Any]:
    body: dict[str, Any] = {"model": draw(model_st), "stream": True, "max_output_tokens": draw(max_tokens_st),
                            "input": draw(st.one_of(hostile_or_long, st.lists(_input_item, min_size=1, max_size=3)))}
    for field, strategy in (("instructions", hostile_or_long), ("user", hostile), ("request_id", hostile),
                            ("metadata", st.dictionaries(hostile, hostile, max_size=3)), ("stop", stop_st)):
        if draw(st.booleans()):
            body[field] = draw(strategy)
    if draw(st.booleans()):
        body["tools"] = draw(st.lists(_optional({"type": "function", "name": hostile, "parameters": parameters_st},
                                                description=hostile), min_size=1, max_size=2))
        body["tool_choice"] = draw(st.one_of(st.sampled_from(["auto", "none", "required"]),
                                             st.sampled_from(body["tools"]).map(
                                                 lambda t: {"type": "function", "name": t["name"]})))
    elif draw(st.booleans()):
        body["text"] = {"format": draw(json_schema_format.map(lambda js: {"type": "json_schema", **js}))}
    if rarely(draw, 8):  # (none is stored: a 404)
        body["previous_response_id"] = draw(hostile)
    return body


_anthropic_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": hostile_or_long}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": hostile,
                           "content": st.one_of(hostile, text_parts)}),
)
_assistant_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": hostile}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": hostile, "name": hostile,
                           "input": st.dictionaries(hostile, hostile, max_size=2)}),
)
_anthropic_turns = st.lists(st.tuples(
    st.fixed_dictionaries({"role": st.just("user"),
                           "content": st.one_of(hostile_or_long, st.lists(_anthropic_block, min_size=1, max_size=2))}),
    st.fixed_dictionaries({"role": st.just("assistant"),
                           "content": st.one_of(hostile, st.lists(_assistant_block, min_size=1, max_size=2))})),
    max_size=2)


@st.composite
def messages_bodies(draw) -> dict[str, Any]:
    turns = [m for pair in draw(_anthropic_turns) for m in pair]
    last = draw(st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(
        hostile_or_long, st.lists(_anthropic_block, min_size=1, max_size=2))}))
    body: dict[str, Any] = {"model": draw(model_st), "messages": [*turns, last], "stream": True,
                            "max_tokens": draw(max_tokens_st)}
    for field, strategy in (("system", st.one_of(hostile_or_long, text_parts)),
                            ("metadata", st.fixed_dictionaries({"user_id": hostile})),
                            ("stop_sequences", st.lists(st.one_of(hostile_char, hostile), min_size=1, max_size=4)),
                            ("request_id", hostile)):
        if draw(st.booleans()):
            body[field] = draw(strategy)
    if draw(st.booleans()):
        body["tools"] = draw(st.lists(_optional({"name": hostile, "input_schema": parameters_st},
                                                description=hostile), min_size=1, max_size=2))
        body["tool_choice"] = draw(st.one_of(
            st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"}]),
            st.sampled_from(body["tools"]).map(lambda t: {"type": "tool", "name": t["name"]}),
            hostile.map(lambda n: {"type": "tool", "name": n})))
    return body


@st.composite
def generate_bodies(draw) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": draw(max_tokens_st)}
    if rarely(draw, 5):  # (refused with a 400: /generate does not simulate stop strings)
        params["stop"] = draw(st.lists(st.one_of(hostile_char, hostile), min_size=1, max_size=3))
    body: dict[str, Any] = {"text": draw(hostile_or_long), "stream": True, "sampling_params": params}
    if draw(st.booleans()):
        body["rid"] = draw(hostile)
    return body


# -- the fuzzers ----------------------------------------------------------------------------------

ROUTES = {
    "chat": ("/v1/chat/completions", chat_bodies(), "openai"),
    "completions": ("/v1/completions", completion_bodies(), "openai"),
    "responses": ("/v1/responses", responses_bodies(), "responses"),
    "messages": ("/v1/messages", messages_bodies(), "messages"),
}


@pytest.mark.parametrize("route", list(ROUTES))
@SETTINGS
@given(data=st.data(), headers=headers_st, ascii_json=st.booleans())
def test_every_event_of_a_fuzzed_stream(openai_server, route, data, headers, ascii_json):
    path, bodies, kind = ROUTES[route]
    check(openai_server.port, path, data.draw(bodies, label="body"), headers, ascii_json, kind)


@SETTINGS
@given(body=generate_bodies(), headers=headers_st, ascii_json=st.booleans())
def test_every_event_of_a_fuzzed_sglang_stream(sglang_server, body, headers, ascii_json):
    check(sglang_server.port, "/generate", body, headers, ascii_json, "openai")


@pytest.mark.parametrize("route", ["openai", "sglang"])
def test_the_loop_never_stalled_and_health_always_answered(openai_server, sglang_server, route):
    """After the fuzzers above (this runs after them, in file order)."""
    w = openai_server if route == "openai" else sglang_server
    stats = w.finish()
    assert w.probe.answers > 0 and not w.probe.failures, w.probe.failures[:5]
    assert stats["watching"] and stats["probes"] > 0, stats
    assert stats["longest_stall_ms"] < STALL_MS, stats
