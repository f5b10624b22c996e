"""The `http_*` series vLLM's frontend exports through prometheus-fastapi-instrumentator, and the
process / platform / GC collectors of prometheus_client's default registry.

vLLM 0.32 builds `Instrumentator(excluded_handlers=[...]).add().instrument(app)` with the default
instrumentation: per request (not per token) it counts

* `http_requests_total{handler,method,status}` (status grouped: `2xx`, `4xx`, ...),
* `http_request_size_bytes{handler}` / `http_response_size_bytes{handler}` (summaries of the
  `Content-Length` headers; a streamed response has none and counts 0),
* `http_request_duration_highr_seconds` (no labels, many buckets) and
  `http_request_duration_seconds{handler,method}` (three buckets), the whole request, stream included.

`handler` is the route template (`/v1/completions`, `/v1/models/{model}`), `none` for a path no route
matches. A handler that one of the excluded patterns finds (a regex search, so `/load` also excludes
`/v1/load_lora_adapter`) is not counted. Values live in plain dicts; prometheus families are built only
when /metrics is scraped, and kept while their values stay the same.
"""

from __future__ import annotations

import re
import time
from functools import reduce
from itertools import compress, repeat
from operator import add, is_, itemgetter
from typing import Any, Callable

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, SummaryMetricFamily
from prometheus_client.samples import Sample

from .exposition import FamilyMemo, exact
from .metrics import Histogram

__all__ = ["HttpMetrics", "register_process_collectors", "EXCLUDED_HANDLERS", "HIGHR_BUCKETS", "LOWR_BUCKETS"]

# vllm/entrypoints/serve/instrumentator/metrics.py: Instrumentator(excluded_handlers=...)
EXCLUDED_HANDLERS = ("/metrics", "/health", "/load", "/ping", "/version", "/server_info")
# prometheus_fastapi_instrumentator.metrics.default(): latency_highr_buckets, latency_lowr_buckets
HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7.5, 10, 30,
                 60)
LOWR_BUCKETS = (0.1, 0.5, 1)

_EXCLUDED = [re.compile(p) for p in EXCLUDED_HANDLERS]
_ENTRY, _IN, _OUT, _DURATION = (itemgetter(i) for i in range(4))  # a kept row's fields


def register_process_collectors(registry: CollectorRegistry) -> None:
    """process_*, python_info and python_gc_* on `registry`, as on prometheus_client's default one."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)


def _fold_count(counter: list, rows: list) -> None:
    counter[0] += len(rows)


def _fold_sizes(size_of: Callable[[tuple], int]) -> Callable[[list, list], None]:
    def fold(summary: list, rows: list) -> None:
        summary[0] += len(rows)
        summary[1] = reduce(add, map(size_of, rows), summary[1])
    return fold


def _fold_duration(histogram: Histogram, rows: list) -> None:
    histogram.observe_all(list(map(_DURATION, rows)))


# a kept row's entry, field by field (requests counter, request sizes, response sizes, latency
# histogram), and how that record takes its rows
_FOLDERS = tuple(zip(map(itemgetter, range(4)), (_fold_count, _fold_sizes(_IN), _fold_sizes(_OUT), _fold_duration)))


class HttpMetrics:
    """prometheus-fastapi-instrumentator's default series, counted by `observe` once per request."""

    def __init__(self, registry: CollectorRegistry | None = None):
        now = time.time()
        self._excluded: dict[str, bool] = {}
        self.requests: dict[tuple[str, str, str], list[float]] = {}  # (method, status, handler) -> [n, created]
        self.in_size: dict[str, list[float]] = {}  # handler -> [count, sum, created]
        self.out_size: dict[str, list[float]] = {}
        self.highr = Histogram(HIGHR_BUCKETS, now)
        self.lowr: dict[tuple[str, str], Histogram] = {}  # (method, handler)
        # (method, status, handler) -> the four records above that such a request adds to
        self._entries: dict[tuple[str, int, str], tuple[list, list, list, Histogram]] = {}
        self._memo = FamilyMemo()
        self._rows: list[tuple[tuple, int, int, float]] = []  # (entry, sizes, duration) not folded in yet
        if registry is not None:
            registry.register(self)

    def excluded(self, handler: str) -> bool:
        hit = self._excluded.get(handler)
        if hit is None:
            hit = self._excluded[handler] = any(p.search(handler) for p in _EXCLUDED)
        return hit

    FOLD_AT = 4096  # kept rows at most (then they are folded in)

    def observe(self, handler: str, method: str, status: int, request_size: int, response_size: int,
                duration: float) -> None:
        """One finished request (call it only for a handler that is not `excluded`): kept as a row,
        folded into the series in bulk (`fold`) before anything reads them."""
        key = (method, status, handler)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = self._entry(method, status, handler)
        rows = self._rows
        rows.append((entry, request_size, response_size, duration))
        if len(rows) >= self.FOLD_AT:
            self.fold()

    def fold(self) -> None:
        """The kept rows into the series, as adding each row at once would: the same additions in
        the same order per record (each record's rows in arrival order: a size summary is shared by
        every method and status of its handler, a latency histogram by every status of its method
        and handler, the histogram with no labels by all of them), with the loops in C."""
        rows = self._rows
        if not rows:
            return
        self._rows = []
        self.highr.observe_all(list(map(_DURATION, rows)))
        entries = list(map(_ENTRY, rows))
        for field, fold_into in _FOLDERS:
            records = list(map(field, entries))
            distinct = {id(r): r for r in records}
            for record in distinct.values():  # (one record: every row is its own)
                mine = rows if len(distinct) == 1 else list(compress(rows, map(is_, records, repeat(record))))
                fold_into(record, mine)

    def _entry(self, method: str, status: int, handler: str) -> tuple[list, list, list, Histogram]:
        """The records a request of this method, status and handler adds to, made on first use."""
        group = f"{str(status)[0]}xx"
        c = self.requests.get((method, group, handler))
        if c is None:
            c = self.requests[(method, group, handler)] = [0, time.time()]
        sizes = []
        for table in (self.in_size, self.out_size):
            s = table.get(handler)
            if s is None:
                s = table[handler] = [0, 0.0, time.time()]
            sizes.append(s)
        h = self.lowr.get((method, handler))
        if h is None:
            h = self.lowr[(method, handler)] = Histogram(LOWR_BUCKETS, time.time())
        return c, sizes[0], sizes[1], h

    # -- exposition (a prometheus_client collector) -------------------------------------------

    def collect(self) -> Any:
        """The families, each the same object as at the last scrape while its values are (FamilyMemo)."""
        self.fold()
        memo = self._memo
        requests = self.requests

        def total():
            fam = CounterMetricFamily("http_requests", "Total number of requests by method, status and handler.",
                                      labels=["method", "status", "handler"])
            for (method, status, handler), (n, created) in requests.items():
                fam.add_metric([method, status, handler], n, created=created)
            return fam

        yield memo.get("http_requests", tuple((k, exact(n), exact(c)) for k, (n, c) in requests.items()), total)
        for name, doc, table in (
                ("http_request_size_bytes", "Content length of incoming requests by handler. Only value of header "
                 "is respected. Otherwise ignored. No percentile calculated. ", self.in_size),
                ("http_response_size_bytes", "Content length of outgoing responses by handler. Only value of "
                 "header is respected. Otherwise ignored. No percentile calculated. ", self.out_size)):
            def summary(name=name, doc=doc, table=table):
                fam = SummaryMetricFamily(name, doc, labels=["handler"])
                for handler, (count, total_size, created) in table.items():
                    fam.add_metric([handler], count, total_size)
                    fam.samples.append(Sample(name + "_created", {"handler": handler}, created))
                return fam

            yield memo.get(name, tuple((k, *map(exact, v)) for k, v in table.items()), summary)
        highr = self.highr

        def highr_family():
            name = "http_request_duration_highr_seconds"
            fam = HistogramMetricFamily(name, "Latency with many buckets but no API specific labels. Made for "
                                        "more accurate percentile calculations. ")
            fam.add_metric([], highr.cumulative(), highr.total)
            fam.samples.append(Sample(name + "_created", {}, highr.created))
            return fam

        yield memo.get("highr", (exact(highr.total), exact(highr.created), *highr.counts), highr_family)
        lowr = self.lowr

        def lowr_family():
            name = "http_request_duration_seconds"
            fam = HistogramMetricFamily(name, "Latency with only few buckets by handler. Made to be only used if "
                                        "aggregation by handler is important. ", labels=["method", "handler"])
            for (method, handler), h in lowr.items():
                fam.add_metric([method, handler], h.cumulative(), h.total)
                fam.samples.append(Sample(name + "_created", {"method": method, "handler": handler}, h.created))
            return fam

        yield memo.get("lowr", tuple((k, exact(h.total), exact(h.created), *h.counts) for k, h in lowr.items()),
                       lowr_family)
