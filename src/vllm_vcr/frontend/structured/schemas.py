"""A JSON Schema as xgrammar's compiler judges it: what the meta-schema rejects is its 400."""

from __future__ import annotations

from typing import Any

from ..protocol import RequestValueError


def check_schema(schema: Any) -> None:
    """A schema the JSON Schema meta-schema rejects is the 400 xgrammar's compiler gives."""
    from jsonschema import exceptions, validators

    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise RequestValueError(f"Grammar error: Invalid schema: {schema!r}")
    try:
        validators.validator_for(schema, default=validators.Draft202012Validator).check_schema(schema)
    except exceptions.SchemaError as e:
        raise RequestValueError(f"Grammar error: {_schema_error_text(e)}") from None


def _schema_error_text(e: Any) -> str:
    if e.validator == "anyOf" and list(e.path)[-1:] == ["type"] or (e.path and e.path[-1] == "type"):
        return f"Invalid type: {e.instance}"
    return e.message
