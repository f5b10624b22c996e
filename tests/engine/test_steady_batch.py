"""Steady batches (engine/steady_batch.py) change nothing a reader or the engine's outputs show:
with readers that can batch, every request gets the same tokens at the same times, every output
batch (its outputs, timestamps, finishes and scheduler stats: running, waiting, KV usage,
preemptions) is the same, as with the same readers taking one token at a time. Only the order of
outputs within one step's batch may differ (a batch's members come out together)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.engine.steady_batch import SteadyBatch
from vllm_vcr.engine.types import EngineCoreRequest, SamplingParams

from .conftest import Harness


def _declines(token: int) -> bool:
    return token % 11 == 0  # about one token in eleven goes out as an output instead


class _Columns:
    def __init__(self) -> None:
        self.readers: list[_Reader] = []

    def add(self, reader: _Reader) -> None:
        self.readers.append(reader)

    def drop(self, index: int) -> None:
        del self.readers[index]

    def take(self, tokens: list[int], ts: float) -> list[int] | None:
        declined = []
        for i, (reader, token) in enumerate(zip(self.readers, tokens)):
            if _declines(token):
                declined.append(i)
            else:
                reader.taken.append((token, ts))
                reader.in_batch += 1
        return declined or None


class _Reader:
    """A reader that takes a steady token in the step (as serve's streams): alone or in a batch."""
    kind = "test"

    def __init__(self, batching: bool) -> None:
        self.taken: list[tuple[int, float]] = []
        self.in_batch = 0
        self.alone = 0
        self.batching = batching

    def sink(self, token: int, ts: float) -> bool:
        if _declines(token):
            return False
        self.taken.append((token, ts))
        self.alone += 1
        return True

    def ready(self) -> bool:
        return self.batching

    def new_columns(self) -> _Columns:
        return _Columns()


def _run(arrivals, aborts, freeze, kv_blocks, batching: bool, patch_at: float | None = None):
    h = Harness(time_to_first_token=30, inter_token_latency=10, max_num_seqs=16, seed=7, kv_cache_size=kv_blocks,
                tokens_per_block=4, max_model_len=256)
    readers = {}
    events = [(t, 0, i) for i, (t, _, _) in enumerate(arrivals)] + [(t, 1, i) for t, i in aborts]
    if freeze is not None:
        events += [(freeze[0], 2, 1), (freeze[0] + freeze[1], 2, 0)]
    if patch_at is not None:
        events.append((patch_at, 3, 0))
    for t, kind, i in sorted(events):
        h.run(until=t)
        if kind == 0:
            _, prompt, max_tokens = arrivals[i]
            rid = f"r{i}"
            reader = readers[rid] = _Reader(batching)
            sink = reader.sink
            h.core.add_request(EngineCoreRequest(
                request_id=rid, prompt_token_ids=Harness.prompt_of(rid, prompt), arrival_time=t,
                sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True)), sink, reader)
        elif kind == 1:
            h.core.abort_requests([f"r{i % len(arrivals)}"])
        elif kind == 2:
            h.core.set_frozen(bool(i))
        else:
            h.core.patch_config({"max_model_len": 200})
    h.run()
    # (a batch's members come out together: within a step, outputs may be in another order)
    trace = [(c, b.timestamp, sorted(b.finished_requests or ()), b.scheduler_stats,
              sorted((o.request_id, o.new_token_ids, o.finish_reason) for o in b.outputs)) for c, b in h.batches]
    return trace, {rid: r.taken for rid, r in readers.items()}, sum(r.in_batch for r in readers.values()), h


@settings(max_examples=40, deadline=None)
@given(arrivals=st.lists(st.tuples(st.sampled_from([0.0, 0.0, 0.004, 0.0101, 0.02, 0.05, 0.1]),
                                   st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=14),
       aborts=st.lists(st.tuples(st.floats(0.0, 0.4), st.integers(0, 13)), max_size=3),
       freeze=st.none() | st.tuples(st.floats(0.01, 0.3), st.floats(0.001, 0.1)),
       kv_blocks=st.sampled_from([1024, 40, 24]),
       patch_at=st.none() | st.floats(0.05, 0.3))
def test_batched_readers_see_what_one_token_at_a_time_gives(arrivals, aborts, freeze, kv_blocks, patch_at):
    trace, taken, in_batch, _ = _run(arrivals, aborts, freeze, kv_blocks, batching=True, patch_at=patch_at)
    plain_trace, plain_taken, plain_in_batch, _ = _run(arrivals, aborts, freeze, kv_blocks, batching=False,
                                                       patch_at=patch_at)
    assert plain_in_batch == 0
    assert taken == plain_taken
    assert trace == plain_trace


def test_streams_due_together_decode_as_one_batch():
    arrivals = [(0.0, 10 + i, 30) for i in range(8)]
    trace, taken, in_batch, h = _run(arrivals, [], None, 1024, batching=True)
    plain_trace, plain_taken, _, _ = _run(arrivals, [], None, 1024, batching=False)
    assert taken == plain_taken and trace == plain_trace
    # every token but the first (prefill), the second (the plain steady path, then it joins) and
    # the last (with its finish) comes with the batch; a declined one goes out as an output, and
    # its stream takes the next one alone before it joins again
    outputs = sum(len(o.new_token_ids) for _, b in h.batches for o in b.outputs)
    declined = outputs - 16
    alone = sum(len(t) for t in taken.values()) - in_batch
    assert declined > 0 and in_batch + alone + outputs == 8 * 30
    assert 8 <= alone <= 8 + declined
    assert in_batch >= 8 * 30 - 3 * 8 - 2 * declined


def test_a_batch_stands_in_the_lane_as_one_entry(monkeypatch):
    monkeypatch.setattr(__import__(__name__, fromlist=["_"]), "_declines", lambda token: False)
    h = Harness(time_to_first_token=30, inter_token_latency=10, seed=7)
    for i in range(6):
        reader = _Reader(True)
        h.core.add_request(EngineCoreRequest(
            request_id=f"r{i}", prompt_token_ids=Harness.prompt_of(f"r{i}", 9),
            sampling_params=SamplingParams(max_tokens=50, ignore_eos=True)),
            lambda t, ts, r=reader: r.taken.append((t, ts)) or True, reader)
    h.run(until=0.1)
    lane = [e for e in h.core.scheduler.decode_lane if e[2] == e[3].heap_gen]
    assert len(lane) == 1 and type(lane[0][3]) is SteadyBatch and len(lane[0][3]) == 6
    h.core.abort_requests(["r2"])
    h.run(until=0.2)
    batch = lane[0][3]
    assert len(batch) == 5 and all(r.steady_batch is batch for r in batch.reqs)
    h.run()
    assert not h.core.requests and not h.core.output.steady.live


@pytest.mark.parametrize("kv_blocks", [30, 20])
def test_kv_pressure_at_a_block_boundary_preempts_as_the_plain_path(kv_blocks):
    arrivals = [(0.0, 6 + 3 * i, 40) for i in range(6)]
    batched = _run(arrivals, [], None, kv_blocks, batching=True)
    plain = _run(arrivals, [], None, kv_blocks, batching=False)
    assert batched[:2] == plain[:2]
    assert sum(b.scheduler_stats.num_preemptions for _, b in batched[3].batches if b.scheduler_stats) > 0
