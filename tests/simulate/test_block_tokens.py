"""The token ids a trace's block keys stand for (simulate/workload.py `_block_tokens`): what the
prefix cache and the `kv` router see depends only on which blocks are equal, so a key must give
the same ids everywhere, another key other ids, and a longer run of a key must start with a
shorter one (a trace's last block is a cut of its key's run)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.simulate.workload import _SUFFIX_POOL, _VOCAB, _block_tokens

keys = st.integers(-(2**40), 2**40) | st.integers(-3, 3)
lengths = st.integers(0, 600) | st.sampled_from([16, 512, _SUFFIX_POOL - 1, _SUFFIX_POOL, _SUFFIX_POOL + 7])


@settings(max_examples=300, deadline=None)
@given(a=keys, b=keys, n=lengths, m=st.integers(0, 600))
def test_a_key_gives_its_own_ids_and_longer_runs_extend_shorter_ones(a, b, n, m):
    run = _block_tokens(a, n)
    assert len(run) == n and all(1 <= t <= _VOCAB for t in run)
    assert _block_tokens(a, n) == run
    assert _block_tokens(a, n + m)[:n] == run
    if a != b and n >= 4:
        assert _block_tokens(b, n) != run


def test_runs_are_fresh_lists():
    run = _block_tokens(5, 32)
    run.append(0)  # a caller extends what it got (a prompt): the next run of the key is untouched
    assert _block_tokens(5, 32) == run[:32]
