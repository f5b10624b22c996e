"""argparse value types shared by the command lines: a number parsed, then checked, with a message
argparse prints after the flag's name (`argument --port: must be in [0, 65535], got 70000`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection
from typing import TypeVar

N = TypeVar("N", int, float)


def _parse(cast: Callable[[str], N], text: str) -> N:
    try:
        return cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid {cast.__name__} value: {text!r}") from None


def bounded(cast: Callable[[str], N], lo: N | None = None, hi: N | None = None) -> Callable[[str], N]:
    """A type for `add_argument(type=...)`: `cast(text)` within [lo, hi] (either end open)."""
    if lo is not None and hi is not None:
        expected = f"in [{lo}, {hi}]"
    else:
        expected = f">= {lo}" if lo is not None else f"<= {hi}"

    def parse(text: str) -> N:
        value = _parse(cast, text)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {expected}, got {value}")
        return value

    return parse


def one_of(cast: Callable[[str], N], allowed: Collection[N]) -> Callable[[str], N]:
    """A type for `add_argument(type=...)`: `cast(text)`, one of `allowed`."""

    def parse(text: str) -> N:
        value = _parse(cast, text)
        if value not in allowed:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(map(str, allowed))}, got {value}")
        return value

    return parse


positive_int = bounded(int, lo=1)
port_number = bounded(int, 0, 65535)
probability = bounded(float, 0.0, 1.0)
