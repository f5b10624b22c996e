"""llama3_json, mistral and hermes tool calls through the real vLLM frontends: `vllm-vcr play
--tokenizer` behind them writes calls in the model family's own format (read from the tools the
chat template rendered into the prompt, or from the constraint the frontend sends), and the
frontend's real parser extracts calls whose arguments validate against the tool's schema,
non-streaming and streaming, for tool_choice auto, required and a named function.

The model is scripts/make_tiny_tool_model.py's: a tiny tokenizer with `<|python_tag|>` and the
Mistral v0.3 tokens (`[TOOL_CALLS]`, `[AVAILABLE_TOOLS]`, ...), without which the frontend
refuses these parsers, and Llama 3.1 / Mistral / Hermes chat templates.

The second half compares the delta structure of `serve`'s tool-call streams with the real
frontend's (which entries carry id, type, name, arguments; the content key; the id form; the
finish chunk), not the text."""

from __future__ import annotations

import json
import re

import httpx
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


@pytest.fixture(scope="module", params=["llama3_json", "mistral", "hermes"])
def stack(request, vllm_version):
    model = peers.tool_model_dir()
    template = ["--chat-template", str(model / f"tool_chat_template_{request.param}.jinja")] \
        if request.param in ("mistral", "hermes") else []
    # 40 ms a token: slow enough that a busy frontend still sends one token per chunk, which the
    # delta-shape comparison needs
    st = peers.start_stack(vllm_version, model_dir=model,
                           frontend_args=["--enable-auto-tool-choice", "--tool-call-parser", request.param,
                                          *template],
                           play_args=["--tokenizer", str(model), "--seed", "5",
                                      "--inter-token-latency", "40", "--time-to-first-token", "0"])
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
                entry = calls.setdefault(d.index, [None, ""])
                # the first delta of a call has its id (0.32's pre-v11 mistral path names a
                # forced call only in its last delta)
                assert d.id or entry[0] is not None or stack.parser == "mistral", d
                entry[0] = entry[0] or (d.function.name if d.function else None)
                entry[1] += (d.function.arguments or "") if d.function else ""
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


# --- the delta structure, the real frontend being the reference for `serve` ----------------------

# Where serve's shape knowingly differs from the reference (kept short):
# - mistral required/named: 0.32 reads a tokenizer without [ARGS] (pre-v11) through its legacy
#   JSON-list path, which streams the arguments before the name (the name comes in the last
#   delta); serve's mistral writes the v11 form `[TOOL_CALLS]name[ARGS]{...}`, streamed as "auto".
SHAPE_ALLOWED = {("mistral", "required"), ("mistral", "named")}


def stream_deltas(base_url: str, model: str, choice) -> list[tuple[dict, str | None, int]]:
    """(delta, finish_reason, tokens in the chunk) of every chunk after the role chunk."""
    body = {"model": model, "messages": MSGS, "tools": TOOLS, "tool_choice": choice, "seed": 21,
            "max_tokens": 300, "stream": True, "return_token_ids": True}
    out = []
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out += [(c["delta"], c["finish_reason"], len(c.get("token_ids") or ()))
                        for c in json.loads(line[6:])["choices"]]
    return out[1:]


def delta_shape(deltas: list[tuple[dict, str | None, int]]) -> dict:
    """What the delta sequence is made of, independent of the text: the key sets of headers and
    argument fragments, whether a delta with calls has a content key, the id form, the finish."""
    shape: dict = {"header": set(), "fragment": set(), "content_key": set(), "id": set()}
    seen: set[int] = set()
    for delta, _, _ in deltas:
        calls = delta.get("tool_calls") or []
        if calls:
            shape["content_key"].add("content" in delta)
        for entry in calls:
            kind = "fragment" if entry["index"] in seen else "header"
            seen.add(entry["index"])
            shape[kind].add((tuple(sorted(entry)), tuple(sorted(entry.get("function") or {}))))
            if "id" in entry:
                shape["id"].add("9 alphanumerics" if re.fullmatch("[A-Za-z0-9]{9}", entry["id"]) else
                                "chatcmpl-tool-" if entry["id"].startswith("chatcmpl-tool-") else entry["id"])
    # the finish delta may close the last call (llama3_json's empty fragment): which index that
    # is depends on how many calls this stream made, not on the shape
    finish = dict(deltas[-1][0])
    if finish.get("tool_calls"):
        finish["tool_calls"] = [{**e, "index": "last call" if e["index"] == max(seen) else e["index"]}
                                for e in finish["tool_calls"]]
    shape["finish"] = (finish, deltas[-1][1])
    return shape


@pytest.fixture(scope="module")
def serve_same_parser(stack, serve_harness, tmp_path_factory):
    sp = serve_harness.start_fast(tmp_path_factory, f"serve-{stack.parser}", "--enable-auto-tool-choice",
                                  "--tool-call-parser", stack.parser, "--inter-token-latency", "1")
    yield sp
    sp.stop()


@pytest.mark.parametrize("choice", list(CHOICES))
def test_delta_shape_matches_the_frontend(stack, serve_same_parser, choice):
    if (stack.parser, choice) in SHAPE_ALLOWED:
        pytest.skip("documented difference: SHAPE_ALLOWED")
    for _ in range(3):  # a busy frontend merges outputs into one chunk: that shape is not the parser's
        reference = stream_deltas(stack.base_url, stack.model, CHOICES[choice])
        if all(n <= 1 for _, _, n in reference):
            break
    else:
        pytest.skip("the frontend merged tokens into chunks three times (busy machine)")
    ours = stream_deltas(serve_same_parser.url, "vllm-vcr/sim", CHOICES[choice])
    assert delta_shape(ours) == delta_shape(reference), (ours, reference)
