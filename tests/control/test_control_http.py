"""The control API over real HTTP against real engines (AsyncEngine on the real clock).

Timing assertions use wide margins (2 shared cores): each compares paces that differ tenfold.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from vllm_vcr import logging_setup
from vllm_vcr.engine.latency import LatencyModel
from vllm_vcr.engine.types import FinishReason

from .control_helpers import make_request
from tests.conftest import scaled


async def drain(engine, req):
    """Run one request to the end: (finish_reason, token emission times)."""
    times, reason = [], None
    async for out in engine.generate(req):
        if out.new_token_ids:
            times.extend([time.monotonic()] * len(out.new_token_ids))
        reason = out.finish_reason
    return reason, times


async def wait_idle(client, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + scaled(timeout)
    while True:
        s = (await client.get("/stats")).json()
        if s["running"] == 0 and s["waiting"] == 0:
            return s
        assert time.monotonic() < deadline, f"engine never went idle: {s}"
        await asyncio.sleep(0.02)


async def test_fan_out_over_several_engines(control_stack):
    engine, c = await control_stack(engine_count=3)
    r = await c.patch("/config", json={"max_num_seqs": 7, "inter_token_latency": 1})
    assert r.status_code == 200 and r.json()["max_num_seqs"] == 7
    assert [core.config.max_num_seqs for core in engine.engines] == [7, 7, 7]

    # GET /config is the first engine's view
    engine.engines[0]._config = engine.engines[0].config.patched({"max_num_seqs": 5})
    assert (await c.get("/config")).json()["max_num_seqs"] == 5

    # GET /stats sums all engines
    for i in range(6):
        req = make_request(f"r{i}", max_tokens=2)
        req.data_parallel_rank = i % 3
        assert (await drain(engine, req))[0] == FinishReason.LENGTH
    assert [core.stats.requests_completed for core in engine.engines] == [2, 2, 2]
    s = (await c.get("/stats")).json()
    assert s == {"requests_received": 6, "requests_completed": 6, "requests_failed": 0,
                 "requests_aborted": 0, "running": 0, "waiting": 0}

    r = await c.post("/stats/reset")
    assert r.status_code == 200 and r.json()["requests_received"] == 0
    assert all(core.stats.requests_received == 0 for core in engine.engines)


async def test_embedded_without_cli_logging_put_log_is_501(control_stack):
    assert not logging_setup.reloadable_logging_installed()
    engine, c = await control_stack()  # log_control="auto", as serve and play call it
    r = await c.put("/log", json={"filter": "debug"})
    assert r.status_code == 501 and "reloadable" in r.json()["error"]


async def test_in_flight_request_keeps_its_pacing_new_one_uses_the_patch(control_stack):
    engine, c = await control_stack(inter_token_latency=20)
    old = engine.generate(make_request("old", max_tokens=30))
    got = 0
    async for out in old:  # let it get going at 20 ms per token
        got += len(out.new_token_ids)
        if got >= 5:
            break_at = time.monotonic()
            break
    r = await c.patch("/config", json={"inter_token_latency": 300})
    assert r.status_code == 200 and r.json()["inter_token_latency"] == 300

    async def rest_of_old():
        async for out in old:
            if out.finish_reason is not None:
                return time.monotonic()

    t_new = time.monotonic()
    t_old_done, (reason, new_times) = await asyncio.gather(
        rest_of_old(), drain(engine, make_request("new", max_tokens=4)))
    assert t_old_done - break_at < min(scaled(2.0), 6.0)  # 25 more tokens at 20 ms = 0.5 s; at 300 ms it would be 7.5 s
    # a token is never emitted before its deadline, so 3 gaps of 300 ms are a hard lower bound
    assert len(new_times) == 4 and new_times[-1] - t_new >= 0.9


async def test_raising_max_num_seqs_admits_waiting_requests(control_stack):
    engine, c = await control_stack()
    await c.patch("/config", json={"max_num_seqs": 1, "inter_token_latency": 100})
    gens = [engine.generate(make_request(f"q{i}", max_tokens=200)) for i in range(3)]
    tasks = [asyncio.create_task(drain_gen(g)) for g in gens]
    await until_stats(c, running=1, waiting=2)

    r = await c.patch("/config", json={"max_num_seqs": 128, "inter_token_latency": 30})
    assert r.status_code == 200
    s = (await c.get("/stats")).json()  # the very next call already sees them running
    assert (s["running"], s["waiting"]) == (3, 0)

    for t in tasks:  # the clients go away: the engine aborts all three
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for g in gens:
        await g.aclose()
    s = await wait_idle(c)
    assert s["requests_aborted"] == 3 and s["requests_received"] == 3


async def drain_gen(gen):
    async for _ in gen:
        pass


async def until_stats(client, timeout: float = 5.0, **want):
    deadline = time.monotonic() + scaled(timeout)
    while True:
        s = (await client.get("/stats")).json()
        if all(s[k] == v for k, v in want.items()):
            return s
        assert time.monotonic() < deadline, f"stats never reached {want}: {s}"
        await asyncio.sleep(0.02)


async def test_failure_injection_at_rate_one_then_back_to_zero(control_stack):
    engine, c = await control_stack(engine_count=2)
    r = await c.patch("/config", json={"failure_injection_rate": 1.0, "failure_types": ["error"]})
    assert r.json()["failure_injection_rate"] == 1.0 and r.json()["failure_types"] == ["error"]
    reasons = [(await drain(engine, make_request(f"f{i}")))[0] for i in range(4)]
    assert reasons == [FinishReason.ERROR] * 4
    await c.patch("/config", json={"failure_injection_rate": 0})
    reasons = [(await drain(engine, make_request(f"ok{i}")))[0] for i in range(4)]
    assert reasons == [FinishReason.LENGTH] * 4
    s = (await c.get("/stats")).json()
    assert (s["requests_received"], s["requests_failed"], s["requests_completed"]) == (8, 4, 4)


async def test_stats_reset_and_invariant_after_mixed_run_with_disconnects(control_stack):
    engine, c = await control_stack(engine_count=2, inter_token_latency=5)
    await drain(engine, make_request("before"))
    assert (await c.post("/stats/reset")).json()["requests_received"] == 0

    async def disconnect_after(rid, n):
        gen = engine.generate(make_request(rid, max_tokens=1000))
        seen = 0
        async for out in gen:
            seen += len(out.new_token_ids)
            if seen >= n:
                break
        await gen.aclose()  # the client goes away mid-stream

    await asyncio.gather(
        *(drain(engine, make_request(f"ok{i}", max_tokens=5)) for i in range(4)),
        *(disconnect_after(f"gone{i}", 3) for i in range(3)),
    )
    await c.patch("/config", json={"failure_injection_rate": 1.0, "failure_types": ["error", "length"]})
    await asyncio.gather(*(drain(engine, make_request(f"bad{i}")) for i in range(2)))
    await c.patch("/config", json={"failure_injection_rate": 0.0})

    s = await wait_idle(c)
    assert s == {"requests_received": 9, "requests_completed": 4, "requests_failed": 2,
                 "requests_aborted": 3, "running": 0, "waiting": 0}
    assert s["requests_received"] == s["requests_completed"] + s["requests_failed"] + s["requests_aborted"]


async def test_reset_mid_flight_keeps_the_invariant(control_stack):
    engine, c = await control_stack(inter_token_latency=20)
    task = asyncio.create_task(drain(engine, make_request("long", max_tokens=20)))
    await until_stats(c, running=1)
    s = (await c.post("/stats/reset")).json()
    assert s["requests_received"] == 1 and s["running"] == 1  # the in-flight one carries over
    await task
    s = await wait_idle(c)
    assert s["requests_received"] == s["requests_completed"] == 1


async def test_409_while_a_latency_trace_paces_requests(control_stack):
    engine, c = await control_stack(engine_count=2)

    class TracePaced(LatencyModel):  # stands in for a trace-fitted latency model
        def __init__(self, inner):
            self.inner = inner

        def pacing(self, *a):
            return self.inner.pacing(*a)

    engine.engines[1].latency = TracePaced(engine.engines[1].latency)
    for field in ("time_to_first_token", "inter_token_latency_std_dev", "prefill_time_per_token",
                  "time_factor_under_load"):
        value = 2.0 if field == "time_factor_under_load" else 5
        r = await c.patch("/config", json={field: value})
        assert r.status_code == 409, field
        assert "latency trace" in r.json()["error"]
    assert engine.engines[0].config.time_to_first_token == 0  # nothing applied anywhere
    r = await c.patch("/config", json={"max_num_seqs": 4})
    assert r.status_code == 200


async def test_500_when_an_engine_loop_is_gone(control_stack):
    engine, c = await control_stack(engine_count=2)
    engine.engines[1].shutdown(0)
    await asyncio.wait_for(engine.tasks[1], 5)
    for r in (await c.get("/stats"), await c.post("/stats/reset"),
              await c.patch("/config", json={"max_num_seqs": 2})):
        assert r.status_code == 500 and "engine 1" in r.json()["error"]
    assert (await c.get("/config")).status_code == 200


async def test_every_status_code(control_stack):
    engine, c = await control_stack(log_control=None)
    cases = [
        (c.get("/config"), 200),
        (c.patch("/config", json={"max_num_seqs": 64}), 200),
        (c.get("/stats"), 200),
        (c.post("/stats/reset"), 200),
        (c.patch("/config", json={"failure_injection_rate": 1.01}), 400),
        (c.patch("/config", json={"time_factor_under_load": 0.99}), 400),
        (c.patch("/config", json={"failure_types": []}), 400),
        (c.patch("/config", json={"prefill_overhead": -1}), 400),
        (c.patch("/config", json={"kv_cache_size": 10}), 400),
        (c.patch("/config", json={"failure_types": ["timeout"]}), 422),
        (c.patch("/config", json={"max_num_seqs": "8"}), 422),
        (c.patch("/config", json={"speed": "fast"}), 422),
        (c.patch("/config", content=b"max_num_seqs=8"), 422),
        (c.put("/log", json={"filter": "debug"}), 501),
        (c.get("/metrics"), 404),
        (c.post("/config"), 405),
        (c.put("/stats"), 405),
    ]
    for coro, status in cases:
        r = await coro
        assert r.status_code == status, (r.request.method, r.request.url.path, r.text)
        assert r.headers["content-type"] == "application/json"
        if status >= 400:
            assert list(r.json()) == ["error"]
    assert engine.engines[0].config.max_num_seqs == 64


@pytest.fixture
def cli_logging(monkeypatch):
    monkeypatch.delenv("RUST_LOG", raising=False)
    monkeypatch.delenv("VLLM_VCR_LOG", raising=False)
    logging_setup.install_reloadable_logging("info")
    yield
    logging_setup.uninstall_reloadable_logging()


async def test_put_log_changes_what_is_logged(cli_logging, control_stack, capsys):
    engine, c = await control_stack(log_requests=True)
    await drain(engine, make_request("loud"))
    err = capsys.readouterr().err
    assert "INFO vllm_vcr::engine: request loud queued" in err

    r = await c.put("/log", json={"filter": "warn"})
    assert r.status_code == 200 and r.json() == {"filter": "warn"}
    await drain(engine, make_request("quiet"))
    assert "request quiet" not in capsys.readouterr().err

    r = await c.put("/log", json={"filter": "vllm_vcr::engine=trace,warn"})
    assert r.json() == {"filter": "vllm_vcr::engine=trace,warn"}
    assert logging.getLogger("vllm_vcr.engine.scheduler").isEnabledFor(logging_setup.TRACE)
    await drain(engine, make_request("again"))
    assert "request again queued" in capsys.readouterr().err

    r = await c.put("/log", json={"filter": "vllm_vcr::engine=noisy"})
    assert r.status_code == 400 and "noisy" in r.json()["error"]
    assert logging_setup.current_log_filter() == "vllm_vcr::engine=trace,warn"
