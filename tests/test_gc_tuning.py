"""The serving processes' garbage-collector settings."""

import contextlib
import gc

from vllm_vcr.gc_tuning import (
    IDLE_GAP_S,
    IDLE_YOUNG_COUNT,
    PAUSE_PER_YOUNG_OBJECT_S,
    YOUNG_THRESHOLD,
    collect_while_idle,
    tune_for_serving,
)


def test_tune_for_serving_freezes_the_heap_and_raises_the_young_threshold():
    before = gc.get_threshold()
    try:
        tune_for_serving()
        assert gc.get_threshold() == (YOUNG_THRESHOLD, before[1], before[2])
        assert gc.get_freeze_count() > 0  # the start-up heap is out of the collector's sight
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def _collections(fn) -> list[int]:
    """The generations collected while fn runs."""
    seen: list[int] = []

    def cb(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(cb)
    try:
        fn()
    finally:
        gc.callbacks.remove(cb)
    return seen


@contextlib.contextmanager
def _thresholds(young: int, older: int):
    """The collector's thresholds for the block (no automatic old collection), from an empty young
    generation; restored after."""
    before = gc.get_threshold()
    gc.set_threshold(young, older, 1000)
    try:
        gc.collect()
        yield
    finally:
        gc.set_threshold(*before)


def test_an_idle_engine_collects_the_young_generation_once_it_is_large():
    with _thresholds(10 * IDLE_YOUNG_COUNT, 1000):  # no automatic collection in this test
        live = [[] for _ in range(IDLE_YOUNG_COUNT + 100)]  # tracked objects that survive
        assert _collections(lambda: collect_while_idle(IDLE_GAP_S / 2)) == []  # too short a sleep
        fits = max(IDLE_GAP_S, 2 * len(live) * PAUSE_PER_YOUNG_OBJECT_S)
        assert _collections(lambda: collect_while_idle(fits)) == [0]
        assert gc.get_count()[0] < IDLE_YOUNG_COUNT
        assert _collections(lambda: collect_while_idle(float("inf"))) == []  # nothing young left
        del live


def test_a_young_generation_whose_walk_would_outlast_the_sleep_waits():
    with _thresholds(10 * IDLE_YOUNG_COUNT, 1000):
        live = [[] for _ in range(4 * IDLE_YOUNG_COUNT)]
        walk = len(live) * PAUSE_PER_YOUNG_OBJECT_S
        assert walk > IDLE_GAP_S  # (a sleep long enough by the first rule)
        assert _collections(lambda: collect_while_idle(walk / 2)) == []
        assert _collections(lambda: collect_while_idle(2 * walk)) == [0]
        del live


def test_it_collects_the_generation_the_interpreter_would_pick():
    with _thresholds(10 * IDLE_YOUNG_COUNT, 2):
        live = [[] for _ in range(IDLE_YOUNG_COUNT + 100)]
        assert _collections(lambda: collect_while_idle(1.0)) == [0]  # one young collection so far
        live += [[] for _ in range(IDLE_YOUNG_COUNT + 100)]
        assert _collections(lambda: collect_while_idle(1.0)) == [1]  # the second takes the older one along
        del live
