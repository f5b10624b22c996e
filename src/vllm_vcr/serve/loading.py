"""`--startup-time`: simulated model loading before `serve` listens, as vLLM loads before serving."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any

logger = logging.getLogger("vllm_vcr.serve")


async def simulate_loading(engine: Any, seconds: float, own_signals: bool = True) -> int | None:
    """Wait until the engine is ready: None then, else the exit status (1: the simulated loading
    failed, 0: SIGINT/SIGTERM stopped it). Without `own_signals` the process's owner handles
    signals (by cancelling the waiting task)."""
    logger.info("simulating model loading for %.1fs", seconds)
    loop = asyncio.get_running_loop()
    waiting = asyncio.ensure_future(engine.wait_ready())
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM) if own_signals else ():
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, waiting.cancel)
            installed.append(sig)
    try:
        await waiting
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():
            raise
        logger.info("received a signal while loading: shutting down")
        return 0
    except Exception as e:
        logger.error("engine start-up failed: %s", e)
        return 1
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
    return None
