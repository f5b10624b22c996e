"""Request/response shapes of the control API and the checks that need no engine.

PATCH /config is checked in layers, each with its own status:

1. 422  the body is not JSON, not an object, names an unknown field, or a value has the wrong
        type (`"max_num_seqs": "8"`, an unknown `failure_types` value): it does not match the schema.
2. 400  the body names a real engine setting that is fixed at start-up (`time_scale`,
        `kv_cache_size`, ...): well-formed, but refused, with a message saying it cannot change at
        run time. 400 rather than 422 because the client must change its intent, not its syntax.
3. 400  a value fails EngineConfig.validate (negative latency, rate outside [0, 1], ...).
4. 409  a latency knob while a recorded latency trace paces requests (needs the engines; see server).
"""

from __future__ import annotations

import math
from typing import Any, Union

import msgspec

from ..engine.config import LATENCY_FIELDS, ConfigError, EngineArgs, EngineConfig

CONFIG_FIELDS: tuple[str, ...] = tuple(f.name for f in msgspec.structs.fields(EngineConfig))

STATS_FIELDS: tuple[str, ...] = (
    "requests_received",
    "requests_completed",
    "requests_failed",
    "requests_aborted",
    "running",
    "waiting",
)

# The knobs only the knob latency model reads; a trace-fitted model ignores all of them
# (time_factor_under_load included), so patching any of them under a trace would do nothing.
KNOB_FIELDS: tuple[str, ...] = LATENCY_FIELDS

_HANDSHAKE = "it reaches the frontend at the handshake"
_TRACE = "replay and trace inputs are loaded once at start-up"
_REASONS: dict[str, str] = {
    "time_scale": "it is baked into every scheduled deadline",
    "shutdown_timeout": "it is read once when the engine loop starts",
    "kv_cache_size": _HANDSHAKE,
    "tokens_per_block": _HANDSHAKE,
    "block_size": _HANDSHAKE,
    "engine_id": f"engine identity: {_HANDSHAKE}",
    "engine_index": f"engine identity: {_HANDSHAKE}",
    "engine_count": f"engine identity: {_HANDSHAKE}",
    "model_name": f"engine identity: {_HANDSHAKE}",
    "served_model_name": f"engine identity: {_HANDSHAKE}",
    "model": f"engine identity: {_HANDSHAKE}",
    "vllm_version": f"engine identity: {_HANDSHAKE}",
    "advertised_max_model_len": f"{_HANDSHAKE} (patch max_model_len to change the arrival check)",
    "latency_trace": _TRACE,
    "replay_tokens": _TRACE,
    "replay_steps": _TRACE,
    "replay_match": _TRACE,
    "replay_arrivals": _TRACE,
    "replay_sessions": _TRACE,
    "expect_config_hash": _TRACE,
    "control_address": "the control API's own address is fixed while it serves",
    "handshake_address": "the engine's sockets are bound at start-up",
    "data_parallel_size": f"engine identity: {_HANDSHAKE}",
}

# Everything EngineArgs holds besides the patchable config is fixed at start-up too.
NOT_PATCHABLE: dict[str, str] = {
    **{f.name: "it is fixed when the engine starts" for f in msgspec.structs.fields(EngineArgs) if f.name != "config"},
    **_REASONS,
}


class ControlError(Exception):
    """An error the control API reports as `{"error": message}` with `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# All-optional mirror of EngineConfig, derived from it so the two never drift apart.
ConfigPatch = msgspec.defstruct(
    "ConfigPatch",
    [
        (f.name, Union[f.type, msgspec.UnsetType], msgspec.UNSET)  # noqa: UP007 - runtime type
        for f in msgspec.structs.fields(EngineConfig)
    ],
    kw_only=True,
    forbid_unknown_fields=True,
)


class LogRequest(msgspec.Struct, forbid_unknown_fields=True):
    filter: str


def _decode_object(body: bytes) -> dict[str, Any]:
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise ControlError(422, f"body is not valid JSON: {e}") from None
    except RecursionError:
        raise ControlError(422, "body is not valid JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise ControlError(422, f"body must be a JSON object, got {type(obj).__name__}")
    return obj


def split_config_patch(body: bytes, extra_fields: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(engine patch, patch of `extra_fields`): the frontend's own fields (HTTP faults) are taken
    out before the engine's layers 1-3 check the rest."""
    obj = _decode_object(body)
    extra = {k: obj.pop(k) for k in list(obj) if k in extra_fields}
    return (parse_config_object(obj) if obj or not extra else {}), extra


def parse_config_patch(body: bytes) -> dict[str, Any]:
    """Layers 1-3 above; returns the patch as a dict of JSON-able values (only the named fields)."""
    return parse_config_object(_decode_object(body))


def parse_config_object(obj: dict[str, Any]) -> dict[str, Any]:
    fixed = [k for k in obj if k not in CONFIG_FIELDS and k in NOT_PATCHABLE]
    unknown = [k for k in obj if k not in CONFIG_FIELDS and k not in NOT_PATCHABLE]
    if unknown:
        raise ControlError(
            422, f"unknown field {unknown[0]!r}; patchable fields are: {', '.join(CONFIG_FIELDS)}"
        )
    if fixed:
        name = fixed[0]
        raise ControlError(400, f"{name} cannot change at run time ({NOT_PATCHABLE[name]}); restart with the new value")
    try:
        patch_obj = msgspec.convert(obj, ConfigPatch)
    except msgspec.ValidationError as e:
        raise ControlError(422, f"body does not match the config schema: {e}") from None
    patch = {
        name: value
        for name in CONFIG_FIELDS
        if (value := getattr(patch_obj, name)) is not msgspec.UNSET
    }
    patch = msgspec.to_builtins(patch)  # enums -> their strings, as EngineConfig.patched expects
    for name, value in patch.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ControlError(400, f"{name} must be a finite number, got {value}")
    # Every check in EngineConfig.validate is per field, so merging into the defaults finds any
    # bad value without asking an engine; the engines re-check against their own config.
    try:
        EngineConfig().patched(patch)
    except ConfigError as e:
        raise ControlError(400, str(e)) from None
    except msgspec.ValidationError as e:  # pragma: no cover - the schema already matched
        raise ControlError(422, f"body does not match the config schema: {e}") from None
    return patch


def parse_log_request(body: bytes) -> str:
    obj = _decode_object(body)
    try:
        return msgspec.convert(obj, LogRequest).filter
    except msgspec.ValidationError as e:
        raise ControlError(422, f'body must be {{"filter": "<EnvFilter directives>"}}: {e}') from None


def latency_knobs_in(patch: dict[str, Any]) -> list[str]:
    return [name for name in KNOB_FIELDS if name in patch]


def empty_stats() -> dict[str, int]:
    return {name: 0 for name in STATS_FIELDS}


def refuse_browser_post(headers: Any) -> None:
    """A POST a web page could send without the browser asking first (a CORS "simple" request):
    a form content type, or any Origin header. `curl -X POST URL` (no body, no content type) and
    JSON clients pass; everything else is refused, so a page cannot reset the counters."""
    ctype = (headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    if ctype and ctype != "application/json":
        raise ControlError(415, f"content-type {ctype!r} not accepted; send no body or application/json")
    if headers.get("origin") is not None:
        raise ControlError(403, "requests from a web page (an Origin header) are refused")
