#!/usr/bin/env python3
"""Where an opening burst's TTFT goes, from both ends: the client's sends and first events
(`stream_bench.py --stamps`, one file per burst round) against the server's arrival stamps and
engine hand-offs (`serve_arrival_log.py --log`).

Requests are matched by rank (the i-th send of a round with the i-th arrival stamp in it): on
loopback a burst's requests arrive in the order they were sent, give or take the few that two
connections race for; the lag columns are therefore rank lags. Per round, and per quarter of the
round's sends: send -> arrival stamp (the server's delay before it notes a request), arrival
stamp -> engine (its parsing, templating and tokenizing, absorbed by the configured TTFT), and the
client's TTFT.

usage: python bench/arrival_lag.py --server-log FILE ROUND1.stamps [ROUND2.stamps ...]
"""

from __future__ import annotations

import argparse
import json

from stream_bench import percentile


def p50_p90(values: list[float]) -> tuple[float, float]:
    s = sorted(values)
    return percentile(s, 50) or 0.0, percentile(s, 90) or 0.0


def lag_rows(server: list[tuple[float, float]], rounds: list[list[dict]], parts: int = 4) -> list[dict]:
    """Per round (a list of stream_bench stamp records), per part of its sends and for the whole
    round: send -> arrival stamp, arrival stamp -> engine and TTFT, p50 and p90, in ms."""
    server = sorted(server)
    out = []
    for k, recs in enumerate(rounds, 1):
        sent = sorted((r for r in recs if r["stamps"]), key=lambda r: r["t0"])
        first, last = sent[0]["t0"], sent[-1]["t0"]
        # a round's arrivals: stamped no earlier than its first send, before its first response
        arrived = [s for s in server if first - 1e-3 <= s[0] <= last + 0.05][:len(sent)]
        size = max(1, len(arrived) // parts)
        for part in range(parts + 1):  # the last row: the whole round
            idx = range(len(arrived)) if part == parts else range(part * size, min((part + 1) * size, len(arrived)))
            lag = [(arrived[i][0] - sent[i]["t0"]) * 1e3 for i in idx]
            engine = [(arrived[i][1] - arrived[i][0]) * 1e3 for i in idx]
            ttft = [(sent[i]["stamps"][0] - sent[i]["t0"]) * 1e3 for i in idx]
            out.append({"round": k, "part": "all" if part == parts else f"q{part + 1}", "n": len(idx),
                        "stamp_lag": p50_p90(lag), "to_engine": p50_p90(engine), "ttft": p50_p90(ttft)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server-log", required=True, help="the file serve_arrival_log.py --log wrote")
    ap.add_argument("rounds", nargs="+", help="stream_bench.py --stamps files, one per burst round")
    ap.add_argument("--parts", type=int, default=4, help="split each round's sends into this many parts")
    a = ap.parse_args()
    server = [tuple(json.loads(line)) for line in open(a.server_log)]
    rounds = [[json.loads(line) for line in open(path)] for path in a.rounds]
    print(f"{'round':>5} {'part':>4} {'n':>4} | {'send->stamp ms p50':>18} {'p90':>6} | "
          f"{'stamp->engine p50':>17} {'p90':>6} | {'TTFT p50':>8} {'p90':>6}")
    for r in lag_rows(server, rounds, a.parts):
        (l50, l90), (e50, e90), (t50, t90) = r["stamp_lag"], r["to_engine"], r["ttft"]
        print(f"{r['round']:5d} {r['part']:>4} {r['n']:4d} | {l50:18.2f} {l90:6.2f} | "
              f"{e50:17.2f} {e90:6.2f} | {t50:8.2f} {t90:6.2f}")


if __name__ == "__main__":
    main()
