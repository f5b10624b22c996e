"""serve's random output is text token by token: ids with no whole-character text of their own
(special tokens, byte-level pieces of a multi-byte character) are never drawn, so each token is its
own SSE event with text, as a model's output would be (a held-back piece merges two tokens into one
event, and a first token without text moves the client's TTFT one ITL later)."""

from __future__ import annotations

import json

import httpx
import pytest

from vllm_vcr.frontend.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def model(tiny_tool_model):
    return tiny_tool_model


def test_textless_ids(model):
    tok = load_tokenizer(model)
    textless = tok.textless_ids(tok.vocab_size)
    assert tok.special_ids <= textless
    pieces = textless - tok.special_ids
    assert len(pieces) >= 100  # the byte-level pieces of non-ASCII characters
    for i in range(tok.vocab_size):
        whole = tok.token_bytes(i).decode("utf-8", "replace")
        assert (i in textless) == (not whole or "\ufffd" in whole), i
    assert tok.textless_ids(50) == frozenset(t for t in textless if t < 50)


def test_every_random_token_is_its_own_event_with_text(serve_process, model):
    sp = serve_process(str(model), "--served-model-name", "m", "--time-to-first-token", "0",
                       "--inter-token-latency", "0")
    with httpx.Client(base_url=sp.url, timeout=30) as c:
        for i in range(12):
            body = {"model": "m", "messages": [{"role": "user", "content": f"say something {i}"}],
                    "max_tokens": 40, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            counts = []
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content") is not None \
                            and chunk["usage"]["completion_tokens"] > (counts[-1] if counts else 0):
                        assert chunk["choices"][0]["delta"]["content"], chunk
                        counts.append(chunk["usage"]["completion_tokens"])
            assert counts == list(range(1, 41)), counts
