"""Both P/D flows between two real engines in one event loop, over real sockets."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from vllm_vcr.engine.async_engine import AsyncEngine
from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.engine.types import EngineCoreRequest, FinishReason, SamplingParams
from vllm_vcr.pd import start_pd_services

from ..conftest import free_port, scaled
from tests.conftest import async_wait_until

PROMPT = list(range(1, 401))  # 400 tokens = 25 blocks of 16
# 400 tokens x 1 MB at 2 GB/s = 200 ms of pull
PULL_S = 0.2
KV = dict(kv_bytes_per_token=1_000_000, kv_transfer_bandwidth=2.0, kv_cache_size=100)


def request(rid, params, max_tokens=3):
    return EngineCoreRequest(request_id=rid, prompt_token_ids=PROMPT, sampling_params=SamplingParams(
        max_tokens=max_tokens, extra_args={"kv_transfer_params": params} if params is not None else None))


async def engine_with_pd(worker_type, ns=None, max_num_seqs=8, ttft_ms=0.0, **kw):
    kw.setdefault("side_channel_port", free_port())
    args = EngineArgs(config=EngineConfig(max_num_seqs=max_num_seqs, inter_token_latency=1.0,
                                          time_to_first_token=ttft_ms),
                      worker_type=worker_type, **{**KV, **kw}).validate()
    engine = AsyncEngine(args)
    await engine.start()
    pd = await start_pd_services(engine.engines, ns or SimpleNamespace())
    return engine, pd


async def run(engine, req):
    """(time of first token, last output) for one request."""
    t0 = time.monotonic()
    first = None
    async for out in engine.generate(req):
        if first is None and out.new_token_ids:
            first = time.monotonic() - t0
        last = out
    return first, last


async def wait_free(engine, total, timeout=3.0):
    pool = engine.engines[0].block_pool
    deadline = time.monotonic() + scaled(timeout)
    while pool.num_free_blocks != total and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return pool.num_free_blocks


@pytest.fixture
async def stack():
    started = []

    async def start(*a, **kw):
        engine, pd = await engine_with_pd(*a, **kw)
        started.append((engine, pd))
        return engine, pd

    yield start
    for engine, pd in started:
        await pd.stop()
        await engine.stop(0)


async def test_nixl_flow_decode_pull_releases_the_prefill_hold(stack):
    port = free_port()
    prefill, pd = await stack("prefill", ns=SimpleNamespace(side_channel_port=port), side_channel_port=port)
    decode, _ = await stack("decode")
    assert pd.side_channel_ports == [port]
    _, out = await run(prefill, request("p1", {"do_remote_decode": True}, max_tokens=50))
    params = out.kv_transfer_params
    assert params["remote_port"] == port and params["remote_host"] == "127.0.0.1"
    assert prefill.engines[0].block_pool.num_free_blocks == 100 - 25  # held for the decode side
    ttft, out = await run(decode, request("d1", params))
    assert ttft >= PULL_S and out.finish_reason is FinishReason.LENGTH
    assert await wait_free(prefill, 100) == 100  # released by the side channel, not the timeout


async def test_bootstrap_flow_decode_first_waits_for_the_prefill(stack):
    prefill, pd = await stack("prefill", ns=SimpleNamespace(bootstrap_port=0), ttft_ms=300.0)
    decode, _ = await stack("decode")
    meta = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pd.bootstrap_port, "bootstrap_room": 2**63 + 5,
            "handoff_id": "h-1"}
    t0 = time.monotonic()
    dec = asyncio.ensure_future(run(decode, request("d", dict(meta))))
    room = pd.server.rooms
    # in the room before the prefill exists
    await async_wait_until(lambda: 2**63 + 5 in room and room[2**63 + 5].decoder, 5)
    _, pout = await run(prefill, request("p", dict(meta)))
    assert pout.kv_transfer_params["bootstrap_room"] == 2**63 + 5
    ttft, dout = await dec
    assert time.monotonic() - t0 >= 0.3 + PULL_S and ttft >= 0.3 + PULL_S - 0.05  # prefill's TTFT, then the pull
    assert dout.finish_reason is FinishReason.LENGTH and dout.error is None
    assert await wait_free(prefill, 100) == 100  # the decoder's close released the hold
    assert pd.handoffs.active == {0: 0}


async def test_bootstrap_errors_surface_on_the_request(stack):
    prefill_no_port, _ = await stack("prefill")
    decode, _ = await stack("decode", max_num_seqs=1,
                            ns=SimpleNamespace(handoff_session_timeout_ms=5000))
    meta = {"bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(), "bootstrap_room": 1, "handoff_id": "h"}
    _, out = await run(prefill_no_port, request("p", dict(meta)))
    assert out.error.message == "source handoff manager is not initialized"
    _, out = await run(decode, request("d", dict(meta)))
    assert out.finish_reason is FinishReason.ERROR and out.error.message.startswith("bootstrap connection failed: ")


async def test_session_limit_per_rank(stack):
    prefill, pd = await stack("prefill", ns=SimpleNamespace(bootstrap_port=0))
    decode, dpd = await stack("decode", max_num_seqs=1)
    meta = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pd.bootstrap_port, "handoff_id": "h"}
    waiting = asyncio.ensure_future(run(decode, request("d1", {**meta, "bootstrap_room": 1})))
    await async_wait_until(lambda: dpd.handoffs.active.get(0) == 1, 5, what="d1's handoff session")
    _, out = await run(decode, request("d2", {**meta, "bootstrap_room": 2}))
    assert out.error.message == "mocker handoff session limit reached for DP rank 0"
    waiting.cancel()  # aborts d1: its session ends and frees the slot
    await asyncio.gather(waiting, return_exceptions=True)
    await async_wait_until(lambda: dpd.handoffs.active.get(0) == 0, 5, what="d1's session to end")
    dec = asyncio.ensure_future(run(decode, request("d3", {**meta, "bootstrap_room": 3})))
    await run(prefill, request("p3", {**meta, "bootstrap_room": 3}))
    _, out = await dec
    assert out.error is None and out.finish_reason is FinishReason.LENGTH


async def test_prefill_cannot_bind_its_side_channel():
    port = free_port()
    blocker = await asyncio.start_server(lambda r, w: None, "127.0.0.1", port)
    try:
        args = EngineArgs(worker_type="prefill", side_channel_port=port).validate()
        engine = AsyncEngine(args)
        with pytest.raises(OSError, match="(?i)^--side-channel-port: KV release listener: .*address already in use"):
            await start_pd_services(engine.engines, SimpleNamespace())
        agg = AsyncEngine(EngineArgs(side_channel_port=port).validate())
        pd = await start_pd_services(agg.engines, SimpleNamespace(side_channel_port=port))  # a warning only
        assert pd.side_channel_ports == []
        await pd.stop()
    finally:
        blocker.close()
        await blocker.wait_closed()


async def test_prefill_cannot_bind_its_bootstrap_port():
    port, side = free_port(), free_port()
    blocker = await asyncio.start_server(lambda r, w: None, "127.0.0.1", port)
    try:
        engine = AsyncEngine(EngineArgs(worker_type="prefill", side_channel_port=side).validate())
        with pytest.raises(OSError, match="^--bootstrap-port: bootstrap server: "):
            await start_pd_services(engine.engines, SimpleNamespace(bootstrap_port=port))
        # the release listener it had started is closed again
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", side)
        probe.close()
        await probe.wait_closed()
    finally:
        blocker.close()
        await blocker.wait_closed()
