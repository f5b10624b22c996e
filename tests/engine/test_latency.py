import random

import pytest

from vllm_vcr.engine.config import EngineConfig
from vllm_vcr.engine.latency import KnobLatency, truncnorm


def test_ttft_and_itl_are_exact_on_the_virtual_clock(harness):
    h = harness(time_to_first_token=100, inter_token_latency=20)
    h.add("r", max_tokens=5)
    h.run()
    times = h.emission_times("r")
    assert times[0] == pytest.approx(0.100)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert gaps == pytest.approx([0.020] * 4)
    assert h.finish("r").name == "LENGTH"


def test_sub_millisecond_latencies_are_not_truncated(harness):
    h = harness(time_to_first_token=0.4, inter_token_latency=0.25)
    h.add("r", max_tokens=3)
    h.run()
    t = h.emission_times("r")
    assert t[0] == pytest.approx(0.0004, abs=2e-4)
    assert t[2] - t[0] == pytest.approx(0.0005, abs=2e-4)


def test_prefill_model_charges_uncached_tokens(harness):
    h = harness(prefill_overhead=10, prefill_time_per_token=1.0, tokens_per_block=16)
    h.add("a", prompt_len=64)
    h.run()
    assert h.emission_times("a")[0] == pytest.approx(0.010 + 0.064)
    # same prompt again: 48 of 64 tokens are cached (the last block is always recomputed)
    t0 = h.clock.now()
    h.add("b", prompt=h.prompt_of("a", 64))
    h.run()
    assert h.emission_times("b")[0] - t0 == pytest.approx(0.010 + 0.016)
    first = [o for _, o in h.outputs("b")][0]
    assert first.prefill_stats.num_cached_tokens == 48


def test_time_scale_divides_every_delay(harness):
    h = harness(time_to_first_token=100, inter_token_latency=20, time_scale=10.0)
    h.add("r", max_tokens=3)
    h.run()
    t = h.emission_times("r")
    assert t[0] == pytest.approx(0.010)
    assert t[2] - t[1] == pytest.approx(0.002)


@pytest.mark.parametrize("running,expected", [(1, 1.0), (2, 1.25), (3, 1.5), (5, 2.0), (50, 2.0)])
def test_load_factor_is_linear_to_max_num_seqs(running, expected):
    k = KnobLatency(EngineConfig(time_factor_under_load=2.0, max_num_seqs=5))
    assert k.load_factor(running) == pytest.approx(expected)


def test_load_factor_is_one_with_a_single_seat():
    assert KnobLatency(EngineConfig(time_factor_under_load=3.0, max_num_seqs=1)).load_factor(10) == 1.0


def test_pacing_is_fixed_at_admission_under_load(harness):
    h = harness(inter_token_latency=10, time_factor_under_load=2.0, max_num_seqs=3, time_to_first_token=1)
    for i in range(3):
        h.add(f"r{i}", max_tokens=3)
    h.run()
    # admitted in one step with 0, 1 and 2 already running: factors 1.0, 1.5, 2.0
    gaps = [h.emission_times(f"r{i}")[1] - h.emission_times(f"r{i}")[0] for i in range(3)]
    assert gaps == pytest.approx([0.010, 0.015, 0.020])


def test_truncnorm_is_clamped_and_exact_without_std():
    rng = random.Random(1)
    assert truncnorm(rng, 20.0, 0.0) == 20.0
    draws = [truncnorm(rng, 20.0, 50.0) for _ in range(2000)]
    assert min(draws) >= 6.0 and max(draws) <= 34.0
    assert 15 < sum(draws) / len(draws) < 25


def test_itl_std_dev_varies_gaps_around_the_mean(harness):
    h = harness(inter_token_latency=20, inter_token_latency_std_dev=5)
    h.add("r", max_tokens=200)
    h.run()
    t = h.emission_times("r")
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert len(set(round(g, 6) for g in gaps)) > 10
    assert sum(gaps) / len(gaps) == pytest.approx(0.020, rel=0.1)
