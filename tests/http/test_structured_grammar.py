"""`grammar` and `structural_tag` structured outputs through a real `vllm-vcr serve` and the
openai SDK: every answer satisfies its constraint (checked with lark / jsonschema), the counts
agree with the tokenizer, and what vLLM 0.32 refuses is its 400 before the engine sees it."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import lark
import openai
import pytest

MODEL = "vllm-vcr/sim"
MSGS = [{"role": "user", "content": "Answer."}]
GBNF = 'root ::= item ("," item){1,3}\nitem ::= [a-z]{2,5} "=" [0-9]+'
LARK = '?start: sum\nsum: NUMBER ("+" NUMBER)*\n%import common.INT -> NUMBER'
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
          "required": ["city", "days"]}
LEGACY_TAG = {"type": "structural_tag", "triggers": ["<function="],
              "structures": [{"begin": "<function=weather>", "schema": SCHEMA, "end": "</function>"}]}
FORMAT_TAG = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "Result: "},
    {"type": "tag", "begin": "<answer>", "content": {"type": "json_schema", "json_schema": SCHEMA},
     "end": ["</answer>", "</a>"]},
    {"type": "regex", "pattern": r" \(code [A-Z]{3}\)"}]}}
TAGGED = re.compile(r"<function=weather>(.*?)</function>", re.S)


@pytest.fixture(scope="module")
def server(serve_harness, tmp_path_factory):
    sp = serve_harness.start_fast(tmp_path_factory, "structured-grammar")
    yield sp
    sp.stop()


def chat(sp, **kw):
    client = openai.OpenAI(base_url=sp.url + "/v1", api_key="x", max_retries=0)
    return client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=400, **kw)


@pytest.mark.parametrize("grammar", [GBNF, LARK])
def test_grammar_answers_parse(server, grammar):
    parser = lark.Lark(LARK) if grammar is LARK else None
    texts = set()
    for seed in range(4):
        r = chat(server, seed=seed, extra_body={"structured_outputs": {"grammar": grammar}})
        text = r.choices[0].message.content
        if parser is not None:
            parser.parse(text)
        else:
            assert re.fullmatch(r"[a-z]{2,5}=[0-9]+(,[a-z]{2,5}=[0-9]+){1,3}", text), text
        texts.add(text)
    assert len(texts) > 1


def test_legacy_structural_tag_response_format(server):
    for seed in range(3):
        text = chat(server, seed=seed, response_format=LEGACY_TAG).choices[0].message.content
        bodies = TAGGED.findall(text)
        assert bodies, text
        for body in bodies:
            jsonschema.validate(json.loads(body), SCHEMA)
        assert "<function=" not in TAGGED.sub("", text)  # the free text around tags has no trigger


def test_format_structural_tag_in_structured_outputs(server):
    so = {"structural_tag": json.dumps(FORMAT_TAG)}
    text = chat(server, seed=4, extra_body={"structured_outputs": so}).choices[0].message.content
    m = re.fullmatch(r"Result: <answer>(.*)</answer> \(code [A-Z]{3}\)", text, re.S)
    assert m is not None, text
    jsonschema.validate(json.loads(m.group(1)), SCHEMA)


def test_counts_agree_with_the_tokenizer(server):
    for body in ({"structured_outputs": {"grammar": GBNF}}, {"response_format": LEGACY_TAG}):
        r = chat(server, seed=5, extra_body=body)
        text = r.choices[0].message.content
        tok = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False},
                         timeout=10).json()
        assert r.usage.completion_tokens == tok["count"] + 1  # the text's tokens, then EOS
        detok = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}, timeout=10)
        assert detok.json()["prompt"] == text


def test_streamed_grammar_answer_is_the_same(server):
    body = {"structured_outputs": {"grammar": LARK}}
    full = chat(server, seed=8, extra_body=body).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in chat(server, seed=8, extra_body=body, stream=True)
             if c.choices]
    assert "".join(parts) == full


def complete(sp, **body) -> dict:
    r = httpx.post(sp.url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "Answer:", "max_tokens": 400, **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("body,check", [
    ({"structured_outputs": {"grammar": GBNF}},
     lambda t: re.fullmatch(r"[a-z]{2,5}=[0-9]+(,[a-z]{2,5}=[0-9]+){1,3}", t)),
    ({"structured_outputs": {"regex": r"[A-Z]{3}\d"}}, lambda t: re.fullmatch(r"[A-Z]{3}\d", t)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"response_format": LEGACY_TAG}, lambda t: TAGGED.search(t)),
])
def test_completions_are_constrained_too(server, body, check):
    for seed in range(2):
        r = complete(server, seed=seed, n=2, **body)
        for choice in r["choices"]:
            assert check(choice["text"]), choice["text"]
            assert choice["finish_reason"] == "stop"


def test_completion_count_error_names_the_parameter(server):
    r = httpx.post(server.url + "/v1/completions", timeout=10, json={
        "model": MODEL, "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "You can only use one kind of constraints for structured outputs "
                                            "('json', 'regex' or 'choice'). (parameter=structured_outputs)",
                                 "type": "BadRequestError", "param": "structured_outputs", "code": 400}
