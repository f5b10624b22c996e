"""`inspect summarize`: a per-concurrency table of TTFT / per-token ITL quantiles and token counts."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from ..trace.io import Trace
from ..trace.schema import TraceRecord
from ..trace.stats import Samples, add_itl_samples, bucket_label, concurrency_bucket

PERCENTILES = (50, 90, 99)


def _row(label: str, recs: Sequence[TraceRecord]) -> dict[str, Any]:
    ttft, itl = Samples(), Samples()
    for r in recs:
        ttft.add(r.ttft_ms)
        add_itl_samples(itl, r)
    prompts = [r.prompt_tokens for r in recs]
    outputs = [r.output_tokens for r in recs]
    row: dict[str, Any] = {
        "concurrency": label,
        "count": len(recs),
        "prompt_min": min(prompts),
        "prompt_max": max(prompts),
        "prompt_total": sum(prompts),
        "cached_total": sum(r.cached_tokens for r in recs),
        "output_min": min(outputs),
        "output_max": max(outputs),
        "output_total": sum(outputs),
    }
    for p in PERCENTILES:
        row[f"ttft_p{p}_ms"] = ttft.quantile(p)
    for p in PERCENTILES:
        row[f"itl_p{p}_ms"] = itl.quantile(p) if len(itl) else None
    return row


def summarize(trace: Trace, by: str = "bucket") -> dict[str, Any]:
    """Rows per concurrency (`bucket`: the latency model's ranges; `exact`: each value) + `all`."""
    groups: dict[Any, list[TraceRecord]] = defaultdict(list)
    for r in trace.records:
        key = concurrency_bucket(r.concurrency) if by == "bucket" else r.concurrency
        groups[key].append(r)
    rows = [
        _row(bucket_label(k) if by == "bucket" else str(k), groups[k]) for k in sorted(groups)
    ]
    if trace.records:
        rows.append(_row("all", trace.records))
    meta = trace.meta
    arrivals = [r.arrival_ms for r in trace.records if r.arrival_ms is not None]
    out: dict[str, Any] = {
        "records": len(trace.records),
        "model": meta.model if meta else None,
        "source": meta.source if meta else None,
        "duration_s": (max(arrivals) - min(arrivals)) / 1e3 if len(arrivals) > 1 else None,
        "truncated": trace.truncated,
        "rows": rows,
    }
    finish: dict[str, int] = defaultdict(int)
    for r in trace.records:
        finish[r.finish_reason or "unknown"] += 1
    out["finish_reasons"] = dict(sorted(finish.items()))
    return out


def _fmt(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def render(summary: dict[str, Any], title: str) -> Any:
    from rich.table import Table

    table = Table(title=title, caption=_caption(summary), title_justify="left")
    table.add_column("conc", justify="right", style="bold")
    table.add_column("reqs", justify="right")
    table.add_column("prompt min-max", justify="right")
    table.add_column("output min-max", justify="right")
    for p in PERCENTILES:
        table.add_column(f"TTFT p{p}", justify="right", style="cyan")
    for p in PERCENTILES:
        table.add_column(f"ITL p{p}", justify="right", style="green")
    for row in summary["rows"]:
        is_all = row["concurrency"] == "all"
        table.add_row(
            row["concurrency"], str(row["count"]),
            f"{row['prompt_min']}-{row['prompt_max']}", f"{row['output_min']}-{row['output_max']}",
            *(_fmt(row[f"ttft_p{p}_ms"]) for p in PERCENTILES),
            *(_fmt(row[f"itl_p{p}_ms"]) for p in PERCENTILES),
            end_section=len(summary["rows"]) > 1 and summary["rows"][-2] is row,
            style="bold" if is_all else None,
        )
    return table


def _caption(summary: dict[str, Any]) -> str:
    parts = [f"{summary['records']} requests", "times in ms, ITL per token, nearest-rank"]
    if summary.get("model"):
        parts.insert(0, f"model {summary['model']}")
    if summary.get("duration_s"):
        parts.append(f"arrivals span {summary['duration_s']:.1f} s")
    if summary.get("truncated"):
        parts.append("TRUNCATED gzip")
    fr = summary.get("finish_reasons") or {}
    if fr:
        parts.append("finish " + ", ".join(f"{k} {v}" for k, v in fr.items()))
    return "; ".join(parts)
