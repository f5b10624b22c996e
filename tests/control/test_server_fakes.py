"""The control server over real HTTP against stand-in engines.

The stand-ins honour the one contract the server relies on (`call(fn)` answers on a future, fn
runs in the loop between two "steps"), which lets these tests reach states a real engine makes
awkward: a loop that is gone, a trace-paced engine, engines that diverge.
"""

from __future__ import annotations

import asyncio
import types

import httpx
import pytest

from vllm_vcr.control import start_control_server
from vllm_vcr.control.server import ControlAddressError, parse_address
from vllm_vcr.control.schema import latency_knobs_in
from vllm_vcr.engine.config import EngineConfig
from vllm_vcr.engine.core import LatencyTraceActive


class FakeCore:
    def __init__(self, index: int, *, knob: bool = True) -> None:
        self.index = index
        self.config = EngineConfig()
        self.latency_source_is_knob = knob
        self.stats = types.SimpleNamespace(
            requests_received=10 + index, requests_completed=7, requests_failed=1 + index,
            requests_aborted=2, running=index, waiting=0,
        )
        self.calls: list[str] = []
        self.dead = False
        self.silent = False

    def call(self, fn):
        if self.dead:
            raise RuntimeError("engine loop has exited")
        fut = asyncio.get_running_loop().create_future()
        if self.silent:
            return fut  # a loop that stopped without failing its queue: never answered

        def run():
            try:
                fut.set_result(fn(self))
            except Exception as e:  # noqa: BLE001 - forwarded like the engine does
                fut.set_exception(e)

        asyncio.get_running_loop().call_soon(run)
        return fut

    def check_patch(self, patch):
        knobs = latency_knobs_in(patch)
        if knobs and not self.latency_source_is_knob:
            raise LatencyTraceActive(f"{', '.join(knobs)}: a latency trace paces requests")
        return self.config.patched(patch)

    def current_stats(self):
        return self.stats

    def patch_config(self, patch):
        self.calls.append("patch")
        self.config = self.config.patched(patch)

    def reset_stats(self):
        self.calls.append("reset")
        for k in ("requests_received", "requests_completed", "requests_failed", "requests_aborted"):
            setattr(self.stats, k, 0)


@pytest.fixture
async def serve():
    servers = []

    async def start(engines, **kw):
        srv = await start_control_server(engines, "127.0.0.1:0", **kw)
        servers.append(srv)
        return srv, httpx.AsyncClient(base_url=srv.url, timeout=10)

    yield start
    for s in servers:
        await s.stop()


async def test_routes_and_fan_out(serve):
    cores = [FakeCore(0), FakeCore(1), FakeCore(2)]
    srv, c = await serve(cores)
    async with c:
        r = await c.get("/config")
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert r.json() == EngineConfig().to_dict()

        r = await c.get("/stats")
        assert r.json() == {"requests_received": 33, "requests_completed": 21, "requests_failed": 6,
                            "requests_aborted": 6, "running": 3, "waiting": 0}

        r = await c.patch("/config", json={"time_to_first_token": 1000, "inter_token_latency": 50})
        assert r.status_code == 200
        assert r.json()["time_to_first_token"] == 1000 and r.json()["inter_token_latency"] == 50
        assert all(core.config.time_to_first_token == 1000 for core in cores)
        assert all(core.calls == ["patch"] for core in cores)

        # GET /config reads the first engine only
        cores[1].config = cores[1].config.patched({"max_num_seqs": 3})
        assert (await c.get("/config")).json()["max_num_seqs"] == 128

        r = await c.post("/stats/reset")
        assert r.status_code == 200
        assert r.json() == {"requests_received": 0, "requests_completed": 0, "requests_failed": 0,
                            "requests_aborted": 0, "running": 3, "waiting": 0}
        assert all(core.calls == ["patch", "reset"] for core in cores)


async def test_async_engine_like_object_is_accepted(serve):
    holder = types.SimpleNamespace(engines=[FakeCore(0), FakeCore(1)])
    srv, c = await serve(holder)
    async with c:
        r = await c.patch("/config", json={"max_num_seqs": 4})
        assert r.json()["max_num_seqs"] == 4
        assert [e.config.max_num_seqs for e in holder.engines] == [4, 4]


async def test_error_statuses(serve):
    cores = [FakeCore(0), FakeCore(1)]
    srv, c = await serve(cores, log_control=None)
    async with c:
        async def err(resp, status):
            assert resp.status_code == status, resp.text
            assert resp.headers["content-type"] == "application/json"
            body = resp.json()
            assert set(body) == {"error"} and body["error"]
            return body["error"]

        await err(await c.patch("/config", json={"failure_injection_rate": 2}), 400)
        await err(await c.patch("/config", json={"time_factor_under_load": 0.9}), 400)
        await err(await c.patch("/config", json={"failure_types": []}), 400)
        await err(await c.patch("/config", json={"inter_token_latency": -5}), 400)
        msg = await err(await c.patch("/config", json={"time_scale": 2.0}), 400)
        assert "cannot change at run time" in msg
        await err(await c.patch("/config", json={"failure_types": ["boom"]}), 422)
        await err(await c.patch("/config", json={"max_num_seqs": "many"}), 422)
        await err(await c.patch("/config", json={"no_such_field": 1}), 422)
        await err(await c.patch("/config", content=b"{not json"), 422)
        await err(await c.put("/log", json={"filter": "info"}), 501)
        await err(await c.get("/nope"), 404)
        await err(await c.get("/config/"), 404)
        r = await c.delete("/config")
        await err(r, 405)
        assert set(r.headers["allow"].replace(" ", "").split(",")) >= {"GET", "PATCH"}
        await err(await c.get("/stats/reset"), 405)
        await err(await c.get("/log"), 405)
        # nothing was applied by any rejected call
        assert all(core.calls == [] for core in cores)
        assert all(core.config == EngineConfig() for core in cores)


async def test_409_when_a_trace_paces_requests(serve):
    cores = [FakeCore(0), FakeCore(1, knob=False)]
    srv, c = await serve(cores)
    async with c:
        r = await c.patch("/config", json={"inter_token_latency": 50, "max_num_seqs": 4})
        assert r.status_code == 409 and "inter_token_latency" in r.json()["error"]
        assert all(core.calls == [] for core in cores)  # engine 0 did not get it either
        r = await c.patch("/config", json={"time_factor_under_load": 2.0})
        assert r.status_code == 409
        # non-latency fields are still patchable
        r = await c.patch("/config", json={"max_num_seqs": 4, "failure_injection_rate": 0.5})
        assert r.status_code == 200
        assert [core.config.max_num_seqs for core in cores] == [4, 4]


async def test_500_when_an_engine_loop_is_gone(serve):
    cores = [FakeCore(0), FakeCore(1)]
    srv, c = await serve(cores, call_timeout=0.5)
    async with c:
        cores[1].dead = True
        for r in [await c.get("/stats"), await c.patch("/config", json={"max_num_seqs": 2}),
                  await c.post("/stats/reset")]:
            assert r.status_code == 500 and "engine 1" in r.json()["error"]
        assert (await c.get("/config")).status_code == 200  # engine 0 alone still answers
        cores[1].dead, cores[0].silent = False, True
        r = await c.get("/config")
        assert r.status_code == 500 and "engine 0" in r.json()["error"]


async def test_put_log_with_a_log_control(serve):
    applied = []

    def log_control(spec):
        from vllm_vcr.log_filter import parse_log_filter

        s = parse_log_filter(spec).to_string()
        applied.append(s)
        return s

    srv, c = await serve([FakeCore(0)], log_control=log_control)
    async with c:
        r = await c.put("/log", json={"filter": "vllm_vcr::engine=TRACE,info"})
        assert r.status_code == 200 and r.json() == {"filter": "vllm_vcr::engine=trace,info"}
        r = await c.put("/log", json={"filter": "vllm_vcr=loud"})
        assert r.status_code == 400 and "loud" in r.json()["error"]
        r = await c.put("/log", json={"level": "info"})
        assert r.status_code == 422
        r = await c.put("/log", content=b"info")
        assert r.status_code == 422
        assert applied == ["vllm_vcr::engine=trace,info"]


async def test_start_errors_and_stop():
    with pytest.raises(ControlAddressError, match="--control-address"):
        await start_control_server([FakeCore(0)], "8001")
    srv = await start_control_server([FakeCore(0)], "127.0.0.1:0")
    with pytest.raises(OSError, match="--control-address"):
        await start_control_server([FakeCore(0)], f"127.0.0.1:{srv.port}")
    await srv.stop()
    await srv.stop()  # idempotent
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient() as c:
            await c.get(f"{srv.url}/config")


@pytest.mark.parametrize(
    ("address", "expected"),
    [("127.0.0.1:8001", ("127.0.0.1", 8001)), ("0.0.0.0:0", ("0.0.0.0", 0)),
     ("localhost:9", ("localhost", 9)), ("[::1]:8001", ("::1", 8001))],
)
def test_parse_address(address, expected):
    assert parse_address(address) == expected


@pytest.mark.parametrize("address", ["", "8001", ":8001", "host:", "host:port", "h:70000", "h:-1"])
def test_parse_address_errors(address):
    with pytest.raises(ControlAddressError, match="--control-address"):
        parse_address(address)


async def test_engine_dying_part_way_through_a_patch_says_which_engines_have_it(serve):
    cores = [FakeCore(0), FakeCore(1), FakeCore(2)]
    srv, c = await serve(cores, call_timeout=0.5)
    original_call = cores[2].call
    seen = []

    def call_then_die(fn):
        seen.append(fn)
        if len(seen) == 2:  # the dry run went through; the loop is gone by the apply
            cores[2].dead = True
        return original_call(fn)

    cores[2].call = call_then_die
    async with c:
        r = await c.patch("/config", json={"max_num_seqs": 9})
        assert r.status_code == 500
        assert "engines 0-1 have the patch" in r.json()["error"]
        assert [core.config.max_num_seqs for core in cores] == [9, 9, 128]
