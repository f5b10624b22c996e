#!/usr/bin/env python3
"""When in a run the long inter-token gaps happened: a timeline of a `stream_bench.py --stamps` file.

A closed loop of C streams started together stays in step: the C requests end at about the same
time and the next C arrive together, so a run of N = k x C requests has k arrival waves. This
prints, per time window, the one-token gaps that ended in it, how many were longer than
`--long-ms`, and how many requests were sent; then the one-token ITL p99 of the whole run and of
the gaps that ended away from any arrival (no request sent in the `--settle` seconds before).

usage: python bench/itl_timeline.py STAMPS [--window 0.25] [--long-ms 30] [--settle 0.5]
"""

from __future__ import annotations

import argparse
import collections
import json

from stream_bench import SETTLE_S, away_from_sends, percentile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stamps", help="the file stream_bench.py --stamps wrote")
    ap.add_argument("--window", type=float, default=0.25, help="seconds per timeline row")
    ap.add_argument("--long-ms", type=float, default=30.0, help="a gap longer than this counts as long")
    ap.add_argument("--settle", type=float, default=SETTLE_S,
                    help="a gap is away from arrivals when no request was sent in this many seconds before its end")
    a = ap.parse_args()
    recs = [json.loads(line) for line in open(a.stamps)]
    start = min(r["t0"] for r in recs)
    sends = sorted(r["t0"] - start for r in recs)
    gaps: list[tuple[float, float]] = []  # (end time, ms) of one-token gaps
    for r in recs:
        st, k = r["stamps"], r["ktoks"]
        gaps += [(st[i] - start, (st[i] - st[i - 1]) * 1e3) for i in range(1, len(st)) if k[i] == 1]
    rows: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for t, ms in gaps:
        row = rows[int(t / a.window)]
        row[0] += 1
        row[1] += ms > a.long_ms
    for t in sends:
        rows[int(t / a.window)][2] += 1
    print(f"{'from s':>7} {'gaps':>7} {'> ' + str(a.long_ms) + ' ms':>9} {'sent':>6}")
    for w in sorted(rows):
        n, long_, sent = rows[w]
        print(f"{w * a.window:7.2f} {n:7d} {long_:9d} {sent:6d}")

    every = sorted(ms for _, ms in gaps)
    calm = sorted(ms for t, ms in gaps if away_from_sends(sends, t, a.settle))
    print(f"one-token ITL p99: {percentile(every, 99) or 0:.2f} ms over {len(every)} gaps; "
          f"away from arrivals: {percentile(calm, 99) or 0:.2f} ms over {len(calm)} gaps "
          f"(p99.9 {percentile(calm, 99.9) or 0:.2f})")


if __name__ == "__main__":
    main()
