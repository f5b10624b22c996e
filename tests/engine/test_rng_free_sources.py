"""A token-source factory marked `rng_free` (the simulator's CountedTokens) spares the engine the
per-request `random.Random`; when it declines a request, the engine's own source draws exactly the
ids it would have drawn without the factory (the same seed, made then)."""

from __future__ import annotations

from vllm_vcr.engine.decode_cohort import counted_token_source
from vllm_vcr.engine.tokens import CountedTokens, seeded_random


def _declining(req, rng):
    return None


def _run(harness, factory):
    h = harness(seed=7)
    h.core.admission.token_source_factory = factory
    h.add("plain", max_tokens=6, ignore_eos=True)
    h.add("biased", max_tokens=6, ignore_eos=True, logit_bias={5: 3.0})
    h.run()
    return h


def test_a_declining_rng_free_factory_leaves_the_drawn_ids_unchanged(harness):
    _declining.rng_free = True
    try:
        lazy = _run(harness, _declining)
    finally:
        del _declining.rng_free
    eager = _run(harness, None)
    for rid in ("plain", "biased"):
        assert lazy.tokens(rid) == eager.tokens(rid) and len(lazy.tokens(rid)) == 6


def test_counted_sources_seed_no_random(harness, monkeypatch):
    made = []

    def counting(seed):  # a request's generator, seeded
        made.append(seed)
        return seeded_random(seed)

    h = harness(seed=7)
    h.core.admission.token_source_factory = counted_token_source(h.core.args.vocab_size)
    monkeypatch.setattr("vllm_vcr.engine.admission.seeded_random", counting)
    h.add("counted", max_tokens=5, ignore_eos=True)
    h.add("biased", max_tokens=5, ignore_eos=True, logit_bias={5: 3.0})  # declined: the engine draws
    h.run()
    counted = CountedTokens(1, h.core.args.vocab_size)  # (the first request to arrive)
    assert h.tokens("counted") == [counted.next_token(i) for i in range(5)]  # both ids, alternating
    assert len(h.tokens("biased")) == 5
    assert len(made) == 1  # the biased request's own rng only
