"""RandomTokens' batched draw (its loop in C) gives exactly the ids of the plain formula
`int(rng.random() * vocab_size)`, draw for draw: a seeded request's tokens never change."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.engine.tokens import RandomTokens


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), vocab=st.one_of(st.integers(51, 120), st.integers(1, 2**31 - 1)),
       count=st.integers(1, 200), avoid=st.sets(st.integers(0, 50), max_size=12))
def test_the_batched_draw_gives_the_plain_formulas_ids(seed, vocab, count, avoid):
    if vocab <= 50:
        avoid = set()  # (a small vocabulary could be avoided whole: nothing left to draw)
    # (51-120 ids with up to 12 avoided: most batches redraw some, several in a row at times)
    ids = RandomTokens(random.Random(seed), vocab, frozenset(avoid)).take(count)
    rng, expected = random.Random(seed), []
    while len(expected) < count:
        batch = [int(rng.random() * vocab) for _ in range(RandomTokens.DRAW_BATCH)]
        for j, t in enumerate(batch):  # an avoided id is redrawn in place, as _draw does
            while t in avoid:
                t = int(rng.random() * vocab)
            batch[j] = t
        expected += batch
    assert ids == expected[:count]
