"""Structural tags: vLLM 0.32's verdicts (read from its venv with xgrammar 0.2.8) and texts that
each format accepts, checked with regexes and jsonschema written independently of the writer."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from vllm_vcr.frontend.protocol import RequestValueError
from vllm_vcr.frontend.structured.engine_source import constrained_text
from vllm_vcr.frontend.structured.instances import InstanceError
from vllm_vcr.frontend.structured.structural_tag import check_structural_tag, structural_tag_instance

OBJ = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


def st(fmt):
    return {"type": "structural_tag", "format": fmt}


def tag(begin, content, end):
    return {"type": "tag", "begin": begin, "content": content, "end": end}


LEGACY = {"type": "structural_tag", "triggers": ["<f="],
          "structures": [{"begin": "<f=a>", "schema": OBJ, "end": "</f>"},
                         {"begin": "<f=b>", "schema": {"type": "boolean"}, "end": "</f>"}]}
ACCEPTED = [
    LEGACY,
    st(tag("<a>", {"type": "json_schema", "json_schema": {"type": "integer"}}, "</a>")),
    st({"type": "triggered_tags", "triggers": ["<f"],
        "tags": [tag("<f1>", {"type": "json_schema", "json_schema": {"type": "object"}}, "</f1>")]}),
    st({"type": "sequence", "elements": [{"type": "const_string", "value": "A: "},
                                         {"type": "regex", "pattern": "[0-9]{3}"}, {"type": "any_text"}]}),
    st({"type": "or", "elements": [{"type": "grammar", "grammar": 'root ::= "x" [0-9]'},
                                   {"type": "const_string", "value": "q"}]}),
    st({"type": "sequence", "elements": [{"value": "x"}]}),  # xgrammar types a format by its fields
    st({"type": "repeat", "min": 2, "max": 3, "content": {"type": "const_string", "value": "ab"}}),
    st({"type": "tags_with_separator", "separator": ",", "at_least_one": True,
        "tags": [tag("<a>", {"type": "json_schema", "json_schema": {"type": "boolean"}}, "</a>")]}),
]
REFUSED = [
    {**LEGACY, "triggers": ["<g="]},  # a begin with no trigger
    {**LEGACY, "structures": []},
    st({"type": "bogus"}),
    st(tag("<a>", {"type": "json_schema", "json_schema": {"type": "nonsense"}}, "</a>")),
    st({"type": "triggered_tags", "triggers": ["<x"], "tags": [tag("<f1>", {"type": "any_text"}, "</f1>")]}),
    st({"type": "grammar", "grammar": "root ::= foo"}),
    st({"type": "plus", "content": {"type": "regex", "pattern": "(a"}}),
    {"type": "structural_tag"},
]


@pytest.mark.parametrize("doc", ACCEPTED)
def test_accepted_as_vllm_accepts(doc):
    check_structural_tag(doc, "response_format")
    check_structural_tag(json.dumps(doc), "structured_outputs")


@pytest.mark.parametrize("doc", REFUSED)
def test_refused_as_vllm_refuses(doc):
    with pytest.raises(RequestValueError) as e:
        check_structural_tag(doc, "response_format")
    assert str(e.value) == "Invalid response_format structural_tag specification. (parameter=response_format)"
    assert e.value.param == "response_format"


@pytest.mark.parametrize("seed", range(6))
def test_legacy_text_is_free_text_then_valid_tags(seed):
    text = structural_tag_instance(json.dumps(LEGACY), seed)
    segments = re.findall(r"<f=(a|b)>(.*?)</f>", text, re.S)
    assert segments
    for name, body in segments:
        jsonschema.validate(json.loads(body), OBJ if name == "a" else {"type": "boolean"})
    assert "<f=" not in re.sub(r"<f=(a|b)>.*?</f>", "", text, flags=re.S)


@pytest.mark.parametrize("doc,pattern", [
    (ACCEPTED[1], r"<a>-?\d+</a>"),
    (ACCEPTED[3], r"A: [0-9]{3}[^<]*"),
    (ACCEPTED[4], r"x[0-9]|q"),
    (ACCEPTED[5], r"x"),
    (ACCEPTED[6], r"(ab){2,3}"),
    (ACCEPTED[7], r"<a>(true|false)</a>(,<a>(true|false)</a>)*"),
    (st({"type": "sequence", "elements": [
        {"type": "optional", "content": {"type": "const_string", "value": "maybe "}},
        {"type": "plus", "content": {"type": "regex", "pattern": "[xy]"}},
        tag("[", {"type": "star", "content": {"type": "const_string", "value": "-"}}, ["]", ")"])]}),
     r"(maybe )?[xy]+\[-*[\])]"),
])
def test_format_texts(doc, pattern):
    for seed in range(4):
        text = structural_tag_instance(doc, seed)
        assert re.fullmatch(pattern, text, re.S), (pattern, text)


def test_token_formats_have_no_text_generator():
    with pytest.raises(InstanceError):
        structural_tag_instance(st({"type": "token", "token": 7}), 0)


def test_engine_side_reads_both_shapes():
    legacy = constrained_text({"structural_tag": json.dumps(LEGACY)}, 3)
    assert re.search(r"<f=(a|b)>.*</f>", legacy, re.S)
    fmt = constrained_text({"structural_tag": json.dumps(ACCEPTED[6])}, 3)
    assert re.fullmatch(r"(ab){2,3}", fmt)
