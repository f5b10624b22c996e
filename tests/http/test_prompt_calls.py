"""play's tool calls for unconstrained prompts: the tools the chat template rendered are read back
and a call in the family's format comes out (tests/conformance/test_play_tools.py runs the real
frontends' parsers on them)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from vllm_vcr.frontend.chat_template import ChatTemplate
from vllm_vcr.frontend.tokenizer import load_tokenizer
from vllm_vcr.frontend.tools.formats import HermesFormat, Llama3JsonFormat
from vllm_vcr.frontend.tools.prompt_calls import prompt_call_text, prompt_tool_schemas, prompt_tools

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"]}}}
SCHEMA = TOOL["function"]["parameters"]
ASK = [{"role": "user", "content": "Weather in {Paris} [today]?"}]
ANSWERED = ASK + [{"role": "assistant", "content": None, "tool_calls": [
    {"id": "abcdefghi", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "abcdefghi", "content": "sunny"}]


@pytest.fixture(scope="module")
def model(tiny_tool_model):
    return tiny_tool_model


def render(model, name: str | None, messages) -> str:
    tok = load_tokenizer(model)
    if name is None:
        return tok.apply_chat_template(messages, tools=[TOOL])
    template = ChatTemplate((model / f"tool_chat_template_{name}.jinja").read_text())
    return template.render(messages, add_generation_prompt=True, tools=[TOOL], bos_token="<s>", eos_token="</s>")


def vocab(model) -> dict[str, int]:
    return load_tokenizer(model).hf.get_vocab()


@pytest.mark.parametrize("family", [None, "mistral", "hermes"])
def test_the_rendered_tools_are_read_back(model, family):
    prompt = render(model, family, ASK)
    assert prompt_tools(prompt) == [TOOL]
    assert prompt_tool_schemas(prompt) == {"get_weather": SCHEMA}


def test_llama3_writes_json_with_parameters(model):
    text = prompt_call_text(render(model, None, ASK), vocab(model), lambda: 7)
    (call,) = Llama3JsonFormat().parse(text)[1]
    assert call.name == "get_weather" and json.loads(text)["parameters"] == json.loads(call.arguments)
    jsonschema.validate(json.loads(call.arguments), SCHEMA)


def test_mistral_without_args_token_writes_the_pre_v11_list(model):
    text = prompt_call_text(render(model, "mistral", ASK), vocab(model), lambda: 7)
    assert text.startswith("[TOOL_CALLS] [")
    (call,) = json.loads(text[len("[TOOL_CALLS] "):])
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], SCHEMA)


def test_hermes_writes_a_tool_call_tag(model):
    text = prompt_call_text(render(model, "hermes", ASK), vocab(model), lambda: 7)
    (call,) = HermesFormat().parse(text)[1]
    jsonschema.validate(json.loads(call.arguments), SCHEMA)


@pytest.mark.parametrize("family", [None, "mistral", "hermes"])
def test_a_tool_result_is_answered_in_text(model, family):
    assert prompt_call_text(render(model, family, ANSWERED), vocab(model), lambda: 7) is None


def test_no_tools_no_call(model):
    assert prompt_call_text(load_tokenizer(model).apply_chat_template(ASK), vocab(model), lambda: 7) is None


def test_same_seed_same_call(model):
    prompt = render(model, "mistral", ASK)
    assert prompt_call_text(prompt, vocab(model), lambda: 3) == prompt_call_text(prompt, vocab(model), lambda: 3)
