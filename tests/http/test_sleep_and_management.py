"""Sleep mode, pause and the operator endpoints through `vllm-vcr serve`'s HTTP interface."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import async_wait_until, scaled

FAST = ["--inter-token-latency", "5", "--time-to-first-token", "2"]
DEV = {"VLLM_SERVER_DEV_MODE": "1"}


def sleep_state(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {s.labels["sleep_state"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "vllm:engine_sleep_state" for s in f.samples}


async def _running(stats) -> bool:
    return (await stats)["running"] == 1


async def _waiting(stats) -> bool:
    return (await stats)["waiting"] == 1


async def _complete(c: httpx.AsyncClient, url: str, max_tokens: int) -> dict:
    r = await c.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_dev_routes_absent_without_dev_mode(serve_process):
    sp = serve_process(*FAST, env={"VLLM_SERVER_DEV_MODE": "0"})
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("GET", "/server_info"),
                         ("POST", "/reset_prefix_cache"), ("POST", "/reset_mm_cache"), ("POST", "/pause")):
        assert httpx.request(method, sp.url + path).status_code == 404, path
    # elastic EP belongs to every generate server; one engine cannot be rescaled without Ray
    r = httpx.post(sp.url + "/scale_elastic_ep", json={"new_data_parallel_size": 2})
    assert r.status_code == 500 and r.json()["error"] == {"message": "Scale failed", "type": "Internal Server Error",
                                                          "param": None, "code": 500}
    same = httpx.post(sp.url + "/scale_elastic_ep", json={"new_data_parallel_size": 1})
    assert same.json() == {"message": "Scaled to 1 data parallel engines"}
    bad = httpx.post(sp.url + "/scale_elastic_ep", json={"new_data_parallel_size": 0})
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "new_data_parallel_size must be a positive integer"
    assert httpx.post(sp.url + "/scale_elastic_ep", json={}).json()["error"]["message"] == \
        "new_data_parallel_size is required"
    assert httpx.post(sp.url + "/is_scaling_elastic_ep").json() == {"is_scaling_elastic_ep": False}


async def test_sleep_aborts_running_holds_new_and_wakes(serve_process, serve_harness):
    port = serve_harness.free_port()
    sp = serve_process(*FAST, "--control-address", f"127.0.0.1:{port}", env=DEV)
    url, control = sp.url, f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(timeout=30) as c:
        assert (await c.get(url + "/is_sleeping")).json() == {"is_sleeping": False}
        async def stats() -> dict:
            return (await c.get(control + "/stats")).json()

        running = asyncio.ensure_future(_complete(c, url, 2000))
        await async_wait_until(lambda: _running(stats()), 10, "the request to run")
        r = await c.post(url + "/sleep", params={"level": 1})
        assert r.json() == {"status": "sleeping", "level": 1}
        assert (await running)["choices"][0]["finish_reason"] == "abort"
        assert (await c.get(url + "/is_sleeping")).json() == {"is_sleeping": True}
        assert sleep_state(url) == {"awake": 0.0, "weights_offloaded": 1.0, "discard_all": 0.0}
        waiting = asyncio.ensure_future(_complete(c, url, 3))
        await async_wait_until(lambda: _waiting(stats()), 10, "the request to queue")
        assert not waiting.done()  # held while asleep: queued in the engine, not admitted
        partial = await c.post(url + "/wake_up", params={"tags": "weights"})
        assert partial.json() == {"status": "sleeping", "tags": ["weights"]}
        assert not waiting.done()
        full = await c.post(url + "/wake_up", params=[("tags", "kv_cache"), ("tags", "scheduling")])
        assert full.json() == {"status": "awake", "tags": ["kv_cache", "scheduling"]}
        assert (await waiting)["choices"][0]["finish_reason"] == "length"
        assert sleep_state(url) == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
        # level 0 only pauses scheduling; a wake without tags resumes it
        assert (await c.post(url + "/sleep", params={"level": 0})).json() == {"status": "sleeping", "level": 0}
        assert sleep_state(url) == {"awake": 0.0, "weights_offloaded": 0.0, "discard_all": 0.0}
        assert (await c.post(url + "/wake_up")).json() == {"status": "awake", "tags": None}
    ops = {s.labels["operation"]: s.value for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
           if f.name == "vllm:sleep_mode_operation_duration_seconds" for s in f.samples
           if s.name.endswith("_count")}
    assert ops == {"sleep": 2.0, "wake": 3.0}


async def test_sleep_keep_freezes_and_resumes(serve_process):
    sp = serve_process(*FAST, env=DEV)
    async with httpx.AsyncClient(timeout=30) as c:
        running = asyncio.ensure_future(_complete(c, sp.url, 40))
        await asyncio.sleep(0.1)
        assert (await c.post(sp.url + "/sleep", params={"level": 2, "mode": "keep"})).status_code == 200
        assert sleep_state(sp.url)["discard_all"] == 1.0
        await asyncio.sleep(0.5)
        assert not running.done()
        assert (await c.post(sp.url + "/wake_up")).json()["status"] == "awake"
        out = await running
        assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 40


async def test_pause_resume(serve_process):
    sp = serve_process(*FAST, env=DEV)
    async with httpx.AsyncClient(timeout=30) as c:
        assert (await c.post(sp.url + "/pause", params={"mode": "wait"})).json() == {"status": "paused"}
        assert (await c.get(sp.url + "/is_paused")).json() == {"is_paused": True}
        held = asyncio.ensure_future(_complete(c, sp.url, 2))
        await asyncio.sleep(0.3)
        assert not held.done()
        assert (await c.post(sp.url + "/resume")).json() == {"status": "resumed"}
        assert (await held)["usage"]["completion_tokens"] == 2
        assert (await c.get(sp.url + "/is_paused")).json() == {"is_paused": False}


def test_sleep_time_with_sleep_mode(serve_process):
    sp = serve_process(*FAST, "--enable-sleep-mode", "--sleep-time", "300", "--wake-up-time", "200", env=DEV)
    t0 = time.monotonic()
    assert httpx.post(sp.url + "/sleep", timeout=10).status_code == 200
    assert time.monotonic() - t0 >= 0.3
    t0 = time.monotonic()
    assert httpx.post(sp.url + "/wake_up", timeout=10).json()["status"] == "awake"
    assert time.monotonic() - t0 >= 0.2


@pytest.mark.parametrize("query, param", [("level=3", "query.level"), ("level=x", "query.level"),
                                          ("mode=later", "query.mode")])
def test_sleep_query_errors(serve_process, query, param):
    sp = serve_process(*FAST, env=DEV)
    r = httpx.post(f"{sp.url}/sleep?{query}")
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "Bad Request" and err["param"] == param and err["message"].startswith("1 validation error:")


def test_dev_cache_and_server_info(serve_process):
    sp = serve_process(*FAST, env={**DEV, "VLLM_SOME_FLAG": "x", "VLLM_TOKEN_KEY": "secret"})
    assert httpx.post(sp.url + "/v1/completions", json={"prompt": "a b c d", "max_tokens": 2}).status_code == 200
    assert httpx.post(sp.url + "/reset_prefix_cache").json() == {"success": True}
    for path in ("/reset_mm_cache", "/reset_encoder_cache"):
        r = httpx.post(sp.url + path)
        assert r.status_code == 200 and r.content == b""
    info = httpx.get(sp.url + "/server_info").json()
    assert isinstance(info["vllm_config"], str) and "max_model_len=4096" in info["vllm_config"]
    assert info["vllm_env"]["VLLM_SOME_FLAG"] == "x" and "VLLM_TOKEN_KEY" not in info["vllm_env"]
    as_json = httpx.get(sp.url + "/server_info", params={"config_format": "json"}).json()
    assert as_json["vllm_config"]["max_model_len"] == 4096
    assert httpx.get(sp.url + "/server_info", params={"config_format": "yaml"}).status_code == 400


def test_release_kv_cache_memory(serve_process):
    sp = serve_process(*FAST, env=DEV)
    r = httpx.post(sp.url + "/release_kv_cache_memory")
    assert r.status_code == 500 and r.json()["error"]["message"] == \
        "Call to release_kv_cache_memory method failed: release_kv_cache_memory() requires a completed pause first"
    assert httpx.post(sp.url + "/pause").json() == {"status": "paused"}
    assert httpx.post(sp.url + "/release_kv_cache_memory").json() == {"status": "kv_cache_released"}
    assert sleep_state(sp.url)["awake"] == 0.0
    assert httpx.post(sp.url + "/wake_up", params={"tags": "kv_cache"}).json() == {"status": "awake",
                                                                                  "tags": ["kv_cache"]}
    assert httpx.get(sp.url + "/is_sleeping").json() == {"is_sleeping": False}


async def test_server_load_tracking(serve_process):
    plain = serve_process(*FAST)
    assert httpx.get(plain.url + "/load").json() == {"server_load": 0}
    sp = serve_process(*FAST, "--enable-server-load-tracking")
    async with httpx.AsyncClient(timeout=30) as c:
        running = [asyncio.ensure_future(_complete(c, sp.url, 100)) for _ in range(3)]
        deadline = time.monotonic() + scaled(10)
        while (await c.get(sp.url + "/load")).json()["server_load"] < 3:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await asyncio.gather(*running)
        assert (await c.get(sp.url + "/load")).json() == {"server_load": 0}
