"""The conversation as a chat template gets it from vLLM: message content as a string (`string`)
or OpenAI's list of parts (`openai`), chosen by `--chat-template-content-format` or, by default,
from the template's syntax tree; the part types a text-only model takes or refuses; the keys of a
message vLLM keeps; tool-call arguments as objects. tests/conformance compares the renders with
the real frontends."""

from __future__ import annotations

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_vcr.frontend.chat_template import ChatTemplate
from vllm_vcr.frontend.content_format import detect_content_format, resolve_content_format
from vllm_vcr.frontend.errors import HTTPError
from vllm_vcr.frontend.conversation import developer_as_system, normalize_messages

from tests.chat_conversations import MEDIA_PARTS, OTHER_PARTS_CONVERSATION, PARTS_CONVERSATION

# a template that takes both shapes (strings as they are, parts one by one) and shows which it got
BOTH = ("{% for m in messages %}{{ m.role }}:{% if m.content is string %}S[{{ m.content }}]{% else %}"
        "{% for p in m.content %}P[{{ p.type }}|{{ p.text }}{% if p.cache_control is defined %}|cc{% endif %}]"
        "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}")

OPENAI_TEMPLATES = {
    "loop over message.content": "{% for m in messages %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}",
    "item access, filter": "{% for m in messages %}{% for c in m['content'] | list %}{{ c }}{% endfor %}{% endfor %}",
    "a test around it": "{% for m in messages %}{% for c in m.content if c is mapping %}{% endfor %}{% endfor %}",
    "messages sliced and set": ("{% set rest = messages[1:] %}{% set more = rest %}{% for m in more %}"
                                "{% for c in m.content %}{% endfor %}{% endfor %}"),
    "a namespace attribute": ("{% set ns = namespace(rest=messages) %}{% for m in ns.rest %}"
                              "{% for c in m.content %}{% endfor %}{% endfor %}"),
    "a namespace attribute set later": ("{% set ns = namespace(rest=[]) %}{% set ns.rest = messages %}"
                                        "{% for m in ns.rest %}{% for c in m.content %}{% endfor %}{% endfor %}"),
    "a macro's parameter": ("{% macro show(x) %}{% for p in x %}{{ p.text }}{% endfor %}{% endmacro %}"
                            "{% for m in messages %}{{ show(m.content) }}{% endfor %}"),
    "a macro's keyword": ("{% macro show(x, y) %}{% for p in y %}{% endfor %}{% endmacro %}"
                          "{% for m in messages %}{{ show(1, y=m['content']) }}{% endfor %}"),
    "a variable named content": ("{% for m in messages %}{% set content = m.content %}"
                                 "{% for p in content %}{% endfor %}{% endfor %}"),
    "generation tags": ("{% for m in messages %}{% generation %}{% for c in m.content %}{{ c.text }}{% endfor %}"
                        "{% endgeneration %}{% endfor %}"),
}
STRING_TEMPLATES = {
    "content printed": "{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}",
    "content tested only": "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% endif %}{% endfor %}",
    "a loop over something else": "{% for m in messages %}{% for t in m.tool_calls %}{% endfor %}{% endfor %}",
    "a macro's loop over its own list": ("{% macro show(x) %}{% for p in x %}{% endfor %}{% endmacro %}"
                                         "{{ show(tools) }}{% for m in messages %}{{ m.content }}{% endfor %}"),
    "a variable named content in a macro": ("{% macro show(content) %}{% for p in content %}{% endfor %}"
                                            "{% endmacro %}{% for m in messages %}{% endfor %}"),
    "a loop over messages with two targets": ("{% for a, b in messages %}{% endfor %}{% for m in messages %}"
                                              "{% for c in m.content %}{% endfor %}{% endfor %}"),
    "not a template": "{% for m in messages %}{{ m.content ",
}


@pytest.mark.parametrize("name", OPENAI_TEMPLATES)
def test_templates_that_loop_over_content_get_parts(name):
    assert detect_content_format(OPENAI_TEMPLATES[name]) == "openai"


@pytest.mark.parametrize("name", STRING_TEMPLATES)
def test_other_templates_get_strings(name):
    assert detect_content_format(STRING_TEMPLATES[name]) == "string"


def test_the_flag_wins_over_the_detection():
    loop = OPENAI_TEMPLATES["loop over message.content"]
    assert resolve_content_format("auto", loop) == "openai"
    assert resolve_content_format("string", loop) == "string"
    assert resolve_content_format("openai", STRING_TEMPLATES["content printed"]) == "openai"
    assert resolve_content_format("auto", None) == "string"


def test_the_two_shapes_of_one_conversation():
    strings = normalize_messages(PARTS_CONVERSATION, "string")
    assert [m["content"] for m in strings] == ["Be terse.", "one\ntwo", "", "r1\nr2", "Be kind.", "three"]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {}}}
    assert strings[2]["tool_calls"] == [call] and strings[5] is PARTS_CONVERSATION[5]
    parts = normalize_messages(PARTS_CONVERSATION, "openai")
    assert [m["content"] for m in parts] == [
        [{"type": "text", "text": "Be terse."}],
        [{"type": "text", "text": "one"}, {"type": "text", "text": "two", "cache_control": {"type": "ephemeral"}}],
        [],
        "r1\nr2",  # a tool message's text parts stay joined
        [{"type": "text", "text": "Be kind."}],
        [{"type": "text", "text": "three"}],
    ]
    assert ChatTemplate(BOTH).render(parts) == ("system:P[text|Be terse.]\nuser:P[text|one]P[text|two|cc]\n"
                                                "assistant:\ntool:S[r1\nr2]\ndeveloper:P[text|Be kind.]\n"
                                                "user:P[text|three]\n")


def test_thinking_refusal_and_tool_reference_parts():
    strings = normalize_messages(OTHER_PARTS_CONVERSATION, "string")
    assert [m["content"] for m in strings] == ["get_weather\ngo", "hm\nno", "get_weather"]
    parts = normalize_messages(OTHER_PARTS_CONVERSATION, "openai")
    assert [m["content"] for m in parts] == [
        [{"type": "tool_reference", "name": "get_weather"}, {"type": "text", "text": "go"}],
        [{"type": "text", "text": "hm"}, {"type": "text", "text": "no"}],  # (a refusal's text is its `refusal`)
        [{"type": "tool_reference", "name": "get_weather"}],  # a tool message with a reference keeps its parts
    ]


@pytest.mark.parametrize("kind", MEDIA_PARTS)
def test_a_media_part_is_refused_as_vllm_refuses_it(kind):
    with pytest.raises(HTTPError) as e:
        normalize_messages([{"role": "user", "content": [MEDIA_PARTS[kind]]}], "string", "/root/models/tiny")
    assert (e.value.status, e.value.message, e.value.param) == (400, "<path> is not a multimodal model", None)


def _call(arguments):
    return {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}


@pytest.mark.parametrize("arguments,seen", [
    ('{"city":"Paris","n":1}', {"city": "Paris", "n": 1}), ({"a": 1}, {"a": 1}), ("not json", {}), ("[1, 2]", {}),
    ("", {}), (None, {}), ("null", {}), ([1], {})])
def test_tool_call_arguments_reach_the_template_as_an_object(arguments, seen):
    conv = [{"role": "assistant", "content": None, "tool_calls": [_call(arguments)]}]
    for fmt in ("string", "openai"):
        assert normalize_messages(conv, fmt)[0]["tool_calls"][0]["function"]["arguments"] == seen
    assert conv[0]["tool_calls"][0]["function"]["arguments"] == arguments  # (the request's own untouched)


def test_the_keys_vllm_keeps_and_the_ones_it_drops():
    conv = [{"role": "user", "content": "q", "foo": 1, "tool_call_id": "x", "name": "bob", "task": "t"},
            {"role": "assistant", "content": "a", "reasoning_content": "r", "tool_calls": [], "name": 3},
            {"role": "tool", "content": "r", "tool_call_id": "c1", "reasoning": "no"},
            {"role": "developer", "content": "d"}]
    assert normalize_messages(conv) == [
        {"role": "user", "content": "q", "name": "bob", "task": "t"},
        {"role": "assistant", "content": "a", "reasoning": "r", "reasoning_content": "r"},  # no empty tool_calls
        {"role": "tool", "content": "r", "tool_call_id": "c1"},
        {"role": "developer", "content": "d", "tools": None}]


@pytest.mark.parametrize("calls,message", [
    ([3], "assistant tool_calls entries must be objects."),
    ([{"type": "custom", "custom": {}}], "chat completions only support assistant tool_calls of type 'function'.")])
def test_malformed_tool_calls_get_vllms_400(calls, message):
    with pytest.raises(HTTPError) as e:
        normalize_messages([{"role": "assistant", "content": "", "tool_calls": calls}])
    assert (e.value.status, e.value.message, e.value.param) == (400, message, "tool_calls")


def test_a_header_line_alone_drops_its_part_and_other_roles_keep_it():
    conv = [{"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: a"},
                                           {"type": "text", "text": "kept"}]},
            {"role": "user", "content": "x-anthropic-billing-header: b\nasked"}]
    assert [m["content"] for m in normalize_messages(conv)] == ["kept", "x-anthropic-billing-header: b\nasked"]


def test_developer_messages_merge_as_text_in_either_shape():
    conv = normalize_messages([{"role": "system", "content": "A."}, {"role": "user", "content": "hi"},
                               {"role": "developer", "content": [{"type": "text", "text": "B."}]}], "openai")
    merged = developer_as_system(conv, "{% for m in messages %}{% for c in m.content %}{% endfor %}{% endfor %}")
    assert merged[0] == {"role": "system", "content": "A.\n\nB."}


def test_serve_renders_each_shape(tmp_path, serve_process):
    template = tmp_path / "both.jinja"
    template.write_text(BOTH)
    messages = [*PARTS_CONVERSATION[:2], {"role": "assistant", "content": [{"type": "text", "text": "par"}]}]

    def rendered(sp, **extra) -> str:
        r = httpx.post(sp.url + "/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": messages, "max_tokens": 200, "ignore_eos": True, **extra})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    common = ("--served-model-name", "m", "--mode", "echo", "--inter-token-latency", "0", "--time-to-first-token",
              "0", "--chat-template", str(template))
    auto = serve_process(*common)
    assert rendered(auto, add_generation_prompt=False).startswith(
        "system:P[text|Be terse.]\nuser:P[text|one]P[text|two|cc]\nassistant:P[text|par]")
    # the final message continued: the render ends at its last text part, as transformers cuts it (the
    # echo then starts the prompt again)
    assert "assistant:P[text|parsystem:" in rendered(auto, add_generation_prompt=False, continue_final_message=True)
    client = openai.OpenAI(base_url=auto.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=20)
    assert r.choices[0].message.content.startswith("user:P[text|hi]")
    auto.stop()
    forced = serve_process(*common, "--chat-template-content-format", "string")
    assert rendered(forced, add_generation_prompt=False).startswith(
        "system:S[Be terse.]\nuser:S[one\ntwo]\nassistant:S[par]")


_text = st.one_of(st.text(max_size=12), st.text(max_size=8).map(lambda t: "x-anthropic-billing-header: " + t))
_part = st.one_of(_text, st.builds(lambda t, ty: {"type": ty, "text": t}, _text,
                                   st.sampled_from(["text", "input_text", "output_text"])))
_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
                                  "content": st.one_of(st.none(), _text, st.lists(_part, max_size=4))})


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # (a loaded box)
@given(st.lists(_message, max_size=6))
def test_both_shapes_carry_the_same_text(conv):
    """Whatever the conversation, the two shapes hold the same texts: the joined string of the
    `string` shape is the `openai` shape's parts joined, and a plain string message (the fast
    path) comes back as it was given."""
    strings = normalize_messages(conv, "string")
    parts = normalize_messages(conv, "openai")
    for given_msg, s, p in zip(conv, strings, parts):
        assert isinstance(s["content"], str)
        joined = p["content"] if isinstance(p["content"], str) else "\n".join(x["text"] for x in p["content"])
        assert joined == s["content"]
        plain = isinstance(given_msg["content"], str) and given_msg["role"] != "developer" and not (
            given_msg["role"] == "system" and given_msg["content"].startswith("x-anthropic-billing-header"))
        assert (s is given_msg) is plain
