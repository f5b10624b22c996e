"""Constrained outputs through the real vLLM frontend: `vllm-vcr play --tokenizer MODEL_DIR`
behind it emits ids whose text satisfies `sampling_params.structured_outputs`, so the real
frontend's structured-outputs answers and its tool parsers' extracted calls are valid."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from . import peers

pytestmark = pytest.mark.conformance

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"]}, "strict": True}}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}
# The real frontend refuses to start llama3_json (no <|python_tag|> token) and mistral (no
# [TOOL_CALLS] token) with the tiny model's tokenizer: test_play_tools.py runs them on the tiny
# tool model (scripts/make_tiny_tool_model.py).
PARSERS = ["hermes", "pythonic"]


@pytest.fixture(scope="module", params=PARSERS)
def stack(request, vllm_version):
    st = peers.start_stack(vllm_version, frontend_args=["--enable-auto-tool-choice", "--tool-call-parser",
                                                        request.param],
                           play_args=["--tokenizer", str(peers.MODEL_DIR), "--seed", "3",
                                      "--inter-token-latency", "0", "--time-to-first-token", "0"])
    st.parser = request.param
    yield st
    st.stop()


def client(st) -> openai.OpenAI:
    return openai.OpenAI(base_url=st.base_url + "/v1", api_key="x", max_retries=0)


def chat(st, **kw):
    return client(st).chat.completions.create(model=st.model, messages=MSGS, max_tokens=300, **kw)


def test_json_schema_answer(stack):
    r = chat(stack, seed=1, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


@pytest.mark.parametrize("so,ok", [({"regex": r"[a-z]{4}-\d{3}"}, lambda t: re.fullmatch(r"[a-z]{4}-\d{3}", t)),
                                   ({"choice": ["left", "right"]}, lambda t: t in ("left", "right"))])
def test_structured_outputs_answer(stack, so, ok):
    r = chat(stack, seed=2, extra_body={"structured_outputs": so})
    assert ok(r.choices[0].message.content), r.choices[0].message.content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_are_extracted(stack, choice):
    r = chat(stack, seed=3, tools=[TOOL], tool_choice=choice)
    calls = r.choices[0].message.tool_calls
    assert calls, f"{stack.parser}: no call in {r.choices[0].message}"
    assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), TOOL["function"]["parameters"])
