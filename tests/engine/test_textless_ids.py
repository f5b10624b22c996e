"""Random output never draws the ids serve's tokenizer says have no whole-character text of their
own (EngineCore's textless_ids input), so every random token is text, as a model's output is; a request's
own logit_bias / allowed_token_ids may still pick them."""

from __future__ import annotations

TEXTLESS = tuple(range(0, 600, 2))  # half of a 600-id vocabulary: a draw that ignored them hits ~50 %
EOS = 1


def test_random_tokens_avoid_textless_ids_and_still_the_stop_ids(harness):
    h = harness(vocab_size=600, textless_ids=TEXTLESS, eos_token_id=EOS)
    h.add("plain", max_tokens=400, ignore_eos=True)
    h.add("stops", max_tokens=400, ignore_eos=True, stop_token_ids=[3, 5])
    h.run()
    plain, stops = h.tokens("plain"), h.tokens("stops")
    assert len(plain) == len(stops) == 400
    assert not set(plain) & set(TEXTLESS) and EOS not in plain
    assert not set(stops) & ({3, 5} | set(TEXTLESS))
    assert len(set(plain)) > 200  # still the rest of the vocabulary, uniformly


def test_a_requests_allowed_ids_may_be_textless(harness):
    h = harness(vocab_size=600, textless_ids=TEXTLESS, eos_token_id=EOS)
    h.add("r", max_tokens=50, ignore_eos=True, allowed_token_ids=[10, 12])
    h.run()
    assert set(h.tokens("r")) == {10, 12}


def test_without_textless_ids_the_whole_vocabulary_is_drawn(harness):
    h = harness(vocab_size=600, eos_token_id=EOS)
    h.add("r", max_tokens=400, ignore_eos=True)
    h.run()
    assert set(h.tokens("r")) & set(TEXTLESS)
