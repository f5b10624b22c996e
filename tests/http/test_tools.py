"""Tool calls in chat through a real `vllm-vcr serve` and the openai SDK: vLLM's gates and errors,
calls whose arguments validate against the tool's schema, finish reasons, streamed deltas, and
nothing reaching the engine for a refused request."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

MODEL = "vllm-vcr/sim"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"},
                                                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"},
                                     "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
PARSERS = ["hermes", "llama3_json", "mistral", "pythonic"]




@pytest.fixture(scope="module", params=PARSERS)
def tool_server(request, serve_harness, tmp_path_factory):
    sp = serve_harness.start_fast(tmp_path_factory, request.param, "--enable-auto-tool-choice",
                "--tool-call-parser", request.param)
    sp.parser = request.param
    yield sp
    sp.stop()


@pytest.fixture(scope="module")
def plain_server(serve_harness, tmp_path_factory):
    sp = serve_harness.start_fast(tmp_path_factory, "plain")
    yield sp
    sp.stop()


def client(sp) -> openai.OpenAI:
    return openai.OpenAI(base_url=sp.url + "/v1", api_key="x", max_retries=0)


def received(sp) -> int:
    return httpx.get(sp.control + "/stats", timeout=5).json()["requests_received"]


def check_call(call) -> None:
    assert call.type == "function"
    assert call.id.startswith("chatcmpl-tool-") or re.fullmatch("[A-Za-z0-9]{9}", call.id)
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_calls_validate_against_the_schema(tool_server, choice):
    c = client(tool_server)
    for seed in range(3):
        r = c.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=choice, seed=seed,
                                      max_tokens=400)
        ch = r.choices[0]
        assert ch.message.tool_calls, (tool_server.parser, ch.message)
        for call in ch.message.tool_calls:
            check_call(call)
        assert ch.message.content == ""  # vLLM: content or "" for forced calls
        if isinstance(choice, dict):
            assert [t.function.name for t in ch.message.tool_calls] == ["add"]
            assert ch.finish_reason == "stop"  # OpenAI: named calls finish with "stop"
        else:
            assert ch.finish_reason == "tool_calls"


def test_same_seed_same_call(tool_server):
    c = client(tool_server)
    runs = [c.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required", seed=11,
                                      max_tokens=400).choices[0].message.tool_calls for _ in range(2)]
    assert [(t.function.name, t.function.arguments) for t in runs[0]] == \
        [(t.function.name, t.function.arguments) for t in runs[1]]


def test_auto_calls_and_counts_tokens(tool_server):
    c = client(tool_server)
    r = c.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, seed=4, max_tokens=400)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
    for call in ch.message.tool_calls:
        check_call(call)
    assert r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_deltas_add_up_to_the_call(tool_server):
    c = client(tool_server)
    kw = dict(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required", seed=5, max_tokens=400)
    full = c.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert entry["id"] is None, "one header per call"
                    entry["id"], entry["name"] = d.id, d.function.name
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert [(calls[k]["name"], json.loads(calls[k]["arguments"])) for k in sorted(calls)] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in full]


def tool_deltas(sp, choice) -> list[tuple[dict, str | None]]:
    """(delta, finish_reason) of every chunk after the role chunk, as raw JSON."""
    body = {"model": MODEL, "messages": MSGS, "tools": TOOLS, "tool_choice": choice, "seed": 7, "max_tokens": 400,
            "stream": True}
    out = []
    with httpx.stream("POST", sp.url + "/v1/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out += [(c["delta"], c["finish_reason"]) for c in json.loads(line[6:])["choices"]]
    return out[1:]


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "add"}}])
def test_streamed_delta_shape(tool_server, choice):
    """The delta sequence of vLLM 0.32's streaming parsers (tests/conformance/test_play_tools.py
    checks the same rules against the real frontend)."""
    deltas = tool_deltas(tool_server, choice)
    forced_json = tool_server.parser == "pythonic" and choice != "auto"
    seen: set[int] = set()
    for delta, _ in deltas:
        calls = delta.get("tool_calls") or []
        if calls:  # hermes sets content explicitly (null); the other parsers leave it out
            assert ("content" in delta) == (tool_server.parser == "hermes" and not forced_json), delta
        for entry in calls:
            fn = entry["function"]
            if entry["index"] not in seen:  # the header: id, type, name (+ arguments on the JSON path)
                seen.add(entry["index"])
                assert entry["type"] == "function" and "name" in fn and entry["id"]
                assert ("arguments" in fn) == forced_json, entry
                if tool_server.parser == "mistral":
                    assert re.fullmatch("[A-Za-z0-9]{9}", entry["id"])
            else:
                assert "id" not in entry and "name" not in fn and "arguments" in fn
                assert ("type" in entry) == (tool_server.parser == "mistral"), entry
    assert seen, deltas
    last, finish = deltas[-1]
    assert finish == ("stop" if isinstance(choice, dict) else "tool_calls")
    if tool_server.parser == "llama3_json" and not forced_json:  # its parser re-reads the finished JSON
        assert last == {"tool_calls": [{"index": max(seen), "function": {"arguments": ""}}]}
    else:
        assert last == {}


def test_none_answers_in_text(tool_server):
    r = client(tool_server).chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="none",
                                                    max_tokens=5)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def test_parallel_tool_calls_false_keeps_one(tool_server):
    c = client(tool_server)
    for seed in range(6):
        r = c.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required", seed=seed,
                                      parallel_tool_calls=False, max_tokens=400)
        assert len(r.choices[0].message.tool_calls) == 1


GATES = [
    ({"tools": TOOLS}, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
     None),
    ({"tools": TOOLS, "tool_choice": "required"}, 'tool_choice="required" requires --tool-call-parser to be set',
     None),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}},
     'tool_choice=function "add" requires --tool-call-parser to be set', None),
]
CHECKS = [
    ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)",
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "The tool specified in `tool_choice` does not match any of the specified `tools` (parameter=tool_choice)",
     "tool_choice"),
    ({"tools": []}, "`tools` must not be an empty array. Either provide at least one tool or omit the field "
                    "entirely. (parameter=tools)", "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, 'Invalid value for `tool_choice`: sometimes! Only named tools, '
     '"none", "auto" or "required" are supported. (parameter=tool_choice)', "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
     'Expected field `name` in `function` in `tool_choice`! Correct usage: `{"type": "function", "function": '
     '{"name": "my_function"}}` (parameter=tool_choice.function.name)', "tool_choice.function.name"),
]


@pytest.mark.parametrize("body,message,param", GATES + CHECKS)
def test_refused_as_vllm_refuses(plain_server, body, message, param):
    before = received(plain_server)
    r = httpx.post(plain_server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": MSGS, "max_tokens": 5, **body}, timeout=10)
    assert r.status_code == 400
    assert r.json() == {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}
    assert received(plain_server) == before  # nothing reached the engine


def test_auto_probability_zero_never_calls(serve_harness, tmp_path_factory):
    sp = serve_harness.start_fast(tmp_path_factory, "p0", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                "--auto-tool-call-probability", "0")
    try:
        for seed in range(3):
            r = client(sp).chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, seed=seed, max_tokens=8)
            assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    finally:
        sp.stop()


def test_auto_choice_without_parser_is_a_cli_error(serve_harness, tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "vllm_vcr", "serve", "--enable-auto-tool-choice", "--port", "0"],
                         capture_output=True, text=True, timeout=60, env=serve_harness.subprocess_env(None))
    assert out.returncode == 2
    assert "--enable-auto-tool-choice requires --tool-call-parser" in out.stderr
