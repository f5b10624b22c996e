"""Connect engines to FPM publishers: one collector (step observer) and one PUB socket per rank."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from .collector import FpmCollector
from .publisher import FpmPublisher, rank_endpoint
from .record import ForwardPassMetrics


def attach_fpm(cores: Iterable[Any], base_port: int | None, *, host: str = "127.0.0.1", worker_id: str = "",
               engine_type: str = "vllm",
               extra_sink: Callable[[ForwardPassMetrics], None] | None = None) -> list[FpmPublisher]:
    """Observe every core's steps and publish their records (rank i on `base_port + i`; no socket
    when `base_port` is None); returns the publishers (close them at shutdown). `extra_sink` also
    gets every record (a trace writer)."""
    publishers = []
    try:
        for core in cores:
            sinks = [extra_sink] if extra_sink is not None else []
            if base_port is not None:
                pub = FpmPublisher(rank_endpoint(host, base_port, core.engine_index))
                pub.idle = ForwardPassMetrics(worker_id=worker_id, dp_rank=core.engine_index, engine_type=engine_type)
                publishers.append(pub)
                sinks.insert(0, pub.publish)
            core.add_step_observer(FpmCollector(core, worker_id, engine_type, sinks))
    except Exception:
        for pub in publishers:
            pub.close()
        raise
    return publishers


def trace_sink(path: str, model: str) -> tuple[Callable[[ForwardPassMetrics], None], Any]:
    """A sink writing each record as a trace's `{"fpm": ...}` line; returns (sink, writer to close)."""
    import msgspec

    from ..trace.io import TraceWriter
    from ..trace.schema import SOURCE_FPM, TraceMeta

    writer = TraceWriter(path, TraceMeta(model=model, source=SOURCE_FPM), flush_each=False)
    return (lambda fpm: writer.write_fpm(msgspec.to_builtins(fpm))), writer


def appending_trace_sink(path: str) -> tuple[Callable[[ForwardPassMetrics], None], Callable[[], None]]:
    """A sink appending each record's `{"fpm": ...}` line to a trace that several processes write
    (one per data-parallel rank), its meta line written already: each line is one write to a file
    opened for appending, so the lines of the processes never mix. Returns (sink, close)."""
    import os

    import msgspec

    from ..trace.io import encode_fpm_line

    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    return (lambda fpm: os.write(fd, encode_fpm_line(msgspec.to_builtins(fpm)))), (lambda: os.close(fd))
