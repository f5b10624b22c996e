#!/usr/bin/env python3
"""Summarise a `py-spy record --format raw` file: top self-time lines and top inclusive functions.

usage: profile_summary.py PROFILE.txt [--top 25] [--filter vllm_vcr]

The raw format is one collapsed stack per line, `frame;frame;...;leaf COUNT`, each frame
`function (file:line)`. Self time is charged to the leaf frame; inclusive time to every distinct
function on the stack. `--filter` also reports, per sample, the innermost frame whose file
matches (time spent in our code including the library calls it makes).
"""

from __future__ import annotations

import argparse
import collections
import linecache
import re

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def parse(path: str):
    for raw in open(path, encoding="utf-8", errors="replace"):
        raw = raw.rstrip("\n")
        if not raw:
            continue
        stack, _, count = raw.rpartition(" ")
        try:
            n = int(count)
        except ValueError:
            continue
        yield stack.split(";"), n


def short(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    f = m.group("file")
    for marker in ("site-packages/", "src/", "lib/python3.11/"):
        i = f.find(marker)
        if i >= 0:
            f = f[i + len(marker):]
            break
    return f"{m.group('func')} ({f}:{m.group('line') or '?'})"


def source(frame: str) -> str:
    """The source text of a frame's line, read now (profile right after recording: files change)."""
    m = _FRAME.match(frame)
    if not m or not m.group("line"):
        return ""
    return linecache.getline(m.group("file"), int(m.group("line"))).strip()[:90]


def func_key(frame: str) -> str:
    # function identity without the line number, for inclusive totals
    m = _FRAME.match(frame)
    if not m:
        return frame
    return short(f"{m.group('func')} ({m.group('file')})").rsplit(":", 1)[0] + ")"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--filter", default="vllm_vcr")
    a = ap.parse_args()
    src: dict[str, str] = {}
    self_t: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    ours: collections.Counter = collections.Counter()
    total = 0
    for stack, n in parse(a.profile):
        total += n
        # py-spy puts the thread name first and the leaf last
        self_t[short(stack[-1])] += n
        src.setdefault(short(stack[-1]), source(stack[-1]))
        for k in {func_key(f) for f in stack[1:]}:
            incl[k] += n
        for f in reversed(stack):
            if a.filter in f:
                ours[short(f)] += n
                src.setdefault(short(f), source(f))
                break
    if not total:
        print("no samples")
        return 1
    print(f"{total} samples")
    print(f"\n== top self time (leaf frame) ==")
    for k, n in self_t.most_common(a.top):
        print(f"{100 * n / total:5.1f}%  {k}    | {src.get(k, '')}")
    print(f"\n== top inclusive functions ==")
    for k, n in incl.most_common(a.top):
        print(f"{100 * n / total:5.1f}%  {k}")
    print(f"\n== innermost frame in '{a.filter}' (our line responsible, library time included) ==")
    for k, n in ours.most_common(a.top):
        print(f"{100 * n / total:5.1f}%  {k}    | {src.get(k, '')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
