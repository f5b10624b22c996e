"""The Prometheus text exposition of `/metrics`, rendered cheaply enough for a scrape every 50 ms.

`TextExposition(registry).render()` returns the bytes `prometheus_client.generate_latest(registry)`
returns for the same registry state, byte for byte (tests/http/test_exposition.py drives both with
hostile label values, special floats and arbitrary update sequences), at a fraction of the cost:

* every family a collector yields goes through the same format rules as the library's, but the
  `# HELP` / `# TYPE` lines of a family and the `name{label="value",...} ` prefix of each sample
  line are built once and kept; a scrape formats only the values;
* a collector that keeps its families (`FamilyMemo`: the same family object while its inputs are
  unchanged) gets that family's whole text kept too, so a histogram nobody observed since the
  last scrape costs a dict lookup, not 25 formatted lines.

Any exception falls back to `generate_latest` itself, so a registry the library refuses fails
the way the library fails. The format rules reproduced here are prometheus-client 0.2x's
(`generate_latest` with the default `underscores` escaping); pyproject.toml pins the release line
they were checked against.
"""

from __future__ import annotations

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
_MAX_PREFIXES = 50_000  # sample prefixes kept (label sets are bounded in serve; this bounds the rest)
_FROZEN = "_vcr_frozen"  # set on a family object a FamilyMemo keeps: it is never changed afterwards
_TEXT = "_vcr_text"  # that family's rendered text, once rendered


def exact(v: Any) -> Any:
    """A value as a memo key that tells apart what formats differently (-0.0 from 0.0; every NaN
    formats alike and gets one key)."""
    return float.hex(v) if type(v) is float else v


class FamilyMemo:
    """A collector's families, kept while their inputs are unchanged.

    `get(slot, key, build)` returns the family `build()` made for `slot` last time if `key` equals
    the key it was made for, else calls `build()` again. The key must determine every byte of the
    family (use `exact()` for floats); the family must not be changed after `build()` returns."""

    __slots__ = ("_memo",)

    def __init__(self) -> None:
        self._memo: dict[Hashable, tuple[Hashable, Any]] = {}

    def get(self, slot: Hashable, key: Hashable, build: Callable[[], Any]) -> Any:
        hit = self._memo.get(slot)
        if hit is not None and hit[0] == key:
            return hit[1]
        fam = build()
        setattr(fam, _FROZEN, True)
        self._memo[slot] = (key, fam)
        return fam


def _escape_value(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class TextExposition:
    """generate_latest(registry) with its per-family headers and per-sample prefixes kept."""

    def __init__(self, registry: Any):
        self.registry = registry
        # (name, type, documentation) -> (header text, {OM sample name: slot}, OM headers by slot)
        self._heads: dict[tuple[str, str, str], tuple[str, dict[str, int], tuple[str, ...]]] = {}
        self._prefixes: dict[Any, str] = {}  # (sample name, label items) -> 'name{k="v",...} '

    def render(self) -> bytes:
        try:
            return self._render().encode("utf-8")
        except Exception:  # whatever the library makes of it (its own exception, with its context)
            return generate_latest(self.registry)

    def _render(self) -> str:
        out = []
        for metric in self.registry.collect():
            d = metric.__dict__
            text = d.get(_TEXT)
            if text is None:
                text = self._family(metric)
                if d.get(_FROZEN):
                    d[_TEXT] = text
            out.append(text)
        return "".join(out)

    def _head(self, metric: Any) -> tuple[str, dict[str, int], tuple[str, ...]]:
        name, mtype, doc = metric.name, metric.type, metric.documentation
        head = self._heads.get((name, mtype, doc))
        if head is None:
            suffix, shown = _MUNGE.get(mtype, ("", mtype))
            mname = escape_metric_name(name + suffix, UNDERSCORES)
            help_doc = doc.replace("\\", r"\\").replace("\n", r"\n")
            om_heads = tuple(f"# HELP {escape_metric_name(name + s, UNDERSCORES)} {help_doc}\n"
                             f"# TYPE {escape_metric_name(name + s, UNDERSCORES)} gauge\n" for s in _OM_SUFFIXES)
            head = (f"# HELP {mname} {help_doc}\n# TYPE {mname} {shown}\n",
                    {name + s: i for i, s in enumerate(_OM_SUFFIXES)}, om_heads)
            self._heads[(name, mtype, doc)] = head
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
        head, om_slot, om_heads = self._head(metric)
        out = [head]
        om: list[list[str]] | None = None
        prefixes = self._prefixes
        fmt = floatToGoString
        for s in metric.samples:
            name, labels = s.name, s.labels
            key = (name, tuple(labels.items()))
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
                    out.append(om_heads[slot])
                    out.extend(lines)
        return "".join(out)
