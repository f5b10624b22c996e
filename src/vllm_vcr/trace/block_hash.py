"""Chained FNV-1a 64 hashes of a prompt's full blocks (the trace's `block_hashes`).

Two records share a prompt prefix exactly as far as their hash chains agree. This is the trace
format's hash, not the engine block pool's (which mixes in a seed, LoRA and cache salt).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK = 0xFFFFFFFFFFFFFFFF


def fnv1a64(data: bytes, h: int = FNV_OFFSET) -> int:
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & _MASK
    return h


def prompt_block_hashes(tokens: Sequence[int], block_size: int) -> list[int] | None:
    """One hash per full block (the partial tail is ignored); None when there is no full block.

    Each block hashes the previous hash (8 bytes LE) followed by its tokens (u32 LE each).
    """
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    n_full = len(tokens) // block_size
    if n_full == 0:
        return None
    out: list[int] = []
    prev = FNV_OFFSET
    fmt = f"<Q{block_size}I"
    for i in range(n_full):
        block = tokens[i * block_size : (i + 1) * block_size]
        prev = fnv1a64(struct.pack(fmt, prev, *(t & 0xFFFFFFFF for t in block)))
        out.append(prev)
    return out


def shared_prefix_blocks(a: Sequence[int] | None, b: Sequence[int] | None) -> int:
    """How many leading blocks two hash chains share."""
    n = 0
    for x, y in zip(a or (), b or ()):
        if x != y:
            break
        n += 1
    return n
