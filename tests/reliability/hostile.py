"""Hostile strings and header values (hypothesis strategies), and a strict reader of SSE streams,
shared by the reliability suite's fuzzers."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from hypothesis import strategies as st

# What the fuzzers counted in this run (requests fuzzed, events parsed, 5xx, invalid events, the
# longest loop stall, ...); tests/reliability/conftest.py prints it at the end.
FIGURES: Counter = Counter()

# -- strings a client may put in any field of a JSON body -----------------------------------------

SPECIAL = ['"', "\\", '\\"', '"\\', "\\u0000", "\\n", "%", "%s", "%d", "%%", "%(x)s", "%b", "{}", "{0}", "</",
           "</script>", "<!--", "]]>", "'", "é", "中", "😀", "\u2028", "\u2029", "\ufeff", "\x7f", "\x80",
           "data: ", "\n\n", "\r\n", "[DONE]"] + [chr(c) for c in range(0x20)]
# any character but a lone surrogate (valid JSON can spell one, UTF-8 cannot carry it)
ANY_CHAR = st.characters(blacklist_categories=("Cs",))
hostile = st.lists(st.one_of(st.sampled_from(SPECIAL), st.text(ANY_CHAR, min_size=1, max_size=3)),
                   min_size=1, max_size=6).map("".join)
# one character that a stop string can be without holding text back
hostile_char = st.one_of(st.sampled_from([s for s in SPECIAL if len(s) == 1]), ANY_CHAR)
# now and then a long one (kilobytes of the same)
hostile_or_long = st.one_of(hostile, hostile, hostile, hostile, hostile,
                            st.tuples(hostile, st.integers(50, 1000)).map(lambda t: (t[0] * t[1])[:1500]))

# -- header values --------------------------------------------------------------------------------

# latin-1 only; no CR/LF/NUL/DEL, no leading or trailing blanks (HTTP strips them)
ASCII_HEADER_CHARS = [chr(c) for c in range(0x20, 0x7F)] + ["\t"]
LATIN1_HEADER_CHARS = ASCII_HEADER_CHARS + [chr(c) for c in range(0x80, 0x100)]
HEADER_SPECIAL = ['"', "\\", '\\"', "%", "%s", "%d", "%%", "</", "'", "{", "}"]


def header_values(chars: list[str], special: list[str]) -> st.SearchStrategy[str]:
    return (st.lists(st.one_of(st.sampled_from(special), st.sampled_from(chars)), min_size=1, max_size=12)
            .map(lambda parts: "".join(parts).strip(" \t")).filter(bool))


hostile_header = header_values(LATIN1_HEADER_CHARS, HEADER_SPECIAL + ["é", "\x85", "\xff"])
ascii_header = header_values(ASCII_HEADER_CHARS, HEADER_SPECIAL)  # what the SDKs take as a header value

# Raw header bytes as a client on a socket can send them: every byte but CR and LF (which end the
# line), control characters and NUL included, UTF-8 text, and values of many kilobytes.
_RAW_PIECES = [b'"', b"\\", b'\\"', b"%s", b"%%", b"'", b"{", b"}", b"</", b"\t", b" ", b"\x00", b"\x01", b"\x1b",
               b"\x1f", b"\x7f", b"\x80", b"\xff", "é".encode(), "中".encode(), "😀".encode(), b"Bearer ",
               b"data: ", b",", b";", b"="]
raw_header_value = st.one_of(
    st.lists(st.one_of(st.sampled_from(_RAW_PIECES), st.binary(min_size=1, max_size=4)), min_size=1, max_size=10)
    .map(b"".join),
    st.tuples(st.sampled_from(_RAW_PIECES), st.integers(1000, 20000)).map(lambda t: t[0] * t[1]),
).map(lambda v: v.replace(b"\r", b"").replace(b"\n", b""))


# -- a strict reader of server-sent events -------------------------------------------------------

DONE = "[DONE]"


class InvalidEvent(AssertionError):
    """A streamed event that is not what SSE and JSON allow."""


def parse_sse(raw: bytes) -> list[tuple[str | None, Any]]:
    """Every event of an SSE body as (event name, parsed JSON data or DONE). Raises InvalidEvent on
    invalid UTF-8, a line that is neither `event: ` nor `data: `, data that is not strict JSON (raw
    control characters included), anything after `data: [DONE]`, or a body not ending in a blank line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidEvent(f"stream is not UTF-8 ({e}): {raw[max(0, e.start - 100):e.end + 100]!r}") from None
    if not text:
        return []
    if not text.endswith("\n\n"):
        raise InvalidEvent(f"stream does not end with a blank line: {text[-200:]!r}")
    out: list[tuple[str | None, Any]] = []
    for block in text[:-2].split("\n\n"):
        name = None
        for line in block.split("\n"):
            if out and out[-1][1] == DONE:
                raise InvalidEvent(f"data after [DONE]: {line!r}")
            if line.startswith("event: "):
                name = line[7:]
                continue
            if not line.startswith("data: "):
                raise InvalidEvent(f"not an SSE field: {line[:300]!r}")
            payload = line[6:]
            if payload == DONE:
                out.append((name, DONE))
                continue
            try:
                out.append((name, json.loads(payload, strict=True)))
            except ValueError as e:
                raise InvalidEvent(f"invalid JSON in a streamed event ({e}): {payload[:600]!r}") from None
    return out
