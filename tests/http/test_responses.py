"""The Responses API through a real `vllm-vcr serve` and the openai SDK: bodies, the streaming
event sequence, tools, structured text, the store (GET, previous_response_id, background,
cancel) and its absence (vLLM's default)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

MODEL = "vllm-vcr/sim"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]




@pytest.fixture(scope="module")
def stored(serve_harness, tmp_path_factory):
    sp = serve_harness.start_fast(tmp_path_factory, "stored", "--enable-auto-tool-choice", "--tool-call-parser",
                "hermes", "--inter-token-latency", "5", env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    yield sp
    sp.stop()


@pytest.fixture(scope="module")
def default(serve_harness, tmp_path_factory):
    sp = serve_harness.start_fast(tmp_path_factory, "default")
    yield sp
    sp.stop()


def client(sp) -> openai.OpenAI:
    return openai.OpenAI(base_url=sp.url + "/v1", api_key="x", max_retries=0)


def test_text_response(default):
    r = client(default).responses.create(model=MODEL, input="Say hi", instructions="Be brief", max_output_tokens=6)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output_text
    assert r.usage.output_tokens == 6 and r.usage.total_tokens == r.usage.input_tokens + 6
    assert r.max_output_tokens == 6 and r.tool_choice == "none" and r.instructions == "Be brief"


def test_stream_event_sequence(default):
    events = list(client(default).responses.create(model=MODEL, input="x", max_output_tokens=4, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output[0].content[0].text == text and final.usage.output_tokens == 4


def test_function_call_items(stored):
    c = client(stored)
    r = c.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, tool_choice="required",
                           extra_body={"seed": 3})
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), TOOLS[0]["parameters"])


def test_streamed_function_call(stored):
    with client(stored).responses.stream(model=MODEL, input="Weather?", tools=TOOLS, tool_choice="required",
                                         extra_body={"seed": 4}) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    call = final.output[0]
    assert call.type == "function_call" and json.loads(call.arguments)["city"]


def test_json_schema_text_format(default):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = client(default).responses.create(model=MODEL, input="a number", max_output_tokens=200, extra_body={"seed": 1},
                                         text={"format": {"type": "json_schema", "name": "num", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_store_get_and_previous_response(stored):
    c = client(stored)
    first = c.responses.create(model=MODEL, input="one", max_output_tokens=3)
    assert c.responses.retrieve(first.id).output[0].content[0].text == first.output_text
    second = c.responses.create(model=MODEL, input="two", previous_response_id=first.id, max_output_tokens=3)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens  # the history is in the prompt


def test_background_and_cancel(stored):
    c = client(stored)
    b = c.responses.create(model=MODEL, input="long", max_output_tokens=2000, background=True)
    assert b.status == "queued"
    assert c.responses.cancel(b.id).status == "cancelled"
    assert c.responses.retrieve(b.id).status == "cancelled"
    done = c.responses.create(model=MODEL, input="short", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response."):
        c.responses.cancel(done.id)


def test_background_stream_and_replay(stored):
    """background + stream (vLLM 0.32 runs it): the POST streams the events as they come; GET
    ?stream=true replays them after `starting_after`, and the stored response completes."""
    c = client(stored)
    events = list(c.responses.create(model=MODEL, input="hello", max_output_tokens=6, background=True, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    rid = events[0].response.id
    replay = list(c.responses.retrieve(rid, stream=True, starting_after=2))
    assert [e.model_dump() for e in replay] == [e.model_dump() for e in events[3:]]
    stored = c.responses.retrieve(rid)
    assert stored.status == events[-1].response.status != "queued"
    assert stored.output[0].content[0].text == events[-1].response.output[0].content[0].text


def test_background_stream_cancelled(stored):
    c = client(stored)
    stream = c.responses.create(model=MODEL, input="long", max_output_tokens=2000, background=True, stream=True)
    first = next(iter(stream))
    assert c.responses.cancel(first.response.id).status == "cancelled"
    rest = list(stream)  # the stream ends when the response is cancelled
    assert all(e.type != "response.completed" for e in rest)
    assert c.responses.retrieve(first.response.id).status == "cancelled"


def test_stream_retrieve_of_a_foreground_response(stored):
    c = client(stored)
    r = c.responses.create(model=MODEL, input="one", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match=f"Unknown response_id: {r.id}"):
        list(c.responses.retrieve(r.id, stream=True))


def test_without_store_nothing_is_found(default):
    c = client(default)
    r = c.responses.create(model=MODEL, input="one", max_output_tokens=2)
    body = httpx.get(default.url + f"/v1/responses/{r.id}", timeout=10).json()
    assert body == {"error": {"message": f"Response with id '{r.id}' not found.", "type": "invalid_request_error",
                              "param": "response_id", "code": 404}}
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model=MODEL, input="two", previous_response_id=r.id)
    with pytest.raises(openai.BadRequestError, match="does not support the background mode"):
        c.responses.create(model=MODEL, input="x", background=True)


def test_tool_choice_checks(default):
    r = httpx.post(default.url + "/v1/responses", json={"model": MODEL, "input": "x", "tool_choice": "required"},
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "Tool choice 'required' must be specified with 'tools' parameter. (parameter=tool_choice)")
