"""What an engine type changes at `serve`'s front door: the Prometheus series `/metrics` serves.

The engine side of an engine type (scheduler policy, handoff order) is engine/policy.py's
registry; its own routes are an API family whose routes are gated on `--engine-type`
(sglang/routes.py). A third engine type registers all three: a policy, an entry here, a family.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sglang.metrics import SGLangFrontendMetrics
from ..vllm.metrics import FrontendMetrics


@dataclass(frozen=True)
class FrontDoor:
    metrics: type[FrontendMetrics]  # the /metrics collector: vLLM's `vllm:` series or another engine's
    # the http_* series of vLLM's prometheus-fastapi-instrumentator and the process / python collectors
    http_series: bool = False


FRONT_DOORS: dict[str, FrontDoor] = {
    "vllm": FrontDoor(FrontendMetrics, http_series=True),
    "sglang": FrontDoor(SGLangFrontendMetrics),
}


def register_front_door(engine_type: str, door: FrontDoor) -> None:
    FRONT_DOORS[engine_type] = door


def front_door(engine_type: str) -> FrontDoor:
    try:
        return FRONT_DOORS[engine_type]
    except KeyError:
        raise ValueError(f"no front door for engine type {engine_type!r} (known: {sorted(FRONT_DOORS)})") from None
