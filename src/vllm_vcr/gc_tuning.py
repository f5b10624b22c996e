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


def tune_for_serving() -> None:
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
