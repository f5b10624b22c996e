"""Per-engine request counters: the control API's authoritative witness of what reached it."""

from __future__ import annotations

import msgspec


class EngineStats(msgspec.Struct, kw_only=True):
    requests_received: int = 0
    requests_completed: int = 0
    requests_failed: int = 0
    requests_aborted: int = 0
    running: int = 0
    waiting: int = 0

    def __add__(self, other: "EngineStats") -> "EngineStats":
        return EngineStats(**{f: getattr(self, f) + getattr(other, f) for f in self.__struct_fields__})
