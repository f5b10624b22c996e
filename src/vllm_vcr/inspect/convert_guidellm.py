"""`inspect from-guidellm`: a guidellm (v0.6 `GenerativeBenchmarksReport`) JSON report -> trace.

guidellm keeps one mean ITL per request, so records carry `itl_summary` instead of `itl_ms`, and
no arrival times (such a trace can fit latency models but cannot drive `replay-arrivals`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ..trace.schema import SOURCE_GUIDELLM, ItlSummary, TraceMeta, TraceRecord

log = logging.getLogger(__name__)


class ConvertError(ValueError):
    pass


def _concurrency(strategy: dict[str, Any] | None, bench_index: int) -> int:
    strategy = strategy or {}
    kind = strategy.get("type_")
    if kind == "concurrent" and isinstance(strategy.get("streams"), int):
        return max(int(strategy["streams"]), 1)
    if kind == "synchronous":
        return 1
    if kind == "throughput":
        mc = strategy.get("max_concurrency")
        if isinstance(mc, int) and mc > 0:
            return mc
        log.warning("benchmark %d: throughput strategy without max_concurrency; using 1", bench_index)
        return 1
    log.warning("benchmark %d: strategy %r has no fixed concurrency; using 1", bench_index, kind)
    return 1


def _required_number(req: dict[str, Any], key: str, where: str) -> float:
    v = req.get(key)
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ConvertError(f"{where}: `{key}` is missing or not a number ({v!r})")
    return v


def convert_guidellm(report: dict[str, Any], model: str | None = None, gpu: str | None = None,
                     tp: int | None = None) -> tuple[TraceMeta, list[TraceRecord]]:
    benchmarks = report.get("benchmarks")
    if not isinstance(benchmarks, list):
        raise ConvertError("not a guidellm report: no `benchmarks` list")
    records: list[TraceRecord] = []
    for bi, bench in enumerate(benchmarks):
        conc = _concurrency((bench.get("config") or {}).get("strategy"), bi)
        successful = ((bench.get("requests") or {}).get("successful")) or []
        for ri, req in enumerate(successful):
            where = f"benchmarks[{bi}].requests.successful[{ri}]"
            prompt = int(_required_number(req, "prompt_tokens", where))
            output = int(_required_number(req, "output_tokens", where))
            ttft = float(_required_number(req, "time_to_first_token_ms", where))
            itl = req.get("inter_token_latency_ms")
            itl_mean = float(itl) if isinstance(itl, (int, float)) else 0.0
            records.append(TraceRecord(
                prompt_tokens=prompt, output_tokens=output, ttft_ms=ttft, concurrency=conc,
                itl_summary=ItlSummary(mean_ms=itl_mean, count=output - 1) if output > 1 else None,
            ))
    args = report.get("args") or {}
    meta = TraceMeta(
        model=model or args.get("model") or args.get("target"), gpu=gpu, tp=tp,
        source=SOURCE_GUIDELLM,
    )
    return meta, records


def load_guidellm(path: str | Path, **kw: Any) -> tuple[TraceMeta, list[TraceRecord]]:
    with open(path, "rb") as f:
        try:
            report = json.load(f)
        except json.JSONDecodeError as e:
            raise ConvertError(f"{path}: invalid JSON: {e}") from None
    return convert_guidellm(report, **kw)
