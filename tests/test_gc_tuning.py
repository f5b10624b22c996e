"""The serving processes' garbage-collector settings."""

import gc

from vllm_vcr.gc_tuning import YOUNG_THRESHOLD, tune_for_serving


def test_tune_for_serving_freezes_the_heap_and_raises_the_young_threshold():
    before = gc.get_threshold()
    try:
        tune_for_serving()
        assert gc.get_threshold() == (YOUNG_THRESHOLD, before[1], before[2])
        assert gc.get_freeze_count() > 0  # the start-up heap is out of the collector's sight
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
