"""Deterministic instances of a constraint: JSON documents from a JSON Schema
(hypothesis-jsonschema), strings from a regex (hypothesis `from_regex`), one of a choice list.

The same (constraint, seed) always gives the same text. The schema is first narrowed to a
readable corner of its instance space (short ASCII strings, few items, no surprise properties):
every instance of the narrowed schema is still an instance of the original one.
"""

from __future__ import annotations

import json
import random
from functools import lru_cache
from typing import Any

_WORD = "^[a-z][a-z0-9 _-]{0,14}$"
_MAX_ITEMS = 3
_MAX_PROPERTIES = 3
_NUMBER_BOUND = 1000
_EXAMPLES = 4  # hypothesis tries the simplest value first; a later example varies with the seed
# keywords that already shape an object's keys (directly or through sub-schemas)
_SHAPING = frozenset({"additionalProperties", "patternProperties", "propertyNames", "required", "anyOf", "oneOf",
                      "allOf", "not", "$ref", "dependentRequired", "dependentSchemas", "if"})


class InstanceError(ValueError):
    """No instance could be generated (an unsatisfiable or unsupported constraint)."""


def narrow_schema(schema: Any) -> Any:
    """A copy of `schema` whose instances are readable and small, and still valid for `schema`."""
    if isinstance(schema, list):
        return [narrow_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: narrow_schema(v) for k, v in schema.items()}
    kinds = out.get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds} if kinds else set()
    free = not ({"enum", "const", "pattern", "format"} & out.keys())
    if "string" in kinds and free and not ({"minLength", "maxLength"} & out.keys()):
        out["pattern"] = _WORD
    if "array" in kinds and "maxItems" not in out:
        out["maxItems"] = max(_MAX_ITEMS, int(out.get("minItems", 0)))
    if "object" in kinds or "properties" in out:
        if "additionalProperties" not in out and "properties" in out:
            out["additionalProperties"] = False
        elif not (_SHAPING & out.keys()):  # a free object: a few short keys with simple values
            out.setdefault("maxProperties", max(_MAX_PROPERTIES, int(out.get("minProperties", 0))))
            out.setdefault("propertyNames", {"pattern": "^[a-z]{1,8}$"})
            out["additionalProperties"] = {"type": ["string", "integer", "boolean"], "pattern": _WORD,
                                           "minimum": -_NUMBER_BOUND, "maximum": _NUMBER_BOUND}
    for kind in ("integer", "number"):
        if kind in kinds and not ({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "enum", "const",
                                   "multipleOf"} & out.keys()):
            out["minimum"], out["maximum"] = -_NUMBER_BOUND, _NUMBER_BOUND
    return out


def draw_examples(strategy: Any, seed: int, count: int = _EXAMPLES) -> list[Any]:
    """The seed's first `count` examples of a hypothesis strategy, without the test machinery's
    randomness (hypothesis tries the simplest value first; later ones vary with the seed)."""
    from hypothesis import HealthCheck, Phase, given
    from hypothesis import seed as hseed
    from hypothesis import settings

    examples: list[Any] = []

    @hseed(seed)
    @settings(max_examples=count, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(strategy)
    def collect(value: Any) -> None:
        examples.append(value)

    try:
        collect()
    except Exception as e:  # Unsatisfiable, InvalidArgument, a schema hypothesis-jsonschema rejects
        raise InstanceError(f"cannot generate an instance: {e}") from None
    if not examples:
        raise InstanceError("cannot generate an instance")
    return examples


def _draw(strategy: Any, seed: int) -> Any:
    """The seed's example of a hypothesis strategy."""
    examples = draw_examples(strategy, seed)
    return examples[seed % len(examples)]


@lru_cache(maxsize=256)
def _schema_strategy(schema_json: str, narrowed: bool) -> Any:
    from hypothesis_jsonschema import from_schema

    schema = json.loads(schema_json)
    if narrowed:
        return from_schema(narrow_schema(schema), codec="ascii")
    return from_schema(schema)


def json_instance(schema: dict[str, Any] | bool, seed: int) -> Any:
    """A JSON value valid for `schema` (draft 4-7 and 2019/2020 keywords hypothesis-jsonschema knows):
    from the narrowed schema when it has instances, else from the schema itself."""
    key = json.dumps(schema, sort_keys=True)
    error: Exception | None = None
    for narrowed in (True, False):
        try:
            return _draw(_schema_strategy(key, narrowed), seed)
        except Exception as e:  # InstanceError, or a schema hypothesis-jsonschema cannot build
            error = e
    raise InstanceError(f"cannot generate an instance: {error}")


@lru_cache(maxsize=256)
def _regex_strategy(pattern: str, printable: bool) -> Any:
    from hypothesis import strategies as st

    if printable:
        return st.from_regex(pattern, fullmatch=True,
                             alphabet=st.characters(min_codepoint=32, max_codepoint=126))
    return st.from_regex(pattern, fullmatch=True, alphabet=st.characters(codec="utf-8"))


def regex_instance(pattern: str, seed: int) -> str:
    """A string the whole of which matches `pattern`: printable ASCII when the regex allows it."""
    try:
        return _draw(_regex_strategy(pattern, True), seed)
    except InstanceError:
        return _draw(_regex_strategy(pattern, False), seed)


def choice_instance(choices: list[str], seed: int) -> str:
    return choices[random.Random(seed).randrange(len(choices))]


def dump_json(value: Any) -> str:
    """JSON text as a model writes it (and as vLLM's parsers re-serialise arguments)."""
    return json.dumps(value, ensure_ascii=False)
