"""Prefix caching, LRU eviction, preemption under KV pressure, admission by blocks."""

from vllm_vcr.engine.block_pool import BlockPool
from vllm_vcr.engine.types import EngineCoreEventType, FinishReason


def cached_tokens(h, rid):
    return h.outputs(rid)[0][1].prefill_stats.num_cached_tokens


def test_shared_prefix_hits_full_blocks_only(harness):
    h = harness(tokens_per_block=16)
    base = h.prompt_of("base", 40)
    h.add("a", prompt=base, max_tokens=1)
    h.run()
    h.add("b", prompt=base[:36] + [9, 9, 9, 9], max_tokens=1)
    h.add("c", prompt=[7] + base[1:], max_tokens=1)
    h.run()
    assert cached_tokens(h, "a") == 0
    assert cached_tokens(h, "b") == 32
    assert cached_tokens(h, "c") == 0  # chained hashes: a different first block changes everything


def test_full_hit_recomputes_the_last_block(harness):
    h = harness(tokens_per_block=16)
    p = h.prompt_of("p", 48)
    h.add("a", prompt=p, max_tokens=1)
    h.run()
    h.add("b", prompt=p, max_tokens=1)
    h.run()
    assert cached_tokens(h, "b") == 32


def test_cache_salt_separates_prefixes(harness):
    from vllm_vcr.engine.types import EngineCoreRequest, SamplingParams

    h = harness(tokens_per_block=16)
    p = h.prompt_of("p", 48)
    for rid, salt in [("a", None), ("b", "tenant-1"), ("c", "tenant-1")]:
        h.add_req(EngineCoreRequest(request_id=rid, prompt_token_ids=p, sampling_params=SamplingParams(max_tokens=1),
                                    cache_salt=salt))
        h.run()
    assert [cached_tokens(h, r) for r in "abc"] == [0, 0, 32]


def test_lru_eviction_drops_the_least_recently_freed_block():
    pool = BlockPool(num_blocks=3, block_size=4)
    a, b, c = pool.allocate(3)
    pool.cache_blocks([a, b, c], [b"A", b"B", b"C"], list(range(12)), None, None)
    pool.free([b])
    pool.free([a])
    pool.free([c])
    (x,) = pool.allocate(1)
    assert x is b and pool.lookup([b"B"]) == [] and pool.lookup([b"A"]) == [a]


def test_prefix_cache_metrics_count_tokens(harness):
    h = harness(tokens_per_block=16)
    p = h.prompt_of("p", 64)
    h.add("a", prompt=p, max_tokens=1)
    h.add("b", prompt=p, max_tokens=1)
    h.run()
    q = sum(b.scheduler_stats.prefix_cache_stats.queries for _, b in h.batches if b.scheduler_stats)
    hits = sum(b.scheduler_stats.prefix_cache_stats.hits for _, b in h.batches if b.scheduler_stats)
    assert q == 128
    assert hits in (0, 48)  # b may be admitted in the same step as a, before a's blocks are cached


def test_preemption_under_kv_pressure_completes_everything(harness):
    # 6 blocks of 4 tokens; three requests of 8 prompt tokens each growing to 16 tokens
    h = harness(kv_cache_size=6, tokens_per_block=4, max_num_batched_tokens=64, inter_token_latency=1)
    for i in range(3):
        h.add(f"r{i}", prompt_len=8, max_tokens=8)
    h.run()
    assert all(h.finish(f"r{i}") is FinishReason.LENGTH for i in range(3))
    assert all(len(h.tokens(f"r{i}")) == 8 for i in range(3))
    preempted = [e for _, b in h.batches for o in b.outputs for e in (o.events or [])
                 if e.type == EngineCoreEventType.PREEMPTED]
    assert preempted
    assert h.core.scheduler.total_preemptions == len(preempted)
    assert h.core.block_pool.num_free_blocks == 6


def test_admission_waits_for_blocks(harness):
    h = harness(kv_cache_size=4, tokens_per_block=4, inter_token_latency=5)
    h.add("a", prompt_len=12, max_tokens=3)  # 3-4 blocks
    h.add("b", prompt_len=12, max_tokens=3)
    h.run(until=0.001)
    assert h.stats().running == 1 and h.stats().waiting == 1
    h.run()
    assert h.finish("b") is FinishReason.LENGTH


def test_prompt_that_can_never_fit_is_rejected(harness):
    h = harness(kv_cache_size=4, tokens_per_block=4)
    h.add("huge", prompt_len=100, max_tokens=3)
    h.run()
    out = h.outputs("huge")[-1][1]
    assert out.finish_reason is FinishReason.ERROR and "KV blocks" in out.error.message
    assert h.stats().requests_failed == 1


def test_kv_usage_is_reported(harness):
    h = harness(kv_cache_size=10, tokens_per_block=4, inter_token_latency=5)
    h.add("a", prompt_len=16, max_tokens=3)
    h.run(until=0.001)
    usage = [b.scheduler_stats.kv_cache_usage for _, b in h.batches if b.scheduler_stats]
    assert usage[-1] == 0.4  # 16 prompt tokens; the first sampled token's slot comes with the next step
    h.run(until=0.006)
    assert h.batches[-1][1].scheduler_stats.kv_cache_usage == 0.5
    h.run()
    assert h.batches[-1][1].scheduler_stats.kv_cache_usage == 0.0
