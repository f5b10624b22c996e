"""Faults by rate: each generation request draws once per kind (flags and PATCH /config)."""

from __future__ import annotations

import random

import msgspec

from .catalogue import ERROR_KINDS
from .rules import FaultSpecError, Rule


class FaultRates(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Probabilities in [0, 1]; the fields (and flags of the same name) of the HTTP faults."""

    http_error_rate: float = 0.0
    http_error_types: list[str] = msgspec.field(default_factory=lambda: ["server_error"])
    stream_error_rate: float = 0.0
    stream_error_after_tokens: int = 1
    stall_rate: float = 0.0
    stall_ms: float = 1000.0
    stall_after_tokens: int = 0
    reset_rate: float = 0.0
    reset_after_tokens: int = 1
    retry_after: float = 1.0

    def validate(self) -> FaultRates:
        for name in ("http_error_rate", "stream_error_rate", "stall_rate", "reset_rate"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise FaultSpecError(f"{name} must be in [0, 1], got {v}")
        if not self.http_error_types:
            raise FaultSpecError("http_error_types must name at least one of " + ", ".join(ERROR_KINDS))
        for t in self.http_error_types:
            if t not in ERROR_KINDS:
                raise FaultSpecError(f"unknown http_error_types value {t!r}; one of {', '.join(ERROR_KINDS)}")
        for name in ("stream_error_after_tokens", "stall_after_tokens", "reset_after_tokens", "stall_ms",
                     "retry_after"):
            if getattr(self, name) < 0:
                raise FaultSpecError(f"{name} must not be negative")
        return self

    def any(self) -> bool:
        return bool(self.http_error_rate or self.stream_error_rate or self.stall_rate or self.reset_rate)

    def draw(self, rng: random.Random) -> Rule | None:
        """The fault for one request, as a one-off rule (None: no fault)."""
        if self.http_error_rate and rng.random() < self.http_error_rate:
            return Rule(action="http_error", error=rng.choice(self.http_error_types), retry_after=self.retry_after)
        if self.reset_rate and rng.random() < self.reset_rate:
            return Rule(action="reset", after_tokens=self.reset_after_tokens)
        if self.stream_error_rate and rng.random() < self.stream_error_rate:
            return Rule(action="stream_error", after_tokens=self.stream_error_after_tokens)
        if self.stall_rate and rng.random() < self.stall_rate:
            return Rule(action="stall", stall_ms=self.stall_ms, after_tokens=self.stall_after_tokens)
        return None


RATE_FIELDS: tuple[str, ...] = tuple(FaultRates.__struct_fields__)
