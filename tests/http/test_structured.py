"""Structured outputs through a real `vllm-vcr serve`: every output satisfies its constraint,
`client.beta.chat.completions.parse` works, token counts agree with the tokenizer, and an
invalid constraint is vLLM's 400 before anything reaches the engine."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

MODEL = "vllm-vcr/sim"
MSGS = [{"role": "user", "content": "Describe a city."}]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "population": {"type": "integer", "minimum": 0},
    "coast": {"type": "boolean"}, "districts": {"type": "array", "items": {"type": "string"}, "minItems": 1},
    "mayor": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
    "required": ["name", "population", "districts", "mayor"]}


@pytest.fixture(scope="module")
def server(serve_harness, tmp_path_factory):
    sp = serve_harness.start_fast(tmp_path_factory, "structured")
    yield sp
    sp.stop()


def client(sp) -> openai.OpenAI:
    return openai.OpenAI(base_url=sp.url + "/v1", api_key="x", max_retries=0)


def chat(sp, **kw):
    return client(sp).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=600, **kw)


def test_json_schema_response_format(server):
    texts = set()
    for seed in range(4):
        r = chat(server, seed=seed, response_format={"type": "json_schema",
                                                     "json_schema": {"name": "city", "schema": SCHEMA}})
        text = r.choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)
        assert r.choices[0].finish_reason == "stop"
        texts.add(text)
    assert len(texts) > 1  # seeds vary the instance


def test_same_seed_same_document(server):
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    assert chat(server, seed=9, response_format=rf).choices[0].message.content == \
        chat(server, seed=9, response_format=rf).choices[0].message.content


def test_token_counts_agree_with_the_tokenizer(server):
    r = chat(server, seed=2, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert isinstance(json.loads(text), dict)
    tok = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False},
                     timeout=10).json()
    assert r.usage.completion_tokens == tok["count"] + 1  # the text's tokens, then EOS


class Mayor(BaseModel):
    name: str


class City(BaseModel):
    name: str
    population: int
    districts: list[str]
    mayor: Mayor


def test_beta_parse_with_a_pydantic_model(server):
    r = client(server).beta.chat.completions.parse(model=MODEL, messages=MSGS, response_format=City, seed=3,
                                                   max_tokens=600)
    assert isinstance(r.choices[0].message.parsed, City)


@pytest.mark.parametrize("so,check", [
    ({"regex": r"[A-Z]{2}-\d{4}"}, lambda t: re.fullmatch(r"[A-Z]{2}-\d{4}", t)),
    ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"json": {"type": "array", "items": {"type": "integer"}, "minItems": 2}},
     lambda t: jsonschema.validate(json.loads(t), {"type": "array", "items": {"type": "integer"},
                                                   "minItems": 2}) is None),
    ({"json": json.dumps({"type": "string", "enum": ["a", "b"]})}, lambda t: json.loads(t) in ("a", "b")),
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
])
def test_structured_outputs_satisfied(server, so, check):
    for seed in range(3):
        r = chat(server, seed=seed, extra_body={"structured_outputs": so})
        assert check(r.choices[0].message.content), r.choices[0].message.content


def test_streamed_document_is_the_same(server):
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    full = chat(server, seed=6, response_format=rf).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in chat(server, seed=6, response_format=rf, stream=True)
             if c.choices]
    assert "".join(parts) == full


def test_n_choices_each_satisfy(server):
    r = chat(server, seed=1, n=3, extra_body={"structured_outputs": {"regex": r"\d{5}"}})
    assert len(r.choices) == 3 and all(re.fullmatch(r"\d{5}", c.message.content) for c in r.choices)


BAD = [
    ({"response_format": {"type": "json_schema"}},
     "When response_format type is 'json_schema', the 'json_schema' field must be provided. "
     "(parameter=response_format)", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "Grammar error: Invalid type: nonsense", None),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}},
     "You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice').", None),
    ({"structured_outputs": {"choice": []}}, "Choice '[]' cannot be an empty list", None),
    ({"structured_outputs": {"json": "{not json"}}, "Invalid JSON grammar specification.", None),
    ({"structured_outputs": {"json_object": False}},
     "structured_outputs.json_object must be True if set; omit structured_outputs to disable structured outputs",
     None),
    # grammars (vLLM's xgrammar-then-llguidance verdict) and structural tags
    ({"structured_outputs": {"grammar": "root ::= foo"}},
     "Invalid grammar specification: Failed to convert the grammar from GBNF to Lark: Rule 'foo' not found", None),
    ({"structured_outputs": {"grammar": "start: foo"}},
     'Grammar error: at 1(8): unknown name: "foo"\n   1 | start: foo\n              ^', None),
    ({"structured_outputs": {"grammar": "  "}}, "structured_outputs.grammar cannot be an empty string", None),
    ({"response_format": {"type": "structural_tag", "format": {"type": "bogus"}}},
     "Invalid response_format structural_tag specification. (parameter=response_format)", "response_format"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<tool>"], "structures": [
        {"begin": "<function=f>", "schema": {"type": "object"}, "end": "</function>"}]}},
     "Invalid response_format structural_tag specification. (parameter=response_format)", "response_format"),
    ({"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag", "format": {
        "type": "regex", "pattern": "(a"}})}},
     "Invalid structured_outputs structural_tag specification. (parameter=structured_outputs)", "structured_outputs"),
]


@pytest.mark.parametrize("body,message,param", BAD)
def test_invalid_constraints_are_refused(server, body, message, param):
    before = httpx.get(server.control + "/stats", timeout=5).json()["requests_received"]
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": MSGS, "max_tokens": 5, **body}, timeout=10)
    assert r.status_code == 400
    assert r.json() == {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}
    assert httpx.get(server.control + "/stats", timeout=5).json()["requests_received"] == before


def test_bad_regex_is_a_400(server):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": MSGS, "structured_outputs": {"regex": "(a"}}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("Grammar error:")
