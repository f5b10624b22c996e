"""Connect engines to FPM publishers: one collector (step observer) and one PUB socket per rank."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from .collector import FpmCollector
from .publisher import FpmPublisher, rank_endpoint
from .record import ForwardPassMetrics


def attach_fpm(cores: Iterable[Any], base_port: int, *, host: str = "127.0.0.1", worker_id: str = "",
               engine_type: str = "vllm",
               extra_sink: Callable[[ForwardPassMetrics], None] | None = None) -> list[FpmPublisher]:
    """Observe every core's steps and publish their records; returns the publishers (close them at
    shutdown). `extra_sink` also gets every record (a trace recorder)."""
    publishers = []
    try:
        for core in cores:
            pub = FpmPublisher(rank_endpoint(host, base_port, core.engine_index))
            publishers.append(pub)
            sinks = [pub.publish] + ([extra_sink] if extra_sink is not None else [])
            core.add_step_observer(FpmCollector(core, worker_id, engine_type, sinks))
    except Exception:
        for pub in publishers:
            pub.close()
        raise
    return publishers
