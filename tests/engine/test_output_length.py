"""Outputs that end like a model's: the output-length distribution (a modeled EOS per request) and
the draw that logit_bias / allowed_token_ids shape, on the virtual clock."""

from __future__ import annotations

import random
import statistics

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_vcr.engine.config import ConfigError, EngineConfig
from vllm_vcr.engine.output_length import (HistogramLengths, LengthError, LognormalLengths, NormalLengths,
                                           build_length_model, modeled_eos_at)
from vllm_vcr.engine.tokens import BiasedTokens
from vllm_vcr.engine.types import FinishReason

from .conftest import Harness

EOS = 7


def lengths_of(h: Harness, rids) -> list[int]:
    return [len(h.tokens(r)) for r in rids]


# --- the distributions --------------------------------------------------------------------------
@pytest.mark.parametrize("cls,mean,std", [(LognormalLengths, 256, 128), (LognormalLengths, 40, 60),
                                          (NormalLengths, 300, 50)])
def test_parametric_draws_have_the_configured_mean_and_spread(cls, mean, std):
    rng = random.Random(1)
    draws = [cls(mean, std).draw(rng) for _ in range(20000)]
    assert min(draws) >= 1
    assert statistics.fmean(draws) == pytest.approx(mean, rel=0.03)
    assert statistics.pstdev(draws) == pytest.approx(std, rel=0.08)


def test_zero_std_dev_is_a_fixed_length():
    rng = random.Random(0)
    assert {LognormalLengths(100, 0).draw(rng) for _ in range(50)} == {100}
    assert {NormalLengths(100, 0).draw(rng) for _ in range(50)} == {100}


def test_histogram_draws_inside_its_buckets_by_weight():
    hist = HistogramLengths.parse("1-10:1, 50:3 ,100-200:0")
    rng = random.Random(0)
    draws = [hist.draw(rng) for _ in range(8000)]
    assert set(draws) <= set(range(1, 11)) | {50}
    assert draws.count(50) / len(draws) == pytest.approx(0.75, abs=0.02)
    assert hist.mean == pytest.approx((5.5 * 1 + 50 * 3) / 4)


@pytest.mark.parametrize("fields,message", [
    ({"output_length_distribution": "zipf"}, "output_length_distribution must be one of"),
    ({"output_length_mean": 0.5}, "output_length_mean must be a number >= 1"),
    ({"output_length_mean": float("nan")}, "output_length_mean"),
    ({"output_length_std_dev": -1}, "output_length_std_dev must be a number >= 0"),
    ({"output_length_distribution": "histogram"}, "output_length_histogram must be set"),
    ({"output_length_histogram": "1-10"}, "not LO-HI:WEIGHT"),
    ({"output_length_histogram": "0-10:1"}, "1 <= LO <= HI"),
    ({"output_length_histogram": "1-10:-1"}, "WEIGHT must be a number >= 0"),
    ({"output_length_histogram": "1-10:0"}, "no bucket with a positive weight"),
])
def test_bad_fields_are_config_errors_naming_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**fields).validate()


def test_off_has_no_model_and_modeled_eos_respects_the_budget():
    assert build_length_model("off", 256, 128, "") is None
    assert modeled_eos_at(None, 0, 100) is None
    assert modeled_eos_at(40, 0, 100) == 40
    assert modeled_eos_at(40, 60, 100) == 60  # min_tokens holds EOS back
    assert modeled_eos_at(140, 0, 100) is None  # max_tokens ends it first: LENGTH
    assert modeled_eos_at(40, 100, 100) is None
    with pytest.raises(LengthError):
        build_length_model("lognormal", 0, 1, "")


# --- through the engine -------------------------------------------------------------------------
def test_no_max_tokens_ends_on_eos_at_a_realistic_length(harness):
    h = harness(advertised_max_model_len=4096)
    for i in range(200):
        h.add(f"r{i}", max_tokens=None, eos_token_id=EOS)
    h.run()
    rids = [f"r{i}" for i in range(200)]
    lengths = lengths_of(h, rids)
    assert all(h.finish(r) is FinishReason.STOP and h.tokens(r)[-1] == EOS for r in rids)
    assert all(EOS not in h.tokens(r)[:-1] for r in rids)
    assert statistics.fmean(lengths) == pytest.approx(256, rel=0.1)  # the documented default
    assert max(lengths) < 4096 - 16


def test_ignore_eos_and_off_give_exactly_max_tokens(harness):
    h = harness()
    h.add("ignore", max_tokens=600, eos_token_id=EOS, ignore_eos=True)
    h.add("fill", max_tokens=None, eos_token_id=EOS, ignore_eos=True, prompt_len=4000)
    h.run()
    assert len(h.tokens("ignore")) == 600 and h.finish("ignore") is FinishReason.LENGTH
    assert len(h.tokens("fill")) == 96 and h.finish("fill") is FinishReason.LENGTH
    off = harness(output_length_distribution="off")
    off.add("r", max_tokens=600, eos_token_id=EOS)
    off.run()
    assert len(off.tokens("r")) == 600 and off.finish("r") is FinishReason.LENGTH


def test_max_tokens_caps_the_draw_with_length(harness):
    h = harness(output_length_mean=500, output_length_std_dev=0)
    h.add("short", max_tokens=20, eos_token_id=EOS)
    h.add("long", max_tokens=800, eos_token_id=EOS)
    h.run()
    assert len(h.tokens("short")) == 20 and h.finish("short") is FinishReason.LENGTH
    assert len(h.tokens("long")) == 500 and h.finish("long") is FinishReason.STOP


def test_a_config_patch_applies_to_the_next_arrival(harness):
    h = harness(output_length_mean=50, output_length_std_dev=0)
    h.add("before", max_tokens=None, eos_token_id=EOS)
    h.run()
    h.core.patch_config({"output_length_distribution": "histogram", "output_length_histogram": "12:1"})
    h.add("after", max_tokens=None, eos_token_id=EOS)
    h.run()
    assert lengths_of(h, ["before", "after"]) == [50, 12]


def test_a_request_seed_and_greedy_fix_the_length(harness):
    def run(**sp):
        h = harness(seed=3)
        h.add("other", max_tokens=None, eos_token_id=EOS)  # consumes the engine's own sequence
        h.add("r", max_tokens=None, eos_token_id=EOS, prompt=[1, 2, 3], **sp)
        h.run()
        return h.tokens("r")

    assert run(seed=11) == run(seed=11)
    assert run(seed=11) != run(seed=12)
    assert run(temperature=0.0) == run(temperature=0.0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mean=st.integers(1, 300), std=st.integers(0, 300), dist=st.sampled_from(["lognormal", "normal"]),
       reqs=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 400), st.integers(0, 2**32)), min_size=1,
                     max_size=12))
def test_lengths_stay_in_bounds_and_repeat_per_seed(mean, std, dist, reqs):
    def run():
        h = Harness(output_length_distribution=dist, output_length_mean=mean, output_length_std_dev=std,
                    kv_cache_size=4096)
        for i, (min_tokens, max_tokens, seed) in enumerate(reqs):
            h.add(f"r{i}", max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens), seed=seed,
                  eos_token_id=EOS)
        h.run()
        return h

    h, again = run(), run()
    for i, (min_tokens, max_tokens, _) in enumerate(reqs):
        rid = f"r{i}"
        toks = h.tokens(rid)
        assert min(min_tokens, max_tokens) <= len(toks) <= max_tokens
        assert toks == again.tokens(rid)
        if h.finish(rid) is FinishReason.STOP:
            assert toks[-1] == EOS and len(toks) < max_tokens
        else:
            assert h.finish(rid) is FinishReason.LENGTH and len(toks) == max_tokens


# --- logit_bias and allowed_token_ids -----------------------------------------------------------
def draw(n=4000, **kw) -> list[int]:
    args = {"ending": frozenset({EOS}), "min_tokens": 0, "bias": None, "allowed": None, **kw}
    src = BiasedTokens(random.Random(0), 1000, args["ending"], args["min_tokens"], args["bias"], args["allowed"])
    return [src.next_token(i) for i in range(n)]


def test_allowed_ids_restrict_the_draw_and_bias_weighs_them():
    ids = draw(allowed=[3, 4, 5], bias={5: 2.0, 4: -100})
    assert set(ids) == {3, 5}
    assert ids.count(5) / len(ids) == pytest.approx(7.389 / 8.389, abs=0.02)  # exp(2) : 1


def test_a_large_bias_makes_a_token_likely_and_minus_100_excludes_it():
    ids = draw(bias={42: 10.0, 43: -100})
    assert ids.count(42) / len(ids) == pytest.approx(22026 / (22026 + 998), abs=0.02)
    assert 43 not in ids and EOS not in ids
    assert set(draw(bias={i: -100 for i in range(1000) if i != 9})) == {9}  # a mostly excluded vocabulary


def test_ending_ids_are_drawn_only_when_named_and_never_before_min_tokens():
    ids = draw(n=200, bias={EOS: 100}, min_tokens=5)
    assert EOS not in ids[:5] and set(ids[5:]) == {EOS}
    assert EOS in draw(n=200, allowed=[1, EOS])


def test_allowed_ids_without_eos_run_to_max_tokens(harness):
    h = harness(output_length_mean=5, output_length_std_dev=0)
    h.add("r", max_tokens=40, eos_token_id=EOS, allowed_token_ids=[100, 101, 102])
    h.add("masked", max_tokens=40, eos_token_id=EOS, logit_bias={EOS: -100})
    h.run()
    assert set(h.tokens("r")) <= {100, 101, 102} and len(h.tokens("r")) == 40
    assert len(h.tokens("masked")) == 40 and h.finish("masked") is FinishReason.LENGTH


def test_a_biased_stop_token_id_ends_the_stream_after_min_tokens(harness):
    h = harness(output_length_distribution="off")
    h.add("r", max_tokens=50, eos_token_id=EOS, stop_token_ids=[500], logit_bias={500: 100}, min_tokens=3)
    h.run()
    out = [o for _, o in h.outputs("r") if o.finish_reason is not None][-1]
    assert h.tokens("r")[-1] == 500 and len(h.tokens("r")) == 4
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == 500


def test_greedy_with_a_bias_is_deterministic(harness):
    def run():
        h = harness()
        h.add("r", max_tokens=30, prompt=[5, 6], temperature=0.0, logit_bias={11: 10.0, 12: 10.0})
        h.run()
        return h.tokens("r")

    assert run() == run() and {11, 12} & set(run())


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mean=st.integers(8, 60), spread=st.floats(0.0, 0.5), dist=st.sampled_from(["lognormal", "normal"]),
       seed=st.integers(0, 2**16))
def test_engine_lengths_have_the_configured_mean(mean, spread, dist, seed):
    std = mean * spread  # (a normal's resampling below 1 would move the mean of a wider one)
    n = 150
    h = Harness(output_length_distribution=dist, output_length_mean=mean, output_length_std_dev=std, seed=seed)
    for i in range(n):
        h.add(f"r{i}", max_tokens=None, eos_token_id=EOS)
    h.run()
    lengths = lengths_of(h, [f"r{i}" for i in range(n)])
    assert abs(statistics.fmean(lengths) - mean) <= 4 * std / n ** 0.5 + 0.5


def test_a_source_that_writes_the_whole_answer_is_not_cut_by_the_modeled_length(harness):
    """A token source from the factory (play's tool call read from the prompt, a constrained
    answer) ends with its own EOS; the modeled length (here always 5) must not cut it short."""
    from vllm_vcr.engine.tokens import ScriptedTokens

    answer = [100 + i for i in range(30)] + [EOS]

    class EosAfter:
        def next_token(self, index: int) -> int:
            return EOS

    h = harness(output_length_mean=5, output_length_std_dev=0)
    h.core.admission.token_source_factory = lambda req, rng: (
        ScriptedTokens(answer, EosAfter()) if req.request_id == "call" else None)
    h.add("call", max_tokens=200, eos_token_id=EOS)
    h.add("text", max_tokens=200, eos_token_id=EOS)
    h.run()
    assert h.tokens("call") == answer and h.finish("call") is FinishReason.STOP
    assert len(h.tokens("text")) == 5 and h.finish("text") is FinishReason.STOP
