"""FaultController: the rates, the script and the gauges of one server, and what they injected.

Owned by one event loop (the frontend's); no locks, no I/O. `active` is one attribute read, so a
server without faults pays nothing more per request.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import msgspec

from .catalogue import parse_return_error
from .gauges import GaugeFunction, GaugeScript
from .rates import RATE_FIELDS, FaultRates
from .rules import ACTIONS, FaultAction, FaultSchemaError, FaultScript, RequestInfo, ScriptSpec, action_of

RETURN_ERROR_HEADER = b"x-return-error"  # llm-d-inference-sim's name and format


class FaultController:
    def __init__(self, rates: FaultRates | None = None, *, model: str = "vllm-vcr/sim", max_model_len: int = 4096,
                 seed: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.rates = (rates or FaultRates()).validate()
        self.script = FaultScript([], clock())
        self.gauges = GaugeScript()
        self.model = model
        self.max_model_len = max_model_len
        self._rng = random.Random(seed)
        self._clock = clock
        self.injected = {name: 0 for name in ACTIONS}
        self.active = False
        self._refresh()

    def _refresh(self) -> None:
        self.active = bool(self.script) or self.rates.any()

    # ---- per request ---------------------------------------------------------------------------
    def decide(self, info: RequestInfo) -> FaultAction | None:
        """The fault for one generation request (script first, then rates), counted as injected."""
        now = self._clock()
        rule = self.script.pick(info, now) if self.script else None
        source = "script"
        if rule is None and self.rates.any():
            rule, source = self.rates.draw(self._rng), "rate"
        if rule is None:
            self._refresh()
            return None
        action = action_of(rule, model=info.model() or self.model, max_model_len=self.max_model_len, source=source)
        self.injected[action.action] += 1
        self._refresh()
        return action

    def from_header(self, value: bytes) -> FaultAction:
        """`X-Return-Error: N`: that status for this request, whatever else is configured."""
        self.injected["http_error"] += 1
        return FaultAction("http_error", "header", parse_return_error(value))

    # ---- control API -----------------------------------------------------------------------------
    def set_script(self, body: Any) -> dict[str, Any]:
        try:
            spec = msgspec.convert(body, ScriptSpec)
        except msgspec.ValidationError as e:
            raise FaultSchemaError(f"body does not match the fault script schema: {e}") from None
        self.script = FaultScript(spec.rules, self._clock())
        self._refresh()
        return self.describe_script()

    def clear_script(self) -> None:
        self.script = FaultScript([], self._clock())
        self._refresh()

    def describe_script(self) -> dict[str, Any]:
        return {"rules": self.script.describe(self._clock()), "requests_seen": self.script.requests_seen}

    def check_rates(self, patch: dict[str, Any]) -> FaultRates:
        """The rates `patch` would make (FaultSpecError if it cannot be applied); nothing changes."""
        merged = {**msgspec.to_builtins(self.rates), **patch}
        try:
            rates = msgspec.convert(merged, FaultRates)
        except msgspec.ValidationError as e:
            raise FaultSchemaError(f"fault fields do not match the schema: {e}") from None
        return rates.validate()

    def patch_rates(self, patch: dict[str, Any]) -> dict[str, Any]:
        self.rates = FaultController.check_rates(self, patch)
        self._refresh()
        return msgspec.to_builtins(self.rates)

    def rates_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.rates)

    def set_gauges(self, body: Any) -> dict[str, dict]:
        try:
            spec = msgspec.convert(body, dict[str, GaugeFunction])
        except msgspec.ValidationError as e:
            raise FaultSchemaError(f"body does not match the gauge schema: {e}") from None
        self.gauges.set(spec, self._clock())
        return self.gauges.describe(self._clock())

    def clear_gauges(self) -> None:
        self.gauges.clear()

    def describe_gauges(self) -> dict[str, dict]:
        return self.gauges.describe(self._clock())

    def now(self) -> float:
        return self._clock()

    def gauge_value(self, name: str) -> float | None:
        return self.gauges.value(name, self._clock()) if self.gauges else None

    def stats(self) -> dict[str, Any]:
        return {"faults_injected": dict(self.injected), "faults_injected_total": sum(self.injected.values())}

    def reset_stats(self) -> None:
        self.injected = {name: 0 for name in ACTIONS}


__all__ = ["FaultController", "RATE_FIELDS", "RETURN_ERROR_HEADER", "RequestInfo"]
