"""The tool-call text formats and the schema/regex instance generators, as properties."""

from __future__ import annotations

import json
import keyword
import re

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.frontend.structured.instances import json_instance, narrow_schema, regex_instance
from vllm_vcr.frontend.tools.calls import extract_calls, render_calls
from vllm_vcr.frontend.tools.formats import get_format

NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True).filter(lambda n: not keyword.iskeyword(n))
SCALARS = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(min_size=1, max_size=5), inner, max_size=3), max_leaves=6)
ARGS = st.dictionaries(NAMES, VALUES, max_size=4)
CALLS = st.lists(st.tuples(NAMES, ARGS), min_size=1, max_size=3)


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral", "pythonic"])
@settings(max_examples=40, deadline=None)
@given(calls=CALLS)
def test_render_then_parse_gives_the_calls(parser, calls):
    fmt = get_format(parser)
    content, parsed = fmt.parse(fmt.render(calls))
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [(n, a) for n, a in calls]


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
@settings(max_examples=30, deadline=None)
@given(calls=CALLS, cut=st.floats(0, 1))
def test_partial_arguments_are_prefixes(parser, calls, cut):
    fmt = get_format(parser)
    text = fmt.render(calls)
    _, partial = fmt.partial(text[: int(len(text) * cut)])
    for p, (name, args) in zip(partial, calls):
        if p.name is not None:
            assert p.name == name
            assert json.dumps(args, ensure_ascii=False).startswith(p.arguments)


def test_forced_json_for_pythonic():
    fmt = get_format("pythonic")
    named = {"type": "function", "function": {"name": "f"}}
    text = render_calls(fmt, [("f", {"x": 1})], named)
    assert text == '{"x": 1}' and extract_calls(fmt, text, named)[1][0].arguments == '{"x": 1}'
    text = render_calls(fmt, [("f", {"x": 1}), ("g", {})], "required")
    assert [c.name for c in extract_calls(fmt, text, "required")[1]] == ["f", "g"]


SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "string", "minLength": 3}, "b": {"type": "number"}},
     "required": ["a"]},
    {"type": "array", "items": {"enum": [1, "x", None]}, "minItems": 2},
    {"type": "object"},
    {"$defs": {"p": {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5}},
                     "required": ["n"]}},
     "type": "object", "properties": {"people": {"type": "array", "items": {"$ref": "#/$defs/p"}}},
     "required": ["people"]},
    {"anyOf": [{"type": "string", "pattern": "^x+$"}, {"type": "integer"}]},
    # vLLM's schema for tool_choice "required" (get_json_schema_from_tools): keys longer than a free object's
    {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [{"properties": {
        "name": {"type": "string", "enum": ["get_weather"]},
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        "required": ["name", "parameters"]}]}},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_instances_validate_and_repeat(schema):
    for seed in range(3):
        value = json_instance(schema, seed)
        jsonschema.validate(value, schema)
        assert json_instance(schema, seed) == value


@pytest.mark.parametrize("schema", SCHEMAS)
def test_narrowed_schema_only_narrows(schema):
    for seed in range(3):
        jsonschema.validate(json_instance(narrow_schema(schema), seed), schema)


@pytest.mark.parametrize("pattern", [r"\d{3}-\d{4}", r"(yes|no|maybe)", r"[A-Za-z]+@[a-z]+\.com", r"\w+\s\w+"])
def test_regex_instances_match(pattern):
    for seed in range(3):
        text = regex_instance(pattern, seed)
        assert re.fullmatch(pattern, text) and text == regex_instance(pattern, seed)
