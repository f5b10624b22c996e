"""`structured_outputs.grammar`: which grammars vLLM 0.32 accepts, and texts in their language.

vLLM's default ("auto") backend tries xgrammar first: a lark grammar (no `::=` line) or a GBNF
one (`root ::= ...`). When xgrammar refuses it, llguidance gets it, and llguidance's refusal is
the 400 ("Invalid grammar specification: ..." or "Grammar error: ..."). Here lark stands in for
xgrammar (lark's own grammars; GBNF through `gbnf.gbnf_to_lark`), and llguidance itself decides
the rest with its own message. Texts come from hypothesis's `from_lark`, written along a
derivation of the grammar (never parsed back).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from lark import Lark
from lark.exceptions import LarkError

from ..errors import sanitize
from ..protocol import RequestValueError
from .gbnf import gbnf_to_lark
from .instances import InstanceError, draw_examples

_COMMENT = re.compile(r"(#|//).*$")
# lark features neither xgrammar nor llguidance take (priorities, templates): they are refused there
_UNSUPPORTED_LARK = re.compile(r"^\s*[?!_]?\w+(\.-?\d+|\{[^}]*\})\s*:", re.M)
_PRINTABLE = (32, 126)
_TRIES = 4


def is_lark_syntax(grammar: str) -> bool:
    """vLLM's test: a grammar with no `name ::=` line (comments aside) is read as lark."""
    return not any("::=" in _COMMENT.sub("", line) for line in grammar.split("\n"))


class _Unreadable(ValueError):
    """lark cannot read the grammar (or it uses lark features the backends lack)."""


@lru_cache(maxsize=128)
def compiled_grammar(grammar: str) -> Lark:
    """The grammar as a lark parser (Earley: any context-free grammar); ValueError if lark or the
    GBNF translation cannot read it."""
    if is_lark_syntax(grammar):
        if _UNSUPPORTED_LARK.search(grammar):
            raise _Unreadable("rule priorities and templates are not supported")
        text = grammar
    else:
        text = gbnf_to_lark(grammar)
    try:
        return Lark(text, start="start", parser="earley")
    except LarkError as e:
        raise _Unreadable(f"lark: {e}") from None


def check_grammar(grammar: str) -> None:
    """vLLM's 400 for a grammar both backends refuse; nothing for one either accepts."""
    try:
        compiled_grammar(grammar)
        return
    except ValueError:
        pass
    message = _llguidance_error(grammar)
    if message is not None:
        raise RequestValueError(sanitize(message))  # vLLM's error responses are stripped (and path-free)


def _llguidance_error(grammar: str) -> str | None:
    """llguidance's verdict on the grammar, worded as vLLM's guidance backend words it."""
    import llguidance

    try:
        serialized = llguidance.grammar_from("grammar", grammar)
    except (ValueError, KeyError, TypeError) as e:
        return f"Invalid grammar specification: {e}"
    err = llguidance.LLMatcher.validate_grammar(serialized, None)
    return f"Grammar error: {err}" if err else None


@lru_cache(maxsize=128)
def _strategy(grammar: str, printable: bool) -> Any:
    from hypothesis import strategies as st
    from hypothesis.extra.lark import from_lark

    compiled = compiled_grammar(grammar)
    if not printable:
        return from_lark(compiled, alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]))
    # printable ASCII, plus the characters the grammar's own literals need
    literal_chars = sorted({c for t in compiled.terminals if t.pattern.type == "str" for c in t.pattern.value
                            if not _PRINTABLE[0] <= ord(c) <= _PRINTABLE[1]})
    alphabet = st.characters(min_codepoint=_PRINTABLE[0], max_codepoint=_PRINTABLE[1])
    return from_lark(compiled, alphabet=alphabet | st.sampled_from(literal_chars) if literal_chars else alphabet)


def grammar_accepts(grammar: str, text: str) -> bool:
    try:
        compiled_grammar(grammar).parse(text)
    except LarkError:
        return False
    return True


def grammar_instance(grammar: str, seed: int) -> str:
    """A text in the grammar's language (printable ASCII where the grammar allows it); the same
    (grammar, seed) gives the same text. Each text is written along a derivation of the grammar
    (hypothesis draws the rules and terminals), so it is in the language by construction and is
    not parsed back: parsing with Earley is cubic in the text, and unbounded for an ambiguous
    grammar. Its time and memory are bounded by the caller (budget.generated_text)."""
    try:
        compiled_grammar(grammar)
    except ValueError as e:
        raise InstanceError(f"no generator for this grammar: {e}") from None
    for printable in (True, False):
        try:
            examples = draw_examples(_strategy(grammar, printable), seed, _TRIES)
        except InstanceError:
            continue
        texts = [t for t in examples if t.strip()] or examples  # an empty answer only when it is the only one
        return texts[seed % len(texts)]
    raise InstanceError("cannot generate a text the grammar accepts")
