"""Per-adapter request states and `vllm:lora_requests_info`, as vLLM's frontend derives them.

vLLM's output processor moves a request between an adapter's `waiting` and `running` sets on
its engine events (QUEUED -> waiting, SCHEDULED -> running, PREEMPTED -> waiting) and drops it
when it finishes; on every scheduler-stats update the gauge `vllm:lora_requests_info` is set to
the current time under the labels `max_lora`, `waiting_lora_adapters` and
`running_lora_adapters` (the names of the adapters with any waiting or running request, joined by
commas: vLLM 0.32 puts the same keys in both). A label set once set stays exported,
so a scrape shows every combination seen, the latest one with the newest timestamp.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from prometheus_client.metrics_core import GaugeMetricFamily

from ..engine.types import EngineCoreEventType, EngineCoreOutputs, EngineCoreRequest

_QUEUED = int(EngineCoreEventType.QUEUED)
_SCHEDULED = int(EngineCoreEventType.SCHEDULED)
_PREEMPTED = int(EngineCoreEventType.PREEMPTED)
MAX_SERIES = 10_000  # label sets kept for the gauge; the oldest go first beyond this


class LoRARequestStates:
    """Which requests of which adapter wait or run; counts per adapter since start."""

    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self._adapter_of: dict[str, str] = {}
        # adapter -> request id -> True (running) / False (waiting); insertion order as vLLM's dict
        self._states: dict[str, dict[str, bool]] = {}
        self.totals: Counter[str] = Counter()
        self._series: dict[tuple[str, str], float] = {}

    def on_submit(self, request: EngineCoreRequest) -> None:
        name = request.lora_name
        if name:
            self._adapter_of[request.request_id] = name
            self.totals[name] += 1

    def on_engine_outputs(self, engine_index: int, outputs: EngineCoreOutputs) -> None:
        adapter_of = self._adapter_of
        if adapter_of:
            for o in outputs.outputs:
                name = adapter_of.get(o.request_id)
                if name is None:
                    continue
                for ev in o.events or ():
                    if ev.type == _QUEUED or ev.type == _PREEMPTED:
                        self._set(name, o.request_id, False)
                    elif ev.type == _SCHEDULED:
                        self._set(name, o.request_id, True)
                if o.finish_reason is not None:
                    self._drop(o.request_id)
            for rid in outputs.finished_requests or ():
                self._drop(rid)
        if outputs.scheduler_stats is not None:
            self._series.pop(self._labels(), None)
            self._series[self._labels()] = time.time()
            if len(self._series) > MAX_SERIES:
                del self._series[next(iter(self._series))]

    def _set(self, name: str, rid: str, running: bool) -> None:
        self._states.setdefault(name, {})[rid] = running

    def _drop(self, rid: str) -> None:
        name = self._adapter_of.pop(rid, None)
        if name is None:
            return
        reqs = self._states.get(name)
        if reqs is not None:
            reqs.pop(rid, None)
            if not reqs:
                del self._states[name]

    def counts(self) -> dict[str, tuple[int, int]]:
        """adapter -> (running, waiting) right now."""
        out = {}
        for name, reqs in self._states.items():
            running = sum(1 for r in reqs.values() if r)
            out[name] = (running, len(reqs) - running)
        return out

    def _labels(self) -> tuple[str, str]:
        # vLLM fills both dicts with every adapter that has a request (count 0 included) and
        # joins their keys: both labels name the same adapters
        names = ",".join(self._states)
        return names, names

    def collect(self) -> Any:
        fam = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        for (waiting, running), ts in self._series.items():
            fam.add_metric([str(self.max_loras), waiting, running], ts)
        yield fam
