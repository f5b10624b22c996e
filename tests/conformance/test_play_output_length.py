"""Outputs that end like a model's, through the real vLLM frontend: `play` ends a request without
max_tokens on the model's EOS at a realistic length, keeps max_tokens under ignore_eos, and draws
only allowed_token_ids / what logit_bias favours, from the SamplingParams the frontend sends."""

from __future__ import annotations

import openai
import pytest

from . import peers

pytestmark = pytest.mark.conformance
MSGS = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def stack(vllm_version):
    st = peers.start_stack(vllm_version, play_args=["--seed", "3", "--inter-token-latency", "0",
                                                    "--time-to-first-token", "0", "--output-length-mean", "48",
                                                    "--output-length-std-dev", "16"])
    yield st
    st.stop()


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def test_default_length_ends_with_stop(client, stack):
    lengths = []
    for _ in range(8):
        r = client.chat.completions.create(model=stack.model, messages=MSGS, extra_body={"return_token_ids": True})
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and choice.stop_reason is None, choice
        lengths.append(r.usage.completion_tokens)
    assert all(8 <= n <= 200 for n in lengths), lengths  # not the 1024-token context


def test_ignore_eos_keeps_max_tokens(client, stack):
    r = client.chat.completions.create(model=stack.model, messages=MSGS, max_tokens=150,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 150 and r.choices[0].finish_reason == "length"


def test_allowed_token_ids_are_honoured(client, stack):
    allowed = [300, 301, 302, 303]
    r = client.completions.create(model=stack.model, prompt="hello", max_tokens=30,
                                  extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    choice = r.choices[0]
    assert set(choice.token_ids) <= set(allowed) and len(choice.token_ids) == 30
    assert choice.finish_reason == "length"  # the model's EOS is not allowed


def test_logit_bias_and_a_biased_stop_token_id(client, stack):
    r = client.completions.create(model=stack.model, prompt="hello", max_tokens=20, logit_bias={"400": 100},
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].token_ids == [400] * 20
    r = client.completions.create(model=stack.model, prompt="hello", max_tokens=50, logit_bias={"401": 100},
                                  extra_body={"stop_token_ids": [401], "min_tokens": 3, "return_token_ids": True})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == 401 and len(choice.token_ids) == 4
