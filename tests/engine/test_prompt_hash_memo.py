"""The prompt-hash memos give exactly the hasher's hashes (a repeated prompt, extra keys, output
blocks, a memo that fills up; for ContentHasher's whole-prompt memo also prompts that share its
fingerprint, block-size edges and resumed requests)."""

from __future__ import annotations

import random
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.engine import kv_cache_manager as kvm
from vllm_vcr.engine.block_hash import ContentHasher, block_extra_keys, make_block_hasher
from vllm_vcr.engine.block_pool import BlockPool


def _request(tokens: list[int], prompt_len: int, lora: str | None = None, salt: str | None = None):
    return SimpleNamespace(block_hashes=[], all_token_ids=list(tokens), num_prompt_tokens=prompt_len,
                           lora_name=lora, lora_path="/p" if lora else "", cache_salt=salt)


def _eager(tokens: list[int], lora: str | None, salt: str | None, bs: int = 16) -> list[bytes]:
    h = make_block_hasher()
    out: list[bytes] = []
    for i in range(len(tokens) // bs):
        extra = block_extra_keys(i, lora, "/p" if lora else "", salt) if (lora or salt) else None
        out.append(h(out[-1] if out else None, tokens[i * bs:(i + 1) * bs], extra))
    return out


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 7), min_size=16, max_size=70), min_size=1, max_size=6),
       order=st.lists(st.integers(0, 5), min_size=1, max_size=20),
       keys=st.sampled_from([(None, None), ("a", None), (None, "s"), ("a", "s")]),
       out_len=st.integers(0, 40), memo_max=st.sampled_from([2, 16384]))
def test_memoised_prompt_hashes_equal_the_hashers(prompts, order, keys, out_len, memo_max):
    kv = kvm.KVCacheManager(BlockPool(64, 16))
    old, kvm._PROMPT_MEMO_MAX = kvm._PROMPT_MEMO_MAX, memo_max
    try:
        for k in order:
            prompt = prompts[k % len(prompts)]
            lora, salt = keys if k % 2 else (None, None)
            tokens = prompt + [k] * out_len  # output tokens after the prompt
            req = _request(prompt, len(prompt), lora, salt)
            kv.update_block_hashes(req)  # the prompt, as admission hashes it
            req.all_token_ids = list(tokens)
            kv.update_block_hashes(req)  # then the output blocks as they fill
            assert req.block_hashes == _eager(tokens, lora, salt)
            assert len(kv._prompt_memo) <= memo_max
    finally:
        kvm._PROMPT_MEMO_MAX = old


# --- the whole-prompt memo of a `chain` hasher (ContentHasher) ------------------------------------

def _plain_chain(tokens: list[int], lora: str | None, salt: str | None, bs: int) -> list:
    """ContentHasher's hashes block by block, no memo, no `chain` (what every path must equal)."""
    h = ContentHasher()
    out: list = []
    for i in range(len(tokens) // bs):
        extra = block_extra_keys(i, lora, "/p" if lora else "", salt) if (lora or salt) else None
        out.append(h(out[-1] if out else None, tokens[i * bs:(i + 1) * bs], extra))
    return out


def _colliding(base: list[int], bs: int, k: int) -> list[int]:
    """A prompt with `base`'s length (in full blocks) and its ids at the memo's fingerprint
    positions, but other ids elsewhere (k picks which)."""
    n = len(base) // bs * bs
    if n < 2 * bs:
        return list(base)
    keep = {n - 1, n >> 1, n // 3}
    return [t if i in keep or i >= n else t + 1 + k for i, t in enumerate(base)]


@settings(max_examples=150, deadline=None)
@given(bs=st.sampled_from([1, 2, 3, 16]),
       lengths=st.lists(st.integers(1, 70), min_size=1, max_size=5),
       order=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 3), st.integers(0, 40), st.booleans()),
                      min_size=1, max_size=30),
       keys=st.sampled_from([(None, None), ("a", None), (None, "s"), ("a", "s")]),
       memo_max=st.sampled_from([1, 3, 16384]))
def test_prompt_chain_memo_equals_plain_hashing(bs, lengths, order, keys, memo_max):
    """Whole prompts again and again (the memo's hits), prompts that share its fingerprint but not its
    ids, block-size edges (a prompt one id short of, at, or past a block boundary), salted and LoRA
    requests beside plain ones, output blocks after the prompt, a resumed request hashed from its
    first block with its outputs in its ids, and a memo that fills up: every hash is the plain one."""
    rng = random.Random(len(lengths) * 1000 + bs)
    bases = [[rng.randrange(50) for _ in range(n)] for n in lengths]
    prompts = [p for b in bases for p in (b, b + [3], b[:-1] or [1], _colliding(b, bs, 1), _colliding(b, bs, 2))]
    kv = kvm.KVCacheManager(BlockPool(64, bs), ContentHasher())
    old, kvm._PROMPT_MEMO_MAX = kvm._PROMPT_MEMO_MAX, memo_max
    try:
        for k, (pick, variant, out_len, resumed) in enumerate(order):
            prompt = prompts[(pick * 5 + variant) % len(prompts)]
            lora, salt = keys if k % 3 == 2 else (None, None)
            tokens = prompt + [k % 50 + i for i in range(out_len)]
            req = _request(prompt, len(prompt), lora, salt)
            if resumed:  # a preempted request: hashed again from its first block, outputs and all
                req.all_token_ids = list(tokens)
                kv.update_block_hashes(req)
            else:
                kv.update_block_hashes(req)  # the prompt, at admission
                req.all_token_ids = list(tokens)
                kv.update_block_hashes(req)  # its output blocks as they fill
            assert req.block_hashes == _plain_chain(tokens, lora, salt, bs)
            kept = [v for v in kv._chain_memo.values() if v is not None]
            assert len(kv._chain_memo) <= memo_max
            # (the blocks kept are counted, and over the bound only while they are one prompt's)
            assert kv._chain_memo_blocks == sum(len(h) for _, h in kept)
            assert len(kept) == 1 or kv._chain_memo_blocks <= memo_max
            for ids, hashes in kept:  # a kept prompt's hashes are its own
                assert hashes == _plain_chain(ids, None, None, bs)
    finally:
        kvm._PROMPT_MEMO_MAX = old
