"""Garbage-collector settings for a serving process (serve, play).

Streaming allocates many short-lived objects per step (outputs, token lists, SSE chunks) and
creates few reference cycles, so CPython's default (a young collection every 700 allocations,
each promoting survivors towards full collections over the whole heap) costs 10-20 % of a busy
server's CPU (W1 in docs/benchmarks.md). Freezing the start-up heap (imports, tokenizer tables,
config) takes it out of every later collection, as vLLM does after start-up (its
`freeze_gc_heap`); a larger young threshold makes collections rarer. Reference counting frees
almost everything at once: a finished request of `serve` leaves no reference cycle
(tests/http/test_reference_cycles.py). Each used to leave one (uvicorn's request cycle and the
scope holding its `send`, 11 objects), and at W2 C=1000 the young generation then reached the
threshold every few seconds; a young collection walks every object allocated since the last one
that is still alive, which under load is every open stream's state: 64-96 ms with the loop held
(docs/benchmarks.md, "Where the ITL tail went"). Peak RSS in the benchmarks did not move (103 MB
W1, 137 MB W2 C=1000).
"""

from __future__ import annotations

import gc

# A young collection under load walks every open stream's state (it was all allocated since the
# last one), however many allocations triggered it: the pause is the same at any threshold, and a
# higher one makes it rarer. With requests leaving no cycles, 200k instead of 50k took the
# mid-run 60-70 ms collections out of W2 C=1000's ten seconds (docs/benchmarks.md); cyclic
# garbage, where there is some (errors, aborts), waits at most that many allocations longer.
YOUNG_THRESHOLD = 200_000
# A young collection's pause grows with what it walks: a burst of new streams leaves tens of
# thousands of live objects in the young generation, and a collection at the threshold then holds
# the loop 10-25 ms, at whatever moment it falls (often when the burst's first tokens are due).
# An engine about to sleep for at least IDLE_GAP_S collects early, while the pause is ~1-4 ms and
# costs nobody a deadline.
IDLE_GAP_S = 0.005
IDLE_YOUNG_COUNT = 10_000
# ... but only into a sleep the collection fits in: it walks every young object still alive, 0.1-0.8
# µs each at W2 C=1000 (cold ones the most), and a walk of 100k objects in a 5 ms sleep held the
# loop 46-61 ms past it, with the last streams' tokens due (docs/benchmarks.md)
PAUSE_PER_YOUNG_OBJECT_S = 1e-6


def tune_for_serving() -> None:
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)


def collect_while_idle(gap: float) -> None:
    """An engine will sleep `gap` seconds: the collection the allocations made so far would soon
    bring, now, if it fits in the sleep (EngineCore's `on_idle`). The generation is the one the
    interpreter would pick."""
    if gap < IDLE_GAP_S:  # (the usual case under load: keep it one comparison)
        return
    young, older, _ = gc.get_count()
    if young < IDLE_YOUNG_COUNT or young * PAUSE_PER_YOUNG_OBJECT_S > gap:
        return
    gc.collect(1 if older + 1 >= gc.get_threshold()[1] else 0)
