"""Tokens in / tokens out and the render routes (--enable-scale-out), their 403 without the flag,
and /invocations, through a real `vllm-vcr serve`."""

from __future__ import annotations

import json
import re

import httpx
import pytest

MODEL = "vllm-vcr/sim"
HI = [{"role": "user", "content": "hi"}]
DISABLED = {"error": {"message": "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to "
                                 "enable them.", "type": "PermissionDeniedError", "param": None, "code": 403}}




@pytest.fixture(scope="module")
def scale_out(serve_harness, tmp_path_factory):
    sp = serve_harness.start_fast(tmp_path_factory, "scale-out", "--enable-scale-out")
    yield sp
    sp.stop()


@pytest.fixture(scope="module")
def plain(serve_harness, tmp_path_factory):
    sp = serve_harness.start_fast(tmp_path_factory, "no-scale-out")
    yield sp
    sp.stop()


def post(sp, path, body):
    return httpx.post(sp.url + path, json=body, timeout=30)


@pytest.mark.parametrize("path", ["/inference/v1/generate", "/v1/chat/completions/render", "/v1/completions/render",
                                  "/v1/messages/render", "/v1/responses/render", "/inference/v1/abort_requests"])
def test_disabled_without_the_flag(plain, path):
    r = post(plain, path, {})
    assert r.status_code == 403 and r.json() == DISABLED


def test_render_then_generate(scale_out):
    rendered = post(scale_out, "/v1/chat/completions/render", {"messages": HI, "max_tokens": 5, "seed": 1}).json()
    tok = post(scale_out, "/tokenize", {"messages": HI}).json()
    assert rendered["token_ids"] == tok["tokens"] and rendered["sampling_params"]["max_tokens"] == 5
    out = post(scale_out, "/inference/v1/generate", rendered).json()
    assert out["request_id"] == "generate-tokens-" + rendered["request_id"]
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 5
    assert out["usage"] == {"prompt_tokens": len(tok["tokens"]), "total_tokens": len(tok["tokens"]) + 5,
                            "completion_tokens": 5, "prompt_tokens_details": None, "completion_tokens_details": None}


def test_completion_render_is_a_list(scale_out):
    rendered = post(scale_out, "/v1/completions/render", {"prompt": ["a", "b c"], "max_tokens": 3}).json()
    assert isinstance(rendered, list) and len(rendered) == 2 and rendered[1]["request_id"].endswith("-1")


def test_text_mode_stream(scale_out):
    with httpx.stream("POST", scale_out.url + "/inference/v1/generate", timeout=30, json={
            "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4}, "stream": True, "output_mode": "text",
            "stream_options": {"include_usage": True}}) as r:
        events = [b[6:] for b in r.read().decode().split("\n\n") if b.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"]) == 4
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and chunks[-1]["choices"] == []


def test_structured_outputs_in_sampling_params(scale_out):
    out = post(scale_out, "/inference/v1/generate", {
        "token_ids": [5, 6], "output_mode": "text",
        "sampling_params": {"max_tokens": 50, "seed": 3, "structured_outputs": {"regex": r"[a-z]{3}-\d{2}"}}}).json()
    assert re.fullmatch(r"[a-z]{3}-\d{2}", out["choices"][0]["text"])


def test_generate_checks(scale_out):
    r = post(scale_out, "/inference/v1/generate", {"token_ids": [], "sampling_params": {}})
    assert r.status_code == 400
    r = post(scale_out, "/inference/v1/generate", {"token_ids": [1], "sampling_params": {}, "model": "nope"})
    assert r.status_code == 404


def test_invocations_routes_by_body(plain):
    chat = post(plain, "/invocations", {"messages": HI, "max_tokens": 3}).json()
    assert chat["object"] == "chat.completion"
    completion = post(plain, "/invocations", {"prompt": "hi", "max_tokens": 3}).json()
    assert completion["object"] == "text_completion"
    r = httpx.post(plain.url + "/invocations", content=b"{bad", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("JSON decode error:")
