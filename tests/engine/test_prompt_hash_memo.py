"""The prompt-block hash memo gives exactly the hasher's hashes (a repeated prompt, extra keys,
output blocks, a memo that fills up)."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.engine import kv_cache_manager as kvm
from vllm_vcr.engine.block_hash import block_extra_keys, make_block_hasher
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
