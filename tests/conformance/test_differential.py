"""Differential: the same requests to (a) a real vLLM frontend + `vllm-vcr play` and (b)
`vllm-vcr serve --tokenizer <same model dir>`, both with `--mode echo` so the engine side produces
the same token ids. Compared: JSON shape (keys and types), SSE chunk sequence, finish reasons,
usage numbers, texts, error statuses and messages.

A difference is a finding about `serve` (the real frontend is the reference). Differences already
reported are listed in KNOWN (shown as a warning, so they stay visible); any other one fails the
test. Remove an entry once serve matches.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import warnings

import httpx
import pytest

from . import peers

pytestmark = pytest.mark.conformance

ENGINE_FLAGS = ["--mode", "echo", "--vocab-size", str(peers.VOCAB_SIZE), "--seed", "3"]
# Values that differ by construction between two servers (ids, clocks, build stamps).
VOLATILE = {"id", "created", "system_fingerprint", "created_at", "call_id", "signature", "request_id",
            "item_id"}


@pytest.fixture(scope="module")
def real(vllm_version):
    st = peers.start_stack(vllm_version, play_args=ENGINE_FLAGS)
    yield st
    st.stop()


def _start_sim(tmp_path_factory, extra_args: list[str] = (), extra_env: dict[str, str] | None = None) -> dict:
    port, control = peers.free_port(), peers.free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOCK_")}
    env["PYTHONPATH"] = os.pathsep.join([str(peers.REPO / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra_env or {})
    cmd = [sys.executable, "-m", "vllm_vcr", "serve", str(peers.MODEL_DIR), "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "1024", "--tokenizer", str(peers.MODEL_DIR),
           "--control-address", f"127.0.0.1:{control}", *ENGINE_FLAGS, *extra_args]
    proc = peers._spawn("vllm-vcr serve", cmd, env, log, cwd=peers.REPO)
    deadline = time.monotonic() + 60
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
def sim(tmp_path_factory):
    st = _start_sim(tmp_path_factory)
    yield st
    st["proc"].stop()


# Reported differences of `vllm-vcr serve` from the real 0.32/0.33 frontends (regexes over findings).
KNOWN = [
    # null-valued fields the real frontend always writes and serve omits
    (r"\.(prompt_token_ids|routed_experts|token_ids|weight_versions|ec_transfer_params|metrics|prompt_text"
     r"|completion_tokens_details|reasoning): missing in serve"),
    # usage.prompt_tokens_details: null in vLLM unless --enable-prompt-tokens-details; serve always fills it
    r"prompt_tokens_details: (type NoneType in real, dict in serve|only in serve)",
    # chat message: serve adds reasoning_content (pre-0.32 name) and an empty tool_calls list
    r"message\.(reasoning_content|tool_calls): only in serve",
    # streaming chunks carry the same null fields as above (and system_fingerprint on the usage chunk)
    r"chunk shape only in (real|serve)",
    # error texts
    r"too_long: \$\.error\.message: ",
    r"unknown_model: \$\.error\.message: ",
    # vLLM 0.33's /is_scaling_elastic_ep also reports the scaling phase; serve answers as 0.32
    r"is_scaling: \$\.(epoch|error|phase|requested_data_parallel_size): missing in serve",
]


def _check(findings: list[str]) -> None:
    norm = sorted({re.sub(r"\[\d+\]", "[*]", f) for f in findings})
    known = [f for f in norm if any(re.search(k, f) for k in KNOWN)]
    new = [f for f in norm if f not in known]
    if known:
        warnings.warn("known differences of serve from the real frontend:\n" + "\n".join(known), stacklevel=2)
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


def post(base: str, path: str, body: dict) -> tuple[int, object]:
    """(status, JSON body or the list of SSE events)."""
    with httpx.stream("POST", base + path, json=body, timeout=60) as r:
        raw = r.read().decode()
        if body.get("stream") and r.status_code == 200:
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
CASES = {
    "completion": ("/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 6}),
    "completion_n2": ("/v1/completions", {"prompt": "import sys", "max_tokens": 4, "n": 2}),
    "completion_stop": ("/v1/completions", {"prompt": "def add(a, b): return a + b", "max_tokens": 20,
                                            "stop": ["return"]}),
    "completion_stream": ("/v1/completions", {"prompt": "for i in range(3):", "max_tokens": 5, "stream": True,
                                              "stream_options": {"include_usage": True}}),
    "chat": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 6}),
    "chat_stream": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 6, "stream": True,
                                             "stream_options": {"include_usage": True}}),
    "too_long": ("/v1/completions", {"prompt": "x", "max_tokens": 5000}),
    "unknown_model": ("/v1/completions", {"prompt": "x", "max_tokens": 2, "model": "no-such-model"}),
}


def test_same_answers(real, sim):
    findings: list[str] = []
    for name, (path, body) in CASES.items():
        body = {"model": real.model, **body}
        sa, a = post(real.base_url, path, body)
        sb, b = post(sim["base_url"], path, body)
        if sa != sb:
            findings.append(f"{name}: HTTP {sa} in real, {sb} in serve")
        if body.get("stream") and isinstance(a, list) and isinstance(b, list):
            findings += [f"{name}: {d}" for d in diff(merge_stream(a), merge_stream(b), "$stream")]
            # every chunk has the same keys and types (first, content and usage chunks)
            sha = {json.dumps(shape(e)) for e in a if e != "[DONE]"}
            shb = {json.dumps(shape(e)) for e in b if e != "[DONE]"}
            for s in sorted(sha - shb):
                findings.append(f"{name}: chunk shape only in real: {s:.300}")
            for s in sorted(shb - sha):
                findings.append(f"{name}: chunk shape only in serve: {s:.300}")
        else:
            findings += [f"{name}: {d}" for d in diff(a, b)]
    _check(findings)


def test_injected_error_same_status(real, sim):
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
    _check(findings)


# -- the rest of the generative surface (issue 13): Responses, Anthropic Messages, tool and
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
# differences of this surface that are known and documented (docs/serve.md)
SURFACE_KNOWN = [
    # xgrammar's own compiler messages cannot be reproduced without xgrammar
    r"rf_bad_schema: \$\.error\.message: ",
]
# serve reproduces 0.32; what 0.33 changed on this surface (documented in docs/serve-api.md)
SURFACE_KNOWN_033 = [
    r"^responses(_stream)?: ",  # 0.33: response.incomplete event, prompt_cache_* / safety_identifier fields
    r"^messages_tools_gate: \$\.error\.type: 'invalid_request_error' in real",
]


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
    norm = sorted({re.sub(r"\[\d+\]", "[*]", f) for f in findings})
    allowed = KNOWN + SURFACE_KNOWN + (SURFACE_KNOWN_033 if real.version == "0.33" else [])
    new = [f for f in norm if not any(re.search(k, f) for k in allowed)]
    known = [f for f in norm if f not in new]
    if known:
        warnings.warn("known differences of serve from the real frontend:\n" + "\n".join(known), stacklevel=2)
    assert not new, "serve differs from the real frontend:\n" + "\n".join(new)


# --- LoRA, sleep and the operator endpoints (issue 14) ---------------------------------------------

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
    accepts any LoRARequest, so the real frontend in front of it says 200) and partial /wake_up tags
    (`play`'s wake_up always reports fully awake) — tests/http/test_lora.py and
    test_sleep_and_management.py check those against vLLM's code instead."""
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
    _check(findings)


@pytest.mark.skip(reason="the real frontend cannot serve the pooling routes in front of `vllm-vcr play`: play "
                         "answers get_supported_tasks with ['generate'] and produces no pooling outputs, so "
                         "`vllm serve --runner pooling` has no pooling task to serve; tests/http/test_pooling.py "
                         "checks the routes against vLLM 0.32's code instead")
def test_pooling_routes_match():
    pass
