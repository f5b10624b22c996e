"""`vllm-router`'s `grpc://` workers: vLLM's Rust frontend (`VLLM_USE_RUST_FRONTEND=1 vllm serve
--grpc-port`, vLLM 0.33) serving the `vllm.Inference` / `vllm.Control` services, with `vllm-vcr play`
as its engine-core. Router, frontend and gRPC protocol are all real; only the engine is ours.

Needs the routers (scripts/install-routers.sh) and vLLM 0.33 (scripts/install-peers.sh); skipped
with the reason otherwise.
"""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from vllm_vcr.testing.waits import free_port, scaled, wait_until

from ..conformance import peers
from .harness import BLOCK, FREE, VLLM_ROUTER

pytestmark = pytest.mark.routers

VERSION = "0.33"  # the first vLLM with the Rust frontend and its gRPC server


@pytest.fixture(scope="module")
def grpc_stacks():
    reason = peers.missing_reason(VERSION)
    if reason:
        pytest.skip(reason)
    stacks = []
    try:
        for _ in range(2):
            port, pub = free_port(), free_port()
            # KV events on a wildcard PUB endpoint: the Rust frontend reports it to the router
            # (Control.GetKvEventSources), which subscribes on loopback
            kv = f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{pub}"}}'
            st = peers.start_stack(VERSION, frontend_env={"VLLM_USE_RUST_FRONTEND": "1"},
                                   frontend_args=["--grpc-port", str(port)], vocab_size=None,
                                   play_args=[str(peers.MODEL_DIR), "--time-to-first-token", "20",
                                              "--inter-token-latency", "5", "--kv-events-config", kv])
            st.extra["grpc"] = f"grpc://127.0.0.1:{port}"
            stacks.append(st)
        yield stacks
    finally:
        for st in stacks:
            st.stop()


def received(st) -> int:
    return httpx.get(st.control_url + "/stats", timeout=10).json()["requests_received"]


def test_round_robin_over_grpc_workers_streams_from_every_engine(fleet, grpc_stacks):
    a, b = grpc_stacks
    r = fleet.router(VLLM_ROUTER, "--worker-urls", a.extra["grpc"], b.extra["grpc"], "--policy", "round_robin",
                     "--prometheus-port", FREE)
    client = openai.OpenAI(base_url=r.url + "/v1", api_key="x", timeout=scaled(60), max_retries=0)
    before = [received(a), received(b)]
    for i in range(6):
        stream = client.chat.completions.create(model=a.model, max_tokens=6, stream=True,
                                                messages=[{"role": "user", "content": f"hello {i}"}])
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text, chunks
        assert chunks[-1].choices[0].finish_reason == "length"
    gained = [received(a) - before[0], received(b) - before[1]]
    assert gained == [3, 3], gained

    # /v1/completions over gRPC takes token ids (the router does not tokenize a completion prompt)
    resp = httpx.post(r.url + "/v1/completions", timeout=scaled(60),
                      json={"model": a.model, "prompt": [5, 6, 7, 8], "max_tokens": 4})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 4


def test_a_client_that_leaves_aborts_the_request_in_the_engine(fleet, grpc_stacks):
    a, _ = grpc_stacks
    r = fleet.router(VLLM_ROUTER, "--worker-urls", a.extra["grpc"], "--prometheus-port", FREE)
    before = httpx.get(a.control_url + "/stats", timeout=10).json()
    body = {"model": a.model, "max_tokens": 2000, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "a long answer"}]}
    with httpx.stream("POST", r.url + "/v1/chat/completions", json=body, timeout=scaled(60)) as resp:
        assert resp.status_code == 200
        for n, _ in enumerate(resp.iter_lines()):
            if n > 4:
                break  # leave mid-stream: the router cancels its GenerateStream
    # the engine ends the request as aborted, long before its 2,000 tokens (10 s at 5 ms)
    stats = wait_until(lambda: (s := httpx.get(a.control_url + "/stats", timeout=10).json())["running"] == 0 and s,
                       timeout=8, what="the engine to drop the abandoned request")
    assert stats["requests_aborted"] - before["requests_aborted"] == 1, stats
    assert stats["requests_completed"] == before["requests_completed"], stats


def test_kv_aware_over_grpc_credits_the_prefix_our_engine_cached(fleet, grpc_stacks):
    """The router finds each engine's KV event stream through the frontend's gRPC control service,
    and routes a prefix warmed on one engine to that engine with exactly its cached blocks credited."""
    a, b = grpc_stacks
    r = fleet.router(VLLM_ROUTER, "--worker-urls", a.extra["grpc"], b.extra["grpc"], "--policy", "kv_aware",
                     "--prometheus-port", FREE, "--log-level", "debug")
    wait_until(lambda: len(r.lines("spawned subscriber")) == 2, 30, "the router to subscribe to both engines")
    prompt = " ".join(["kappa lambda mu"] * 40)
    messages = [{"role": "user", "content": prompt}]
    warm = httpx.post(b.base_url + "/v1/chat/completions", timeout=scaled(30),
                      json={"model": b.model, "messages": messages, "max_tokens": 1}).json()
    cached = warm["usage"]["prompt_tokens"] // BLOCK * BLOCK

    def credited() -> list[int]:
        return [int(m.group(1)) for line in r.lines("KV prefix decision")
                if (m := re.search(r"credited_prefix_tokens=(\d+)", line))]

    def routed_with_credit() -> bool:
        resp = httpx.post(r.url + "/v1/chat/completions", timeout=scaled(30),
                          json={"model": a.model, "messages": messages, "max_tokens": 1})
        assert resp.status_code == 200, resp.text
        return credited()[-1] > 0

    wait_until(routed_with_credit, 20, "vllm-router to credit the prefix from our KV events", interval=0.2)
    assert credited()[-1] == cached
    # once the router knows the blocks, the prefix goes to the engine holding them
    known = [received(a), received(b)]
    for _ in range(3):
        assert routed_with_credit()
    assert credited()[-3:] == [cached] * 3
    assert [received(a) - known[0], received(b) - known[1]] == [0, 3]
