"""The real `vllm-router` in front of `vllm-vcr serve` workers: each policy and each resilience
feature does to our workers what it does to vLLM's (docs/routers.md has the commands)."""

from __future__ import annotations

import re
import threading

import httpx
import pytest

from vllm_vcr.testing.waits import scaled, wait_until

from .harness import check_breaker_opens_and_recovers, BLOCK, FREE, MODEL, VLLM_ROUTER

pytestmark = pytest.mark.routers

FAST = ("--time-to-first-token", "0", "--inter-token-latency", "0")


def words(seed: str, n: int = 40) -> str:
    return " ".join([seed] * n)


def router(fleet, workers=(), policy: str | None = None, *args: str):
    urls = ["--worker-urls", *(w.url for w in workers)] if workers else []
    pol = ["--policy", policy] if policy else []
    return fleet.router(VLLM_ROUTER, *urls, *pol, "--prometheus-port", FREE, "--log-level", "debug", *args)


def test_round_robin_serves_every_worker(fleet):
    workers = [fleet.worker(*FAST) for _ in range(3)]
    fleet.ready(*workers)
    r = router(fleet, workers, "round_robin")
    for i in range(6):
        resp = r.complete(f"hello {i}")
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["finish_reason"] == "length"
    assert [w.served() for w in workers] == [2, 2, 2]


def test_cache_aware_keeps_a_prompt_on_one_worker(fleet):
    workers = [fleet.worker(*FAST) for _ in range(2)]
    fleet.ready(*workers)
    r = router(fleet, workers, "cache_aware")
    for seed in ("alpha beta", "gamma delta"):
        before = [w.served() for w in workers]
        for _ in range(4):
            assert r.chat(words(seed)).status_code == 200
        gained = [w.served() - b for w, b in zip(workers, before)]
        assert sorted(gained) == [0, 4], f"{seed!r} spread over workers: {gained}"


def test_kv_aware_routes_a_cached_prefix_to_its_holder_and_credits_our_blocks(fleet):
    """Two workers publish vLLM KV events; the second one is warmed with a prompt directly. The
    router, which knows only what our events told it, sends that prompt to the second worker and
    logs a credited prefix equal to the cached tokens the worker reports."""
    flags = (*FAST, "--enable-scale-out", "--enable-prompt-tokens-details")
    workers = [fleet.worker(*flags, kv_events=True) for _ in range(2)]
    fleet.ready(*workers)
    sources = [a for w in workers for a in ("--kv-event-source", f"{w.url}={w.kv_endpoint}")]
    r = router(fleet, workers, "kv_aware", *sources, "--kv-event-model", MODEL,
               "--kv-event-block-size", str(BLOCK))
    holder = workers[1]
    prompt = words("kappa lambda mu", 30)
    for target in workers:  # whichever worker the router would pick first, the cold one is not the holder
        assert target.served() == 0
    warm = httpx.post(holder.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
                      timeout=scaled(30)).json()
    prompt_tokens = warm["usage"]["prompt_tokens"]
    cached_blocks = prompt_tokens // BLOCK

    def credited() -> list[int]:
        return [int(m.group(1)) for line in r.lines("KV prefix decision")
                if (m := re.search(r"credited_prefix_tokens=(\d+)", line))]

    # the router's index learns the blocks from the event stream: wait until a probe is credited
    # (a probe is a real request, so count what the holder serves from here)
    served_before = holder.served()
    resp = None

    def routed_with_credit():
        nonlocal resp
        resp = r.complete(prompt, max_tokens=1)
        assert resp.status_code == 200, resp.text
        return credited()[-1] > 0

    wait_until(routed_with_credit, 20, "vllm-router to credit the prefix from our KV events", interval=0.2)
    assert credited()[-1] == cached_blocks * BLOCK
    cached_tokens = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert credited()[-1] == cached_tokens, "the router's credited prefix is not the prefix the worker cached"
    assert holder.served() > served_before and workers[0].served() == 0, \
        f"the prefix went to the cold worker: {[w.served() for w in workers]}"
    line = r.lines("KV request selected")[-1]
    assert holder.url in line, line


def test_power_of_two_sends_work_to_the_idle_worker(fleet):
    """One long request keeps one worker busy; every short request then goes to the other."""
    workers = [fleet.worker("--time-to-first-token", "0", "--inter-token-latency", "20") for _ in range(2)]
    fleet.ready(*workers)
    r = router(fleet, workers, "power_of_two")
    done = threading.Event()
    long_result: dict = {}

    def long_request():
        try:
            long_result["resp"] = r.complete("a long one", max_tokens=1000, ignore_eos=True, timeout=120)
        finally:
            done.set()

    t = threading.Thread(target=long_request, daemon=True)
    t.start()
    busy = wait_until(lambda: next((w for w in workers if w.stats()["running"] == 1), None), 20,
                      "the long request to run on a worker")
    idle = next(w for w in workers if w is not busy)
    for i in range(6):
        assert r.complete(f"short {i}", max_tokens=2).status_code == 200
        assert not done.is_set(), "the long request ended early: raise its max_tokens"
    assert idle.served() == 6 and busy.served() == 1, [w.served() for w in workers]
    t.join(scaled(60))
    assert long_result["resp"].status_code == 200


def test_vllm_pd_disaggregation_prefill_then_decode_and_the_prefill_frees_its_kv(fleet, tmp_path):
    kv = ("--kv-bytes-per-token", "100000", "--kv-transfer-bandwidth", "10", "--kv-cache-size", "256")
    prefill = fleet.worker(*FAST, "--worker-type", "prefill", "--side-channel-port", FREE, *kv)
    decode = fleet.worker("--time-to-first-token", "0", "--inter-token-latency", "2", "--worker-type", "decode", *kv)
    fleet.ready(prefill, decode)
    r = router(fleet, (), "round_robin", "--vllm-pd-disaggregation", "--prefill", prefill.url,
               "--decode", decode.url)
    for i in range(3):
        resp = r.complete(words(f"prompt {i}", 20), max_tokens=8)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 8
    assert prefill.served() == 3 and decode.served() == 3
    total = prefill.kv()["blocks_total"]
    wait_until(lambda: prefill.kv()["blocks_free"] == total, 10,
               "the prefill worker to free the KV blocks the decode side pulled")
    assert prefill.stats()["requests_completed"] == 3


def test_retries_move_a_failed_request_to_another_worker(fleet):
    """The next 5 requests to one worker fail with 503: the router retries them on the other, so
    the client sees only successes."""
    workers = [fleet.worker(*FAST) for _ in range(2)]
    fleet.ready(*workers)
    r = router(fleet, workers, "round_robin", *("--retry-max-retries", "3",
               "--retry-initial-backoff-ms", "1", "--retry-max-backoff-ms", "5", "--disable-circuit-breaker"))
    bad, good = workers
    bad.faults([{"action": "http_error", "error": "unavailable", "count": 5}])
    for i in range(6):
        resp = r.complete(f"retry me {i}")
        assert resp.status_code == 200, resp.text
    injected = bad.stats()["faults_injected"]["http_error"]
    assert injected >= 1
    assert good.stats()["requests_completed"] == 6 - bad.stats()["requests_completed"]


def test_circuit_breaker_opens_on_a_failing_worker_and_half_opens_after_recovery(fleet):
    workers = [fleet.worker(*FAST) for _ in range(2)]
    fleet.ready(*workers)
    timeout_s = 2
    r = router(fleet, workers, "round_robin", *(
        "--cb-failure-threshold", "2", "--cb-success-threshold", "1", "--cb-timeout-duration-secs", str(timeout_s),
        "--cb-window-duration-secs", "60", "--retry-max-retries", "3", "--retry-initial-backoff-ms", "1",
        "--retry-max-backoff-ms", "5"))
    bad, good = workers
    check_breaker_opens_and_recovers(r, bad, timeout_s)


def healthy(r) -> dict[str, bool]:
    """The router's own view (GET /workers): worker URL -> is_healthy."""
    return {w["url"]: w["is_healthy"] for w in httpx.get(r.url + "/workers", timeout=10).json()["workers"]}


def test_health_checks_keep_a_sleeping_worker_and_drop_a_dead_one(fleet):
    """vLLM's /health stays 200 while the engine sleeps, so the router keeps the worker, and a
    request routed to it runs after the wake-up; a worker that stops answering is dropped."""
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    workers = [fleet.worker(*FAST, env=env) for _ in range(2)]
    fleet.ready(*workers)
    r = router(fleet, workers, "round_robin", *(
        "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--health-check-timeout-secs", "2"))
    sleeper, other = workers
    assert httpx.post(sleeper.url + "/sleep?level=1", timeout=10).json()["status"] == "sleeping"
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda i=i: results.append(r.complete(f"asleep {i}")), daemon=True)
               for i in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: sleeper.stats()["waiting"] == 1, 20, "a request queued on the sleeping worker")
    assert httpx.get(sleeper.url + "/health", timeout=10).status_code == 200
    assert httpx.post(sleeper.url + "/wake_up", timeout=10).json()["status"] == "awake"
    for t in threads:
        t.join(scaled(30))
    assert [x.status_code for x in results] == [200, 200]
    assert sleeper.stats()["requests_completed"] == 1
    assert healthy(r) == {sleeper.url: True, other.url: True}, "the router dropped the sleeping worker"
    sleeper.stop()
    wait_until(lambda: healthy(r).get(sleeper.url) is False, 20, "the router to mark the stopped worker unhealthy",
               interval=0.2)
    for i in range(4):
        assert r.complete(f"after {i}").status_code == 200
    assert other.stats()["requests_completed"] == 1 + 4
