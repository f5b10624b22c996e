"""A chat request whose body bytes the server has seen before skips parsing, checks, template and
tokenizer (openai/chat.py keeps what they made of the bytes): its answer must be the one the full
path gives. A real `serve` (echo mode: the output follows from the prompt alone) gets each
hostile body twice with the same X-Request-Id; the first goes the full path, the second the
repeated one (or the full path again when the first failed: failures are never kept); both
answers must be the same: the same bytes for a whole answer or an error (less `created`, the
clock's), the same text, finishes, ids, logprobs and usage for a stream (whose chunking follows
the engine's timing).
A third time the body differs by one byte of JSON whitespace: the full path again, same answer.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from tests.http.conftest import FAST, MODEL, _start
from tests.reliability.hostile import hostile



@pytest.fixture(scope="module")
def echo_short(serve_harness, tmp_path_factory):
    """Echo mode (tokens follow from the prompt), a short context (so that length checks fail)."""
    sp = _start(serve_harness, tmp_path_factory, "repeated", *FAST, "--mode", "echo", "--max-model-len", "96",
                "--served-model-name", MODEL, "other-name")
    yield sp
    sp.stop()


@pytest.fixture(scope="module")
def client(echo_short):
    with httpx.Client(base_url=echo_short.url, timeout=60) as c:
        yield c


small_ints = st.integers(-3, 120) | st.sampled_from([0, 1, 2, 10**30, -(2**63)])
anything = st.none() | st.booleans() | small_ints | st.floats(allow_nan=False) | hostile | st.lists(small_ints,
                                                                                                     max_size=2)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]) | hostile,
                                 "content": hostile | st.lists(st.fixed_dictionaries(
                                     {"type": st.sampled_from(["text", "image_url"]), "text": hostile}), max_size=2)},
                                optional={"name": hostile})
fields = {
    "model": st.sampled_from([MODEL, "other-name", "unknown", None, ""]) | hostile,
    "max_tokens": small_ints | anything, "max_completion_tokens": small_ints, "temperature": st.sampled_from(
        [0, 0.5, 2.5, -1]) | anything, "top_p": st.sampled_from([0.5, 0, 1.5]), "n": st.sampled_from([1, 2, 0]),
    "stream": st.booleans() | anything, "stop": hostile | st.lists(hostile, max_size=2) | anything,
    "logprobs": st.booleans(), "top_logprobs": st.sampled_from([0, 2, -1, 30]), "echo": st.booleans(),
    "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
    "logit_bias": st.dictionaries(st.sampled_from(["1", "01", "x", "99999"]), st.sampled_from([1, -100, 500]),
                                  max_size=2), "allowed_token_ids": st.lists(small_ints, max_size=2),
    "seed": small_ints, "ignore_eos": st.booleans(), "min_tokens": small_ints, "request_id": hostile,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "return_token_ids": st.booleans(), "prompt_logprobs": st.sampled_from([None, 1, 30]),
    "truncate_prompt_tokens": st.sampled_from([None, 4, -1, 1000]), "stop_token_ids": st.lists(small_ints,
                                                                                               max_size=2),
    "chat_template_kwargs": st.sampled_from([None, {}, {"x": 1}]), "vllm_xargs": st.sampled_from([None, {"a": 1}]),
    "priority": small_ints, "unknown_field": anything,
}
hostile_bodies = st.fixed_dictionaries({"messages": st.lists(message, max_size=3) | anything}, optional=fields)
# requests that pass (mostly): what the repeated path is for
text = hostile.filter(lambda t: "\ud800" not in t and len(t) < 40)
valid_bodies = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                 "content": text}), min_size=1, max_size=3)},
    optional={"model": st.sampled_from([MODEL, "other-name"]), "max_tokens": st.integers(1, 12),
              "max_completion_tokens": st.integers(1, 12), "temperature": st.sampled_from([0, 0.7, 1]),
              "stream": st.booleans(), "stop": text | st.lists(text, max_size=2), "n": st.sampled_from([1, 2]),
              "seed": st.integers(0, 9), "ignore_eos": st.booleans(), "min_tokens": st.integers(0, 2),
              "request_id": text, "return_token_ids": st.booleans(), "echo": st.booleans(),
              "add_generation_prompt": st.booleans(), "include_stop_str_in_output": st.booleans(),
              "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                                    "continuous_usage_stats": st.booleans()}),
              "logprobs": st.just(True), "top_logprobs": st.integers(0, 3), "stop_token_ids": st.lists(
                  st.integers(0, 50), max_size=2), "logit_bias": st.dictionaries(st.sampled_from(["1", "7"]),
                                                                                 st.sampled_from([1, -100]),
                                                                                 max_size=1)})
bodies = valid_bodies | valid_bodies | hostile_bodies


def merged(stream: bytes) -> Any:
    """A stream as what must agree however its tokens fell into chunks (back-to-back engine steps
    reach a lagging reader merged): per choice its role, text, finish, token ids and logprobs,
    the chunks' heads, the final usage, errors, the [DONE] count."""
    heads, choices, usage, errors, done = set(), {}, None, [], 0
    for line in stream.split(b"\n"):
        if not line.startswith(b"data: "):
            assert not line, line
            continue
        if line == b"data: [DONE]":
            done += 1
            continue
        e = json.loads(line[6:])
        if "error" in e:
            errors.append(e)
            continue
        heads.add((e["id"], e["object"], e["model"], e.get("system_fingerprint")))
        if not e["choices"] and e.get("usage"):
            usage = e["usage"]
        for c in e["choices"]:
            acc = choices.setdefault(c["index"], {"role": None, "content": "", "finish": None, "ids": [], "lp": []})
            delta = c.get("delta") or {}
            acc["role"] = delta.get("role") or acc["role"]
            acc["content"] += delta.get("content") or ""
            if c.get("finish_reason") is not None:
                acc["finish"] = (c["finish_reason"], c.get("stop_reason"))
            acc["ids"] += c.get("token_ids") or []
            acc["lp"] += (c.get("logprobs") or {}).get("content") or []
    return sorted(heads, key=repr), choices, usage, errors, done


def answer(client: httpx.Client, raw: bytes, rid: str) -> tuple[int, str, Any]:
    r = client.post("/v1/chat/completions", content=raw,
                    headers={"content-type": "application/json", "x-request-id": rid})
    kind = r.headers.get("content-type", "")
    content = re.sub(rb'"created":\d+', b'"created":0', r.content)
    return r.status_code, kind, merged(content) if kind.startswith("text/event-stream") else content


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies, indent=st.sampled_from([None, 1]))
@example(body={"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3,
               "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
         indent=None).via("W2's shape")
@example(body={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stop": ["l"],
               "logprobs": True, "top_logprobs": 2, "n": 2}, indent=None).via("stops, logprobs, two choices")
@example(body={"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 3}, indent=None).via("too long")
def test_a_repeated_body_gets_the_full_paths_answer(client: httpx.Client, body: dict[str, Any],
                                                    indent: int | None) -> None:
    raw = json.dumps(body, indent=indent).encode()
    first = answer(client, raw, "req-fixed")
    event(f"HTTP {first[0]}")
    second = answer(client, raw, "req-fixed")
    assert second == first
    spaced = raw[:1] + b" " + raw[1:]  # other bytes, the same request: the full path again
    assert answer(client, spaced, "req-fixed") == first
