"""`vllm-router`'s `grpc://` workers: vLLM's Rust frontend (`VLLM_USE_RUST_FRONTEND=1 vllm serve
--grpc-port`, vLLM 0.33) serving the `vllm.Inference` / `vllm.Control` services, with `vllm-vcr play`
as its engine-core. Router, frontend and gRPC protocol are all real; only the engine is ours.

Needs the routers (scripts/install-routers.sh) and vLLM 0.33 (scripts/install-peers.sh); skipped
with the reason otherwise.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from vllm_vcr.testing.waits import free_port, scaled, wait_until

from ..conformance import peers
from .harness import FREE, VLLM_ROUTER

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
            port = free_port()
            st = peers.start_stack(VERSION, frontend_env={"VLLM_USE_RUST_FRONTEND": "1"},
                                   frontend_args=["--grpc-port", str(port)], vocab_size=None,
                                   play_args=[str(peers.MODEL_DIR), "--time-to-first-token", "20",
                                              "--inter-token-latency", "5"])
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
