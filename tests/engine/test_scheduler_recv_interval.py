"""SGLang's --scheduler-recv-interval on timed steps (engine/step.py `TimedSteps.schedule`): the
scheduler reads requests delivered mid-step only when its counter reaches N (a decode step adds
1, a step with a prefill or an idle wake-up reads at once)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_vcr.engine.config import ConfigError, EngineArgs

from .test_step_timing import StepHarness


class SGLangHarness(StepHarness):
    def __init__(self, recv_interval: int) -> None:
        super().__init__(engine={"engine_type": "sglang", "scheduler_recv_interval": recv_interval})

    def add(self, rid: str, prompt_len: int = 10, max_tokens: int = 20) -> None:
        super().add(rid, prompt_len, max_tokens)


@pytest.mark.parametrize("interval, first", [(1, 0.033), (4, 0.066)])
def test_a_request_delivered_mid_decode_waits_for_the_read(interval, first):
    h = SGLangHarness(interval)
    h.add("a")  # step 1 (0 -> 11 ms): a's prefill; then a's decodes, 11 ms each
    h.core.run_until_idle(until=0.015)  # mid step 2 (11 -> 22 ms)
    h.add("b", max_tokens=1)
    h.core.run_until_idle()
    # interval 1: read at 22 ms, b's prefill runs alone (SGLang: extend first) 22 -> 33 ms.
    # interval 4: the prefill step before step 2 read at once (counter reset); decode steps
    # starting at 22, 33, 44 ms count 1, 2, 3; the read at 55 ms: b's prefill 55 -> 66 ms
    assert h.times("b") == [first]
    assert h.core.stats.requests_completed == 2


def test_nothing_else_to_run_reads_at_once():
    h = SGLangHarness(30)
    h.add("a", max_tokens=2)  # prefill 0 -> 11, its last decode 11 -> 22 ms
    h.core.run_until_idle(until=0.015)
    h.add("b", max_tokens=1)
    h.core.run_until_idle()
    assert h.times("b") == [0.033]  # the idle loop read it when a's step ended


def test_an_abort_before_the_read_leaves_nothing_hidden():
    h = SGLangHarness(30)
    h.add("a", max_tokens=40)
    h.core.run_until_idle(until=0.015)
    h.add("b", max_tokens=3)
    h.core.run_until_idle(until=0.030)
    h.core.abort_requests(["b"])
    h.core.run_until_idle()
    assert h.times("b") == []
    assert not h.core.timed.unread and not h.core.timed.gate.hidden
    assert h.core.stats.requests_completed == 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 40), st.lists(st.tuples(st.integers(0, 200), st.integers(1, 300), st.integers(1, 30)),
                                    min_size=1, max_size=12))
def test_every_request_finishes_whatever_the_interval(interval, arrivals):
    h = SGLangHarness(interval)
    t = 0.0
    for i, (gap_ms, prompt, out) in enumerate(arrivals):
        t += gap_ms * 1e-3
        h.core.run_until_idle(until=t)
        h.add(f"r{i}", prompt_len=prompt, max_tokens=out)
    h.core.run_until_idle()
    assert h.core.stats.requests_completed == len(arrivals)
    assert not h.core.timed.unread
    for i, (_, _, out) in enumerate(arrivals):
        assert len(h.times(f"r{i}")) == out


def test_the_flag_is_sglang_s_and_positive():
    with pytest.raises(ConfigError, match="scheduler-recv-interval"):
        EngineArgs(scheduler_recv_interval=10).validate()
    with pytest.raises(ConfigError, match="scheduler-recv-interval"):
        EngineArgs(engine_type="sglang", scheduler_recv_interval=0).validate()
