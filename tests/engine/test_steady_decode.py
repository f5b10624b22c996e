"""The steady decode's shortcuts (one random token without the general sample's branches, in-order
deadlines on a FIFO lane beside the heap, one output batch per step without regrouping) change
nothing an engine emits: every batch, output, token, finish and timestamp is the same with them
on and off."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.engine import output, scheduler
from vllm_vcr.engine.types import FinishReason

from .conftest import Harness


class _NotRandomTokens:
    """Stands in for RandomTokens in output.py: no source matches it, so `sample` appends the same
    ids through `next_token` (its general path)."""


@contextlib.contextmanager
def _plain_paths():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(output.OutputProcessor, "_steady_decode", lambda self, req, outputs: False)
        mp.setattr(output, "RandomTokens", _NotRandomTokens)
        mp.setattr(scheduler.Scheduler, "push_next_decode", scheduler.Scheduler.push_decode)
        yield


def _trace(h: Harness) -> list:
    return [(c, b.timestamp, b.finished_requests,
             [(o.request_id, o.new_token_ids, o.finish_reason, o.stop_reason) for o in b.outputs])
            for c, b in h.batches]


def _run(arrivals: list[tuple[float, int, int]], aborts: list[tuple[float, int]], freeze: tuple[float, float] | None,
         itl_std: float, max_model_len: int, load_factor: float = 1.0) -> list:
    # a load factor gives requests admitted at different loads different gaps: deadlines pushed
    # out of order, which must leave the lane for the heap
    h = Harness(time_to_first_token=30, inter_token_latency=10, inter_token_latency_std_dev=itl_std,
                time_factor_under_load=load_factor, max_model_len=max_model_len, max_num_seqs=8, seed=7)
    events = [(t, 0, i) for i, (t, _, _) in enumerate(arrivals)] + [(t, 1, i) for t, i in aborts]
    if freeze is not None:
        events += [(freeze[0], 2, 1), (freeze[0] + freeze[1], 2, 0)]
    for t, kind, i in sorted(events):
        h.run(until=t)
        if kind == 0:
            _, prompt, max_tokens = arrivals[i]
            h.add(f"r{i}", prompt_len=prompt, max_tokens=max_tokens, ignore_eos=True, arrival_time=t)
        elif kind == 1:
            h.core.abort_requests([f"r{i % len(arrivals)}"])
        else:
            h.core.set_frozen(bool(i))
    h.run()
    return _trace(h)


@settings(max_examples=40, deadline=None)
@given(arrivals=st.lists(st.tuples(st.sampled_from([0.0, 0.004, 0.0101, 0.02, 0.05, 0.1]),
                                   st.integers(1, 40), st.integers(1, 30)), min_size=1, max_size=12),
       aborts=st.lists(st.tuples(st.floats(0.0, 0.4), st.integers(0, 11)), max_size=3),
       freeze=st.none() | st.tuples(st.floats(0.01, 0.3), st.floats(0.001, 0.1)),
       itl_std=st.sampled_from([0.0, 0.0, 3.0]), max_model_len=st.sampled_from([0, 48]),
       load_factor=st.sampled_from([1.0, 3.0]))
def test_the_shortcuts_emit_exactly_what_the_general_paths_emit(arrivals, aborts, freeze, itl_std, max_model_len,
                                                                 load_factor):
    fast = _run(arrivals, aborts, freeze, itl_std, max_model_len, load_factor)
    with _plain_paths():
        plain = _run(arrivals, aborts, freeze, itl_std, max_model_len, load_factor)
    assert fast == plain


def test_in_order_deadlines_take_the_lane_and_keep_their_pace(harness):
    h = harness(time_to_first_token=30, inter_token_latency=10)
    for i in range(5):  # the same arrival: equal deadlines, served in arrival order
        h.add(f"r{i}", max_tokens=20, ignore_eos=True)
    h.run(until=0.1)
    sched = h.core.scheduler
    assert len(sched.decode_lane) == 5 and not sched.decode_heap
    h.run()
    for i in range(5):
        times = h.emission_times(f"r{i}")
        assert len(times) == 20 and h.finish(f"r{i}") is FinishReason.LENGTH
        assert times == pytest.approx([0.03 + 0.01 * k for k in range(20)])


@pytest.mark.parametrize("new_len", [30, 45, 200])
def test_a_patched_max_model_len_ends_steady_decodes_as_the_general_path_does(new_len):
    """A steady decode counts its run ahead (to the token before its last); a max_model_len patch
    mid-stream must cut that run where the general path would end the request."""
    def run() -> tuple[list, dict]:
        h = Harness(time_to_first_token=30, inter_token_latency=10, max_model_len=100, max_num_seqs=8, seed=7)
        for i in range(4):
            h.add(f"r{i}", prompt_len=10 + 5 * i, max_tokens=60, ignore_eos=True)
        h.run(until=0.2)
        h.core.patch_config({"max_model_len": new_len})
        h.run()
        return _trace(h), {f"r{i}": len(h.tokens(f"r{i}")) for i in range(4)}

    fast, fast_lens = run()
    with _plain_paths():
        plain, plain_lens = run()
    assert fast == plain
    assert fast_lens == plain_lens
