"""`/metrics` of `serve --api-server-count N`: the series of every API server process, added up
the way vLLM's API servers add them up.

vLLM (0.32) points PROMETHEUS_MULTIPROC_DIR at a temporary directory when it starts more than one
API server; every process's prometheus_client metrics then live in memory-mapped files there,
and each API server's /metrics is a registry holding only prometheus_client's
MultiProcessCollector over that directory. What a scrape then shows: counters and histograms
summed over the processes; the `vllm:` gauges as the most recently written value
(`multiprocess_mode="mostrecent"`; `vllm:lora_requests_info` is summed); no `_created` samples;
no process_* / python_* series.

This frontend keeps its counts in plain Python (vllm/metrics.py), so each process writes them
into the same files, in prometheus_client's format (its MmapedDict), whenever it is scraped, when
a gauge vLLM sets on an event is set (`vllm:engine_sleep_state`: stamped with the time of the set,
changed or not, as prometheus_client stamps every set) and every DUMP_INTERVAL seconds; the exposition is then prometheus_client's own MultiProcessCollector.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector

DUMP_INTERVAL = 0.5  # s: how stale another API server's counts can be in a scrape
SUMMED_GAUGES = frozenset({"vllm:lora_requests_info"})
NOT_SHARED = ("process_", "python_")  # the default registry's process collectors: absent in vLLM's multiprocess registry


def gauge_mode(name: str) -> str:
    """vLLM's multiprocess_mode of a gauge (prometheus_client's default, `all`, for the others)."""
    if name in SUMMED_GAUGES:
        return "sum"
    return "mostrecent" if name.startswith("vllm:") else "all"


class SharedMetrics:
    """One API server's metrics (a FrontendMetrics, whose recording calls pass through) with the
    multiprocess exposition in place of its own."""

    def __init__(self, metrics: Any, directory: str) -> None:
        self._metrics = metrics
        self.directory = directory
        self._pid = os.getpid()
        self._files: dict[str, MmapedDict] = {}
        self._gauges: dict[str, tuple[float, float]] = {}  # key -> (value, when it last changed)
        self._registry = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(self._registry, path=directory)
        self._task: asyncio.Task | None = None
        self._epoch: int | None = None  # the scripted gauges' epoch at the last dump
        metrics.on_gauge_set = self.dump  # an event's gauge reaches the other processes at once

    def __getattr__(self, name: str) -> Any:
        return getattr(self._metrics, name)

    # ------------------------------------------------------------------ writing this process's values
    def _file(self, kind: str) -> MmapedDict:
        f = self._files.get(kind)
        if f is None:
            f = self._files[kind] = MmapedDict(os.path.join(self.directory, f"{kind}_{self._pid}.db"))
        return f

    def dump(self) -> None:
        """Write this process's current values into its files. A gauge is written when its value
        changed, or was set by an event, since the last dump, and every gauge when the scripted
        gauges were set or cleared since (by any process: a process that never rendered a scripted
        value has nothing changed of its own, while another's file may still hold that value as the
        most recent)."""
        now = time.time()
        epoch_of = getattr(self._metrics, "gauges_epoch", None)
        epoch = epoch_of() if epoch_of is not None else None
        restamp = epoch != self._epoch
        self._epoch = epoch
        for fam in self._metrics.registry.collect():
            if fam.name.startswith(NOT_SHARED):
                continue
            if fam.type == "counter":
                self._dump_plain(fam, self._file("counter"))
            elif fam.type == "histogram":
                self._dump_histogram(fam, self._file("histogram"))
            elif fam.type == "gauge":
                self._dump_gauge(fam, self._file(f"gauge_{gauge_mode(fam.name)}"), now, restamp)

    @staticmethod
    def _key(fam: Any, sample: Any) -> str:
        labels = sample.labels
        return mmap_key(fam.name, sample.name, list(labels), list(labels.values()), fam.documentation)

    def _dump_plain(self, fam: Any, f: MmapedDict) -> None:
        for s in fam.samples:
            if not s.name.endswith("_created"):
                f.write_value(self._key(fam, s), float(s.value), 0.0)

    def _dump_histogram(self, fam: Any, f: MmapedDict) -> None:
        # the files hold each bucket's own count (the collector accumulates) and the sum
        previous: dict[tuple, float] = {}
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                series = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                below = previous.get(series, 0.0)
                previous[series] = float(s.value)
                f.write_value(self._key(fam, s), float(s.value) - below, 0.0)
            elif s.name.endswith("_sum"):
                f.write_value(self._key(fam, s), float(s.value), 0.0)

    def _dump_gauge(self, fam: Any, f: MmapedDict, now: float, restamp: bool = False) -> None:
        set_at = self._metrics.gauge_set_at.get(fam.name)
        for s in fam.samples:
            key = self._key(fam, s)
            value = float(s.value)
            last = self._gauges.get(key)
            if set_at is not None and (last is None or set_at > last[1]):
                when = set_at  # set (to whatever value) since the last dump: prometheus_client stamps every set
            elif not restamp and last is not None and last[0] == value:
                continue
            else:
                when = now
            # "mostrecent" across processes: the one whose value was set or changed last
            self._gauges[key] = (value, when)
            f.write_value(key, value, when)

    # ------------------------------------------------------------------ exposition (basics.py's /metrics)
    def render_text(self) -> bytes:
        self.dump()
        return generate_latest(self._registry)

    def render(self, accept_header: str | None = None) -> tuple[bytes, str]:
        self.dump()
        encoder, content_type = choose_encoder(accept_header or "")
        return encoder(self._registry), content_type

    # ------------------------------------------------------------------ keeping the files fresh
    def start(self) -> None:
        self.dump()
        self._task = asyncio.get_running_loop().create_task(self._dump_every(), name="metrics-dump")

    async def _dump_every(self) -> None:
        while True:
            await asyncio.sleep(DUMP_INTERVAL)
            self.dump()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        try:
            self.dump()  # the last values stay for the processes still running (vLLM's files do too)
        except Exception:  # noqa: BLE001 - never fail a shutdown for metrics
            pass
        for f in self._files.values():
            f.close()
        self._files.clear()
