"""`--kv-events-config`: vLLM's KVEventsConfig (vllm/config/kv_events.py, same in 0.32 and 0.33).

vLLM parses the flag's JSON into a pydantic dataclass that forbids unknown keys; this does the
same checks by hand so a typo fails at startup with the key's name. `--enable-kv-cache-events`
is vllm-vcr's own shorthand for `{"enable_kv_cache_events": true}` (vLLM has no such flag).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Mapping


class KVEventsConfigError(ValueError):
    pass


@dataclasses.dataclass
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" | "null"; None resolves like vLLM in __post_init__
    endpoint: str = "tcp://*:5557"  # PUB: bound if it has "*"/"::" or is ipc/inproc, else connected
    replay_endpoint: str | None = None  # ROUTER, always bound
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # PUB send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        self.validate()

    @property
    def active(self) -> bool:
        """True when a real publisher should run (vLLM's EventPublisherFactory rule)."""
        return bool(self.enable_kv_cache_events) and self.publisher != "null"

    def validate(self) -> "KVEventsConfig":
        if self.publisher not in ("zmq", "null"):
            raise KVEventsConfigError(
                f"--kv-events-config: publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 0:
                raise KVEventsConfigError(f"--kv-events-config: {name} must be >= 0")
        if self.max_queue_size == 0:
            raise KVEventsConfigError("--kv-events-config: max_queue_size must be >= 1")
        ep = self.endpoint
        if not ep or not (ep.startswith(("tcp://", "ipc://", "inproc://"))):
            raise KVEventsConfigError(
                f"--kv-events-config: endpoint must be tcp://, ipc:// or inproc://, got {ep!r}")
        return self

    def to_dict(self) -> dict[str, Any]:
        """Field order and names of vLLM's dataclass (as the READY response reports it)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "KVEventsConfig":
        if not isinstance(data, Mapping):
            raise KVEventsConfigError(
                f"--kv-events-config: expected a JSON object, got {type(data).__name__}")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise KVEventsConfigError(
                f"--kv-events-config: unknown key(s) {', '.join(unknown)}; "
                f"known: {', '.join(known)}")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            kwargs[key] = _coerce(key, value)
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise KVEventsConfigError(f"--kv-events-config: invalid JSON: {e}") from None
        return cls.from_dict(data)


_BOOL_FIELDS = {"enable_kv_cache_events"}
_INT_FIELDS = {"buffer_steps", "hwm", "max_queue_size"}
_OPT_STR_FIELDS = {"publisher", "replay_endpoint"}


def _coerce(key: str, value: Any) -> Any:
    # pydantic's lax mode (what vLLM uses) accepts "true"/1 for bools and "10" for ints
    if key in _BOOL_FIELDS:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            return value.lower() in ("true", "1", "yes", "on")
    elif key in _INT_FIELDS:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
    elif key in _OPT_STR_FIELDS:
        if value is None or isinstance(value, str):
            return value
    elif isinstance(value, str):
        return value
    raise KVEventsConfigError(f"--kv-events-config: bad value for {key}: {value!r}")


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
        cfg = dataclasses.replace(cfg, enable_kv_cache_events=True,
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
    return parse_kv_events_config(getattr(ns, "kv_events_config", None),
                                  bool(getattr(ns, "enable_kv_cache_events", False)))
