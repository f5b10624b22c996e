"""KV cache blocks and the prefix cache (vLLM v1's BlockPool, simplified).

Blocks hold `block_size` tokens. A full block gets a chained hash (parent hash + its tokens +
extra keys) and stays findable in the prefix cache while it sits in the free queue; the free
queue is LRU ordered, so allocation evicts the least recently freed cached block first.
"""

from __future__ import annotations

from collections import deque
from operator import attrgetter
from typing import Callable, Protocol, Sequence

BlockHash = bytes
BlockHasher = Callable[[BlockHash | None, Sequence[int], tuple | None], BlockHash]
_block_hash = attrgetter("block_hash")


class KVEventSink(Protocol):
    def stored(self, block_hashes: list[BlockHash], parent: BlockHash | None, token_ids: list[int],
               block_size: int, lora_name: str | None, *, lora_id: int | None = None,
               extra_keys: list | None = None) -> None: ...

    def removed(self, block_hashes: list[BlockHash]) -> None: ...

    def cleared(self) -> None: ...


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int, ref_cnt: int = 0) -> None:
        self.block_id = block_id
        self.ref_cnt = ref_cnt
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


_new_block = KVCacheBlock.__new__


class DeferredChain:
    """The blocks of one request entered in the prefix cache without their hashes yet (see
    deferred_hashes.py). Once its request freed them, they sit in the free queue as one run (tail
    first) from entry `start` on: block i is still the chain's until entry `start + n - 1 - i` is read."""

    __slots__ = ("h0", "tokens", "req", "blocks", "count", "start", "n")

    def __init__(self, h0, tokens: list[int], req) -> None:
        self.h0 = h0  # the hash of its first block
        self.tokens = tokens  # the request's token ids (its prompt and outputs), by reference
        self.req = req  # None once the request freed its blocks
        # its blocks 0..count-1: the first `count` of its request's block list, by reference (the
        # list is the request's until it frees them; then, reversed in place, the chain's alone)
        self.blocks: list[KVCacheBlock] = []
        self.count = 0
        self.start = -1  # the free-queue entry of its request's last block (-1: not freed yet)
        self.n = 0  # its request's blocks, freed as one run

    def own_blocks(self) -> list[KVCacheBlock]:
        """Its blocks 0..count-1, in order (its request's list is tail first once freed)."""
        blocks = self.blocks[::-1] if self.start >= 0 else self.blocks
        return blocks[:self.count]

    def holds(self, i: int, read: int) -> bool:
        """Whether block i still holds the chain's tokens (`read`: the free queue's entries read)."""
        return self.start < 0 or self.start + self.n - 1 - i >= read


class BlockPool:
    """The free queue is vLLM's: least recently freed first, every block free at the start in id
    order. Blocks never allocated yet are kept as a range (ids `_fresh`..`num_blocks - 1`, always
    at the head of the queue, since freed blocks join at its tail): a pool of tens of thousands of
    blocks costs nothing until they are used. Blocks freed since are a list in the order they were
    freed, read from `_head` on (so an allocation takes a slice). A cache hit that takes a free block
    leaves its entry behind (stale: counted in `_stale`, skipped when it comes up; a block's stale
    entries all precede its live one). `_multi` counts the blocks referenced more than once (cache
    hits on a block in use): while there are none, a free drops every reference without reading
    them."""

    COMPACT_AT = 2  # stale entries are dropped when the free queue grows past this many times the pool

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 events: KVEventSink | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.events = events
        self._created: list[KVCacheBlock] = []  # blocks 0.._fresh-1, by id
        self._fresh = 0  # the first block id never allocated
        self._queue: list[KVCacheBlock] = []  # from _head on: freed blocks, least recently freed first
        self._head = 0
        self._base = 0  # entries dropped from the front of _queue (entry numbers count from the first ever)
        self._stale: dict[KVCacheBlock, int] = {}  # stale entries in the queue, by block
        self._multi = 0  # blocks whose ref_cnt is 2 or more
        self.num_free_blocks = num_blocks
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        # deferred hashing (deferred_hashes.py): chains by the hash of their first block, and the
        # first blocks that more than one request has had (hashed eagerly)
        self.deferred: dict[BlockHash, DeferredChain] = {}
        self.shared_first_blocks: set[BlockHash] = set()
        self.released: deque[DeferredChain] = deque()  # deferred chains freed, in free-queue order

    # --- queries -------------------------------------------------------------------------
    @property
    def blocks(self) -> list[KVCacheBlock]:
        """Every block, by id (creates the ones never allocated: for tests and inspection)."""
        self._created += map(KVCacheBlock, range(len(self._created), self.num_blocks))
        return self._created

    def is_free(self, block: KVCacheBlock) -> bool:
        return block.block_id >= self._fresh or block.ref_cnt == 0

    def free_queue(self) -> list[int]:
        """The free block ids in eviction order (for tests and inspection)."""
        stale = dict(self._stale)
        live = []
        for b in self._queue[self._head:]:
            if stale.get(b):
                stale[b] -= 1
            else:
                live.append(b.block_id)
        return list(range(self._fresh, self.num_blocks)) + live

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[KVCacheBlock]:
        """The longest run of leading blocks already in the prefix cache."""
        if not self.enable_caching:
            return []
        hits = list(map(self.cached.get, block_hashes))  # (every lookup in C; a miss ends the run)
        if None in hits:
            del hits[hits.index(None):]
        return hits

    # --- reference counting ----------------------------------------------------------------
    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on cache hits (the entry of a free one in the free queue goes stale)."""
        stale = self._stale
        for b in blocks:
            r = b.ref_cnt
            if r == 0:
                self.num_free_blocks -= 1
                stale[b] = stale.get(b, 0) + 1
            elif r == 1:
                self._multi += 1
            b.ref_cnt = r + 1

    def allocate(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks, {self.num_free_blocks} free")
        self.num_free_blocks -= n
        fresh = self._fresh
        if fresh < self.num_blocks:  # the head of the queue: blocks never used, in id order
            k = min(n, self.num_blocks - fresh)
            if len(self._created) == fresh:  # (made without a call of __init__ each: a pool makes all of them)
                new = _new_block
                out = []
                for i in range(fresh, fresh + k):
                    b = new(KVCacheBlock)
                    b.block_id = i
                    b.ref_cnt = 1
                    b.block_hash = None
                    out.append(b)
                self._created += out
            else:  # (created already by `blocks`)
                out = self._created[fresh:fresh + k]
                for b in out:
                    b.ref_cnt = 1
            self._fresh = fresh + k
            if k == n:
                return out
            n -= k
        else:
            out = []
        taken = self._take(n)
        hashes = list(map(_block_hash, taken))
        if hashes.count(None) == len(hashes):  # (the blocks of unhashed requests: nothing to evict)
            for b in taken:
                b.ref_cnt = 1
            return out + taken if out else taken
        evicted: list[BlockHash] = []
        cached = self.cached
        for b, h in zip(taken, hashes):  # least recently freed first
            if h is not None:
                if cached.get(h) is b:
                    del cached[h]
                    evicted.append(h)
                b.block_hash = None
            b.ref_cnt = 1
        if evicted and self.events is not None:
            self.events.removed(evicted)
        return out + taken if out else taken

    def _take(self, n: int) -> list[KVCacheBlock]:
        """The next `n` live entries of the free queue, taken off it."""
        q, head, stale = self._queue, self._head, self._stale
        if not stale:
            taken = q[head:head + n]
            head += n
        else:
            taken = []
            while len(taken) < n:
                b = q[head]
                head += 1
                c = stale.get(b)
                if c:  # a stale entry (its block was taken by a cache hit since)
                    if c == 1:
                        del stale[b]
                    else:
                        stale[b] = c - 1
                else:
                    taken.append(b)
        if head > 4096 and 2 * head > len(q):  # let go of the entries read
            del q[:head]
            self._base += head
            head = 0
        self._head = head
        released = self.released
        if released:  # forget the deferred chains whose blocks are all taken (the first block's entry is last)
            read = self._base + head
            while released and released[0].start + released[0].n <= read:
                c = released.popleft()
                if self.deferred.get(c.h0) is c:
                    del self.deferred[c.h0]
        return taken

    @property
    def entries_read(self) -> int:
        """Free-queue entries read since the pool was made (deferred chains tell their blocks by it)."""
        return self._base + self._head

    def release_deferred(self, chain: DeferredChain, num_blocks: int) -> None:
        """The request of `chain` is about to free its `num_blocks` blocks: one run, since a deferred
        request's blocks are its own (it never takes a cache hit)."""
        chain.start, chain.n = self._base + len(self._queue), num_blocks
        self.released.append(chain)

    def free(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop a reference; the caller passes blocks tail first so tails are evicted first."""
        if not self._multi:  # every block is referenced once: each becomes free
            for b in blocks:
                b.ref_cnt = 0
        else:
            shared = False
            for b in blocks:
                r = b.ref_cnt - 1
                b.ref_cnt = r
                if r:
                    shared = True
                    if r == 1:
                        self._multi -= 1
            if shared:
                blocks = [b for b in blocks if not b.ref_cnt]
        self._queue += blocks
        self.num_free_blocks += len(blocks)
        if len(self._queue) - self._head > self.COMPACT_AT * self.num_blocks:  # (many cache hits on free blocks)
            self._compact()

    def _compact(self) -> None:
        """Drop the stale entries of the free queue (the runs of released deferred chains, never stale,
        are renumbered: their entries read stay read, the others keep their order)."""
        stale, read = self._stale, self._base + self._head
        runs = []
        for c in self.released:
            if c.start + c.n > read:
                runs.append(c)
            elif self.deferred.get(c.h0) is c:  # (all its blocks were taken: forgotten)
                del self.deferred[c.h0]
        for c in runs:  # (its first unread entry, and how many of its entries were read)
            c.n, c.start = c.n - max(read - c.start, 0), max(c.start, read)
        live: list[KVCacheBlock] = []
        i = 0
        for j, b in enumerate(self._queue[self._head:], read):
            while i < len(runs) and runs[i].start == j:
                runs[i].start = read + len(live)
                i += 1
            c = stale.get(b)
            if c:
                stale[b] = c - 1
            else:
                live.append(b)
        stale.clear()
        self._queue, self._head, self._base = live, 0, read
        self.released = deque(runs)

    # --- prefix cache ----------------------------------------------------------------------
    def cache_blocks(self, blocks: Sequence[KVCacheBlock], hashes: Sequence[BlockHash],
                     token_ids: Sequence[int], parent: BlockHash | None, lora_name: str | None = None,
                     lora_id: int | None = None, extra_keys: list | None = None) -> None:
        """Register newly full blocks under their hashes (one BlockStored event per call, as vLLM)."""
        if not self.enable_caching or not blocks:
            return
        cached = self.cached
        for b, h in zip(blocks, hashes):
            if b.block_hash is None:  # a block is hashed once; the manager only passes new ones
                b.block_hash = h
                cached.setdefault(h, b)
        if self.events is not None:
            self.events.stored(list(hashes), parent, list(token_ids), self.block_size, lora_name,
                               lora_id=lora_id, extra_keys=extra_keys)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use, as vLLM does."""
        if self.num_free_blocks != self.num_blocks:
            return False
        had = bool(self.cached)
        self.cached.clear()
        self.deferred.clear()
        self.shared_first_blocks.clear()
        self.released.clear()
        for b in self._created:
            b.block_hash = None
        if had and self.events is not None:
            self.events.cleared()
        return True
