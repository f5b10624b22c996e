"""OpenAIApp._watched: the handler runs in the server's task; a disconnect cancels it, and the
task is left as it was (not cancelling) for what the server does after. Both ways of hearing of
the disconnect: a watcher on `receive` (any server), the protocol's hook (serve's own)."""

from __future__ import annotations

import asyncio

import pytest

from vllm_vcr.http.serving_base import RequestContext
from vllm_vcr.http.uvicorn_internals import CLIENT_GONE, ON_DISCONNECT, client_left
from vllm_vcr.serve.app import OpenAIApp


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


def _hooked_ctx() -> RequestContext:
    async def receive() -> dict:
        raise AssertionError("with the protocol's hook nothing watches receive")

    return RequestContext({"type": "http", "headers": [], ON_DISCONNECT: None}, receive, None, b"")


def _client_leaves(ctx: RequestContext) -> None:
    client_left(ctx.scope)  # what serve's protocol does in connection_lost


async def test_the_protocols_hook_cancels_the_handler_without_a_second_task():
    ctx = _hooked_ctx()
    seen: dict = {}
    tasks_before = len(asyncio.all_tasks())

    async def handler(c: RequestContext) -> None:
        seen["tasks"] = len(asyncio.all_tasks())
        asyncio.get_running_loop().call_soon(_client_leaves, c)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen["cancelled"] = True
            raise

    await OpenAIApp._watched(None, handler, ctx)
    assert seen == {"tasks": tasks_before, "cancelled": True}
    assert asyncio.current_task().cancelling() == 0
    assert ctx.scope[ON_DISCONNECT] == CLIENT_GONE


async def test_the_hook_after_finishing_cancels_nothing_and_is_removed():
    ctx = _hooked_ctx()

    async def handler(c: RequestContext) -> None:
        c.finishing = True
        _client_leaves(c)
        await asyncio.sleep(0.01)

    await OpenAIApp._watched(None, handler, ctx)
    assert asyncio.current_task().cancelling() == 0
    ctx2 = _hooked_ctx()

    async def quick(c: RequestContext) -> None:
        await asyncio.sleep(0)

    await OpenAIApp._watched(None, quick, ctx2)
    assert ctx2.scope[ON_DISCONNECT] is None  # a disconnect after the handler reaches no one


async def test_a_client_gone_before_the_handler_starts_runs_nothing():
    ctx = _hooked_ctx()
    _client_leaves(ctx)
    ran = []

    async def handler(c: RequestContext) -> None:
        ran.append(1)

    await OpenAIApp._watched(None, handler, ctx)
    assert ran == []


@pytest.mark.parametrize("hooked", [False, True], ids=["watcher", "hook"])
async def test_an_outside_cancel_still_propagates(hooked):
    ctx = _hooked_ctx() if hooked else _ctx(asyncio.Event())
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
