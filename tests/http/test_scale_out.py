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


# --- derender: the way back from tokens ---------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def scale_out_tools(serve_harness, tmp_path_factory):
    sp = serve_harness.start_fast(tmp_path_factory, "scale-out-tools", "--enable-scale-out",
                                  "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield sp
    sp.stop()


def generate_stream(sp, rendered) -> list[dict]:
    with httpx.stream("POST", sp.url + "/inference/v1/generate", timeout=30,
                      json={**rendered, "stream": True}) as r:
        events = [b[6:] for b in r.read().decode().split("\n\n") if b.startswith("data: ")]
    return [json.loads(e) for e in events[:-1]]


def test_derender_chat_is_the_text_of_the_tokens(scale_out):
    rendered = post(scale_out, "/v1/chat/completions/render", {"messages": HI, "max_tokens": 6, "seed": 2}).json()
    out = post(scale_out, "/inference/v1/generate", rendered).json()
    ids = out["choices"][0]["token_ids"]
    text = post(scale_out, "/detokenize", {"tokens": ids}).json()["prompt"]
    back = post(scale_out, "/v1/chat/completions/derender",
                {"generate_response": out, "prompt_tokens": len(rendered["token_ids"])}).json()
    assert back["object"] == "chat.completion" and back["id"] == out["request_id"]
    assert back["choices"][0]["message"]["content"] == text
    assert back["choices"][0]["finish_reason"] == "length"
    assert back["usage"]["completion_tokens"] == 6 and back["usage"]["prompt_tokens"] == len(rendered["token_ids"])


def test_derender_completion_joins_the_prompts(scale_out):
    rendered = post(scale_out, "/v1/completions/render", {"prompt": ["a", "b c"], "max_tokens": 3}).json()
    outs = [post(scale_out, "/inference/v1/generate", r).json() for r in rendered]
    back = post(scale_out, "/v1/completions/derender", {"generate_responses": outs, "prompt_tokens": [2, 3]}).json()
    assert [c["index"] for c in back["choices"]] == [0, 1]
    assert back["usage"] == {"prompt_tokens": 5, "total_tokens": 11, "completion_tokens": 6,
                             "prompt_tokens_details": None, "completion_tokens_details": None}


def test_derender_stream_adds_up(scale_out):
    rendered = post(scale_out, "/v1/completions/render", {"prompt": "once", "max_tokens": 8, "seed": 3}).json()[0]
    state, text, ids = None, "", []
    for chunk in generate_stream(scale_out, rendered):
        if not chunk["choices"]:
            continue
        ids += chunk["choices"][0]["token_ids"]
        r = post(scale_out, "/v1/completions/derender", {"stream": True, "generate_chunk": chunk,
                                                          "stream_state": state}).json()
        state, text = r["stream_state"], text + r["chunk"]["choices"][0]["text"]
    assert text == post(scale_out, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert state["output_token_ids"] == ids


def test_derender_reads_tool_calls_back(scale_out_tools):
    req = {"messages": HI, "tools": [TOOL], "tool_choice": "required", "max_tokens": 200, "seed": 4}
    rendered = post(scale_out_tools, "/v1/chat/completions/render", req).json()
    # the tokens a model writes for a hermes call (how the engine gets there is not derender's business)
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 22}}\n</tool_call>'
    ids = post(scale_out_tools, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    out = {"request_id": "gen-1", "choices": [{"index": 0, "finish_reason": "stop", "token_ids": ids}]}
    r = post(scale_out_tools, "/v1/chat/completions/derender", {"generate_response": out})
    assert r.status_code == 400 and "chat_request is required" in r.json()["error"]["message"]
    back = post(scale_out_tools, "/v1/chat/completions/derender",
                {"generate_response": out, "chat_request": {"model": MODEL, **req}}).json()
    call = back["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "add" and set(json.loads(call["function"]["arguments"])) >= {"a", "b"}
    # streamed: one call per chunk, the state carried by the client
    state, calls = None, {}
    for k in range(0, len(ids), 2):
        chunk = {"request_id": "gen-1", "choices": [{"index": 0, "token_ids": ids[k:k + 2],
                                                     "finish_reason": "stop" if k + 2 >= len(ids) else None}]}
        r = post(scale_out_tools, "/v1/chat/completions/derender", {
            "stream": True, "generate_chunk": chunk, "stream_state": state, "chat_request": {"model": MODEL, **req},
            "prompt_token_ids": rendered["token_ids"]}).json()
        state = r["stream_state"]
        for d in r["chunk"]["choices"][0]["delta"].get("tool_calls") or ():
            entry = calls.setdefault(d["index"], ["", ""])
            entry[0] += d["function"].get("name", "")
            entry[1] += d["function"].get("arguments", "")
        finish = r["chunk"]["choices"][0]["finish_reason"]
    assert calls[0][0] == "add" and json.loads(calls[0][1]) == json.loads(call["function"]["arguments"])
    assert finish == "tool_calls" and state["tools_streamed"]


def test_derender_checks(scale_out):
    r = post(scale_out, "/v1/completions/derender", {"generate_responses": []})
    assert r.status_code == 400 and r.json()["error"]["message"] == "generate_responses must not be empty"
    r = post(scale_out, "/v1/chat/completions/derender", {"generate_response": {
        "request_id": "x", "choices": [{"index": 0, "token_ids": []}]}})
    assert r.status_code == 400 and r.json()["error"]["message"] == "choice 0 has empty or null token_ids"
