"""The Prometheus text exposition of `/metrics`, rendered cheaply enough for a scrape every 50 ms.

`TextExposition(registry).render()` returns the bytes `prometheus_client.generate_latest(registry)`
returns for the same registry state, byte for byte (tests/http/test_exposition.py drives both with
hostile label values, special floats and arbitrary update sequences), at a fraction of the cost:

* every family a collector yields goes through the same format rules as the library's, but the
  `# HELP` / `# TYPE` lines of a family and the `name{label="value",...} ` prefix of each sample
  line are built once and kept, once per process (a fleet's workers share them); a scrape
  formats only the values;
* a collector that builds its families through a `FamilyMemo` gets a family's whole text kept
  while the family's inputs (its key) are unchanged, so a histogram nobody observed since the last
  scrape costs a key comparison, not a family object and 25 formatted lines. Only the text is
  kept, not the family; outside `render()` (generate_latest, the OpenMetrics encoder) a memo
  builds every family from the current values.

Any exception falls back to `generate_latest` itself, so a registry the library refuses fails
the way the library fails. The format rules reproduced here are prometheus-client 0.26's
(`generate_latest` with the default `underscores` escaping); pyproject.toml pins the release line
they were checked against.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Hashable
from typing import Any

from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import UNDERSCORES, escape_label_name, escape_metric_name
from prometheus_client.utils import floatToGoString

__all__ = ["FamilyMemo", "TextExposition", "exact"]

# the OpenMetrics-only samples the text format moves into gauges of their own after the family,
# in sorted(suffix) order (generate_latest's `sorted(om_samples.items())`)
_OM_SUFFIXES = ("_created", "_gcount", "_gsum")
# Prometheus text format munging of OpenMetrics types: type -> (name suffix, type shown)
_MUNGE = {"counter": ("_total", "counter"), "info": ("_info", "gauge"), "stateset": ("", "gauge"),
          "gaugehistogram": ("", "histogram"), "unknown": ("", "untyped")}
_MAX_PREFIXES = 20_000  # sample prefixes kept (label sets are bounded in serve; this bounds the rest)
# the text that depends only on names, help texts and label values: one copy per process, whatever
# the number of registries (a fleet's workers share the prefixes of their common series)
_HEADS: dict[tuple[str, str, str], tuple[str, dict[str, int]]] = {}  # (name, type, help) -> (header, OM slots)
_OM_HEADS: dict[tuple[str, int, str], str] = {}  # (name, OM slot, help) -> header of that OM gauge
_PREFIXES: dict[tuple[str, ...], str] = {}  # (sample name, *label names, *label values) -> 'name{k="v",...} '
_KEEP = "_vcr_keep"  # on a family a FamilyMemo built while rendering: (memo dict, slot, key)
# set while TextExposition.render() collects: only then does a FamilyMemo hand out kept texts
_RENDERING: contextvars.ContextVar[bool] = contextvars.ContextVar("vllm_vcr_exposition_rendering", default=False)


def exact(v: Any) -> Any:
    """A value as a memo key that tells apart what formats differently (-0.0 from 0.0; every NaN
    formats alike and gets one key)."""
    return float.hex(v) if type(v) is float else v


class _Kept:
    """A family's rendered text, standing in for the family while its key is unchanged."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


class FamilyMemo:
    """A collector's families' texts, kept while their inputs are unchanged.

    `get(slot, key, build)` returns the text TextExposition rendered for `slot` last time if `key`
    equals the key it was built for; otherwise (and always outside TextExposition.render) the
    family `build()` returns. The key must determine every byte of the family (use `exact()` for
    floats)."""

    __slots__ = ("_memo",)

    def __init__(self) -> None:
        self._memo: dict[Hashable, tuple[Hashable, _Kept]] = {}

    def get(self, slot: Hashable, key: Hashable, build: Callable[[], Any]) -> Any:
        if not _RENDERING.get():
            return build()
        hit = self._memo.get(slot)
        if hit is not None and hit[0] == key:
            return hit[1]
        fam = build()
        setattr(fam, _KEEP, (self._memo, slot, key))  # the renderer keeps its text under `key`
        return fam


def _escape_help(doc: str) -> str:
    return doc.replace("\\", r"\\").replace("\n", r"\n")


def _escape_value(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class TextExposition:
    """generate_latest(registry) with its per-family headers and per-sample prefixes kept."""

    def __init__(self, registry: Any):
        self.registry = registry
        # what depends only on names, help texts and label values, shared by every worker of the process
        self._heads = _HEADS
        self._om_heads = _OM_HEADS
        self._prefixes = _PREFIXES

    def render(self) -> bytes:
        token = _RENDERING.set(True)
        try:
            body = self._render().encode("utf-8")
        except Exception:  # whatever the library makes of it (its own exception, with its context)
            body = None
        finally:
            _RENDERING.reset(token)
        return generate_latest(self.registry) if body is None else body

    def _render(self) -> str:
        out = []
        kept = []  # texts to keep, once the whole scrape has rendered
        for metric in self.registry.collect():
            if type(metric) is _Kept:
                out.append(metric.text)
                continue
            text = self._family(metric)
            keep = metric.__dict__.get(_KEEP)
            if keep is not None:
                kept.append((keep, text))
            out.append(text)
        for (memo, slot, key), text in kept:
            memo[slot] = (key, _Kept(text))
        return "".join(out)

    def _head(self, metric: Any) -> tuple[str, dict[str, int]]:
        name, mtype, doc = metric.name, metric.type, metric.documentation
        head = self._heads.get((name, mtype, doc))
        if head is None:
            suffix, shown = _MUNGE.get(mtype, ("", mtype))
            mname = escape_metric_name(name + suffix, UNDERSCORES)
            head = (f"# HELP {mname} {_escape_help(doc)}\n# TYPE {mname} {shown}\n",
                    {name + s: i for i, s in enumerate(_OM_SUFFIXES)})
            self._heads[(name, mtype, doc)] = head
        return head

    def _om_head(self, metric: Any, slot: int) -> str:
        """The header of the gauge an OpenMetrics-only sample (`_created`, ...) moves into."""
        key = (metric.name, slot, metric.documentation)
        head = self._om_heads.get(key)
        if head is None:
            name = escape_metric_name(metric.name + _OM_SUFFIXES[slot], UNDERSCORES)
            head = self._om_heads[key] = f"# HELP {name} {_escape_help(metric.documentation)}\n# TYPE {name} gauge\n"
        return head

    def _prefix(self, name: str, labels: dict[str, str]) -> str:
        if labels:
            inner = ",".join(f'{escape_label_name(k, UNDERSCORES)}="{_escape_value(v)}"'
                             for k, v in sorted(labels.items()))
            p = f"{escape_metric_name(name, UNDERSCORES)}{{{inner}}} "
        else:
            p = f"{escape_metric_name(name, UNDERSCORES)} "
        if len(self._prefixes) >= _MAX_PREFIXES:
            self._prefixes.clear()
        return p

    def _family(self, metric: Any) -> str:
        head, om_slot = self._head(metric)
        out = [head]
        om: list[list[str]] | None = None
        prefixes = self._prefixes
        fmt = floatToGoString
        for s in metric.samples:
            name, labels = s.name, s.labels
            key = (name, *labels, *labels.values())  # (its length tells names from values)
            p = prefixes.get(key)
            if p is None:
                p = prefixes[key] = self._prefix(name, labels)
            v, ts = s.value, s.timestamp
            # an int below 1e6 (bucket counts) is repr(float(v)) without the float: "12.0"
            vs = f"{v}.0" if type(v) is int and 0 <= v < 1_000_000 else fmt(v)
            line = f"{p}{vs}\n" if ts is None else f"{p}{vs} {int(float(ts) * 1000):d}\n"
            slot = om_slot.get(name)
            if slot is None:
                out.append(line)
            else:
                if om is None:
                    om = [[], [], []]
                om[slot].append(line)
        if om is not None:
            for slot, lines in enumerate(om):
                if lines:
                    out.append(self._om_head(metric, slot))
                    out.extend(lines)
        return "".join(out)
