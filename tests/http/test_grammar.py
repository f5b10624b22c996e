"""Grammars for `structured_outputs.grammar` (GBNF and lark): the translation, the texts, and
vLLM 0.32's verdicts. Every generated text is parsed back with lark and, for the grammars that
are regular, matched against an equivalent Python regex written independently of the grammar."""

from __future__ import annotations

import re

import lark
import pytest

from vllm_vcr.frontend.protocol import RequestValueError
from vllm_vcr.frontend.structured.gbnf import GbnfError, gbnf_to_lark
from vllm_vcr.frontend.structured.grammar import check_grammar, grammar_accepts, grammar_instance, is_lark_syntax

# (grammar, an equivalent regex)
REGULAR = [
    ('root ::= "yes" | "no"', r"yes|no"),
    ('root ::= [a-z]+ "-" [0-9]{2,3}', r"[a-z]+-[0-9]{2,3}"),
    ('root ::= item ("," item)*\nitem ::= [a-z]+', r"[a-z]+(,[a-z]+)*"),
    ('root ::= "x" ws\nws ::= [ \\t\\n]*  # trailing space', r"x[ \t\n]*"),
    ('root ::= ("a" | "b")+ [\\u0041-\\u005A]', r"[ab]+[A-Z]"),
    ('root ::= [^"\\n]{1,8} "!"', r'[^"\n]{1,8}!'),
    ('root-x ::= "a"\nroot ::= root-x{2,} "\\x42"', r"a{2,}B"),
    ('root ::= "a"\n  "b" (\n "c" | "d")?', r"ab[cd]?"),
    ('root ::= [\\]\\[] | "q\\"" | ""', r'[\]\[]|q"|'),
    ('start: "a" | "b"', r"a|b"),
    ('start: WORD ("," WORD)*\n%import common.WORD', r"[A-Za-z]+(,[A-Za-z]+)*"),
    ('start: /[a-z]+/ "!"', r"[a-z]+!"),
    ('start: "ab" ~ 2..3', r"(ab){2,3}"),
    ('start: A\nA: "a".."c"', r"[a-c]"),
]
# context-free, not regular: lark is the only checker
NESTED = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"'
JSONISH = '?start: value\nvalue: "[" [value ("," value)*] "]" | NUMBER\n%import common.NUMBER'


@pytest.mark.parametrize("grammar,regex", REGULAR)
def test_texts_are_in_the_language(grammar, regex):
    texts = {grammar_instance(grammar, seed) for seed in range(6)}
    for text in texts:
        assert re.fullmatch(regex, text, re.S), (grammar, text)
        assert grammar_accepts(grammar, text)
    check_grammar(grammar)


@pytest.mark.parametrize("seed", [0, 1, 7, 2 ** 31 + 5, 123456789])
def test_nested_grammar_texts_parse(seed):
    for grammar in (NESTED, JSONISH):
        text = grammar_instance(grammar, seed)
        assert grammar_accepts(grammar, text)
        assert text.count("(") == text.count(")") and text.count("[") == text.count("]")


def test_same_seed_same_text():
    assert grammar_instance(NESTED, 11) == grammar_instance(NESTED, 11)
    assert len({grammar_instance(NESTED, s) for s in range(8)}) > 1


def test_gbnf_translation_reads_as_lark():
    text = gbnf_to_lark('root ::= a-b{1,2}\na-b ::= [x-z] "q"?')
    parser = lark.Lark(text)
    parser.parse("xqz")
    with pytest.raises(lark.exceptions.LarkError):
        parser.parse("xqzqy")


@pytest.mark.parametrize("grammar", ['root ::= foo', 'root ::= "a', 'a ::= "x"', "root ::= [a-z]\nroot ::= [0-9]"])
def test_gbnf_translation_refuses(grammar):
    with pytest.raises(GbnfError):
        gbnf_to_lark(grammar)


def test_lark_or_gbnf_as_vllm_tells_them_apart():
    assert is_lark_syntax('start: "a"\n# x ::= y')
    assert not is_lark_syntax('root ::= "a"')


# vLLM 0.32's verdicts (xgrammar, then llguidance), read from its venv: None = accepted
VERDICTS = [
    ('root ::= "a" | ', None),  # xgrammar refuses the empty alternative, llguidance takes it
    ('?start: expr\nexpr: NUMBER "+" NUMBER\n%import common.NUMBER', None),
    ("root ::= foo", "Invalid grammar specification: Failed to convert the grammar from GBNF to Lark: "
                     "Rule 'foo' not found"),
    ('root ::= "a', "Invalid grammar specification: Failed to convert the grammar from GBNF to Lark: "
                    "Unexpected end of input at line 1, 'root ::= \"a' ^ ''"),
    ('a ::= "x"', "Invalid grammar specification: Failed to convert the grammar from GBNF to Lark: "
                  "No 'root' rule found"),
    ("start: foo", 'Grammar error: at 1(8): unknown name: "foo"\n   1 | start: foo\n              ^'),
    ('start: a.2\na: "q"', "Grammar error: 1(9): Expected value (at \".\" ('.'))\n   1 | start: a.2\n"
                           "               ^\n   2 | a: \"q\""),
    ('start: x{"a"}\nx{p}: p p', 'Grammar error: at 2(7): params not supported yet\n   1 | start: x{"a"}\n'
                                 '   2 | x{p}: p p\n             ^'),
]


@pytest.mark.parametrize("grammar,message", VERDICTS)
def test_verdicts_are_vllms(grammar, message):
    if message is None:
        check_grammar(grammar)
        return
    with pytest.raises(RequestValueError) as e:
        check_grammar(grammar)
    assert str(e.value) == message
