"""`vllm-vcr serve` processes: CLI errors, start-up, auth, engine errors, disconnects, signals."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from tests.conftest import scaled, wait_until

MODEL = "vllm-vcr/sim"


@pytest.mark.parametrize("args, flag", [
    (["--port", "abc"], "--port"),
    (["--max-model-len", "lots"], "--max-model-len"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--time-to-first-token", "-5"], "--time-to-first-token"),
    (["--failure-types", "bogus"], "--failure-types"),
    (["--tokenizer", "/nonexistent/dir"], "--tokenizer"),
    (["--time-scale", "0"], "--time-scale"),
    (["--prefix-caching-hash-algo", "md5"], "--prefix-caching-hash-algo"),
    (["--fingerprint-mode", "custom"], "--fingerprint-value"),
])
def test_bad_flag_values_exit_2(args, flag, capsys):
    from vllm_vcr.cli import build_parser

    parser, modules = build_parser()
    try:  # in process (without the CLI's logging set-up): every case fails before anything starts
        code = modules["serve"].run(parser.parse_args(["serve", *args]))
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert flag in err
    assert "Traceback" not in err


def test_vllm_command_line_accepted_and_sigterm_exits_0(serve_harness, tmp_path):
    """A typical `vllm serve` manifest line, unchanged; quick start-up; SIGTERM -> exit 0."""
    t0 = time.monotonic()
    sp = serve_harness.ServeProcess(
        ["meta-llama/Llama-3.1-8B-Instruct", "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.9",
         "--dtype", "bfloat16", "--enforce-eager", "--trust-remote-code", "--kv-cache-dtype", "fp8",
         "--no-enable-prefix-caching", "--disable-log-requests", "--enable-chunked-prefill",
         "--max-model-len", "8k", "--max-num-seqs", "64", "--max-num-batched-tokens", "4096", "--block-size", "16",
         "--cpu-offload-gb", "4", "--download-dir", "/models", "--load-format", "safetensors",
         "--enable-prompt-tokens-details", "--uvicorn-log-level", "warning", "--disable-log-stats",
         "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json", "--seed", "0",
         "--generation-config", "vllm", "-q", "fp8", "--inter-token-latency", "1"],
        log_path=tmp_path / "serve.log").wait_ready()
    startup = time.monotonic() - t0
    models = httpx.get(sp.url + "/v1/models").json()
    assert models["data"][0]["id"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert models["data"][0]["max_model_len"] == 8000
    log = sp.log()
    assert "--tensor-parallel-size=2" in log and "--dtype=bfloat16" in log
    assert startup < scaled(10)  # generous: CI machines are shared; the process itself reports ~0.2 s
    assert sp.stop(signal.SIGTERM) == 0


@pytest.mark.vllm_vcr(api_key="sekrit", inter_token_latency=0)
def test_api_key(vllm_vcr_server):
    sp = vllm_vcr_server
    r = httpx.get(sp.url + "/v1/models")
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    r = httpx.get(sp.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = httpx.get(sp.url + "/v1/models", headers={"Authorization": "Bearer sekrit"})
    assert r.status_code == 200
    assert httpx.get(sp.url + "/health").status_code == 200  # only /v1 is guarded, as in vLLM


@pytest.mark.vllm_vcr(failure_injection_rate=1, failure_types=["error"])
def test_engine_error_is_500(vllm_vcr_server):
    sp = vllm_vcr_server
    r = httpx.post(sp.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3})
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "Internal server error", "type": "InternalServerError",
                                  "param": None, "code": 500}}
    r = httpx.post(sp.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True})
    events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == 500
    assert httpx.get(sp.url + "/health").status_code == 200


@pytest.mark.vllm_vcr(failure_injection_rate=1, failure_types=["length"])
def test_injected_length_failure_is_a_normal_finish(vllm_vcr_server):
    sp = vllm_vcr_server
    r = httpx.post(sp.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


async def _stats_once_aborted(engine):
    """Engine stats, polled until the abort that follows a client disconnect has landed (≤ 4 s)."""
    for _ in range(200):
        stats = await engine.call_all(lambda core: core.stats)
        if stats[0].requests_aborted >= 1:
            break
        await asyncio.sleep(0.02)
    return stats


@pytest.mark.parametrize("stamped", [False, True], ids=["uvicorn-protocol", "serve-protocol"])
async def test_client_disconnect_aborts_engine_request(inprocess, stamped):
    url, engine = await inprocess(itl_ms=5.0, stamped=stamped)
    async with httpx.AsyncClient(timeout=10) as c:
        async with c.stream("POST", url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 2000,
                "stream": True}) as r:
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 3:
                    break
        # leaving the block closes the connection mid-stream
    stats = await _stats_once_aborted(engine)
    assert stats[0].requests_aborted == 1
    assert stats[0].requests_completed == 0
    assert stats[0].running == 0 or engine.engines[0].num_unfinished() == 0


@pytest.mark.parametrize("stamped", [False, True], ids=["uvicorn-protocol", "serve-protocol"])
async def test_non_streaming_disconnect_aborts_too(inprocess, stamped):
    # serve's protocol reports the disconnect through the scope's hook; uvicorn's own is watched
    url, engine = await inprocess(itl_ms=5.0, stamped=stamped)
    async with httpx.AsyncClient(timeout=0.3) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2000})
    stats = await _stats_once_aborted(engine)
    assert stats[0].requests_aborted == 1


def test_sigterm_with_stream_in_flight_drains_and_exits_0(serve_process):
    sp = serve_process("--inter-token-latency", "20", "--shutdown-timeout", "0.5")
    with httpx.Client(timeout=15) as c:
        with c.stream("POST", sp.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "x", "max_tokens": 4000, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            sp.proc.send_signal(signal.SIGTERM)
            rest = [ln for ln in lines if ln.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    finish = [json.loads(ln[6:]) for ln in rest[:-1]][-1]["choices"][0]["finish_reason"]
    assert finish == "abort"
    assert sp.proc.wait(scaled(10)) == 0


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_cuts_the_drain_short(serve_process, second):
    # the stream would outlast the 300 s drain; the second signal aborts it and the process exits
    sp = serve_process("--inter-token-latency", "100", "--shutdown-timeout", "300")
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", sp.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "x", "max_tokens": 4000, "ignore_eos": True,
                            "stream": True}) as r:
            lines = (ln for ln in r.iter_lines() if ln.startswith("data: "))
            next(lines)
            sp.proc.send_signal(signal.SIGTERM)
            for _ in range(5):  # draining: the stream goes on
                assert next(lines) != "data: [DONE]"
            assert sp.proc.poll() is None
            sp.proc.send_signal(second)
            try:
                assert sp.proc.wait(30) == 0  # not the 300 s of the drain
            finally:
                if sp.proc.poll() is None:
                    sp.proc.kill()  # ends the stream, so the test does not hang on it
            try:
                rest = list(lines)
            except httpx.HTTPError:  # the stream may be cut rather than closed
                rest = []
    if rest:
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "abort"


def _first_answer(url: str, timeout: float = 15.0) -> tuple[float, int]:
    """(seconds until the port answered, the status of GET /health then)."""
    t0 = time.monotonic()
    timeout = scaled(timeout)
    while time.monotonic() - t0 < timeout:
        try:
            return time.monotonic() - t0, httpx.get(url + "/health", timeout=0.5).status_code
        except httpx.ConnectError:
            time.sleep(0.05)
    raise AssertionError("the port never answered")


def test_startup_time_nothing_listens_until_loaded_then_ready(serve_process):
    # like vLLM: connections are refused while the model "loads"; "ready" is logged only after
    sp = serve_process("--startup-time", "2.0", wait=False)
    waited, status = _first_answer(sp.url)
    assert status == 200 and waited > 1.0
    log = sp.log()
    assert log.index("simulating model loading") < log.index("ready in")
    r = httpx.post(sp.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=15)
    assert r.status_code == 200


def test_startup_failure_exits_1_with_its_message_never_listening(serve_process):
    bad = serve_process("--startup-time", "1.0", "--startup-failure", "CUDA out of memory", wait=False)
    assert bad.proc.wait(15) == 1
    with pytest.raises(httpx.ConnectError):
        httpx.get(bad.url + "/health", timeout=0.5)
    assert "CUDA out of memory" in bad.log() and "ready in" not in bad.log()


def test_prefill_worker_returns_kv_transfer_params(serve_process):
    sp = serve_process("--worker-type", "prefill")
    r = httpx.post(sp.url + "/v1/completions", json={
        "model": MODEL, "prompt": "a prompt for the decode side", "max_tokens": 10,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 1
    assert isinstance(body["kv_transfer_params"], dict) and body["kv_transfer_params"]


def test_model_directory_supplies_tokenizer_and_template(serve_process, tmp_path):
    from importlib import resources

    d = tmp_path / "my-model"
    d.mkdir()
    data = resources.files("vllm_vcr") / "data"
    (d / "tokenizer.json").write_text((data / "tokenizer.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|end_of_text|>", "bos_token": "<|begin_of_text|>",
        "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}"}))
    sp = serve_process(str(d), "--mode", "echo", "--inter-token-latency", "0")
    models = httpx.get(sp.url + "/v1/models").json()
    assert models["data"][0]["id"] == str(d)
    r = httpx.post(sp.url + "/v1/chat/completions", json={
        "model": str(d), "messages": [{"role": "user", "content": "hey"}], "max_tokens": 30}).json()
    assert r["choices"][0]["message"]["content"].startswith("<user>hey<assistant>")
    m = httpx.get(sp.url + "/metrics").text
    assert "vllm:request_success_total" in m


def test_kv_events_from_serve(serve_process, tmp_path):
    import zmq

    from vllm_vcr.kv_events import decode_batch

    endpoint = f"ipc://{tmp_path}/kv-events"  # bound by the publisher, no TCP port needed
    cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"})
    sp = serve_process("--kv-events-config", cfg, "--inter-token-latency", "0")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        # PUB/SUB: events published before the subscription reached the publisher are lost, so
        # requests go until one's events arrive (a new prompt each time: no prefix-cache hit)
        sent = iter(range(10**6))

        def published() -> bool:
            prompt = f"block {next(sent)} " * 64
            httpx.post(sp.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                       timeout=scaled(30))
            return bool(sub.poll(200))

        wait_until(published, 10, "a KV event")
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        assert decode_batch(payload).events
    finally:
        sub.close(0)
        ctx.term()


def test_reasoning_parser_splits_thinking(serve_process):
    sp = serve_process("--reasoning", "100,101,0.5", "--reasoning-parser", "deepseek_r1")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "think"}], "max_tokens": 10, "ignore_eos": True}
    r = httpx.post(sp.url + "/v1/chat/completions", json=body).json()
    msg = r["choices"][0]["message"]
    assert msg["reasoning"] and msg["content"]
    assert r["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}  # 5 thinking = start + 3 + end
    s = httpx.post(sp.url + "/v1/chat/completions",
                   json={**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(e[6:]) for e in s.text.split("\n\n") if e.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasoning = "".join(d.get("reasoning", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert reasoning == msg["reasoning"] or reasoning  # random tokens differ per request
    assert content
    first_content = next(k for k, d in enumerate(deltas) if d.get("content"))
    assert all("content" not in d or d["content"] == "" for d in deltas[1:first_content])  # thinking first
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}


def test_a_request_that_can_never_fit_is_a_clear_400(serve_process):
    # 4 blocks of 16 tokens: a ~200-token prompt can never be admitted
    sp = serve_process("--kv-cache-size", "4", "--block-size", "16")
    r = httpx.post(sp.url + "/v1/completions", json={"model": MODEL, "prompt": "word " * 200, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and "KV blocks" in err["message"]
    ok = httpx.post(sp.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200  # the server goes on
