"""`grammar` and `structural_tag` structured outputs through the real vLLM frontends: the
frontend accepts (or refuses) the constraint itself and sends it in
`sampling_params.structured_outputs`; `vllm-vcr play --tokenizer MODEL_DIR` emits ids whose text
satisfies it. The refusals of bad grammars are compared with `vllm-vcr serve`'s."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import lark
import pytest

from . import peers
from .test_differential import _start_sim

pytestmark = pytest.mark.conformance

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
     "end": "</answer>"}]}}
BAD = {
    "gbnf_undefined_rule": {"structured_outputs": {"grammar": "root ::= foo"}},
    "gbnf_unterminated": {"structured_outputs": {"grammar": 'root ::= "a'}},
    "gbnf_no_root": {"structured_outputs": {"grammar": 'a ::= "x"'}},
    "lark_unknown_name": {"structured_outputs": {"grammar": "start: foo"}},
    "lark_priority": {"structured_outputs": {"grammar": 'start: a.2\na: "q"'}},
    "empty_grammar": {"structured_outputs": {"grammar": " "}},
    "tag_unknown_format": {"response_format": {"type": "structural_tag", "format": {"type": "bogus"}}},
    "tag_no_trigger": {"response_format": {**LEGACY_TAG, "triggers": ["<tool>"]}},
    "tag_bad_regex": {"structured_outputs": {"structural_tag": json.dumps(
        {"type": "structural_tag", "format": {"type": "regex", "pattern": "(a"}})}},
    "tag_no_structures": {"response_format": {**LEGACY_TAG, "structures": []}},
}
# accepted by one backend only, or only through a default: both sides must answer 200
EDGE_OK = {
    "gbnf_empty_alternative": {"structured_outputs": {"grammar": 'root ::= "a" | '}},  # llguidance only
    "lark_inline_start": {"structured_outputs": {"grammar": '?start: x\nx: "q"+'}},  # xgrammar only
    "tag_without_type": {"response_format": {"type": "structural_tag", "format": {"type": "sequence",
                                                                                 "elements": [{"value": "x"}]}}},
}


@pytest.fixture(scope="module")
def stack(vllm_version):
    st = peers.start_stack(vllm_version, play_args=["--tokenizer", str(peers.MODEL_DIR), "--seed", "3",
                                                    "--inter-token-latency", "0", "--time-to-first-token", "0"])
    yield st
    st.stop()


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    st = _start_sim(tmp_path_factory)
    yield st
    st["proc"].stop()


def chat(st, seed: int, **body) -> dict:
    r = httpx.post(st.base_url + "/v1/chat/completions", timeout=120,
                   json={"model": st.model, "messages": MSGS, "max_tokens": 400, "seed": seed, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_gbnf_grammar(stack):
    for seed in range(3):
        text = chat(stack, seed, structured_outputs={"grammar": GBNF})["choices"][0]["message"]["content"]
        assert re.fullmatch(r"[a-z]{2,5}=[0-9]+(,[a-z]{2,5}=[0-9]+){1,3}", text), text


def test_lark_grammar_and_token_counts(stack):
    parser = lark.Lark(LARK)
    for seed in range(3):
        r = chat(stack, seed, structured_outputs={"grammar": LARK})
        text = r["choices"][0]["message"]["content"]
        parser.parse(text)
        tok = httpx.post(stack.base_url + "/tokenize", timeout=30,
                         json={"model": stack.model, "prompt": text, "add_special_tokens": False}).json()
        assert r["usage"]["completion_tokens"] == tok["count"] + 1  # the text's tokens, then EOS


@pytest.mark.parametrize("body", [{"response_format": LEGACY_TAG},
                                  {"structured_outputs": {"structural_tag": json.dumps(LEGACY_TAG)}}])
def test_legacy_structural_tag(stack, body):
    text = chat(stack, 1, **body)["choices"][0]["message"]["content"]
    bodies = re.findall(r"<function=weather>(.*?)</function>", text, re.S)
    assert bodies, text
    for b in bodies:
        jsonschema.validate(json.loads(b), SCHEMA)


def test_format_structural_tag(stack):
    text = chat(stack, 2, response_format=FORMAT_TAG)["choices"][0]["message"]["content"]
    m = re.fullmatch(r"Result: <answer>(.*)</answer>", text, re.S)
    assert m is not None, text
    jsonschema.validate(json.loads(m.group(1)), SCHEMA)


ROUTES = {"/v1/chat/completions": {"messages": MSGS}, "/v1/completions": {"prompt": "Answer:"}}
COMPLETION_ONLY = {"two_kinds": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}


def test_verdicts_match_serve(stack, sim):
    """The same status and error object from the real frontend and from serve, on both routes."""
    differences = []
    for path, prompt in ROUTES.items():
        cases = {**BAD, **EDGE_OK, **(COMPLETION_ONLY if path == "/v1/completions" else {})}
        for name, body in cases.items():
            answers = []
            for base, model in ((stack.base_url, stack.model), (sim["base_url"], str(peers.MODEL_DIR))):
                r = httpx.post(base + path, timeout=60, json={"model": model, "max_tokens": 5, **prompt, **body})
                answers.append((r.status_code, r.json().get("error") if r.status_code != 200 else None))
            real, ours = answers
            assert real[0] == (200 if name in EDGE_OK else 400), (path, name, real)
            if real != ours:
                differences.append(f"{path} {name}: real {real!r}\n  serve {ours!r}")
    assert not differences, "\n".join(differences)


def test_completion_grammar(stack):
    r = httpx.post(stack.base_url + "/v1/completions", timeout=120, json={
        "model": stack.model, "prompt": "Answer:", "max_tokens": 400, "seed": 4, "n": 2,
        "structured_outputs": {"grammar": GBNF}})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert re.fullmatch(r"[a-z]{2,5}=[0-9]+(,[a-z]{2,5}=[0-9]+){1,3}", choice["text"]), choice["text"]
