"""The engine-side constrained token source (what `play --tokenizer` installs)."""

from __future__ import annotations

import json
import random
import re
from types import SimpleNamespace

import jsonschema

from vllm_vcr.frontend.structured.engine_source import constrained_text, constrained_token_source, grammar_choices
from vllm_vcr.frontend.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
HERMES_TAG = {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": [
    {"type": "tag", "begin": '<tool_call>\n{"name": "get_weather", "arguments": ',
     "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": "}\n</tool_call>"}],
    "separator": "", "at_least_one": True, "stop_after_first": False}}


def test_structural_tag_is_filled_with_a_schema_instance():
    text = constrained_text({"structural_tag": json.dumps(HERMES_TAG)}, 5)
    m = re.fullmatch(r'<tool_call>\n\{"name": "get_weather", "arguments": (.*)\}\n</tool_call>', text, re.S)
    assert m is not None
    jsonschema.validate(json.loads(m.group(1)), SCHEMA)


def test_free_arguments_are_an_object():
    tag = json.loads(json.dumps(HERMES_TAG))
    tag["format"]["tags"][0]["content"]["json_schema"] = True
    text = constrained_text({"structural_tag": json.dumps(tag)}, 1)
    args = text.split('"arguments": ', 1)[1].rsplit("}\n</tool_call>", 1)[0]
    assert isinstance(json.loads(args), dict)


def test_choice_grammar_from_the_frontend():
    assert grammar_choices(r'root ::= "yes" | "no" | "a\"b"') == ["yes", "no", 'a"b']
    assert grammar_choices("root ::= [a-z]+") is None
    assert constrained_text({"grammar": 'root ::= "yes" | "no"'}, 3) in ("yes", "no")


def test_factory_emits_the_text_then_eos():
    tok = load_tokenizer()
    factory = constrained_token_source(tok, tok.vocab_size)
    sp = SimpleNamespace(structured_outputs={"regex": r"\d{4}"}, seed=7)
    src = factory(SimpleNamespace(sampling_params=sp, request_id="r"), random.Random(0))
    ids = [src.next_token(i) for i in range(8)]
    end = ids.index(tok.eos_token_id)
    assert re.fullmatch(r"\d{4}", tok.decode(ids[:end]))
    assert factory(SimpleNamespace(sampling_params=SimpleNamespace(structured_outputs=None, seed=None),
                                   request_id="r"), random.Random(0)) is None


def test_unconstrained_prompt_with_tools_gets_a_call():
    """No structured outputs, but the prompt offers tools (Hermes style): play writes a call."""
    tok = load_tokenizer()
    factory = constrained_token_source(tok, tok.vocab_size)
    tool = {"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {"host": {"type": "string"}}, "required": ["host"]}}}
    prompt = f"<tools>\n{json.dumps(tool)}\n</tools>\nuser: ping it"
    sp = SimpleNamespace(structured_outputs=None, seed=3)
    src = factory(SimpleNamespace(sampling_params=sp, request_id="r", prompt_token_ids=tok.encode(prompt)),
                  random.Random(0))
    ids = [src.next_token(i) for i in range(200)]
    text = tok.decode(ids[:ids.index(tok.eos_token_id)])
    assert text.startswith("<tool_call>\n") and json.loads(text.split("\n")[1])["name"] == "ping"
