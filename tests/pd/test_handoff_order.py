"""The bootstrap handoff order per engine type (Dynamo's `order_for_engine`): vLLM source first,
SGLang destination first; both complete, between two real engines over real sockets."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from vllm_vcr.engine.policy import HandoffOrder, order_for_engine
from vllm_vcr.engine.request import RequestStatus
from vllm_vcr.engine.types import FinishReason

from tests.conftest import async_wait_until
from .test_services import request, run, stack, wait_free  # noqa: F401 (stack: the fixture)

ENGINE_TYPES = ("vllm", "sglang")


def meta(pd, room):
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": pd.bootstrap_port, "bootstrap_room": room,
            "handoff_id": f"h-{room}"}


def test_order_for_engine():
    assert order_for_engine("vllm") is HandoffOrder.SOURCE_FIRST
    assert order_for_engine("sglang") is HandoffOrder.DESTINATION_FIRST
    with pytest.raises(ValueError, match="does not support disaggregated handoff"):
        order_for_engine("trtllm")


@pytest.mark.parametrize("engine_type", ENGINE_TYPES)
async def test_prefill_arriving_first(stack, engine_type):
    prefill, pd = await stack("prefill", ns=SimpleNamespace(bootstrap_port=0), engine_type=engine_type)
    decode, _ = await stack("decode", engine_type=engine_type)
    pre = asyncio.ensure_future(run(prefill, request("p", meta(pd, 7))))
    core = prefill.engines[0]
    if engine_type == "vllm":  # source first: computed at once, its KV held for the decoder; its
        # finish waits for the handoff (Dynamo's mocker holds the final output until the session completes)
        await async_wait_until(lambda: "p" in core.requests and core.requests["p"].status is RequestStatus.HANDING_OFF,
                               10, "the prefill to hand off")
        assert not pre.done()
        assert core.block_pool.num_free_blocks == 100 - 25
    else:  # destination first: not even queued until the decoder joins
        await async_wait_until(lambda: "p" in core.requests, 10, "the prefill to arrive")
        await asyncio.sleep(0.05)  # (a prefill that were wrongly scheduled would run now)
        assert not pre.done() and core.requests["p"].status is RequestStatus.BOOTSTRAPPING
        assert core.block_pool.num_free_blocks == 100 and not core.scheduler.waiting
    _, dout = await run(decode, request("d", meta(pd, 7)))
    _, pout = await pre
    assert pout.kv_transfer_params["bootstrap_room"] == 7
    assert dout.finish_reason is FinishReason.LENGTH and dout.error is None
    assert await wait_free(prefill, 100) == 100
    assert pd.handoffs.active == {0: 0}


@pytest.mark.parametrize("engine_type", ENGINE_TYPES)
async def test_decoder_arriving_first(stack, engine_type):
    prefill, pd = await stack("prefill", ns=SimpleNamespace(bootstrap_port=0), engine_type=engine_type)
    decode, _ = await stack("decode", engine_type=engine_type)
    dec = asyncio.ensure_future(run(decode, request("d", meta(pd, 9))))
    await async_wait_until(lambda: 9 in pd.server.rooms and pd.server.rooms[9].decoder, 5)
    _, pout = await run(prefill, request("p", meta(pd, 9)))
    _, dout = await dec
    assert pout.error is None and dout.finish_reason is FinishReason.LENGTH and dout.error is None
    assert await wait_free(prefill, 100) == 100


async def test_sglang_prefill_without_decoder_fails_after_the_session_timeout(stack):
    prefill, pd = await stack("prefill", ns=SimpleNamespace(bootstrap_port=0, handoff_session_timeout_ms=200),
                              engine_type="sglang")
    _, out = await run(prefill, request("p", meta(pd, 11)))
    assert out.finish_reason is FinishReason.ERROR
    assert out.error.message == "bootstrap room 11 was aborted before its decoder joined"
    assert not prefill.engines[0].requests and pd.handoffs.active == {0: 0}
