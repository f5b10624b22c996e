"""`inspect from-aiperf`: an aiperf `profile_export.jsonl` (one record per request) -> trace.

Each aiperf line has `metadata` (request_start_ns, request_end_ns, was_cancelled, ...), `metrics`
(name -> {"value", "unit"}) and `error`. We keep successful, uncancelled requests with a TTFT.
aiperf measures per *chunk* (`inter_chunk_latency`), which is what our `itl_ms` means; when a
request delivered more tokens than chunks, the surplus is spread evenly over the chunks as
`itl_tokens`. Arrival times and in-flight concurrency come from the request start/end stamps.
"""

from __future__ import annotations

import bisect
import json
import logging
from pathlib import Path
from typing import Any

from .convert_guidellm import ConvertError
from ..trace.schema import SOURCE_AIPERF, ItlSummary, TraceMeta, TraceRecord

log = logging.getLogger(__name__)

_MS_PER_UNIT = {"ms": 1.0, "s": 1e3, "sec": 1e3, "us": 1e-3, "ns": 1e-6}


def _metric(metrics: dict[str, Any], *names: str) -> Any:
    for name in names:
        m = metrics.get(name)
        if isinstance(m, dict) and "value" in m:
            return m["value"], m.get("unit")
        if m is not None and not isinstance(m, dict):
            return m, None
    return None, None


def _ms(value: Any, unit: str | None) -> Any:
    scale = _MS_PER_UNIT.get((unit or "ms").lower(), 1.0)
    if isinstance(value, list):
        return [float(v) * scale for v in value]
    return float(value) * scale


def _gaps(output: int, chunks: list[float], itl_mean: float | None
          ) -> tuple[list[float] | None, list[int] | None, ItlSummary | None]:
    if output <= 1:
        return None, None, None
    n = len(chunks)
    if n and n + 1 == output:
        return chunks, None, None
    if n and n + 1 < output:
        per = max(output // (n + 1), 1)  # the first chunk takes the remainder
        return chunks, [per] * n, None
    mean = itl_mean if itl_mean is not None else (sum(chunks) / n if n else 0.0)
    return None, None, ItlSummary(mean_ms=mean, count=output - 1)


def convert_aiperf_lines(lines: list[dict[str, Any]], model: str | None = None,
                         gpu: str | None = None, tp: int | None = None
                         ) -> tuple[TraceMeta, list[TraceRecord]]:
    kept: list[tuple[int, int, TraceRecord]] = []  # (start_ns, end_ns, record)
    skipped = 0
    for line in lines:
        meta = line.get("metadata") or {}
        metrics = line.get("metrics") or {}
        if line.get("error") or meta.get("was_cancelled"):
            skipped += 1
            continue
        ttft, ttft_unit = _metric(metrics, "time_to_first_token")
        prompt, _ = _metric(metrics, "input_sequence_length")
        output, _ = _metric(metrics, "output_sequence_length", "output_token_count")
        if ttft is None or prompt is None or output is None:
            skipped += 1
            continue
        chunks, chunk_unit = _metric(metrics, "inter_chunk_latency")
        itl_mean, itl_unit = _metric(metrics, "inter_token_latency")
        output = int(output)
        itl_ms, itl_tokens, summary = _gaps(
            output,
            _ms(chunks, chunk_unit) if isinstance(chunks, list) else [],
            _ms(itl_mean, itl_unit) if itl_mean is not None else None,
        )
        if output > 1 and itl_ms is None and summary is None:
            skipped += 1
            continue
        rec = TraceRecord(prompt_tokens=int(prompt), output_tokens=output,
                          ttft_ms=_ms(ttft, ttft_unit), itl_ms=itl_ms, itl_tokens=itl_tokens,
                          itl_summary=summary)
        start = meta.get("request_start_ns")
        end = meta.get("request_end_ns")
        if isinstance(start, int):
            kept.append((start, end if isinstance(end, int) else start, rec))
        else:
            kept.append((-1, -1, rec))
    _stamp_arrivals(kept)
    if skipped:
        log.warning("skipped %d aiperf records (errors, cancellations or missing metrics)", skipped)
    meta_out = TraceMeta(model=model or _model_of(lines), gpu=gpu, tp=tp, source=SOURCE_AIPERF)
    return meta_out, [r for _, _, r in kept]


def _stamp_arrivals(kept: list[tuple[int, int, TraceRecord]]) -> None:
    """arrival_ms relative to the first start; concurrency = requests in flight at each start."""
    timed = [k for k in kept if k[0] >= 0]
    if not timed:
        return
    t0 = min(s for s, _, _ in timed)
    starts = sorted(s for s, _, _ in timed)
    ends = sorted(e for _, e, _ in timed)
    for start, _, rec in timed:
        rec.arrival_ms = (start - t0) / 1e6
        # started at or before this one, minus those already finished by then
        in_flight = bisect.bisect_right(starts, start) - bisect.bisect_right(ends, start)
        rec.concurrency = max(in_flight, 1)


def _model_of(lines: list[dict[str, Any]]) -> str | None:
    for line in lines[:1]:
        m = (line.get("metadata") or {}).get("model_name")
        if isinstance(m, str):
            return m
    return None


def load_aiperf(path: str | Path, **kw: Any) -> tuple[TraceMeta, list[TraceRecord]]:
    lines: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ConvertError(f"{path}:{lineno}: invalid JSON: {e}") from None
            if not isinstance(obj, dict) or "metrics" not in obj and "metadata" not in obj:
                raise ConvertError(f"{path}:{lineno}: not an aiperf profile_export record")
            lines.append(obj)
    return convert_aiperf_lines(lines, **kw)
