"""Connect engines to KV event publishers: one collector and one publisher per engine (DP rank)."""

from __future__ import annotations

from typing import Any, Iterable

from .config import KVEventsConfig
from .events import KVEventCollector
from .publisher import create_publisher


def attach_kv_events(cores: Iterable[Any], config: KVEventsConfig | None) -> list[Any]:
    """Give every EngineCore a collector and a publisher (ports offset by rank); returns the
    publishers so the caller can report their config and close them at shutdown."""
    if config is None or not config.active:
        return []  # no collector at all: events cost nothing when off
    publishers = []
    for core in cores:
        publisher = create_publisher(config, data_parallel_rank=core.engine_index)
        core.attach_kv_events(KVEventCollector(), publisher.publish)
        publishers.append(publisher)
    return publishers
