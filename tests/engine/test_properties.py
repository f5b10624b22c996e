"""Hypothesis properties over random request mixes: nothing is lost, nothing leaks."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_vcr.engine.config import FailureType

from .conftest import Harness

request_st = st.tuples(
    st.integers(1, 120),  # prompt length
    st.integers(0, 40),  # max tokens
    st.booleans(),  # shares a prefix
    st.integers(-2, 2),  # priority
    st.sampled_from([None, 0.0, 0.003, 0.02]),  # abort after this long (None: never)
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request_st, min_size=1, max_size=25),
    kv_blocks=st.integers(12, 80),
    block=st.sampled_from([4, 16]),
    budget=st.integers(16, 256),
    seqs=st.integers(1, 8),
    policy=st.sampled_from(["fcfs", "priority"]),
    fail_rate=st.sampled_from([0.0, 0.2]),
    threshold=st.sampled_from([0, 24]),
)
def test_counters_balance_and_blocks_are_returned(reqs, kv_blocks, block, budget, seqs, policy, fail_rate, threshold):
    h = Harness(kv_cache_size=kv_blocks, tokens_per_block=block, max_num_batched_tokens=budget, max_num_seqs=seqs,
                scheduling_policy=policy, failure_injection_rate=fail_rate, long_prefill_token_threshold=threshold,
                failure_types=[FailureType.ERROR, FailureType.LENGTH], inter_token_latency=1, time_to_first_token=2)
    shared = Harness.prompt_of("shared", 120)
    aborts = []
    for i, (plen, max_tokens, share, prio, abort_after) in enumerate(reqs):
        prompt = shared[:plen] if share else Harness.prompt_of(f"r{i}", plen)
        h.add(f"r{i}", prompt=prompt, max_tokens=max_tokens, priority=prio)
        if abort_after is not None:
            aborts.append((abort_after, f"r{i}"))
    for t, rid in sorted(aborts):
        h.run(until=t)
        h.core.abort_requests([rid])
    h.run()
    s = h.stats()
    assert s.running == 0 and s.waiting == 0
    assert s.requests_received == len(reqs)
    assert s.requests_received == s.requests_completed + s.requests_failed + s.requests_aborted
    pool = h.core.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    finished = [rid for _, b in h.batches for rid in (b.finished_requests or [])]
    assert sorted(finished) == sorted(f"r{i}" for i in range(len(reqs)))  # each exactly once
    for i, (plen, max_tokens, *_rest) in enumerate(reqs):
        n = len(h.tokens(f"r{i}"))
        assert n <= max_tokens
        if h.finish(f"r{i}") is not None and h.finish(f"r{i}").name == "LENGTH" and n:
            # outputs are capped where the KV cache could not hold the sequence any more
            assert n == min(max_tokens, kv_blocks * block - plen)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "lookup"]), st.integers(0, 5)),
                    max_size=60))
def test_block_pool_refcounts_and_free_queue_agree(ops):
    from vllm_vcr.engine.block_pool import BlockPool

    pool = BlockPool(num_blocks=8, block_size=4)
    held: list = []
    n_hash = 0
    for op, k in ops:
        if op == "alloc" and k <= pool.num_free_blocks:
            held.extend(pool.allocate(k))
        elif op == "free" and held:
            b = held.pop(k % len(held))
            pool.free([b])
        elif op == "cache" and held:
            b = held[k % len(held)]
            n_hash += 1
            pool.cache_blocks([b], [bytes([n_hash % 256, n_hash // 256])], [1, 2, 3, 4], None, None)
        elif op == "lookup":
            hits = pool.lookup([bytes([k, 0])])
            pool.touch(hits)
            held.extend(hits)
        in_use = {b.block_id for b in held}
        assert all((b.ref_cnt == 0) == pool.is_free(b) for b in pool.blocks)
        assert all(pool.blocks[i].ref_cnt > 0 for i in in_use)
        assert all(pool.cached[h].block_hash == h for h in pool.cached)
