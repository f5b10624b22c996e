"""`vllm-vcr play` at its defaults behind the real vLLM 0.32 and 0.33 frontends:
one token per engine step and per SSE event, and logprobs the real frontend can render.

Why chunks merged before: the frontend's output socket task reads every engine message already
queued without yielding (pyzmq completes a recv at once when one is waiting), and its output
handler then feeds them all to the request's RequestOutputCollector before the HTTP task runs, so
the collector merges them. At latency 0 play's steps came microseconds apart; now they come at
least `--min-step-time` (2 ms) apart, as a real GPU's would.
"""

from __future__ import annotations

import time

import pytest

from . import peers
from .test_differential import LOGPROB_CASES, collapse_token_keys, diff, post, real_engine, shape  # noqa: F401
from tests.conftest import scaled

pytestmark = pytest.mark.conformance

STREAM_ATTEMPTS = 20  # a frontend that loses the CPU for longer than a step merges, as with a real GPU
USER = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def play(vllm_version):
    st = peers.start_stack(vllm_version)  # play's defaults: latency 0, the default step floor
    yield st
    st.stop()


def _token_counts(events: list) -> list[int]:
    return [len(e["choices"][0]["token_ids"]) for e in events
            if e != "[DONE]" and e.get("choices") and e["choices"][0].get("token_ids")]


def test_a_12_token_stream_comes_one_token_per_event(play):
    body = {"model": play.model, "messages": USER, "max_tokens": 12, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    seen = []
    for _ in range(STREAM_ATTEMPTS):
        before = peers.metrics(play.base_url)
        status, events = post(play.base_url, "/v1/chat/completions", body)
        assert status == 200, events
        sizes = _token_counts(events)
        assert sum(sizes) == 12, sizes
        content = [e for e in events if e != "[DONE]" and e.get("choices")
                   and "content" in e["choices"][0]["delta"] and e["choices"][0].get("token_ids")]
        seen.append(len(content))
        # deterministic whatever the load: the frontend received one engine message per step
        deadline = time.monotonic() + scaled(10)
        while True:
            steps = (peers.metric_sum(peers.metrics(play.base_url), "vllm:iteration_tokens_total_count")
                     - peers.metric_sum(before, "vllm:iteration_tokens_total_count"))
            if steps >= 12 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert steps >= 12, f"the frontend saw {steps:.0f} engine steps for 12 tokens"
        if len(content) >= 12:
            assert sizes == [1] * 12
            return
    pytest.fail(f"no 12-token stream came as 12 content chunks in {STREAM_ATTEMPTS} tries: {seen}")


def _check_sample_logprobs(name: str, resp: dict, k: int, chat: bool) -> None:
    choice = resp["choices"][0]
    n = resp["usage"]["completion_tokens"]
    if chat:
        content = choice["logprobs"]["content"]
        assert len(content) == n, name
        for entry in content:
            assert len(entry["top_logprobs"]) == k, (name, entry)
            assert entry["top_logprobs"] and entry["logprob"] <= 0.0
    else:
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]), name
        tops = [t for t in lp["top_logprobs"] if t is not None]
        assert len(tops) >= n and all(k <= len(t) <= k + 1 or (k == 0 and len(t) == 1) for t in tops), (name, tops)


def _check_prompt_logprobs(name: str, resp: dict, k: int) -> None:
    plp = resp.get("prompt_logprobs") or resp["choices"][0].get("prompt_logprobs")
    assert plp[0] is None and len(plp) == resp["usage"]["prompt_tokens"], (name, plp)
    for pos in plp[1:]:
        assert max(k, 1) <= len(pos) <= k + 1, (name, pos)
        assert all({"logprob", "rank", "decoded_token"} <= v.keys() for v in pos.values())


LOGPROBS = [  # (name, path, body, sample k, prompt k)
    ("chat_top_3", "/v1/chat/completions", {"messages": USER, "max_tokens": 5, "logprobs": True,
                                            "top_logprobs": 3}, 3, None),
    ("chat_top_3_stream", "/v1/chat/completions", {"messages": USER, "max_tokens": 5, "logprobs": True,
                                                   "top_logprobs": 3, "stream": True,
                                                   "stream_options": {"include_usage": True}}, 3, None),
    ("chat_prompt_logprobs", "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "prompt_logprobs": 1},
     None, 1),
    ("completion_logprobs_2", "/v1/completions", {"prompt": "hello there", "max_tokens": 4, "logprobs": 2}, 2, None),
    ("completion_logprobs_0", "/v1/completions", {"prompt": "hello there", "max_tokens": 4, "logprobs": 0}, 0, None),
    ("completion_logprobs_2_stream", "/v1/completions", {"prompt": "hello there", "max_tokens": 4, "logprobs": 2,
                                                         "stream": True,
                                                         "stream_options": {"include_usage": True}}, 2, None),
    ("completion_prompt_logprobs", "/v1/completions", {"prompt": "hello there", "max_tokens": 2,
                                                       "prompt_logprobs": 2}, None, 2),
    ("completion_echo_both", "/v1/completions", {"prompt": "hello there", "max_tokens": 2, "echo": True,
                                                 "logprobs": 1, "prompt_logprobs": 1}, 1, 1),
]


def _merged(events: list, chat: bool) -> dict:
    """A stream's chunks as one response: its logprobs concatenated, its usage."""
    out = {"choices": [{"logprobs": {"content": []} if chat else
                        {"tokens": [], "token_logprobs": [], "top_logprobs": []}}]}
    for e in events:
        if e == "[DONE]":
            continue
        if e.get("usage"):
            out["usage"] = e["usage"]
        for c in e.get("choices") or []:
            lp = c.get("logprobs")
            if lp:
                for key, items in lp.items():
                    if isinstance(items, list) and key in out["choices"][0]["logprobs"]:
                        out["choices"][0]["logprobs"][key] += items
    return out


@pytest.mark.parametrize("name, path, body, k, prompt_k", LOGPROBS, ids=[c[0] for c in LOGPROBS])
def test_logprobs_through_the_real_frontend(play, name, path, body, k, prompt_k):
    chat = path.startswith("/v1/chat")
    status, resp = post(play.base_url, path, {"model": play.model, **body, "ignore_eos": True})
    assert status == 200, resp
    if body.get("stream"):
        resp = _merged(resp, chat)
    if k is not None:
        _check_sample_logprobs(name, resp, k, chat)
    if prompt_k is not None:
        _check_prompt_logprobs(name, resp, prompt_k)


def test_logprob_shapes_equal_the_real_engines(play, real_engine):
    """The same requests to the real frontend with its real CPU engine (0.32) and with play."""
    findings = []
    for name, (path, body) in LOGPROB_CASES.items():
        body = {"model": real_engine.model, **body, "ignore_eos": True}
        sa, a = post(real_engine.url, path, body)
        sb, b = post(play.base_url, path, body)
        if sa != sb:
            findings.append(f"{name}: HTTP {sa} with the real engine, {sb} with play")
            continue
        findings += [f"{name}: {d}" for d in diff(shape(collapse_token_keys(a)), shape(collapse_token_keys(b)))]
    assert not findings, "play's logprobs differ from the real engine's:\n" + "\n".join(findings)
