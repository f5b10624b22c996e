"""The size budget of structured outputs, checked before anything is compiled, on the event
loop, in time proportional to the limits rather than to the input: a grammar, regex, structural
tag or choice list of at most `MAX_CONSTRAINT_CHARS` characters; a JSON schema (or structural
tag document) of at most `MAX_SCHEMA_NODES` values and `MAX_CONSTRAINT_CHARS` characters of keys
and strings; a grammar of at most `MAX_GRAMMAR_RULES` rules. Over it: a 400 worded as vLLM's
xgrammar backend words a constraint it cannot compile (param null, as there).
"""

from __future__ import annotations

import re
from typing import Any

from ..protocol import RequestValueError

MAX_CONSTRAINT_CHARS = 256 * 1024
MAX_SCHEMA_NODES = 20_000
MAX_GRAMMAR_RULES = 2_000

_RULE_HEAD = re.compile(r"^\s*[?!]?[A-Za-z_][\w.-]*\s*(::=|:)", re.M)
KIND_NAMES = {"json": "json schema", "json_object": "json schema", "regex": "regex", "grammar": "grammar",
              "choice": "choices", "structural_tag": "structural tag"}


def too_large(kind: str, detail: str) -> RequestValueError:
    """vLLM's xgrammar wording for a constraint it cannot compile, with the reason."""
    if kind == "grammar":
        return RequestValueError(f"Invalid grammar specification: {detail}")
    if kind == "structural_tag":
        return RequestValueError(f"Invalid structural tag specification: {detail}")
    return RequestValueError(f"Failed to transform {KIND_NAMES.get(kind, kind)} into a grammar: {detail}")


def _schema_size(value: Any) -> tuple[int, int]:
    """(nodes, characters) of a JSON value, counted up to just past the limits."""
    nodes = chars = 0
    stack = [value]
    while stack:
        v = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES or chars > MAX_CONSTRAINT_CHARS:
            break
        if isinstance(v, dict):
            for k, x in v.items():
                chars += len(k) if isinstance(k, str) else 0
                stack.append(x)
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str):
            chars += len(v)
    return nodes, chars


def check_size(kind: str, value: Any) -> None:
    """The size budget of one constraint (400 over it)."""
    if isinstance(value, str):
        if len(value) > MAX_CONSTRAINT_CHARS:
            raise too_large(kind, f"it is {len(value)} characters long; this server compiles at most "
                                  f"{MAX_CONSTRAINT_CHARS}")
        if kind == "grammar":
            rules = 0
            for _ in _RULE_HEAD.finditer(value):
                rules += 1
                if rules > MAX_GRAMMAR_RULES:
                    raise too_large(kind, f"it has more than {MAX_GRAMMAR_RULES} rules, this server's limit")
        return
    nodes, chars = _schema_size(value)
    if nodes > MAX_SCHEMA_NODES:
        raise too_large(kind, f"it has more than {MAX_SCHEMA_NODES} values, this server's limit")
    if chars > MAX_CONSTRAINT_CHARS:
        raise too_large(kind, f"it is over {MAX_CONSTRAINT_CHARS} characters long, this server's limit")


def check_sizes(response_format: Any, structured_outputs: Any) -> None:
    """The size budget of every constraint a request carries."""
    if isinstance(response_format, dict):
        check_size("json" if response_format.get("type") == "json_schema" else "structural_tag", response_format)
    if isinstance(structured_outputs, dict):
        for kind, value in structured_outputs.items():
            if value is not None and kind in KIND_NAMES:
                check_size(kind, value)


