"""Latency models fitted from recorded traces (the models themselves are in engine/latency/).

`load_latency_model` is what `--latency-trace` builds: the step-time model for an engine tap
trace, the cell model for any other (`--latency-trace-model` forces one)."""

from __future__ import annotations

import logging

from ...engine.latency import LatencyModel
from ...trace.io import read_trace
from ...trace.schema import SOURCE_TAP
from .cells import fit_cell_model
from .steps import fit_step_model

logger = logging.getLogger("vllm_vcr.latency_fit")
MODEL_CHOICES = ("auto", "steps", "cells")


def load_latency_model(path: str, time_scale: float = 1.0, which: str = "auto") -> LatencyModel:
    """The latency model of a trace file: `which` is auto (steps for an engine tap trace, else
    cells), steps or cells. OSError / ValueError for a file that cannot be read or fitted."""
    if which not in MODEL_CHOICES:
        raise ValueError(f"unknown latency model {which!r} (choose from {', '.join(MODEL_CHOICES)})")
    trace = read_trace(path)
    if which == "steps":
        return fit_step_model(trace.records, time_scale)
    if which == "auto" and trace.meta is not None and trace.meta.source == SOURCE_TAP:
        try:
            return fit_step_model(trace.records, time_scale)
        except ValueError as e:
            logger.warning("--latency-trace %s: %s; using the cell model", path, e)
    return fit_cell_model(trace.records, time_scale)


__all__ = ["MODEL_CHOICES", "fit_cell_model", "fit_step_model", "load_latency_model"]
