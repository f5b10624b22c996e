"""Scripted gauges for autoscaler tests: a metric's value as a function of time.

    constant  value
    ramp      start -> end over period_s, then holds end (repeat: true starts over: a sawtooth)
    sine      between min and max, period_s, starting at the middle going up
    square    max for the first duty*period_s of each period, min for the rest

`/metrics` reports the function's value instead of the engine's for every engine series of that
gauge; the engines themselves are untouched (GET /stats still counts what really ran).
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from .rules import FaultSpecError

GAUGES: tuple[str, ...] = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
)  # vllm:num_requests_waiting_by_reason follows vllm:num_requests_waiting (all of it "capacity")
_FRACTIONS = {"vllm:kv_cache_usage_perc"}


class GaugeFunction(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    function: Literal["constant", "ramp", "sine", "square"]
    value: float | None = None  # constant
    start: float | None = None  # ramp
    end: float | None = None  # ramp
    min: float | None = None  # sine, square
    max: float | None = None  # sine, square
    period_s: float | None = None  # ramp, sine, square
    duty: float = 0.5  # square
    repeat: bool = False  # ramp

    def validate(self, name: str) -> GaugeFunction:
        need = {"constant": ("value",), "ramp": ("start", "end", "period_s"),
                "sine": ("min", "max", "period_s"), "square": ("min", "max", "period_s")}[self.function]
        missing = [f for f in need if getattr(self, f) is None]
        if missing:
            raise FaultSpecError(f"{name}: a {self.function} needs {', '.join(need)} (missing {', '.join(missing)})")
        if self.period_s is not None and self.period_s <= 0:
            raise FaultSpecError(f"{name}: period_s must be > 0")
        if not 0 < self.duty < 1:
            raise FaultSpecError(f"{name}: duty must be in (0, 1)")
        values = [v for v in (self.value, self.start, self.end, self.min, self.max) if v is not None]
        if any(not math.isfinite(v) or v < 0 for v in values):
            raise FaultSpecError(f"{name}: values must be finite and >= 0")
        if name in _FRACTIONS and any(v > 1 for v in values):
            raise FaultSpecError(f"{name}: is a fraction, values must be in [0, 1]")
        return self

    def at(self, t: float) -> float:
        """The value t seconds after the function was set."""
        f = self.function
        if f == "constant":
            return float(self.value)  # type: ignore[arg-type]
        period = float(self.period_s)  # type: ignore[arg-type]
        if f == "ramp":
            phase = (t % period) / period if self.repeat else min(t / period, 1.0)
            return self.start + (self.end - self.start) * phase  # type: ignore[operator]
        lo, hi = float(self.min), float(self.max)  # type: ignore[arg-type]
        if f == "sine":
            return lo + (hi - lo) * (1 + math.sin(2 * math.pi * t / period)) / 2
        return hi if (t % period) < self.duty * period else lo


class GaugeScript:
    """The overridden gauges, each with the time it was set."""

    def __init__(self) -> None:
        self._funcs: dict[str, tuple[GaugeFunction, float]] = {}

    def __bool__(self) -> bool:
        return bool(self._funcs)

    def set(self, spec: dict[str, GaugeFunction], now: float) -> None:
        unknown = [n for n in spec if n not in GAUGES]
        if unknown:
            raise FaultSpecError(f"unknown gauge {unknown[0]!r}; scriptable gauges: {', '.join(GAUGES)}")
        checked = {name: fn.validate(name) for name, fn in spec.items()}
        self._funcs.update({name: (fn, now) for name, fn in checked.items()})

    def clear(self) -> None:
        self._funcs.clear()

    def value(self, name: str, now: float) -> float | None:
        entry = self._funcs.get(name)
        if entry is None:
            return None
        fn, since = entry
        return fn.at(now - since)

    def to_state(self) -> dict:
        """The functions and their start times, as plain data (faults/shared.py keeps it in a file)."""
        return {name: [msgspec.to_builtins(fn), since] for name, (fn, since) in self._funcs.items()}

    @classmethod
    def from_state(cls, state: dict) -> GaugeScript:
        script = cls()
        script._funcs = {name: (msgspec.convert(fn, GaugeFunction), since) for name, (fn, since) in state.items()}
        return script

    def describe(self, now: float) -> dict[str, dict]:
        return {name: {**msgspec.to_builtins(fn), "current": round(fn.at(now - since), 6)}
                for name, (fn, since) in self._funcs.items()}
