"""Filling the cell model (engine/latency/cells.py) from a recorded trace."""

from __future__ import annotations

from collections.abc import Iterable

from ...engine.latency.cells import CellLatency
from ...trace.schema import TraceRecord


def decode_steps(r: TraceRecord) -> list[tuple[float, int]]:
    """A record's decode steps as (gap ms, tokens) in order (its mean gap when only a summary was kept)."""
    if r.itl_ms:
        return list(zip(r.itl_ms, r.gap_tokens()))
    if r.itl_summary is not None:
        return [(r.itl_summary.mean_ms, 1)]
    return []


def fit_cell_model(records: Iterable[TraceRecord], time_scale: float = 1.0) -> CellLatency:
    """The cell model of a trace (ValueError when it has no records or no inter-token data)."""
    model = CellLatency(time_scale)
    for r in records:
        model.add_request(r.concurrency, r.uncached_prompt_tokens(), r.ttft_ms, r.prompt_tokens, decode_steps(r),
                          r.output_tokens)
    return model.finish()
