"""Prefix-cache registration without hashing, while no other request could hit the blocks.

A block's chained hash depends on every token before it, so two requests can share cached blocks
only if their first blocks are equal. While no other request has had a request's first block
(its hash `h0`, one hash per request), nothing can look its later blocks up: they are kept in the
request's `DeferredChain` (not hashed, not entered in the prefix cache). The first time another
request (or the same one, resumed after preemption) comes with that `h0`, the chain is hashed and
its blocks that were not evicted meanwhile are entered, in the order the eager manager would have
entered them; from then on every request with that `h0` is hashed eagerly. A deferred request
never takes a cache hit, so its blocks are its own and leave in one run when it frees them: the
free queue's position tells which of them were taken since (block_pool.py).
So every lookup finds what the eager manager's would, block for block (tests/engine/
test_deferred_hashes.py), and a simulation of requests that share nothing hashes one block each.

Only for a hasher whose hashes never leave the process (`ContentHasher`, no KV events).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .block_pool import BlockPool, DeferredChain

if TYPE_CHECKING:
    from .request import Request


class DeferredHashes:
    def __init__(self, pool: BlockPool, hasher) -> None:
        self.pool = pool
        self.hasher = hasher
        self.block_size = pool.block_size
        self.by_request: dict[Request, DeferredChain] = {}  # live requests whose blocks are deferred

    def decide(self, req: Request) -> DeferredChain | None:
        """A request with a full first block and no hashes yet: its chain (deferred), or None when its
        first block was seen before (hash it eagerly; a pending chain with it is entered first)."""
        pool = self.pool
        h0 = self.hasher(None, req.all_token_ids[:self.block_size], None)
        pending = pool.deferred.get(h0)
        if pending is not None:
            self.enter(pending)
        if h0 in pool.shared_first_blocks or h0 in pool.cached:
            return None
        chain = pool.deferred[h0] = self.by_request[req] = DeferredChain(h0, req.all_token_ids, req)
        return chain

    def enter(self, chain: DeferredChain) -> None:
        """Hash a deferred chain and enter its blocks still holding its tokens in the prefix cache."""
        pool = self.pool
        blocks = chain.own_blocks()
        hashes = self.hasher.chain(None, chain.tokens, 0, len(blocks), self.block_size)
        cached, read = pool.cached, pool.entries_read
        for i, (h, b) in enumerate(zip(hashes, blocks)):
            if chain.holds(i, read):  # (not taken off the free queue since its request freed it)
                b.block_hash = h
                cached.setdefault(h, b)
        del pool.deferred[chain.h0]
        pool.shared_first_blocks.add(chain.h0)
        chain.blocks, chain.count = [], 0
        req = chain.req
        if req is not None:  # still running: hashed eagerly from now on
            del self.by_request[req]
            req.block_hashes = hashes
            chain.req = None

    def register(self, chain: DeferredChain, req: Request, start: int, full: int) -> None:
        """Blocks `start`..`full - 1` of `req` are full of computed tokens: the chain's (unhashed).
        (Its blocks so far are the request's first `start`: a reference to the request's list and a
        count, not a copy; the list's later blocks are not the chain's.)"""
        chain.blocks = req.blocks
        chain.count = full

    def release(self, req: Request) -> None:
        """`req` is about to free its blocks (finished or preempted): its chain stays until entered,
        or until the free queue gives its first block to another request."""
        chain = self.by_request.pop(req, None)
        if chain is not None:
            chain.req = None
            if not chain.count:  # (aborted before a block was computed: nothing to keep)
                del self.pool.deferred[chain.h0]
            else:
                self.pool.release_deferred(chain, len(req.blocks))
