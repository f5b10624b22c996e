"""heap_trim: one trim per busy period, only once the engines are idle (never mid-stream)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from vllm_vcr import heap_trim


@dataclass
class FakeCore:
    step_counter: int = 0
    num_unfinished: int = 0


def run_polls(script: list[tuple[int, int]], monkeypatch) -> list[int]:
    """Drive the trimmer poll by poll: before poll i the core shows script[i] = (steps, unfinished);
    returns the poll indices after which a trim ran."""
    core, trims, poll = FakeCore(), [], [0]
    monkeypatch.setattr(heap_trim, "trim_heap", lambda: trims.append(poll[0] - 1) or True)

    async def sleep(_: float) -> None:
        if poll[0] == len(script):
            raise asyncio.CancelledError
        core.step_counter, core.num_unfinished = script[poll[0]]
        poll[0] += 1

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(heap_trim.trim_after_busy_periods(lambda: [core], sleep=sleep))
    return trims


def test_trims_once_after_a_busy_period(monkeypatch):
    # busy (steps advance), then quiet and empty: one trim, not repeated while still idle
    assert run_polls([(0, 0), (5, 3), (9, 1), (12, 0), (12, 0), (12, 0), (12, 0)], monkeypatch) == [4]


def test_no_trim_while_requests_are_held_or_steps_advance(monkeypatch):
    # steps stop but a request is still unfinished (a long ITL, a paused engine): no trim until it ends
    assert run_polls([(0, 0), (4, 2), (4, 2), (4, 2), (6, 0), (6, 0)], monkeypatch) == [5]
    # nothing ever ran: nothing to give back
    assert run_polls([(0, 0)] * 5, monkeypatch) == []


def test_trim_heap_runs_here():
    assert heap_trim.trim_heap() is True  # glibc on the CI machines
