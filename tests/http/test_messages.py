"""Anthropic Messages through a real `vllm-vcr serve` and the anthropic SDK: text, tool use
(forced and named), the streaming events, count_tokens and errors in Anthropic's format."""

from __future__ import annotations


import anthropic
import httpx
import jsonschema
import pytest

MODEL = "vllm-vcr/sim"
TOOLS = [{"name": "get_weather", "description": "Weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                            "days": {"type": "integer", "minimum": 1}},
                           "required": ["city"]}}]
HI = [{"role": "user", "content": "hi"}]




@pytest.fixture(scope="module")
def server(serve_harness, tmp_path_factory):
    sp = serve_harness.start_fast(tmp_path_factory, "anthropic", "--enable-auto-tool-choice",
                "--tool-call-parser", "hermes")
    yield sp
    sp.stop()


@pytest.fixture(scope="module")
def plain(serve_harness, tmp_path_factory):
    sp = serve_harness.start_fast(tmp_path_factory, "anthropic-plain")
    yield sp
    sp.stop()


def client(sp) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=sp.url, api_key="x", max_retries=0)


def test_text_message(server):
    m = client(server).messages.create(model=MODEL, max_tokens=7, system="Be terse", messages=HI)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.stop_reason == "max_tokens" and m.content[0].type == "text" and m.content[0].text
    assert m.usage.output_tokens == 7 and m.usage.input_tokens > 0


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_tool_use(server, choice):
    m = client(server).messages.create(model=MODEL, max_tokens=300, messages=HI, tools=TOOLS, tool_choice=choice)
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, TOOLS[0]["input_schema"])


def test_stream_text_events(server):
    with client(server).messages.stream(model=MODEL, max_tokens=5, messages=HI) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[1] == "content_block_start" and "message_delta" in kinds
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 5 and final.content[0].text


def test_stream_tool_use(server):
    with client(server).messages.stream(model=MODEL, max_tokens=300, messages=HI, tools=TOOLS,
                                        tool_choice={"type": "any"}) as s:
        final = s.get_final_message()
    use = final.content[0]
    assert final.stop_reason == "tool_use" and use.type == "tool_use"
    jsonschema.validate(use.input, TOOLS[0]["input_schema"])


def test_tool_result_round_trip(server):
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                  "input": {"city": "Paris"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}]
    m = client(server).messages.create(model=MODEL, max_tokens=4, messages=history, tools=TOOLS,
                                       tool_choice={"type": "none"})
    assert m.content[0].type == "text"


def test_count_tokens_matches_usage(server):
    c = client(server)
    counted = c.messages.count_tokens(model=MODEL, messages=HI).input_tokens
    assert counted == c.messages.create(model=MODEL, max_tokens=1, messages=HI).usage.input_tokens


def test_errors_in_anthropic_format(plain):
    with pytest.raises(anthropic.BadRequestError) as e:
        client(plain).messages.create(model=MODEL, max_tokens=5, messages=HI, tools=TOOLS)
    assert e.value.body == {"type": "error", "error": {
        "type": "BadRequestError",
        "message": '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'}}
    r = httpx.post(plain.url + "/v1/messages", json={"model": "nope", "max_tokens": 3, "messages": HI}, timeout=10)
    assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "NotFoundError"
