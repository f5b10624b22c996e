"""Synthetic prompts that reproduce a trace's prompt lengths and prefix sharing.

Each distinct block hash becomes one deterministic block of token ids (SplitMix64 seeded by the
hash), so two records that shared a prefix in the capture share it again on replay; the tail past
the last full block is unique per request. Records without `block_hashes` get fully unique prompts
(and no hashes in the replay's trace: nothing in them is shared).
Ids stay in [FIRST_ID, vocab_size) to avoid the special tokens most tokenizers keep at the bottom.
"""

from __future__ import annotations

import struct

import numpy as np

from ..trace.block_hash import FNV_OFFSET, fnv1a64
from ..trace.schema import TraceRecord

_M64 = 0xFFFFFFFFFFFFFFFF
_GOLDEN = 0x9E3779B97F4A7C15
FIRST_ID = 10


def _splitmix(seeds: np.ndarray, n: int, vocab_size: int) -> np.ndarray:
    """For each seed, its first n SplitMix64 outputs mapped into [FIRST_ID, vocab_size).
    Vectorized: a long prompt costs microseconds on the load generator's event loop."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as SplitMix64 wants
        z = seeds[:, None] + np.arange(1, n + 1, dtype=np.uint64)[None, :] * np.uint64(_GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    span = np.uint64(max(vocab_size - FIRST_ID, 1))
    return (z % span + np.uint64(FIRST_ID)).astype(np.int64)


def _ids(seed: int, n: int, vocab_size: int) -> list[int]:
    if n <= 0:
        return []
    return _splitmix(np.array([seed & _M64], dtype=np.uint64), n, vocab_size)[0].tolist()


class PromptBuilder:
    def __init__(self, block_size: int = 16, vocab_size: int = 4000, seed: int = 0):
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.seed = seed
        self._blocks: dict[int, list[int]] = {}
        self._chain: dict[tuple[int, int], int] = {}  # (previous hash, source hash) -> our hash

    def _make_blocks(self, hashes: list[int]) -> None:
        """Generate every not-yet-seen block of a request in one vectorized call."""
        missing = list(dict.fromkeys(h for h in hashes if h not in self._blocks))
        if not missing:
            return
        salt = (self.seed * _GOLDEN) & _M64
        seeds = np.array([(h & _M64) ^ salt for h in missing], dtype=np.uint64)
        for h, row in zip(missing, _splitmix(seeds, self.block_size, self.vocab_size).tolist()):
            self._blocks[h] = row

    def token_ids(self, index: int, rec: TraceRecord) -> list[int]:
        return self.build(index, rec)[0]

    def build(self, index: int, rec: TraceRecord) -> tuple[list[int], list[int] | None]:
        """The prompt's token ids and their block hashes (the trace format's chained FNV-1a).
        Hashes of the shared blocks are memoized, so only a request's new blocks are hashed."""
        n = max(rec.prompt_tokens, 1)
        bs = self.block_size
        ids: list[int] = []
        hashes: list[int] = []
        prev = FNV_OFFSET
        usable = (rec.block_hashes or [])[: n // bs]  # a larger source block size: keep what fits
        self._make_blocks(usable)
        for h in usable:
            block = self._blocks[h]
            key = (prev, h)
            nh = self._chain.get(key)
            if nh is None:
                nh = self._chain[key] = _hash_block(prev, block)
            ids.extend(block)
            hashes.append(nh)
            prev = nh
        tail_seed = ((self.seed + 1) << 40) ^ (index * 0xD1B54A32D192ED03)
        ids.extend(_ids(tail_seed & _M64, n - len(ids), self.vocab_size))
        if not rec.block_hashes:
            return ids, None  # a prompt unique from its first token: nothing worth hashing
        for k in range(len(hashes) * bs, (len(ids) // bs) * bs, bs):  # full blocks of the tail
            prev = _hash_block(prev, ids[k:k + bs])
            hashes.append(prev)
        return ids, hashes or None


def _hash_block(prev: int, block: list[int]) -> int:
    return fnv1a64(struct.pack(f"<Q{len(block)}I", prev, *block))


# Common short English words (about one token each in GPT-style BPE vocabularies), for chat
# requests, where a prompt has to be text.
_WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "are", "with", "as", "at", "be",
    "by", "this", "had", "not", "but", "from", "or", "have", "an", "they", "which", "one", "you",
    "were", "her", "all", "she", "there", "would", "their", "we", "him", "been", "has", "when",
    "who", "will", "more", "no", "if", "out", "so", "said", "what", "up", "its", "about", "into",
    "than", "them", "can", "only", "other", "new", "some", "could", "time", "these", "two", "may",
    "then", "do", "first", "any", "my", "now", "such", "like", "our", "over", "man", "me", "even",
    "most", "made", "after", "also", "did", "many", "before", "must", "through", "back", "years",
    "where", "much", "your", "way", "well", "down", "should", "because", "each", "just", "those",
    "people", "how", "too", "little", "state", "good", "very", "make", "world", "still", "own",
    "see", "men", "work", "long", "get", "here", "between", "both", "life", "being", "under",
    "never", "day", "same", "another", "know", "while", "last", "might", "us", "great", "old",
    "year", "off", "come", "since", "against", "go", "came", "right", "used", "take", "three"
)


def ids_to_text(ids: list[int]) -> str:
    return " ".join(_WORDS[i % len(_WORDS)] for i in ids)
