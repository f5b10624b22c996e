"""Deferred prompt-block hashing (engine/deferred_hashes.py) and the lazily created KV pool.

Hypothesis drives two KV cache managers through the same random life of requests that share
prefixes (admission with prefix lookup, chunked computation, output tokens, finishes,
preemptions and resumes, eviction under a small pool): one hashes every block eagerly, the other
defers. Every lookup must hit the same blocks, every allocation get the same block ids, and the
pools must end alike. A second property holds the lazily created pool to a plain LRU free queue.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.engine.block_hash import ContentHasher
from vllm_vcr.engine.block_pool import BlockPool
from vllm_vcr.engine.kv_cache_manager import KVCacheManager
from vllm_vcr.engine.request import Request
from vllm_vcr.engine.types import EngineCoreRequest, SamplingParams

BS = 4
_hash = ContentHasher()


def _eager_hasher(parent, tokens, extra):  # the same hashes, but no `chain`: the manager hashes eagerly
    return _hash(parent, tokens, extra)


def _request(rid: str, prompt: list[int], seq: int) -> Request:
    ecr = EngineCoreRequest(request_id=rid, prompt_token_ids=list(prompt),
                            sampling_params=SamplingParams(max_tokens=64, ignore_eos=True))
    return Request(ecr, ecr.sampling_params, 64, 0.0, seq)


class Twin:
    """One manager and the requests it holds."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.live: dict[int, Request] = {}  # running
        self.waiting: dict[int, Request] = {}  # preempted


def _admit(t: Twin, req: Request, chunk: int) -> tuple | None:
    """Lookup, then blocks for the hits and a chunk; None when the pool cannot hold it (it waits)."""
    kv = t.kv
    hits = kv.get_computed_blocks(req)
    left = len(req.all_token_ids) - len(hits) * BS
    n = min(chunk, left)
    if not kv.allocate_slots(req, n, hits):
        return None
    req.num_computed_tokens += len(hits) * BS
    return tuple(b.block_id for b in hits), tuple(b.block_id for b in req.blocks)


def _compute(t: Twin, req: Request, k: int, out_token: int) -> tuple | None:
    """Compute up to k more tokens (appending an output token once the prompt is computed)."""
    kv = t.kv
    if req.num_computed_tokens >= len(req.all_token_ids):
        req.all_token_ids.append(out_token)
        req.output_token_ids.append(out_token)
    n = min(k, len(req.all_token_ids) - req.num_computed_tokens)
    if not kv.allocate_slots(req, n):
        return None
    req.num_computed_tokens += n
    kv.cache_computed_blocks(req)
    return tuple(b.block_id for b in req.blocks)


OPS = ["add", "add", "compute", "compute", "compute", "finish", "finish", "preempt", "resume"]


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 1 << 32), num_ops=st.integers(1, 400), num_blocks=st.integers(4, 40),
       shared=st.sampled_from([0.0, 0.5, 0.9]), compact_at=st.sampled_from([2, 0]))
def test_deferred_hashing_finds_what_eager_hashing_finds(seed, num_ops, num_blocks, shared, compact_at):
    with mock.patch.object(BlockPool, "COMPACT_AT", compact_at):  # 0: the free queue is compacted at every free
        _twin_lives(seed, num_ops, num_blocks, shared)


def _twin_lives(seed: int, num_ops: int, num_blocks: int, shared: float) -> None:
    rng = random.Random(seed)  # long random lives (many evictions, resumes, re-shared prefixes) per example
    prefixes = [[p * 100 + i for i in range(24)] for p in range(3)]
    twins = [Twin(KVCacheManager(BlockPool(num_blocks, BS), _eager_hasher)),
             Twin(KVCacheManager(BlockPool(num_blocks, BS), ContentHasher()))]
    assert twins[0].kv.deferred is None and twins[1].kv.deferred is not None
    seq = 0
    for _ in range(num_ops):
        op, pick, size, token = rng.choice(OPS), rng.randrange(4), rng.randint(1, 30), rng.randrange(50)
        prefix = prefixes[pick % 3][:size] if rng.random() < shared else []
        tail = [7] * (size % 9) if rng.random() < 0.2 else [1000 + seq * 50 + i for i in range(size % 13)]
        results = []
        for t in twins:
            if op == "add":  # a prompt: a shared prefix (or none), then its own tokens or a common tail
                req = _request(f"r{seq}", (prefix + tail) or [5], seq)
                got = _admit(t, req, chunk=size)
                (t.live if got is not None else t.waiting)[seq] = req
                results.append(got)
            elif op == "resume" and t.waiting:
                key = sorted(t.waiting)[pick % len(t.waiting)]
                got = _admit(t, t.waiting[key], chunk=size)
                if got is not None:
                    t.live[key] = t.waiting.pop(key)
                results.append((key, got))
            elif t.live:
                key = sorted(t.live)[pick % len(t.live)]
                req = t.live[key]
                if op == "compute":
                    results.append((key, _compute(t, req, size, token)))
                else:  # finish / preempt: the blocks go back to the pool (a preempted one recomputes)
                    t.kv.cache_computed_blocks(req)
                    t.kv.free(req)
                    del t.live[key]
                    if op == "preempt":
                        req.num_computed_tokens = 0
                        t.waiting[key] = req
                    results.append(key)
            results.append(t.kv.pool.num_free_blocks)
        seq += op == "add"
        half = len(results) // 2
        assert results[:half] == results[half:], (op, results)
    eager, deferred = (t.kv.pool for t in twins)
    assert [b.ref_cnt for b in eager.blocks] == [b.ref_cnt for b in deferred.blocks]


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 1 << 32), num_ops=st.integers(1, 300), num_blocks=st.integers(1, 12))
def test_lazily_created_pool_is_an_lru_free_queue(seed, num_ops, num_blocks):
    rng = random.Random(seed)
    ops = [(rng.choice(["alloc", "alloc", "free", "free", "cache", "touch", "touch", "blocks", "reset"]), rng.randrange(7))
           for _ in range(num_ops)]
    pool = BlockPool(num_blocks, BS)
    ref = OrderedDict((i, None) for i in range(num_blocks))  # free block ids, eviction order
    held: list = []
    hashes: dict[int, bytes] = {}  # block id -> hash, as cached
    n = 0
    for op, k in ops:
        if op == "alloc" and k <= len(ref):
            got = pool.allocate(k)
            want = [ref.popitem(last=False)[0] for _ in range(k)]
            assert [b.block_id for b in got] == want and all(b.ref_cnt == 1 for b in got)
            for i in want:
                hashes.pop(i, None)
            held += got
        elif op == "free" and held:
            b = held.pop(k % len(held))
            pool.free([b])
            if b.ref_cnt == 0:
                ref[b.block_id] = None
        elif op == "cache" and held:
            b = held[k % len(held)]
            n += 1
            h = bytes([n % 256, n // 256])
            pool.cache_blocks([b], [h], [1] * BS, None)
            hashes.setdefault(b.block_id, h)
        elif op == "touch" and hashes:
            h = sorted(hashes.values())[k % len(hashes)]
            hits = pool.lookup([h])
            assert [b.block_id for b in hits] == [i for i, x in hashes.items() if x == h][:1]
            for b in hits:
                ref.pop(b.block_id, None)
            pool.touch(hits)
            held += hits
        elif op == "blocks":  # creating every block for inspection changes nothing
            assert [b.block_id for b in pool.blocks] == list(range(num_blocks))
        elif op == "reset" and pool.reset_prefix_cache():
            hashes.clear()
        assert pool.num_free_blocks == len(ref) and pool.free_queue() == list(ref)
        assert all(pool.is_free(b) == (b.ref_cnt == 0) for b in held)
        assert all(pool.cached[h].block_hash == h for h in pool.cached)


def test_pool_lets_go_of_read_entries_and_keeps_lru_order():
    # many allocate/free cycles over a few thousand blocks: the queue's read entries are dropped
    pool = BlockPool(3000, BS)
    ref = OrderedDict((i, None) for i in range(3000))
    rng = random.Random(1)
    held: list = []
    for _ in range(400):
        got = pool.allocate(rng.randint(1, 60))
        assert [b.block_id for b in got] == [ref.popitem(last=False)[0] for _ in got]
        held += got
        rng.shuffle(held)
        k = rng.randint(0, len(held))
        freed, held = held[:k], held[k:]
        pool.free(freed)
        for b in freed:
            ref[b.block_id] = None
    assert pool._head < 8192 and pool.free_queue() == list(ref)
