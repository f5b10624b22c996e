"""Latency models behind one timing interface (base.py): the knob model, the cell model and the
step-time model. They are built by the CLI layer (replay/latency_fit/ fits them from traces) and
injected into the engine; nothing here reads a file."""

from .aic import AicStepLatency, StepPricer
from .base import LatencyModel, RequestPacing, StepBatch, StepRecord, inverse_cdf, truncnorm, zero_pacing
from .cells import CellLatency, TracePacing
from .knob import KnobLatency
from .steps import InputDelay, Residuals, StepLatency

__all__ = ["AicStepLatency", "CellLatency", "InputDelay", "KnobLatency", "LatencyModel", "RequestPacing", "Residuals",
           "StepBatch", "StepLatency", "StepPricer", "StepRecord", "TracePacing", "inverse_cdf", "truncnorm", "zero_pacing"]
