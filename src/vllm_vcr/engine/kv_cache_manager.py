"""Per-request KV block bookkeeping on top of the BlockPool (vLLM's KVCacheManager)."""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter
from typing import Sequence

from .block_hash import block_extra_keys, make_block_hasher
from .block_pool import BlockHasher, BlockPool, KVCacheBlock
from .deferred_hashes import DeferredHashes
from .request import Request

_PROMPT_MEMO_MAX = 16384  # prompt blocks remembered (~6 MB at 16 tokens a block)
_ref_cnt = attrgetter("ref_cnt")


class KVCacheManager:
    def __init__(self, pool: BlockPool, hasher: BlockHasher | None = None) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        # vLLM's own block hash (sha256 by default), so KV events match a real engine's
        self.hasher = hasher or make_block_hasher()
        self._chain = getattr(self.hasher, "chain", None)  # a run of blocks in one call (ContentHasher)
        # a hasher whose hashes stay in the process: hash only blocks another request could hit
        self.deferred = DeferredHashes(pool, self.hasher) if self._chain is not None else None
        # prompt blocks recur (a shared system prompt, a benchmark's prompt pool): (parent, tokens,
        # extra keys) -> hash, so a repeated block costs a lookup instead of a pickle and a sha256
        self._prompt_memo: dict[tuple, bytes] = {}
        # the same for a `chain` hasher, a whole prompt at a time (its full blocks): (their token count,
        # three of their ids) -> (the ids, their hashes), or None for a prompt seen once (a prompt is
        # kept from its second time on); the ids are compared in full, so a fingerprint only finds it
        self._chain_memo: dict[tuple, tuple[list[int], list] | None] = {}
        self._chain_memo_blocks = 0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @staticmethod
    def _extra_keys(req: Request, block_index: int) -> tuple | None:
        if req.lora_name is None and req.cache_salt is None:
            return None
        return block_extra_keys(block_index, req.lora_name, req.lora_path, req.cache_salt)

    def update_block_hashes(self, req: Request) -> None:
        """Hash every newly full block of the request's tokens (prompt and output)."""
        bs = self.block_size
        hashes = req.block_hashes
        tokens = req.all_token_ids
        full = len(tokens) // bs
        hasher = self.hasher
        keyed = req.lora_name is not None or req.cache_salt is not None
        start = len(hashes)
        if not keyed and self._chain is not None:
            if full > start:
                if not start and req.num_prompt_tokens >= 2 * bs:  # a whole prompt: it may have come before
                    hashes += self._prompt_chain(tokens, min(full, req.num_prompt_tokens // bs) * bs)
                    start = len(hashes)
                    if full == start:
                        return
                hashes += self._chain(hashes[-1] if start else None, tokens, start, full, bs)
            return
        prompt_blocks = min(full, req.num_prompt_tokens // bs)
        memo = self._prompt_memo
        parent = hashes[-1] if start else None
        if start < prompt_blocks:  # prompt blocks recur: through the memo (their tuples made in C)
            blocks = zip(*[iter(tokens[start * bs:prompt_blocks * bs])] * bs)
            extras = map(self._extra_keys, repeat(req), range(start, prompt_blocks)) if keyed else repeat(None)
            for block, extra in zip(blocks, extras):
                key = (parent, block, extra)
                parent = memo.get(key)
                if parent is None:
                    if len(memo) >= _PROMPT_MEMO_MAX:
                        memo.clear()
                    parent = memo[key] = hasher(key[0], block, extra)
                hashes.append(parent)
            start = prompt_blocks
        for i in range(start, full):  # output blocks: new to the cache every time
            parent = hasher(parent, tokens[i * bs:(i + 1) * bs], self._extra_keys(req, i) if keyed else None)
            hashes.append(parent)

    def _prompt_chain(self, tokens: list[int], n: int) -> list:
        """The chained hashes of the blocks of `tokens[:n]` (n: a multiple of the block size), kept
        for a prompt that recurs (a benchmark's prompt pool, a client's retries)."""
        key = (n, tokens[n - 1], tokens[n >> 1], tokens[n // 3])
        memo = self._chain_memo
        kept = memo.get(key, False)
        if kept:
            ids = tokens if len(tokens) == n else tokens[:n]
            if kept[0] == ids:
                return kept[1]
        hashes = self._chain(None, tokens, 0, n // self.block_size, self.block_size)
        if kept is False:  # first seen: only its fingerprint (a prompt that never recurs keeps no copy)
            if len(memo) >= _PROMPT_MEMO_MAX:
                memo.clear()
                self._chain_memo_blocks = 0
            memo[key] = None
            return hashes
        # seen before (or another prompt with its fingerprint, which it replaces)
        blocks = self._chain_memo_blocks + len(hashes) - (len(kept[1]) if kept else 0)
        if blocks > _PROMPT_MEMO_MAX:
            memo.clear()
            blocks = len(hashes)
        memo[key] = (tokens[:n], hashes)
        self._chain_memo_blocks = blocks
        return hashes

    def get_computed_blocks(self, req: Request) -> list[KVCacheBlock]:
        """Prefix-cache hits for a request about to be scheduled from waiting."""
        if not self.pool.enable_caching:
            return []
        if self._defer(req) is not None:
            return []  # its first block is new: nothing in the cache can match
        self.update_block_hashes(req)
        # always recompute at least the last token, as vLLM does on a full hit
        max_blocks = (req.num_tokens - 1) // self.block_size
        return self.pool.lookup(req.block_hashes[:max_blocks])

    def can_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.pool.num_blocks

    def allocate_slots(self, req: Request, num_new_tokens: int, new_computed: Sequence[KVCacheBlock] = (),
                       must_fit: int = 0, headroom: int = 0) -> bool:
        """Blocks for `num_new_tokens` more tokens (after the prefix-cache hits `new_computed`);
        False, and nothing taken, when the free blocks less `headroom` (vLLM's watermark) cannot
        hold them, or (`must_fit` > 0: vLLM's full_sequence_must_fit at admission) cannot hold the
        first `must_fit` tokens."""
        total = req.num_computed_tokens + len(new_computed) * self.block_size + num_new_tokens
        needed = -(-total // self.block_size) - len(req.blocks) - len(new_computed)
        # hits sitting in the free queue stop being evictable once touched
        evictable_hits = list(map(_ref_cnt, new_computed)).count(0) if new_computed else 0
        free = self.pool.num_free_blocks - headroom
        if max(needed, 0) + evictable_hits > free:
            return False
        if must_fit > total and -(-must_fit // self.block_size) - len(req.blocks) - len(new_computed) \
                + evictable_hits > free:  # (a chunk that covers the whole sequence was checked above)
            return False
        if new_computed:
            self.pool.touch(new_computed)
            req.blocks.extend(new_computed)
            req.num_hashed_blocks = len(req.blocks)
        if needed > 0:
            req.blocks.extend(self.pool.allocate(needed))
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """Register blocks that became full of computed tokens in the prefix cache."""
        full = req.num_computed_tokens // self.block_size
        start = req.num_hashed_blocks
        if full <= start:
            return
        chain = self._defer(req)
        if chain is not None:
            self.deferred.register(chain, req, start, full)
            req.num_hashed_blocks = full
            return
        self.update_block_hashes(req)
        bs = self.block_size
        hashes = req.block_hashes
        extra = None
        if self.pool.events is not None and (req.lora_name is not None or req.cache_salt is not None):
            extra = [self._extra_keys(req, i) for i in range(start, full)]
        self.pool.cache_blocks(
            req.blocks[start:full], hashes[start:full], req.all_token_ids[start * bs:full * bs],
            hashes[start - 1] if start else None, req.lora_name, req.lora_id, extra,
        )
        req.num_hashed_blocks = full

    def _defer(self, req: Request):
        """The request's deferred chain (its blocks are entered without hashes), or None: hash."""
        d = self.deferred
        if d is None or req.block_hashes or self.pool.events is not None:
            return None
        chain = d.by_request.get(req)
        if chain is None and len(req.all_token_ids) >= self.block_size and req.lora_name is None \
                and req.cache_salt is None:
            chain = d.decide(req)
        return chain

    def free(self, req: Request) -> None:
        if self.deferred is not None:
            self.deferred.release(req)
        blocks = req.blocks
        if blocks:
            req.blocks = []
            blocks.reverse()  # tail first: evicted before the shared prefix (a deferred chain reads it so)
            self.pool.free(blocks)
        req.num_hashed_blocks = 0
