"""Multi-turn sessions inferred from prefix chains, so replay sends turns in order.

A record's parent is the most recent earlier record (by arrival) whose full `block_hashes` chain
is a proper prefix of its own: the previous turn of the same conversation. A child is sent at its
recorded offset, but never before its parent finished plus the recorded think time.
"""

from __future__ import annotations

from ..trace.schema import TraceRecord


def find_parents(records: list[TraceRecord]) -> list[int | None]:
    """`records` in replay order (by arrival); returns the parent index of each, or None."""
    # Hashes are chained, so a chain's last hash identifies the whole chain: key on it.
    by_last: dict[int, int] = {}  # last hash of a full chain -> latest record with that chain
    parents: list[int | None] = []
    for i, rec in enumerate(records):
        chain = rec.block_hashes or []
        parent = None
        for k in range(len(chain) - 2, -1, -1):  # longest proper prefix first
            j = by_last.get(chain[k])
            if j is not None:
                parent = j
                break
        parents.append(parent)
        if chain:
            by_last[chain[-1]] = i
    return parents


def think_gap_ms(parent: TraceRecord, child: TraceRecord) -> float:
    """Recorded time between the parent's last token and the child's arrival (>= 0)."""
    if parent.arrival_ms is None or child.arrival_ms is None:
        return 0.0
    return max(child.arrival_ms - (parent.arrival_ms + parent.latency_ms()), 0.0)
