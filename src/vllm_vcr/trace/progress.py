"""Rich progress for the long operations of the trace tools (on stderr, only on a terminal)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .io import Trace, read_trace

_MIN_BYTES_FOR_BAR = 4 << 20  # small files load faster than a bar can draw


def _console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def interactive() -> bool:
    return sys.stderr.isatty() and not os.environ.get("CI")


@contextmanager
def task_progress(description: str, total: float | None, unit: str = "bytes",
                  enabled: bool = True) -> Iterator[Any]:
    """Yields `advance(n)`; a no-op when not on a terminal."""
    if not (enabled and interactive()):
        yield lambda n=1: None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    cols = [TextColumn("{task.description}"), BarColumn()]
    cols.append(DownloadColumn() if unit == "bytes" else MofNCompleteColumn())
    cols.append(TimeRemainingColumn())
    with Progress(*cols, console=_console(), transient=True) as prog:
        task = prog.add_task(description, total=total)
        yield lambda n=1: prog.advance(task, n)


def load_trace(path: str) -> Trace:
    size = os.path.getsize(path) if path != "-" and os.path.exists(path) else 0
    with task_progress(f"reading {os.path.basename(path)}", size,
                       enabled=size >= _MIN_BYTES_FOR_BAR) as advance:
        return read_trace(path, on_read=advance if size >= _MIN_BYTES_FOR_BAR else None)
