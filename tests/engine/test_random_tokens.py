"""RandomTokens' batched draw (its loop in C) gives exactly the ids of the plain formula
`int(rng.random() * vocab_size)`, draw for draw: a seeded request's tokens never change."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.engine.tokens import RandomTokens, seeded_random


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


def _plain_ids(seed: int, vocab: int, avoid: set[int], count: int) -> list[int]:
    rng, expected = random.Random(seed), []
    while len(expected) < count:
        batch = [int(rng.random() * vocab) for _ in range(RandomTokens.DRAW_BATCH)]
        for j, t in enumerate(batch):
            while t in avoid:
                t = int(rng.random() * vocab)
            batch[j] = t
        expected += batch
    return expected[:count]


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32), vocab=st.one_of(st.integers(51, 80), st.integers(1, 2**31 - 1)),
       needed=st.integers(-1, 130), avoid=st.sets(st.integers(0, 50), max_size=12),
       takes=st.lists(st.integers(1, 70), min_size=1, max_size=5), one_by_one=st.booleans())
def test_ids_drawn_ahead_for_a_short_request_are_the_plain_formulas_ids(seed, vocab, needed, avoid, takes,
                                                                       one_by_one):
    """Admission draws only as many numbers as a short request can take (when none of them is
    avoided): whatever it is told, and however many ids are taken after, in whatever steps, the
    ids are the plain formula's, draw for draw."""
    if vocab <= 50:
        avoid = set()
    src = RandomTokens(random.Random(seed), vocab, frozenset(avoid))
    src.draw_ahead(needed)
    src.draw_ahead(needed)  # a second call draws nothing more
    got: list[int] = []
    for k in takes:
        got += [src.next_token(0) for _ in range(k)] if one_by_one else src.take(k)
    assert got == _plain_ids(seed, vocab, avoid, sum(takes))


@settings(max_examples=300, deadline=None)
@given(seed=st.one_of(st.integers(-2**70, 2**70), st.binary(max_size=300),
                      st.text(max_size=80).map(lambda s: s.encode("utf-8", "surrogatepass")),
                      st.sampled_from([0, -1, 1, 2**32, 2**32 - 1, 2**64, b"", b"\x00", b"0/0/req"])),
       draws=st.integers(0, 700))
def test_seeded_random_is_random_random(seed, draws):
    """A request's generator, seeded without Random.seed's Python layer, is `random.Random(seed)`
    (negative, huge and zero ints, empty and hostile bytes, surrogates), state and draws alike."""
    fast, plain = seeded_random(seed), random.Random(seed)
    assert type(fast) is random.Random and fast.getstate() == plain.getstate()
    assert [fast.random() for _ in range(draws)] == [plain.random() for _ in range(draws)]
    assert fast.gauss(0, 1) == plain.gauss(0, 1) and fast.getrandbits(77) == plain.getrandbits(77)
