"""Request plans: what a recording says one request must do (replayed verbatim by the engine).

A planner (built by `trace/` from a recorded trace) maps an arriving request to a plan; the
engine then emits exactly the planned token ids and finish reason, and/or paces the request with
the recorded first-token delay and per-step gaps and chunk sizes instead of its latency model.
"""

from __future__ import annotations

from typing import Callable, Protocol

import msgspec

from .types import EngineCoreRequest, FinishReason


class RequestPlan(msgspec.Struct, kw_only=True):
    token_ids: list[int] | None = None  # output ids, verbatim
    finish_reason: FinishReason | None = None  # when the planned ids run out (default LENGTH)
    ttft: float | None = None  # seconds from scheduling to the first chunk (before time_scale)
    first_chunk_tokens: int = 1  # tokens delivered with the first chunk
    steps: list[tuple[float, int]] | None = None  # (gap seconds, tokens) of each later chunk
    # response replay tables set the output length (Dynamo); a trace only clamps max_tokens
    overrides_max_tokens: bool = False

    @property
    def num_tokens(self) -> int | None:
        if self.token_ids is not None:
            return len(self.token_ids)
        if self.steps is not None:
            return self.first_chunk_tokens + sum(k for _, k in self.steps)
        return None


Planner = Callable[[EngineCoreRequest], "RequestPlan | None"]


class ScriptedPacing:
    """Pacing from a plan: recorded TTFT, then recorded (gap, tokens) per step, scaled by time_scale.

    After the recorded steps run out (a longer request than the recording) the last gap repeats."""

    __slots__ = ("ttft", "itl_mean", "itl_std", "_steps", "_scale", "first_chunk", "_i")

    def __init__(self, plan: RequestPlan, fallback, time_scale: float) -> None:
        self._scale = 1.0 / time_scale
        self.ttft = plan.ttft * self._scale if plan.ttft is not None else fallback.ttft
        self._steps = plan.steps
        self.itl_mean = fallback.itl_mean
        self.itl_std = -1.0  # never the constant-gap fast path: next_step() decides
        self.first_chunk = plan.first_chunk_tokens if plan.steps is not None else 1
        self._i = 0

    def next_step(self) -> tuple[float, int]:
        steps = self._steps
        if not steps:
            return self.itl_mean, 1
        gap, k = steps[min(self._i, len(steps) - 1)]
        self._i += 1
        return gap * self._scale, k


class OutputReplayTable(Protocol):
    """Planned output ids by output-replay id (a response replay table, see replay_table.py)."""

    def get(self, key: str) -> list[int] | None: ...
