"""A chat or completion request's output constraint, read as vLLM 0.32 reads it.

`response_format` (text / json_object / json_schema / structural_tag) overrides
`structured_outputs` (json / regex / choice / grammar / json_object / structural_tag), as
`structured_outputs_from_response_format` does; the checks and their messages are those of the
request validators, SamplingParams and the xgrammar backend (grammars: `grammar.check_grammar`,
structural tags: `structural_tag.check_structural_tag`). Legacy `guided_*` fields are not
read by 0.32 (they are ignored extra fields), so they are ignored here too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..protocol import RequestValueError
from .grammar import check_grammar
from .schemas import check_schema
from .sizes import check_sizes
from .structural_tag import check_structural_tag

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_MAX_NESTING = 64  # vLLM's check_json_nesting bound (deeper schemas are refused)


@dataclass(frozen=True)
class Constraint:
    kind: str  # "json" | "json_object" | "regex" | "choice" | "grammar" | "structural_tag"
    value: Any  # schema dict, pattern, list of choices, grammar text

    def describe(self) -> str:
        return self.kind


def check_request_constraints(body: dict[str, Any] | Any, tool_choice: Any, *, completion: bool = False) -> None:
    """The request model's before-validators: response_format and structured_outputs counts (a
    completion request names the parameter in its count error and has no tools). The size
    budget (sizes.py) comes first: nothing larger is even looked at."""
    rf = _get(body, "response_format")
    check_sizes(rf, _get(body, "structured_outputs"))
    if isinstance(rf, dict) and rf.get("type") == "json_schema" and rf.get("json_schema") is None:
        raise RequestValueError("When response_format type is 'json_schema', the 'json_schema' field must "
                                "be provided.", "response_format")
    if isinstance(rf, dict) and rf.get("type") == "structural_tag":
        check_structural_tag(rf, "response_format")
    so = _get(body, "structured_outputs")
    if not isinstance(so, dict):
        return
    count = sum(so.get(k) is not None for k in ("json", "regex", "choice"))
    if count > 1:
        raise RequestValueError("You can only use one kind of constraints for structured outputs "
                                "('json', 'regex' or 'choice').", "structured_outputs" if completion else None)
    forcing = (tool_choice if tool_choice is not None else "none") not in ("none", "auto", "required")
    if not completion and count > 0 and forcing:
        raise RequestValueError("You can only either use constraints for structured outputs or tools, not both.")
    if so.get("structural_tag") is not None:
        check_structural_tag(so["structural_tag"], "structured_outputs")


def _get(body: Any, name: str) -> Any:
    return body.get(name) if isinstance(body, dict) else getattr(body, name, None)


def request_constraint(response_format: dict[str, Any] | None,
                       structured_outputs: dict[str, Any] | None) -> Constraint | None:
    """The effective constraint (None: free text), validated as the engine-side checks do (can take
    long: the server runs it through budget.checked_constraint)."""
    check_sizes(response_format, structured_outputs)
    so = dict(structured_outputs) if isinstance(structured_outputs, dict) else None
    rf_type = response_format.get("type") if isinstance(response_format, dict) else None
    if rf_type == "json_object":
        so = {**(so or {}), "json_object": True}
    elif rf_type == "json_schema":
        js = response_format.get("json_schema") or {}
        so = {**(so or {}), "json": js.get("schema", js.get("json_schema"))}
    elif rf_type == "structural_tag":
        so = {**(so or {}), "structural_tag": json.dumps(response_format)}
    if not so:
        return None
    present = [k for k in _KINDS if so.get(k) is not None]
    if len(present) > 1:
        raise RequestValueError("You can only use one kind of structured outputs constraint but multiple are "
                                f"specified: {so}")
    if not present:
        if so.get("json_object") is False:
            raise RequestValueError("structured_outputs.json_object must be True if set; omit structured_outputs "
                                    "to disable structured outputs")
        return None
    kind = present[0]
    return _validated(kind, so[kind])


def _validated(kind: str, value: Any) -> Constraint:
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise RequestValueError(f"Choice '{value}' cannot be an empty list")
        return Constraint("choice", [str(c) for c in value])
    if kind == "json_object":
        if value is False:
            raise RequestValueError("structured_outputs.json_object must be True if set; omit structured_outputs "
                                    "to disable structured outputs")
        return Constraint("json_object", {"type": "object"})
    if kind == "regex":
        if "\x00" in value:
            raise RequestValueError("structured_outputs.regex must not contain a NUL character ('\\x00')")
        try:
            re.compile(value)
        except re.error as e:
            raise RequestValueError(f"Grammar error: invalid regex {value!r}: {e}") from None
        return Constraint("regex", value)
    if kind == "json":
        return Constraint("json", _schema(value))
    if kind == "grammar":
        if not str(value).strip():
            raise RequestValueError("structured_outputs.grammar cannot be an empty string")
        check_grammar(str(value))
        return Constraint("grammar", str(value))
    if not str(value).strip():
        raise RequestValueError("structured_outputs.structural_tag cannot be an empty string")
    return Constraint("structural_tag", value)


def _schema(value: Any) -> dict[str, Any] | bool:
    if isinstance(value, str):
        if not value.strip():
            raise RequestValueError("structured_outputs.json cannot be an empty string")
        try:
            value = json.loads(value)
        except ValueError:
            raise RequestValueError("Invalid JSON grammar specification.") from None
    if _depth(value) > _MAX_NESTING:
        raise RequestValueError(f"structured_outputs.json exceeds the maximum nesting depth of {_MAX_NESTING}.")
    check_schema(value)
    return value


def _depth(v: Any, d: int = 0) -> int:
    if isinstance(v, dict):
        return max((_depth(x, d + 1) for x in v.values()), default=d + 1)
    if isinstance(v, list):
        return max((_depth(x, d + 1) for x in v), default=d + 1)
    return d
