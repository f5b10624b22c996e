from __future__ import annotations

from vllm_vcr.trace.block_hash import (
    FNV_OFFSET,
    fnv1a64,
    prompt_block_hashes,
    shared_prefix_blocks,
)


def test_fnv1a64_known_vectors():
    assert fnv1a64(b"") == FNV_OFFSET
    assert fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert fnv1a64(b"foobar") == 0x85944171F73967E8


def test_chain_shares_prefixes_and_ignores_the_tail():
    a = list(range(40))
    b = list(range(32)) + [999] * 8
    ha, hb = prompt_block_hashes(a, 16), prompt_block_hashes(b, 16)
    assert len(ha) == 2 and ha == hb  # the partial third block is ignored
    c = list(range(16)) + [7] * 16
    assert shared_prefix_blocks(ha, prompt_block_hashes(c, 16)) == 1
    assert prompt_block_hashes([1, 2, 3], 16) is None


def test_chain_definition():
    import struct

    toks = list(range(16))
    h1 = fnv1a64(struct.pack("<Q", FNV_OFFSET) + struct.pack("<16I", *toks))
    assert prompt_block_hashes(toks, 16) == [h1]
