"""Overlays of the estimator's systems directory: a directory of symbolic links to its files, with
some entries replaced, built once in a private place and published by an atomic rename (the
borrowed tables of `tables.py`, the cut tables of `compact.py`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def link_all(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> None:
    """`dst` made to hold a link to each of `src`'s entries but the ones named in `skip`."""
    dst.mkdir(parents=True, exist_ok=True)
    for entry in src.iterdir():
        if entry.name not in skip:
            (dst / entry.name).symlink_to(entry.resolve())


def publish(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`/systems, built by `build(systems)` in a fresh directory beside `target` and renamed
    into place; a finished overlay another process published first is kept, and when the place
    is taken by something else the one just built serves."""
    if (target / "systems").is_dir():
        return target / "systems"
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + "."))
    try:
        build(work / "systems")
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    try:
        os.rename(work, target)
    except OSError:
        if (target / "systems").is_dir():
            shutil.rmtree(work, ignore_errors=True)
        else:
            return work / "systems"
    return target / "systems"
