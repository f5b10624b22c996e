"""`--kv-events-config`: vLLM's KVEventsConfig (vllm/config/kv_events.py, same in 0.32 and 0.33).

Like vLLM, a pydantic dataclass that forbids unknown keys and validates in lax mode ("true" is a
bool, "10" an int), so a typo fails at start-up; every error names the flag and the key. On top
of vLLM's types, values that could only fail later (a negative buffer, an endpoint ZMQ cannot
use) fail here. `--enable-kv-cache-events` is vllm-vcr's own shorthand for
`{"enable_kv_cache_events": true}` (vLLM has no such flag).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Literal, Mapping

import pydantic
from pydantic import ConfigDict, Field, field_validator
from pydantic.dataclasses import dataclass

FLAG = "--kv-events-config"


class KVEventsConfigError(ValueError):
    pass


@dataclass(config=ConfigDict(extra="forbid"))
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None resolves like vLLM in __post_init__
    endpoint: str = "tcp://*:5557"  # PUB: bound if it has "*"/"::" or is ipc/inproc, else connected
    replay_endpoint: str | None = None  # ROUTER, always bound
    buffer_steps: int = Field(default=10_000, ge=0)  # batches kept for replay
    hwm: int = Field(default=100_000, ge=0)  # PUB send high-water mark
    max_queue_size: int = Field(default=100_000, ge=1)  # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"

    @field_validator("endpoint")
    @classmethod
    def _zmq_endpoint(cls, ep: str) -> str:
        if not ep.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError("must be tcp://, ipc:// or inproc://")
        return ep

    @property
    def active(self) -> bool:
        """True when a real publisher should run (vLLM's EventPublisherFactory rule)."""
        return bool(self.enable_kv_cache_events) and self.publisher != "null"

    def to_dict(self) -> dict[str, Any]:
        """Field order and names of vLLM's dataclass (as the READY response reports it)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVEventsConfig:
        if not isinstance(data, Mapping):
            raise KVEventsConfigError(f"{FLAG}: expected a JSON object, got {type(data).__name__}")
        return _validated(cls, **data)

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise KVEventsConfigError(f"{FLAG}: invalid JSON: {e}") from None
        return cls.from_dict(data)


def _validated(build: Any, *args: Any, **kwargs: Any) -> KVEventsConfig:
    """`build(...)` with pydantic's errors turned into one KVEventsConfigError naming flag and key."""
    try:
        return build(*args, **kwargs)
    except pydantic.ValidationError as e:
        problems = []
        for err in e.errors(include_url=False):
            key = ".".join(str(p) for p in err["loc"]) or "value"
            if err["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
                known = ", ".join(f.name for f in dataclasses.fields(KVEventsConfig))
                problems.append(f"unknown key {key} (known: {known})")
            else:
                msg = err["msg"].removeprefix("Value error, ")
                problems.append(f"{key}: {msg} (got {err.get('input')!r})")
        raise KVEventsConfigError(f"{FLAG}: " + "; ".join(problems)) from None


def parse_kv_events_config(value: str | Mapping[str, Any] | KVEventsConfig | None = None,
                           enable_kv_cache_events: bool = False) -> KVEventsConfig | None:
    """The config the engine runs with, or None when neither flag was given.

    `enable_kv_cache_events=True` (the shorthand) switches events on over whatever the JSON
    said; an explicit `"publisher": "null"` in the JSON still wins.
    """
    if value is None or value == "":
        if not enable_kv_cache_events:
            return None
        return KVEventsConfig(enable_kv_cache_events=True)
    if isinstance(value, KVEventsConfig):
        cfg = value
    elif isinstance(value, str):
        cfg = KVEventsConfig.from_json(value)
    else:
        cfg = KVEventsConfig.from_dict(value)
    if enable_kv_cache_events and not cfg.enable_kv_cache_events:
        explicit_publisher = isinstance(value, (str, Mapping)) and _has_publisher(value)
        cfg = _validated(dataclasses.replace, cfg, enable_kv_cache_events=True,
                         publisher=cfg.publisher if explicit_publisher else None)
    return cfg


def _has_publisher(value: str | Mapping[str, Any]) -> bool:
    data = json.loads(value) if isinstance(value, str) else value
    return data.get("publisher") is not None


def add_kv_events_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("KV cache events (vLLM ZMQ publisher)")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="vLLM's KVEventsConfig as JSON, e.g. "
                        "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
                        "\"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv@pod@model\"}'")
    g.add_argument("--enable-kv-cache-events", action="store_true", default=False,
                   help="shorthand for --kv-events-config '{\"enable_kv_cache_events\": true}' "
                        "(PUB on tcp://*:5557, no replay)")


def kv_events_config_from_cli(ns: argparse.Namespace) -> KVEventsConfig | None:
    """The config of the parsed --kv-events-config / --enable-kv-cache-events (see add_kv_events_args)."""
    return parse_kv_events_config(ns.kv_events_config, ns.enable_kv_cache_events)
