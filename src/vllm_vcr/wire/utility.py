"""Engine-core utility calls (vllm-protocol.md §4.4).

Every call gets an answer: `[null, value]` for the methods a real engine answers, and a failure
string ("Call to <m> method failed: ...") for the rest, because a silent utility hangs the
frontend's HTTP call forever. Handlers run as tasks on the engine's loop; the ones that touch
engine state go through `EngineCore.call`, which runs them between two steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ..engine.types import not_simulated

# the bridge of wire/server.py that a handler answers for (its engine, its address); typed loosely
# here, as server.py imports this module
EngineBridge = Any

log = logging.getLogger("vllm_vcr.wire.utility")

SUPPORTED_TASKS = ["generate"]


class UtilityFailure(Exception):
    """Raised by a handler: becomes the failure message the frontend turns into an HTTP 500."""


async def await_call(fut: Any) -> Any:
    """EngineCore.call may hand back an asyncio or a concurrent future; await either."""
    if isinstance(fut, concurrent.futures.Future):
        return await asyncio.wrap_future(fut)
    if asyncio.isfuture(fut) or asyncio.iscoroutine(fut):
        return await fut
    return fut


def _lora_id(lora: Any) -> tuple[str | None, int | None]:
    # LoRARequest arrives as an array [name, int_id, path, ...] (trailing fields vary by line).
    if isinstance(lora, (list, tuple)) and len(lora) >= 2:
        return (lora[0] if isinstance(lora[0], str) else None), (lora[1] if isinstance(lora[1], int) else None)
    if isinstance(lora, dict):
        return lora.get("lora_name"), lora.get("lora_int_id")
    return None, None


def _arg(args: list, i: int, default: Any = None) -> Any:
    return args[i] if len(args) > i else default


Handler = Callable[["EngineBridge", list], Awaitable[Any]]
HANDLERS: dict[str, Handler] = {}


def handler(*names: str):
    def deco(fn: Handler) -> Handler:
        for n in names:
            HANDLERS[n] = fn
        return fn
    return deco


@handler("get_supported_tasks")
async def _tasks(b: EngineBridge, args: list) -> Any:
    return SUPPORTED_TASKS


@handler("reset_mm_cache", "reset_encoder_cache", "profile", "execute_dummy_batch", "save_sharded_state")
async def _noop(b: EngineBridge, args: list) -> Any:
    return None


# Sleep and pause: each engine's EngineSleep (engine/sleep.py, `b.sleep`), the same model as one
# `serve` process, for a real vLLM frontend in front of `play` and for serve's own API servers.

def _mode(value: Any) -> str:
    """A pause mode; vLLM's engine core refuses any other with these words."""
    mode = "abort" if value is None else value
    if mode not in ("abort", "wait", "keep"):
        raise UtilityFailure(f"Invalid pause mode: {mode}")
    return mode


@handler("release_kv_cache_memory")
async def _release_kv_cache_memory(b: EngineBridge, args: list) -> Any:
    # the engine core's rule: only after a completed pause, with all memory resident; the KV
    # cache is then gone (its prefix cache with it) until a wake-up brings it back
    try:
        await b.sleep.release_kv_cache_memory()
    except RuntimeError as e:
        raise UtilityFailure(str(e)) from None
    return None


@handler("reset_prefix_cache")
async def _reset_prefix_cache(b: EngineBridge, args: list) -> Any:
    # vLLM refuses (False) while requests run; the engine decides, we only carry the answer.
    ok = await await_call(b.core.call(lambda c: c.reset_prefix_cache()))
    return bool(True if ok is None else ok)


@handler("vcr_load")
async def _load(b: EngineBridge, args: list) -> Any:
    # serve's API servers read a rank's load for SGLang's /get_server_info (not a vLLM method)
    return await await_call(b.core.call(lambda c: c.load()))


@handler("is_sleeping")  # paused scheduling or any part asleep
async def _is_sleeping(b: EngineBridge, args: list) -> Any:
    return b.sleep.is_sleeping


@handler("sleep")  # (level=1, mode="abort")
async def _sleep(b: EngineBridge, args: list) -> Any:
    level = _arg(args, 0, 1)
    await b.sleep.sleep(level if isinstance(level, int) else 1, _mode(_arg(args, 1)))
    return None


@handler("wake_up")  # (tags=None): whether every part is awake again
async def _wake_up(b: EngineBridge, args: list) -> Any:
    tags = _arg(args, 0)
    return await b.sleep.wake_up([str(t) for t in tags] if isinstance(tags, (list, tuple)) else None)


@handler("pause_scheduler")  # 0.32's /pause (mode="abort", clear_cache=True): new requests wait until resume
async def _pause_scheduler(b: EngineBridge, args: list) -> Any:
    await b.sleep.pause(_mode(_arg(args, 0)), _arg(args, 1, True) is not False)
    return None


@handler("pause_generation")  # 0.33's /pause: abort/wait refuse new requests (retryable), keep queues
async def _pause_generation(b: EngineBridge, args: list) -> Any:
    mode = _mode(_arg(args, 0))
    await b.sleep.pause(mode, _arg(args, 1, True) is not False, reject_new=mode != "keep")
    return None


@handler("resume_scheduler", "resume_generation")
async def _resume(b: EngineBridge, args: list) -> Any:
    await b.sleep.resume()
    return None


@handler("is_scheduler_paused", "is_paused")
async def _is_paused(b: EngineBridge, args: list) -> Any:
    return b.sleep.paused


@handler("add_lora")
async def _add_lora(b: EngineBridge, args: list) -> Any:
    name, lid = _lora_id(_arg(args, 0))
    if lid is None:
        raise UtilityFailure("add_lora needs a LoRARequest [lora_name, lora_int_id, ...]")
    b.loras[lid] = name or str(lid)
    return True


@handler("remove_lora")
async def _remove_lora(b: EngineBridge, args: list) -> Any:
    return b.loras.pop(_arg(args, 0), None) is not None


@handler("pin_lora")
async def _pin_lora(b: EngineBridge, args: list) -> Any:
    return _arg(args, 0) in b.loras


@handler("list_loras")
async def _list_loras(b: EngineBridge, args: list) -> Any:
    return sorted(b.loras)


@handler("set_weight_version")
async def _set_weight_version(b: EngineBridge, args: list) -> Any:
    v = _arg(args, 0)
    b.weight_version = str(v) if v is not None else "default"
    return None


@handler("get_weight_version")
async def _get_weight_version(b: EngineBridge, args: list) -> Any:
    return b.weight_version


@handler("compute_weight_checksums")
async def _checksums(b: EngineBridge, args: list) -> Any:
    return []  # no weights


async def dispatch(b: EngineBridge, method: str, args: list) -> tuple[bool, Any]:
    """(ok, value-or-failure-message)."""
    fn = HANDLERS.get(method)
    if fn is None:
        log.warning("engine %d: utility %r is not simulated; answering a failure", b.rank, method)
        return False, not_simulated(method)
    try:
        return True, await fn(b, args)
    except UtilityFailure as e:
        return False, f"Call to {method} method failed: {e}"
    except Exception as e:  # a bug in a handler must still answer the frontend
        log.exception("engine %d: utility %r raised", b.rank, method)
        return False, f"Call to {method} method failed: {type(e).__name__}: {e}"
