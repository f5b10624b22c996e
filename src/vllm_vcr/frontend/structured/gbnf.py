"""GBNF (xgrammar's / llama.cpp's EBNF: `root ::= ...`) translated into a lark grammar.

lark parses the GBNF text with the meta-grammar below; a small transformer writes the same
language in lark's EBNF (`root` becomes `start`, character classes become one-character regex
terminals, `{m,n}` becomes `~ m..n`), so lark can check outputs and hypothesis can generate them.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

from lark import Lark, Token, Transformer
from lark.exceptions import LarkError

_META = r"""
grammar: rule+
rule: RULE_HEAD alternatives
alternatives: sequence ("|" sequence)*
sequence: item*
item: atom QUANT?
?atom: STRING -> literal
     | CHARCLASS -> charclass
     | NAME -> ref
     | "(" alternatives ")" -> group
RULE_HEAD.2: /[a-zA-Z_][a-zA-Z0-9_.-]*\s*::=/
NAME: /[a-zA-Z_][a-zA-Z0-9_.-]*/
STRING: /"(?:[^"\\]|\\.)*"/
CHARCLASS: /\[(?:[^\]\\]|\\.)*\]/
QUANT: /[*+?]/ | /\{\s*\d*\s*(,\s*\d*\s*)?\}/
COMMENT: /#[^\n]*/
%ignore COMMENT
%ignore /\s+/
"""

_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)", re.S)
_SIMPLE = {"n": "\n", "r": "\r", "t": "\t", "0": "\0", "f": "\f", "v": "\v", "a": "\a", "b": "\b"}


class GbnfError(ValueError):
    """Not a GBNF grammar this translator reads (a syntax error, an undefined rule, no root)."""


def _unescape(body: str) -> str:
    def one(m: re.Match[str]) -> str:
        e = m.group(1)
        if len(e) > 1:
            return chr(int(e[1:], 16))
        return _SIMPLE.get(e, e)

    return _ESCAPE.sub(one, body)


def _class_char(c: str) -> str:
    """One character inside a Python regex class, written so that lark's `/.../` keeps it."""
    if c.isascii() and c.isalnum():
        return c
    return f"\\u{ord(c):04x}" if ord(c) < 0x10000 else c


def _class_regex(text: str) -> str:
    """`[^a-z\\n]` (GBNF) as the lark regex terminal `/[^a-z\\u000a]/`."""
    body = text[1:-1]
    negated = body.startswith("^")
    chars = [m.group(0) for m in re.finditer(r"\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)|.",
                                             body[negated:], re.S)]
    out = []
    for i, piece in enumerate(chars):
        is_range = piece == "-" and 0 < i < len(chars) - 1
        out.append("-" if is_range else _class_char(_unescape(piece)))
    if not out:
        raise GbnfError(f"empty character class {text}")
    return "/[" + ("^" if negated else "") + "".join(out) + "]/"


def _quantified(atom: str, quant: str) -> str:
    if quant in "*+?":
        return f"({atom}){quant}"
    m = re.fullmatch(r"\{\s*(\d*)\s*(,)?\s*(\d*)\s*\}", quant)
    lo, comma, hi = int(m.group(1) or 0), m.group(2), m.group(3)
    if not comma:
        return f"({atom}) ~ {lo}" if lo else ""
    if hi:
        return f"({atom}) ~ {lo}..{int(hi)}"
    return f"(({atom}) ~ {lo} ({atom})*)" if lo else f"({atom})*"


class _ToLark(Transformer):
    def __init__(self, names: dict[str, str]):
        super().__init__()
        self.names = names

    def literal(self, children: list[Token]) -> str:
        text = _unescape(children[0][1:-1])
        return json.dumps(text, ensure_ascii=False) if text else ""

    def charclass(self, children: list[Token]) -> str:
        return _class_regex(str(children[0]))

    def ref(self, children: list[Token]) -> str:
        name = str(children[0])
        if name not in self.names:
            raise GbnfError(f"rule {name!r} is not defined")
        return self.names[name]

    def group(self, children: list[str]) -> str:
        return f"({children[0]})"

    def item(self, children: list) -> str:
        atom = children[0]
        if not atom:
            return ""
        return _quantified(atom, str(children[1])) if len(children) > 1 else atom

    def sequence(self, children: list[str]) -> str:
        return " ".join(c for c in children if c)

    def alternatives(self, children: list[str]) -> str:
        return " | ".join(children)

    def rule(self, children: list) -> str:
        return f"{self.names[_head_name(children[0])]}: {children[1]}"

    def grammar(self, children: list[str]) -> str:
        return "\n".join(children) + "\n"


def _head_name(head: str) -> str:
    return head[:-3].strip()


@lru_cache(maxsize=1)
def _meta_parser() -> Lark:
    return Lark(_META, start="grammar", parser="lalr")


def gbnf_to_lark(text: str) -> str:
    """The lark grammar (start rule `start`) of a GBNF grammar (start rule `root`)."""
    try:
        tree = _meta_parser().parse(text)
    except LarkError as e:
        raise GbnfError(f"GBNF syntax error: {e}") from None
    heads = [_head_name(t) for t in tree.scan_values(lambda v: isinstance(v, Token) and v.type == "RULE_HEAD")]
    if "root" not in heads:
        raise GbnfError("no 'root' rule")
    if len(set(heads)) != len(heads):
        raise GbnfError("a rule is defined twice")
    names = {h: "start" if h == "root" else f"r{i}_{re.sub(r'[^a-z0-9_]', '_', h.lower())}"
             for i, h in enumerate(heads)}
    try:
        return _ToLark(names).transform(tree)
    except LarkError as e:  # a GbnfError raised in a callback arrives wrapped
        raise GbnfError(str(getattr(e, "orig_exc", e))) from None
