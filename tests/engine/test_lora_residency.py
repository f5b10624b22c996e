"""engine/lora.py: vLLM's max_loras admission rule and the LRU adapter caches as step time."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_vcr.engine.lora import LoRAResidency, admissible


def test_admissible_follows_the_batch_adapters():
    assert admissible(None, {1, 2}, 2) and admissible(0, {1, 2}, 2)  # base model requests always fit
    assert admissible(1, {1, 2}, 2)  # an adapter already in the batch
    assert not admissible(3, {1, 2}, 2)  # a third adapter with max_loras 2 waits
    assert admissible(3, {1}, 2)


def test_first_use_loads_swap_in_from_cpu_pool():
    r = LoRAResidency(max_loras=1, max_cpu_loras=2, load_time=0.5, swap_in_time=0.1)
    assert r.activate([1]) == pytest.approx(0.6)  # disk -> CPU -> GPU
    assert r.activate([1]) == 0.0  # resident
    assert r.activate([2]) == pytest.approx(0.6)  # evicts 1 from the only GPU slot, keeps it in the CPU pool
    assert r.activate([1]) == pytest.approx(0.1)  # swap-in from the CPU pool
    assert r.activate([3]) == pytest.approx(0.6)  # CPU pool of 2: the least recent (2) is dropped
    assert r.activate([2]) == pytest.approx(0.6)  # so 2 loads from disk again
    assert (r.loads, r.swap_ins) == (4, 1)


def test_cpu_pool_must_hold_the_slots():
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAResidency(2, 1, 0.0, 0.0)


@given(st.integers(1, 4), st.integers(0, 4), st.lists(st.lists(st.integers(1, 8), max_size=4), max_size=30))
def test_caches_stay_bounded_and_nested(max_loras, extra_cpu, batches):
    r = LoRAResidency(max_loras, max_loras + extra_cpu, load_time=1.0, swap_in_time=0.25)
    for batch in batches:
        batch = list(dict.fromkeys(batch))[:max_loras]  # the scheduler never exceeds max_loras
        before_gpu, before_cpu = set(r.gpu), set(r.cpu)
        cost = r.activate(batch)
        expected = sum(0 if i in before_gpu else 0.25 if i in before_cpu else 1.25 for i in batch)
        assert cost == pytest.approx(expected)
        assert set(batch) <= set(r.gpu) and len(r.gpu) <= max_loras
        assert set(r.gpu) <= set(r.cpu) and len(r.cpu) <= max_loras + extra_cpu
