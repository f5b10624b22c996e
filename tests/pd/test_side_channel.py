"""The KV release side channel: listener per engine, notifier that never blocks or raises."""

from __future__ import annotations

import asyncio
import logging

from tests.conftest import free_port
from vllm_vcr.pd.side_channel import ReleaseListener, ReleaseNotifier


class FakeCore:
    def __init__(self, index):
        self.engine_index = index
        self.released = []
        self.event = asyncio.Event()

    def release_kv_hold(self, rid):
        self.released.append(rid)
        self.event.set()


def closed_port() -> int:
    return free_port()


async def test_release_reaches_the_engine_behind_the_advertised_port():
    cores = [FakeCore(0), FakeCore(1)]
    listener = ReleaseListener()
    await listener.start(cores, "127.0.0.1", 0)
    notifier = ReleaseNotifier()
    try:
        assert notifier.notify("127.0.0.1", listener.ports[1], "req-b")
        assert notifier.notify("127.0.0.1", listener.ports[0], "req-a")
        assert notifier.notify("127.0.0.1", listener.ports[0], "req-c")  # same kept-alive connection
        await asyncio.wait_for(cores[1].event.wait(), 2.0)
        for _ in range(100):
            if len(cores[0].released) == 2:
                break
            await asyncio.sleep(0.01)
        assert cores[0].released == ["req-a", "req-c"] and cores[1].released == ["req-b"]
    finally:
        await notifier.close()
        await listener.close()


async def test_listener_binds_base_port_plus_engine_index():
    base = closed_port()
    listener = ReleaseListener()
    try:
        await listener.start([FakeCore(0), FakeCore(1)], "127.0.0.1", base)
    except OSError:
        return  # base+1 happened to be taken: nothing to learn here
    try:
        assert listener.ports == [base, base + 1]
    finally:
        await listener.close()


async def test_malformed_lines_are_ignored():
    core = FakeCore(0)
    listener = ReleaseListener()
    await listener.start([core], "127.0.0.1", 0)
    try:
        _, w = await asyncio.open_connection("127.0.0.1", listener.ports[0])
        w.write(b"garbage\n{\"release\": 5}\n{\"release\": \"ok\"}\n")
        await w.drain()
        await asyncio.wait_for(core.event.wait(), 2.0)
        assert core.released == ["ok"]
        w.close()
    finally:
        await listener.close()


async def test_unreachable_peer_is_logged_not_fatal(caplog):
    notifier = ReleaseNotifier()
    with caplog.at_level(logging.WARNING, "vllm_vcr.pd"):
        assert notifier.notify("127.0.0.1", closed_port(), "r1")
        for _ in range(200):
            if "unreachable" in caplog.text:
                break
            await asyncio.sleep(0.01)
    assert "unreachable" in caplog.text and "hold timeout" in caplog.text
    await notifier.close()


def test_unusable_addresses_are_skipped():
    notifier = ReleaseNotifier()
    # the llm-d simulator's dummies, or a prefill that did not say where it is
    assert not notifier.notify("DUMMY", 0, "r")
    assert not notifier.notify(None, None, "r")
    assert not notifier.notify("127.0.0.1", 5600, None)
