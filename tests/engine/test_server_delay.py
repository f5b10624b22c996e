"""TTFT counts from the request's arrival: what the server spent before the engine admitted it is
inside the configured TTFT when the engine admitted it in the loop's same busy run (however many
token-budget steps that took), and adds to it when the request waited for capacity while the
loop slept (as queueing does in vLLM). Driven turn by turn on a hand-moved clock: no sleeping."""

from __future__ import annotations

import types

import pytest

from vllm_vcr.engine import admission, request
from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.engine.core import EngineCore
from vllm_vcr.engine.types import EngineCoreRequest, SamplingParams

WALL = 1_700_000_000.0  # wall-clock time at monotonic 0
TTFT = 0.1


class HandClock:
    """A real (not virtual) clock that moves only when the test says so."""
    virtual = False

    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = HandClock()
    wall = types.SimpleNamespace(time=lambda: WALL + c.t)
    monkeypatch.setattr(admission, "time", wall)
    monkeypatch.setattr(request, "time", wall)
    return c


def _core(clock: HandClock, **cfg) -> EngineCore:
    config = EngineConfig(time_to_first_token=TTFT * 1000, inter_token_latency=20.0, log_requests=False, **cfg)
    return EngineCore(EngineArgs(config=config, enable_chunked_prefill=False).validate(), clock=clock)


def _add(core: EngineCore, rid: str, arrived: float) -> None:
    core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=[len(rid)] * 16,
                                       sampling_params=SamplingParams(max_tokens=4), arrival_time=WALL + arrived))


def test_a_burst_admitted_over_several_steps_keeps_ttft_from_each_arrival(clock):
    core = _core(clock, max_num_batched_tokens=16)  # one 16-token prompt per step
    for i in range(5):
        _add(core, f"r{i}", arrived=clock.t - 0.030)  # 30 ms of parsing and tokenizing before the engine
    for _ in range(5):  # one admission per step; each step's work takes 4 ms
        core._turn()
        clock.t += 0.004
    dues = [core.requests[f"r{i}"].first_due for i in range(5)]
    assert dues == pytest.approx([100.0 - 0.030 + TTFT] * 5, abs=1e-6)


def test_a_request_that_waited_for_capacity_gets_its_ttft_after_admission(clock):
    core = _core(clock, max_num_seqs=1)
    _add(core, "first", arrived=clock.t)
    core._turn()
    _add(core, "second", arrived=clock.t - 0.010)  # 10 ms in the frontend, then the batch is full
    core._turn()
    assert core.requests["second"].pacing is None  # not admitted: waiting
    core.idle_waits += 1  # the loop sleeps until "first" ends (as run() counts it)
    clock.t += 0.5
    core.finish_requests(["first"], [])
    core._turn()
    second = core.requests["second"]
    assert second.first_due == pytest.approx(clock.t + TTFT - 0.010, abs=1e-6)  # the queueing adds, the frontend does not
