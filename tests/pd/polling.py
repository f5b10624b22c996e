"""Waiting for a state instead of sleeping for a guessed time."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from tests.conftest import scaled


async def until(predicate: Callable[[], object], timeout: float = 5.0, what: str = "the awaited state") -> None:
    """Poll `predicate` every few ms until it is true; fail after `timeout` seconds."""
    deadline = time.monotonic() + scaled(timeout)
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {scaled(timeout):.1f}s waiting for {what}")
        await asyncio.sleep(0.005)
