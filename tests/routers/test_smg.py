"""The real `smg` (Shepherd / SGLang model gateway) in front of `vllm-vcr serve --engine-type sglang`
workers: it detects them as SGLang, routes round robin and cache-aware, retries, and drives
SGLang's P/D bootstrap flow (docs/routers.md has the commands)."""

from __future__ import annotations

import httpx
import pytest

from vllm_vcr.testing.waits import free_port, wait_until

from .harness import check_breaker_opens_and_recovers, FREE, SMG

pytestmark = pytest.mark.routers

SGLANG = ("--engine-type", "sglang", "--time-to-first-token", "0", "--inter-token-latency", "0")


def smg(fleet, *args: str):
    # (no grace period at exit: nothing is in flight by then, and smg would wait 5 s at each test's end)
    return fleet.router(SMG, "launch", *args, "--prometheus-port", FREE, "--shutdown-grace-period-secs", "0",
                        "--prometheus-host", "127.0.0.1", "--log-level", "debug", ready_path="/readiness")


def ready_workers(r, n: int) -> None:
    """smg registers workers in the background: wait until it routes to all of them."""
    def count():
        r_ = httpx.get(r.url + "/readiness", timeout=10)
        return r_.status_code == 200 and r_.json().get("healthy_workers", 0) >= n
    wait_until(count, 30, f"smg to register {n} workers", interval=0.2)


def test_smg_detects_sglang_workers_and_round_robins(fleet):
    workers = [fleet.worker(*SGLANG) for _ in range(2)]
    fleet.ready(*workers)
    r = smg(fleet, "--worker-urls", *(w.url for w in workers), "--policy", "round_robin")
    ready_workers(r, 2)
    assert any("Detected backend: sglang" in line for line in r.log().splitlines()), \
        "smg did not take the workers for SGLang"
    for i in range(4):
        resp = r.complete(f"hello {i}")
        assert resp.status_code == 200, resp.text
    gen = httpx.post(r.url + "/generate", json={"text": "native", "sampling_params": {"max_new_tokens": 3}},
                     timeout=30)
    assert gen.status_code == 200, gen.text
    assert gen.json()["meta_info"]["completion_tokens"] == 3
    assert sorted(w.served() for w in workers) == [2, 3]


def test_smg_cache_aware_keeps_a_prompt_on_one_worker(fleet):
    workers = [fleet.worker(*SGLANG) for _ in range(2)]
    fleet.ready(*workers)
    r = smg(fleet, "--worker-urls", *(w.url for w in workers), "--policy", "cache_aware")
    ready_workers(r, 2)
    for seed in ("alpha beta", "gamma delta"):
        before = [w.served() for w in workers]
        for _ in range(4):
            assert r.complete(" ".join([seed] * 40)).status_code == 200
        gained = [w.served() - b for w, b in zip(workers, before)]
        assert sorted(gained) == [0, 4], f"{seed!r} spread over workers: {gained}"


def test_smg_retries_a_503_on_another_worker(fleet):
    workers = [fleet.worker(*SGLANG) for _ in range(2)]
    fleet.ready(*workers)
    r = smg(fleet, "--worker-urls", *(w.url for w in workers), "--policy", "round_robin",
            "--retry-max-retries", "4", "--retry-initial-backoff-ms", "1", "--retry-max-backoff-ms", "5")
    ready_workers(r, 2)
    bad, good = workers
    bad.faults([{"action": "http_error", "error": "unavailable", "count": 5}])
    for i in range(6):
        resp = r.complete(f"retry me {i}")
        assert resp.status_code == 200, resp.text
    assert bad.stats()["faults_injected"]["http_error"] >= 1
    assert bad.stats()["requests_completed"] + good.stats()["requests_completed"] == 6


def test_smg_sglang_pd_bootstrap_flow(fleet):
    """smg sends each request to the prefill and the decode worker at once with SGLang's
    bootstrap_host/port/room; the decode side joins the prefill's room and pulls, and the prefill
    frees the blocks it held (without the handoff it would hold them for --kv-hold-timeout)."""
    boot = free_port()
    kv = ("--kv-bytes-per-token", "100000", "--kv-transfer-bandwidth", "10", "--kv-cache-size", "256")
    prefill = fleet.worker(*SGLANG, "--worker-type", "prefill", "--bootstrap-port", str(boot),
                           "--side-channel-port", FREE, *kv)
    decode = fleet.worker(*SGLANG, "--worker-type", "decode", "--max-num-seqs", "24", *kv)
    fleet.ready(prefill, decode)
    r = smg(fleet, "--pd-disaggregation", "--prefill", prefill.url, str(boot), "--decode", decode.url,
            "--policy", "round_robin")
    ready_workers(r, 2)
    total = prefill.kv()["blocks_total"]
    for i in range(3):
        resp = r.complete(" ".join([f"prompt{i}"] * 40), max_tokens=6)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 6
    assert prefill.served() == 3 and decode.served() == 3
    wait_until(lambda: prefill.kv()["blocks_free"] == total, 10,
               "the prefill worker to free its blocks after the decode side's pull")
    chat = r.chat("a chat through the bootstrap flow", max_tokens=3)
    assert chat.status_code == 200, chat.text
    assert prefill.served() == 4 and decode.served() == 4
    # smg's P/D admission gate reads the decode worker's running window from /server_info
    # (SGLang's max_running_requests = --max-num-seqs): without it the gate is off for the worker
    log = r.log()
    assert f'running window worker="{decode.url}" window=24' in log, \
        [line for line in log.splitlines() if "admission" in line.lower()]
    assert "'/model_info' returned 404" not in log  # (/server_info is vLLM's dev-mode route: smg falls back)


def healthy(r) -> dict[str, bool]:
    """smg's own view (GET /workers): worker URL -> is_healthy."""
    return {w["url"]: w["is_healthy"] for w in httpx.get(r.url + "/workers", timeout=10).json()["workers"]}


def test_smg_circuit_breaker_opens_and_half_opens_after_recovery(fleet):
    workers = [fleet.worker(*SGLANG) for _ in range(2)]
    fleet.ready(*workers)
    timeout_s = 2
    r = smg(fleet, "--worker-urls", *(w.url for w in workers), "--policy", "round_robin",
            "--cb-failure-threshold", "2", "--cb-success-threshold", "1", "--cb-timeout-duration-secs",
            str(timeout_s), "--cb-window-duration-secs", "60", "--retry-max-retries", "4",
            "--retry-initial-backoff-ms", "1", "--retry-max-backoff-ms", "5")
    ready_workers(r, 2)
    bad, good = workers
    check_breaker_opens_and_recovers(r, bad, timeout_s)


def test_smg_health_checks_drop_a_dead_worker(fleet):
    workers = [fleet.worker(*SGLANG) for _ in range(2)]
    fleet.ready(*workers)
    r = smg(fleet, "--worker-urls", *(w.url for w in workers), "--policy", "round_robin",
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
            "--health-check-timeout-secs", "2")
    ready_workers(r, 2)
    dead, alive = workers
    assert healthy(r) == {dead.url: True, alive.url: True}
    dead.stop()
    wait_until(lambda: healthy(r).get(dead.url) is False, 20, "smg to mark the stopped worker unhealthy",
               interval=0.2)
    for i in range(4):
        assert r.complete(f"after {i}").status_code == 200
    assert alive.stats()["requests_completed"] == 4
