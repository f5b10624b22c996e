"""Garbage-collector settings for a serving process (serve, play).

Streaming allocates many short-lived objects per step (outputs, token lists, SSE chunks) and
creates few reference cycles, so CPython's default (a young collection every 700 allocations,
each promoting survivors towards full collections over the whole heap) costs 10-20 % of a busy
server's CPU (W1 in docs/benchmarks.md). Freezing the start-up heap (imports, tokenizer tables,
config) takes it out of every later collection, as vLLM does after start-up (its
`freeze_gc_heap`); a larger young threshold makes collections rarer. Reference counting still
frees almost everything at once, and the cycles there are (asyncio tasks and futures) are still
collected many times a second under load: peak RSS in the benchmarks did not move (103 MB W1,
137 MB W2 C=1000).
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000
# A young collection's pause grows with what it walks: a burst of new streams leaves tens of
# thousands of live objects in the young generation, and a collection at the threshold then holds
# the loop 10-25 ms, at whatever moment it falls (often when the burst's first tokens are due).
# An engine about to sleep for at least IDLE_GAP_S collects early, while the pause is ~1-4 ms and
# costs nobody a deadline.
IDLE_GAP_S = 0.005
IDLE_YOUNG_COUNT = 10_000


def tune_for_serving() -> None:
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)


def collect_while_idle(gap: float) -> None:
    """An engine will sleep `gap` seconds: the collection the allocations made so far would soon
    bring, now (EngineCore's `on_idle`). The generation is the one the interpreter would pick."""
    if gap < IDLE_GAP_S:  # (the usual case under load: keep it one comparison)
        return
    young, older, _ = gc.get_count()
    if young < IDLE_YOUNG_COUNT:
        return
    gc.collect(1 if older + 1 >= gc.get_threshold()[1] else 0)
