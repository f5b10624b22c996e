"""The loop watch (GET /stats/loop) counts the CPU time the loop thread runs before it comes back
to a posted callback: a callback that computes for 150 ms is a stall; one that sleeps is a wait the
watch reports apart (as a process the OS leaves without a core would be)."""

from __future__ import annotations

import asyncio
import time

from tests.conftest import async_wait_until
from vllm_vcr.control.loop_watch import LoopWatch


def _compute(seconds: float) -> None:
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:  # CPU time: the same work however loaded the machine
        pass


async def test_a_computing_callback_is_a_stall_a_sleeping_one_is_not():
    watch = LoopWatch(asyncio.get_running_loop())
    watch.start()
    try:
        await async_wait_until(lambda: watch.snapshot()["probes"] >= 3, 10, "the watch's first probes")
        assert watch.snapshot()["longest_stall_ms"] < 50  # an idle loop

        time.sleep(0.2)  # blocks the loop without computing
        await async_wait_until(lambda: watch.snapshot()["longest_wait_ms"] >= 100, 10, "the sleep to be seen")
        assert watch.snapshot()["longest_stall_ms"] < 50 and watch.snapshot()["stalls_over_50ms"] == 0

        _compute(0.15)
        await async_wait_until(lambda: watch.snapshot()["stalls_over_50ms"] == 1, 10, "the stall to be seen")
        # (the probe posted last before the stall may have gone out up to one interval into it)
        assert 50 <= watch.snapshot()["longest_stall_ms"] <= 1000

        watch.reset()
        snap = watch.snapshot()
        assert (snap["probes"], snap["longest_stall_ms"], snap["stalls_over_50ms"]) == (0, 0, 0)
    finally:
        watch.stop()
    assert not watch.snapshot()["watching"]


async def test_get_stats_loop_arms_the_watch_and_reset_zeroes_it(control_stack):
    _, c = await control_stack()
    first = (await c.get("/stats/loop")).json()
    assert first["watching"] and set(first) == {"watching", "seconds", "probes", "longest_stall_ms",
                                                "longest_wait_ms", "stalls_over_50ms"}

    async def probed() -> bool:
        return (await c.get("/stats/loop")).json()["probes"] >= 3

    await async_wait_until(probed, 10, "the watch's probes")
    _compute(0.15)  # this test's loop is the control server's

    async def stalled() -> bool:
        return (await c.get("/stats/loop")).json()["stalls_over_50ms"] >= 1

    await async_wait_until(stalled, 10, "the stall to be counted")
    assert (await c.get("/stats/loop")).json()["longest_stall_ms"] >= 50
    assert (await c.post("/stats/reset")).status_code == 200
    after = (await c.get("/stats/loop")).json()
    assert after["stalls_over_50ms"] == 0 and after["longest_stall_ms"] < 50, after
