"""Structural tags (`response_format: {"type": "structural_tag", ...}` or
`structured_outputs.structural_tag`), in both shapes vLLM 0.32 accepts:

* legacy: `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}` — free text in which
  each tagged segment starts with a trigger and carries a JSON document of its schema; it is
  xgrammar's `triggered_tags` format, and is read here as one;
* `{"format": {...}}` — xgrammar's format tree (tag, sequence, or, triggered_tags,
  tags_with_separator, const_string, json_schema, regex, grammar, any_text, optional, plus,
  star, repeat, ...).

`check_structural_tag` refuses what xgrammar's compiler refuses, with vLLM's message;
`structural_tag_instance` writes a text the format accepts: free text where it allows it, tagged
segments whose bodies are instances of their schemas (hypothesis-jsonschema), regexes and
grammars filled by their own generators.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from ..protocol import RequestValueError
from .grammar import check_grammar, grammar_instance
from .instances import InstanceError, dump_json, json_instance, regex_instance
from .schemas import check_schema

_STR, _LIST, _DICT = str, list, dict
_SCHEMA = (bool, dict)
# each format type: its required fields and their types (xgrammar's pydantic models)
_FIELDS: dict[str, dict[str, Any]] = {
    "const_string": {"value": _STR}, "json_schema": {"json_schema": _SCHEMA}, "any_text": {},
    "grammar": {"grammar": _STR}, "regex": {"pattern": _STR}, "sequence": {"elements": _LIST},
    "or": {"elements": _LIST}, "tag": {"begin": (str, dict), "content": _DICT, "end": (str, list, dict)},
    "triggered_tags": {"triggers": _LIST, "tags": _LIST}, "tags_with_separator": {"tags": _LIST, "separator": _STR},
    "optional": {"content": _DICT}, "plus": {"content": _DICT}, "star": {"content": _DICT},
    "repeat": {"min": int, "max": int, "content": _DICT}, "token": {"token": (int, str)}, "exclude_token": {},
    "any_tokens": {}, "dispatch": {"rules": _LIST}, "token_dispatch": {"rules": _LIST},
    "token_triggered_tags": {"trigger_tokens": _LIST, "tags": _LIST}, "qwen_xml_parameter": {"json_schema": _SCHEMA},
}
_FREE_TEXT = r"[A-Z][a-z]{2,7}( [a-z]{2,7}){1,5}[.:]"


class _Invalid(ValueError):
    pass


def structural_format(tag: Any) -> dict[str, Any]:
    """The format tree of a structural tag document (the legacy shape as `triggered_tags`)."""
    doc = json.loads(tag) if isinstance(tag, str) else tag
    if not isinstance(doc, dict):
        raise _Invalid("not an object")
    if "structures" in doc:
        structures, triggers = doc.get("structures"), doc.get("triggers")
        if not isinstance(structures, list) or not _strings(triggers):
            raise _Invalid("structures and triggers must be lists")
        tags = []
        for s in structures:
            if not isinstance(s, dict) or not _strings([s.get("begin"), s.get("end")]) \
                    or not isinstance(s.get("schema"), _SCHEMA):
                raise _Invalid("a structure needs begin, schema and end")
            tags.append({"type": "tag", "begin": s["begin"], "end": s["end"],
                         "content": {"type": "json_schema", "json_schema": s["schema"]}})
        if not tags:
            raise _Invalid("no structures")
        return {"type": "triggered_tags", "triggers": triggers, "tags": tags}
    if not isinstance(doc.get("format"), dict):
        raise _Invalid("no format")
    return doc["format"]


def _strings(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def check_structural_tag(tag: Any, parameter: str) -> None:
    """vLLM's 400 for a structural tag xgrammar cannot compile."""
    try:
        _check(structural_format(tag))
    except (ValueError, TypeError, re.error):  # _Invalid, a bad schema / grammar, a bad regex
        raise RequestValueError(f"Invalid {parameter} structural_tag specification.", parameter) from None


def _check(fmt: Any, default_type: str | None = None) -> None:
    if not isinstance(fmt, dict):
        raise _Invalid("a format must be an object")
    kind = format_type(fmt, default_type)
    if kind not in _FIELDS:
        raise _Invalid(f"unknown format type {kind!r}")
    for name, typ in _FIELDS[kind].items():
        if not isinstance(fmt.get(name), typ) or isinstance(fmt.get(name), bool) and typ is int:
            raise _Invalid(f"{kind}.{name}")
    _check_content(kind, fmt)
    for child, default in _children(kind, fmt):
        _check(child, default)


def _check_content(kind: str, fmt: dict[str, Any]) -> None:
    if kind in ("json_schema", "qwen_xml_parameter"):
        check_schema(fmt["json_schema"])
    elif kind == "regex":
        re.compile(fmt["pattern"])
    elif kind == "grammar":
        check_grammar(fmt["grammar"])
    elif kind == "triggered_tags":
        for t in fmt["tags"]:
            begin = t.get("begin") if isinstance(t, dict) else None
            if not isinstance(begin, str) or sum(begin.startswith(x) for x in fmt["triggers"]) != 1:
                raise _Invalid("each tag's begin must start with exactly one trigger")
    elif kind == "repeat" and not (0 <= fmt["min"] and (fmt["max"] == -1 or fmt["min"] <= fmt["max"])):
        raise _Invalid("repeat bounds")


def format_type(fmt: dict[str, Any], default_type: str | None = None) -> str | None:
    """The format's type; without one, xgrammar reads it from the fields present."""
    if "type" in fmt:
        return fmt["type"]
    inferred = [kind for kind, fields in _FIELDS.items() if fields and fields.keys() <= fmt.keys()]
    return default_type or (inferred[0] if inferred else None)


def _children(kind: str, fmt: dict[str, Any]) -> list[tuple[Any, str | None]]:
    if kind in ("sequence", "or"):
        return [(e, None) for e in fmt["elements"]]
    if kind in ("triggered_tags", "tags_with_separator", "token_triggered_tags"):
        return [(t, "tag") for t in fmt["tags"]]
    if kind in ("tag", "optional", "plus", "star", "repeat"):
        return [(fmt["content"], None)]
    if kind in ("dispatch", "token_dispatch"):
        return [(r[1], None) for r in fmt["rules"] if isinstance(r, list) and len(r) == 2]
    return []


def structural_tag_instance(tag: Any, seed: int) -> str:
    """A text the structural tag accepts; InstanceError for formats with no generator here
    (token-level formats, dispatch, XML argument styles)."""
    try:
        fmt = structural_format(tag)
    except ValueError as e:
        raise InstanceError(f"not a structural tag: {e}") from None
    return _Writer(seed).text(fmt)


class _Writer:
    """Writes one text for a format tree; every choice comes from one seeded generator."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def seed(self) -> int:
        return self.rng.getrandbits(32)

    def text(self, fmt: dict[str, Any], default_type: str | None = None) -> str:
        kind = format_type(fmt, default_type)
        write = getattr(self, "_" + str(kind), None)
        if write is None:
            raise InstanceError(f"no generator for structural tag format {kind!r}")
        return write(fmt)

    def _const_string(self, fmt: dict[str, Any]) -> str:
        return fmt["value"]

    def _json_schema(self, fmt: dict[str, Any]) -> str:
        if fmt.get("style", "json") != "json":
            raise InstanceError(f"no generator for the {fmt['style']} argument style")
        return dump_json(json_instance(fmt["json_schema"], self.seed()))

    def _regex(self, fmt: dict[str, Any]) -> str:
        return regex_instance(fmt["pattern"], self.seed())

    def _grammar(self, fmt: dict[str, Any]) -> str:
        return grammar_instance(fmt["grammar"], self.seed())

    def _any_text(self, fmt: dict[str, Any]) -> str:
        return self.free_text(fmt.get("excludes") or [], fmt.get("max_chars"))

    def free_text(self, excludes: list[str], max_chars: int | None = None) -> str:
        """A short sentence containing none of `excludes` (triggers, end strings)."""
        for _ in range(8):
            text = regex_instance(_FREE_TEXT, self.seed())[:max_chars]
            if not any(x and x in text for x in excludes):
                return text
        return ""

    def _sequence(self, fmt: dict[str, Any]) -> str:
        return "".join(self.text(e) for e in fmt["elements"])

    def _or(self, fmt: dict[str, Any]) -> str:
        return self.text(self.rng.choice(fmt["elements"]))

    def _tag(self, fmt: dict[str, Any]) -> str:
        begin, end = fmt["begin"], fmt["end"]
        if isinstance(end, list):
            end = end[0] if end else ""
        if not isinstance(begin, str) or not isinstance(end, str):
            raise InstanceError("token-delimited tags have no text generator")
        return begin + self.text(fmt["content"]) + end

    def _triggered_tags(self, fmt: dict[str, Any]) -> str:
        """Free text, then one tagged segment (the format allows text before and after tags)."""
        prefix = self.free_text([*fmt["triggers"], *(fmt.get("excludes") or [])])
        return (prefix + " " if prefix else "") + self.text(self.rng.choice(fmt["tags"]), "tag")

    def _tags_with_separator(self, fmt: dict[str, Any]) -> str:
        return self.text(self.rng.choice(fmt["tags"]), "tag")

    def _optional(self, fmt: dict[str, Any]) -> str:
        return self.text(fmt["content"])

    def _plus(self, fmt: dict[str, Any]) -> str:
        return "".join(self.text(fmt["content"]) for _ in range(self.rng.randint(1, 2)))

    _star = _optional

    def _repeat(self, fmt: dict[str, Any]) -> str:
        high = fmt["min"] + 2 if fmt["max"] == -1 else min(fmt["max"], fmt["min"] + 2)
        return "".join(self.text(fmt["content"]) for _ in range(self.rng.randint(fmt["min"], high)))
