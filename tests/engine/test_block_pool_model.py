"""The block pool against a model of vLLM's free queue written the plain way: any sequence of
allocations, cache hits (on blocks in use or free), registrations, frees and evictions gives the
same blocks, reference counts, free count, free-queue order and prefix cache, whichever of the
pool's paths (fresh blocks, unhashed runs, a free with every block referenced once) it takes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.engine.block_pool import BlockPool


class PlainPool:
    """vLLM's BlockPool, one block at a time: a free list least recently freed first."""

    def __init__(self, num_blocks: int) -> None:
        self.ref = [0] * num_blocks
        self.hash: list[bytes | None] = [None] * num_blocks
        self.queue = list(range(num_blocks))
        self.cached: dict[bytes, int] = {}

    def allocate(self, n: int) -> list[int]:
        out = self.queue[:n]
        del self.queue[:n]
        for b in out:
            h = self.hash[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.hash[b] = None
            self.ref[b] = 1
        return out

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                self.queue.remove(b)
            self.ref[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.queue.append(b)

    def cache(self, blocks: list[int], hashes: list[bytes]) -> None:
        for b, h in zip(blocks, hashes):
            if self.hash[b] is None:
                self.hash[b] = h
                self.cached.setdefault(h, b)


# an operation: (kind, holder, n): allocate n blocks for a holder, hit a holder's hashed blocks for
# another, hash a holder's blocks, free a holder's blocks (tail first)
_op = st.tuples(st.sampled_from(["allocate", "allocate", "hit", "cache", "free", "free"]),
                st.integers(0, 5), st.integers(1, 9))


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(4, 40), ops=st.lists(_op, max_size=80), shared_hashes=st.booleans())
def test_the_pool_matches_the_plain_free_queue(num_blocks, ops, shared_hashes):
    pool, plain = BlockPool(num_blocks, 4), PlainPool(num_blocks)
    held: dict[int, list] = {}  # holder -> its blocks (pool objects), in order
    made = 0
    for kind, holder, n in ops:
        blocks = held.setdefault(holder, [])
        if kind == "allocate":
            n = min(n, pool.num_free_blocks)
            got = pool.allocate(n)
            assert [b.block_id for b in got] == plain.allocate(n)
            blocks += got
        elif kind == "hit":  # cache hits on blocks in the prefix cache (in use by others, or free)
            hits = [b for b in pool.cached.values() if b not in blocks][:n]
            pool.touch(hits)
            plain.touch([b.block_id for b in hits])
            blocks += hits
        elif kind == "cache":
            # shared_hashes: several blocks may get one hash (the pool keeps the first in its cache)
            hashes = [bytes([made % 3 if shared_hashes else made, i]) for i in range(len(blocks))]
            made += 1
            pool.cache_blocks(blocks, hashes, [0] * 4 * len(blocks), None)
            plain.cache([b.block_id for b in blocks], hashes)
        else:
            pool.free(blocks[::-1])
            plain.free([b.block_id for b in blocks[::-1]])
            held[holder] = []
        made_blocks = pool._created  # (not `pool.blocks`: it would make the blocks never used yet)
        assert [b.block_id for b in made_blocks] == list(range(len(made_blocks)))
        assert [b.ref_cnt for b in made_blocks] == plain.ref[:len(made_blocks)]
        assert [b.block_hash for b in made_blocks] == plain.hash[:len(made_blocks)]
        assert not any(plain.ref[len(made_blocks):])
        assert pool.free_queue() == plain.queue
        assert pool.num_free_blocks == len(plain.queue)
        assert {h: b.block_id for h, b in pool.cached.items()} == plain.cached
        assert pool._multi == sum(r >= 2 for r in plain.ref)
