"""OpenAIApp._watched: the handler runs in the server's task; a disconnect cancels it, and the
task is left as it was (not cancelling) for what the server does after."""

from __future__ import annotations

import asyncio

from vllm_vcr.http.app import OpenAIApp
from vllm_vcr.http.serving_base import RequestContext


def _ctx(disconnect: asyncio.Event) -> RequestContext:
    async def receive() -> dict:
        await disconnect.wait()
        return {"type": "http.disconnect"}

    return RequestContext({"type": "http", "headers": []}, receive, None, b"")


async def test_a_disconnect_cancels_the_handler_in_the_servers_task():
    gone = asyncio.Event()
    ctx = _ctx(gone)
    seen: dict = {}

    async def handler(c: RequestContext) -> None:
        seen["task"] = asyncio.current_task()
        gone.set()  # the client leaves while the handler waits
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen["cancelled"] = True
            raise

    await OpenAIApp._watched(None, handler, ctx)  # (in this task: wait_for would make another)
    assert seen == {"task": asyncio.current_task(), "cancelled": True}
    assert asyncio.current_task().cancelling() == 0
    await asyncio.sleep(0)  # the task carries on normally


async def test_a_disconnect_after_finishing_cancels_nothing():
    gone = asyncio.Event()
    ctx = _ctx(gone)

    async def handler(c: RequestContext) -> str:
        c.finishing = True  # the last body message is on its way: a disconnect is the normal end
        gone.set()
        await asyncio.sleep(0.05)
        return "done"

    await OpenAIApp._watched(None, handler, ctx)
    assert asyncio.current_task().cancelling() == 0


async def test_an_outside_cancel_still_propagates():
    ctx = _ctx(asyncio.Event())
    started = asyncio.Event()

    async def handler(c: RequestContext) -> None:
        started.set()
        await asyncio.sleep(30)

    task = asyncio.ensure_future(OpenAIApp._watched(None, handler, ctx))
    await started.wait()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    assert task.cancelled()
