"""A simulation collects cycles rarely while it runs and leaves the collector as it found it: the
same thresholds, and a heap the process froze stays frozen. What the run still holds when it ends
goes to the oldest generation without a young collection walking it, and cyclic garbage among it
is still found by a full collection."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from pathlib import Path

import pytest

from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.simulate import driver as driver_mod
from vllm_vcr.simulate.driver import Simulation
from vllm_vcr.simulate.router import make_router
from vllm_vcr.simulate.workload import LengthDist, SyntheticWorkload
from vllm_vcr.testing.waits import scaled

from ..engine.test_decode_cohort import _latency


def _simulate(monkeypatch) -> Simulation:
    monkeypatch.setattr(driver_mod, "engine_inputs", lambda a: {"latency": _latency()})
    args = EngineArgs(config=EngineConfig(max_num_seqs=8, max_num_batched_tokens=256), kv_cache_size=400,
                      tokens_per_block=4, advertised_max_model_len=1 << 16).validate()
    wl = SyntheticWorkload(num_requests=40, isl=LengthDist("fixed", 60), osl=LengthDist("fixed", 30), concurrency=8)
    return Simulation(args, 1, make_router("round_robin", 1, block_size=4, capacity_blocks=400), wl,
                      concurrency=8, timing_only=True).run()


def check_promotion() -> None:
    """The run in a process whose heap nothing froze (a test session may have: serve's start-up
    freezes its heap, gc_tuning.py)."""
    assert gc.get_freeze_count() == 0
    mp = pytest.MonkeyPatch()
    before = gc.get_threshold()
    gc.collect()
    try:
        sim = _simulate(mp)
    finally:
        mp.undo()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
    assert gc.get_count()[0] < before[0]  # (no young collection pending over the run's objects)
    # what the run holds is in the oldest generation already (left alone, a young collection would
    # only have moved it to the middle one)
    assert any(o is sim.cores[0] for o in gc.get_objects(generation=2))
    assert len(sim.done) == 40
    core = weakref.ref(sim.cores[0])
    del sim
    gc.collect()
    assert core() is None  # the engines' cycles are still garbage to a full collection


def test_the_run_leaves_the_thresholds_and_promotes_what_it_holds():
    root = Path(__file__).resolve().parents[2]
    code = "from tests.simulate.test_run_gc import check_promotion; check_promotion()"
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                       timeout=scaled(120))
    assert r.returncode == 0, r.stdout + r.stderr


class _Sentinel:
    pass


def test_a_frozen_heap_stays_frozen(monkeypatch):
    gc.collect()
    sentinel = _Sentinel()
    gc.freeze()
    try:
        assert not any(o is sentinel for o in gc.get_objects())  # (the permanent generation is not listed)
        before = gc.get_threshold()
        sim = _simulate(monkeypatch)
        assert not any(o is sentinel for o in gc.get_objects())
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == before
        assert len(sim.done) == 40
    finally:
        gc.unfreeze()
    assert any(o is sentinel for o in gc.get_objects())
