"""Zero-latency decode bursts: k back-to-back steps run as one, with the same results.

A burst only changes how outputs are batched: every request must get the same tokens, the same
finish reason and the same counters as when the engine takes those steps one at a time.
"""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_vcr.engine import step as step_mod
from vllm_vcr.engine.tokens import RandomTokens

from .conftest import Harness

request_st = st.tuples(
    st.integers(1, 60),  # prompt length
    st.integers(1, 50),  # max tokens
    st.integers(0, 6),  # min tokens
    st.booleans(),  # a stop token id taken from the prompt (stops echo mode)
    st.sampled_from([None, 0.0, 0.001]),  # arrives at (None: with the others)
)


def _run(monkeypatch, burst: int, reqs, **engine):
    monkeypatch.setattr(step_mod, "MAX_BURST", burst)
    h = Harness(**engine)
    late = []
    for i, (plen, max_tokens, min_tokens, stop, at) in enumerate(reqs):
        prompt = Harness.prompt_of(f"r{i}", plen)
        sp = dict(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens), seed=i)
        if stop:
            sp["stop_token_ids"] = [prompt[len(prompt) // 2]]
        if at:
            late.append((at, f"r{i}", prompt, sp))
        else:
            h.add(f"r{i}", prompt=prompt, **sp)
    for at, rid, prompt, sp in late:
        h.run(until=at)
        h.add(rid, prompt=prompt, **sp)
    h.run()
    rids = [f"r{i}" for i in range(len(reqs))]
    return h, {rid: (h.tokens(rid), h.finish(rid)) for rid in rids}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(reqs=st.lists(request_st, min_size=1, max_size=12), kv_blocks=st.integers(10, 60),
       block=st.sampled_from([4, 16]), budget=st.integers(8, 128), seqs=st.integers(1, 8),
       mode=st.sampled_from(["random", "echo"]), max_len=st.sampled_from([0, 64]))
def test_bursts_change_batching_only(monkeypatch, reqs, kv_blocks, block, budget, seqs, mode, max_len):
    engine = dict(kv_cache_size=kv_blocks, tokens_per_block=block, max_num_batched_tokens=budget,
                  max_num_seqs=seqs, mode=mode, max_model_len=max_len)
    one, expected = _run(monkeypatch, 1, reqs, **engine)
    many, got = _run(monkeypatch, 8, reqs, **engine)
    assert got == expected
    a, b = one.stats(), many.stats()
    assert (b.requests_completed, b.requests_failed, b.requests_aborted) == \
        (a.requests_completed, a.requests_failed, a.requests_aborted)
    pool = many.core.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_a_decoding_batch_bursts_and_the_first_token_comes_alone(monkeypatch, harness):
    monkeypatch.setattr(step_mod, "MAX_BURST", 8)
    h = harness(max_num_batched_tokens=2048)
    for i in range(4):
        h.add(f"r{i}", max_tokens=20)
    h.run()
    for i in range(4):
        sizes = [len(o.new_token_ids) for _, o in h.outputs(f"r{i}")]
        assert sum(sizes) == 20
        assert sizes[0] == 1  # the prefill step's token
        assert max(sizes) == 8
    # the step counter still counts every step a burst stands for
    assert h.core.scheduler_stats().step_counter >= 20


def test_no_burst_with_a_gap_between_tokens_or_a_request_waiting(harness):
    h = harness(inter_token_latency=1)
    h.add("paced", max_tokens=10)
    h.run()
    assert all(len(o.new_token_ids) == 1 for _, o in h.outputs("paced"))
    h = harness(max_num_seqs=1)
    h.add("a", max_tokens=10)
    h.add("b", max_tokens=10)  # waits for a's slot: a's steps are interleaved with its admission
    h.run()
    assert all(len(o.new_token_ids) == 1 for _, o in h.outputs("a"))


def test_bursts_stop_when_free_blocks_could_not_cover_them(monkeypatch, harness):
    monkeypatch.setattr(step_mod, "MAX_BURST", 8)
    # 3 blocks of 4: the prompt takes 1, the 8-token answer the rest: too few to burst safely
    h = harness(kv_cache_size=3, tokens_per_block=4)
    h.add("r", prompt_len=4, max_tokens=8)
    h.run()
    assert h.tokens("r") and max(len(o.new_token_ids) for _, o in h.outputs("r")) == 1


@pytest.mark.parametrize("avoid", [frozenset(), frozenset(range(0, 20, 2))])
def test_random_tokens_do_not_depend_on_how_many_are_taken_at_once(avoid):
    one = RandomTokens(random.Random(7), 20, avoid)
    singles = [one.next_token(i) for i in range(300)]
    rng = random.Random(1)
    many = RandomTokens(random.Random(7), 20, avoid)
    mixed: list[int] = []
    while len(mixed) < 300:
        k = rng.choice([1, 3, 8, 64, 100])
        mixed += many.take(k) if k > 1 else [many.next_token(len(mixed))]
    assert mixed[:300] == singles
    assert not avoid.intersection(singles)
