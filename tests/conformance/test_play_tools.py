"""llama3_json and mistral tool calls through the real vLLM frontends: `vllm-vcr play
--tokenizer` behind them writes calls in the model family's own format (read from the tools the
chat template rendered into the prompt, or from the constraint the frontend sends), and the
frontend's real parser extracts calls whose arguments validate against the tool's schema,
non-streaming and streaming, for tool_choice auto, required and a named function.

The model is scripts/make_tiny_tool_model.py's: a tiny tokenizer with `<|python_tag|>` and the
Mistral v0.3 tokens (`[TOOL_CALLS]`, `[AVAILABLE_TOOLS]`, ...), without which the frontend
refuses these parsers."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from . import peers

pytestmark = pytest.mark.conformance

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]
CHOICES = {"auto": "auto", "required": "required",
           "named": {"type": "function", "function": {"name": "get_time"}}}


@pytest.fixture(scope="module", params=["llama3_json", "mistral"])
def stack(request, vllm_version):
    model = peers.tool_model_dir()
    template = ["--chat-template", str(model / "tool_chat_template_mistral.jinja")] \
        if request.param == "mistral" else []
    st = peers.start_stack(vllm_version, model_dir=model,
                           frontend_args=["--enable-auto-tool-choice", "--tool-call-parser", request.param,
                                          *template],
                           play_args=["--tokenizer", str(model), "--seed", "5",
                                      "--inter-token-latency", "10", "--time-to-first-token", "0"])
    st.parser = request.param
    yield st
    st.stop()


def client(st) -> openai.OpenAI:
    return openai.OpenAI(base_url=st.base_url + "/v1", api_key="x", max_retries=0)


def check_calls(st, choice, calls: list[tuple[str, str]]) -> None:
    assert calls, f"{st.parser}: no tool call extracted"
    for name, arguments in calls:
        if choice == "named":
            assert name == "get_time"
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("choice", list(CHOICES))
def test_calls_extracted(stack, choice):
    r = client(stack).chat.completions.create(model=stack.model, messages=MSGS, tools=TOOLS, max_tokens=300,
                                              seed=11, tool_choice=CHOICES[choice])
    msg = r.choices[0].message
    check_calls(stack, choice, [(c.function.name, c.function.arguments) for c in msg.tool_calls or ()])
    assert not (msg.content or "").strip(), msg.content
    if choice != "named":
        assert r.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("choice", list(CHOICES))
def test_calls_streamed(stack, choice):
    stream = client(stack).chat.completions.create(model=stack.model, messages=MSGS, tools=TOOLS,
                                                   max_tokens=300, seed=12, tool_choice=CHOICES[choice],
                                                   stream=True)
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or ():
                if d.index not in calls:  # the first delta of a call names it
                    assert d.id and d.function.name, d
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += (d.function.arguments or "") if d.function else ""
    check_calls(stack, choice, [(n, a) for n, a in calls.values()])
    if choice != "named":
        assert finish == "tool_calls"


def test_tool_result_answered_in_text(stack):
    """After a tool result the model answers in text: no call is extracted."""
    first = client(stack).chat.completions.create(model=stack.model, messages=MSGS, tools=TOOLS, max_tokens=300,
                                                  seed=13, tool_choice="auto").choices[0].message
    call = first.tool_calls[0]
    call_id = call.id if len(call.id) == 9 else "abcdefghi"  # Mistral ids are 9 alphanumerics
    msgs = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": call.function.name,
                                                          "arguments": call.function.arguments}}]},
                   {"role": "tool", "tool_call_id": call_id, "content": "sunny"}]
    r = client(stack).chat.completions.create(model=stack.model, messages=msgs, tools=TOOLS, max_tokens=20,
                                              seed=14, tool_choice="auto")
    assert not r.choices[0].message.tool_calls
