"""`vllm-vcr play` behind vLLM 0.33's Rust frontend (`VLLM_USE_RUST_FRONTEND=1 vllm serve`). The
Rust frontend decodes every engine-core message into strict types (a missing field fails the
request), so it checks play's wire encoding field by field: handshake, outputs, scheduler stats,
finish reasons, usage."""

from __future__ import annotations

import httpx
import openai
import pytest

from vllm_vcr.testing.waits import scaled

from . import peers

pytestmark = pytest.mark.conformance

VERSION = "0.33"


@pytest.fixture(scope="module")
def stack():
    reason = peers.missing_reason(VERSION)
    if reason:
        pytest.skip(reason)
    st = peers.start_stack(VERSION, frontend_env={"VLLM_USE_RUST_FRONTEND": "1"}, vocab_size=None,
                           play_args=[str(peers.MODEL_DIR), "--time-to-first-token", "10",
                                      "--inter-token-latency", "2"])
    yield st
    st.stop()


def test_chat_and_completions_stream_through_the_rust_frontend(stack):
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="x", timeout=scaled(60), max_retries=0)
    chunks = list(client.chat.completions.create(
        model=stack.model, max_tokens=7, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hello"}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 7

    done = client.completions.create(model=stack.model, prompt="one two three", max_tokens=5)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 5
    assert done.usage.prompt_tokens > 0

    # one token: the first output is also the last
    short = client.completions.create(model=stack.model, prompt="x", max_tokens=1)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 1


def test_scheduler_stats_reach_the_rust_frontends_metrics(stack):
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="x", timeout=scaled(60), max_retries=0)
    client.completions.create(model=stack.model, prompt="metrics please", max_tokens=3)
    text = httpx.get(stack.base_url + "/metrics", timeout=10).text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert any(n.startswith("vllm:") for n in names), sorted(names)[:40]
