"""Regression tests for what a hostile client could do to `serve` and its control API, each through
the real process and a real client."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, scaled

MODEL = "vllm-vcr/sim"
UNTRUSTED = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
             "Refused request with untrusted chat template.")
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def plain(serve_harness, tmp_path_factory):
    """Default flags, with the control API (reloadable logging is installed by the CLI)."""
    port = serve_harness.free_port()
    log = Path(tmp_path_factory.mktemp("hostile")) / "serve.log"
    sp = serve_harness.ServeProcess(["--inter-token-latency", "0", "--time-to-first-token", "0",
                                     "--control-address", f"127.0.0.1:{port}"], log_path=log).wait_ready()
    sp.control_url = f"http://127.0.0.1:{port}"
    yield sp
    assert sp.stop() == 0


@pytest.fixture(scope="module")
def trusting(serve_harness, tmp_path_factory):
    log = Path(tmp_path_factory.mktemp("trusting")) / "serve.log"
    sp = serve_harness.ServeProcess(["--inter-token-latency", "0", "--trust-request-chat-template"],
                                    log_path=log).wait_ready()
    yield sp
    assert sp.stop() == 0


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# ---- 1. chat templates from the request ----------------------------------------------------------

@pytest.mark.parametrize("path,extra", [
    ("/v1/chat/completions", {"chat_template": "{{ messages }}"}),
    ("/v1/chat/completions", {"chat_template_kwargs": {"chat_template": "{{ messages }}"}}),
    ("/tokenize", {"chat_template": NESTED_LOOPS}),
])
def test_request_template_refused_without_the_flag(plain, path, extra):
    err = _error(httpx.post(plain.url + path, json={"model": MODEL, "messages": MSGS, **extra}, timeout=10), 400)
    assert err["message"] == UNTRUSTED and err["type"] == "BadRequestError"


def test_trusted_template_renders(trusting):
    r = httpx.post(trusting.url + "/tokenize", json={
        "model": MODEL, "messages": MSGS, "chat_template": "{% for m in messages %}<{{ m.content }}>{% endfor %}"},
        timeout=scaled(30))  # the first request template starts its worker process
    assert r.status_code == 200, r.text
    assert r.json()["count"] > 0


def test_endless_template_is_stopped_and_the_server_keeps_answering(trusting):
    result: dict = {}

    def hostile() -> None:
        t0 = time.monotonic()
        result["r"] = httpx.post(trusting.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": MSGS, "chat_template": NESTED_LOOPS}, timeout=60)
        result["seconds"] = time.monotonic() - t0

    th = threading.Thread(target=hostile)
    th.start()
    time.sleep(0.3)
    worst = 0.0
    while th.is_alive():  # /health and a real request are answered while the template spins
        t0 = time.monotonic()
        assert httpx.get(trusting.url + "/health", timeout=scaled(10)).status_code == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.05)
    th.join()
    err = _error(result["r"], 400)
    assert "took longer than" in err["message"]
    assert result["seconds"] < scaled(20)
    assert worst < scaled(2.0), worst


def test_sigterm_while_a_template_renders(serve_process):
    import signal

    sp = serve_process("--inter-token-latency", "0", "--trust-request-chat-template")
    th = threading.Thread(target=lambda: httpx.post(sp.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": MSGS, "chat_template": NESTED_LOOPS}, timeout=30), daemon=True)
    th.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    sp.proc.send_signal(signal.SIGTERM)
    assert sp.proc.wait(scaled(20)) == 0
    assert time.monotonic() - t0 < scaled(10)  # a render in flight does not hold up the exit


@pytest.mark.parametrize("template", [
    "{{ 'a' * 300000000 }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{{ 'x' | center(300000000) }}",
    "{{ '%300000000s' % 'a' }}",
    "{% for i in range(100000) %}{{ 'abcdefghij' * 100 }}{% endfor %}",
])
def test_memory_hungry_templates_fail_fast(trusting, template):
    t0 = time.monotonic()
    err = _error(httpx.post(trusting.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": MSGS, "chat_template": template}, timeout=scaled(30)), 400)
    assert "exceeds" in err["message"]
    assert time.monotonic() - t0 < scaled(5)


# ---- 3. PUT /log ---------------------------------------------------------------------------------

def test_huge_log_filter_is_refused_at_once(plain):
    spec = ",".join(f"t{i}=debug" for i in range(100_000)) + ",info"
    t0 = time.monotonic()
    r = httpx.put(plain.control_url + "/log", json={"filter": spec}, timeout=10)
    assert r.status_code == 400 and "characters long" in r.json()["error"]
    assert time.monotonic() - t0 < scaled(2)
    many = ",".join(f"t{i}=debug" for i in range(200)) + ",info"
    r = httpx.put(plain.control_url + "/log", json={"filter": many}, timeout=10)
    assert r.status_code == 400 and "more than 128 targets" in r.json()["error"]
    ok = httpx.put(plain.control_url + "/log", json={"filter": "vllm_vcr::engine=debug,info"}, timeout=10)
    assert ok.status_code == 200 and ok.json() == {"filter": "vllm_vcr::engine=debug,info"}
    assert httpx.put(plain.control_url + "/log", json={"filter": "info"}).status_code == 200


# ---- 5. deeply nested JSON -----------------------------------------------------------------------

DEEP = b"[" * 5000 + b"]" * 5000


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", b'{"model": "vllm-vcr/sim", "prompt": "hi", "vllm_xargs": {"a": ' + DEEP + b"}}"),
    ("/v1/chat/completions", b'{"model": "vllm-vcr/sim", "messages": ' + DEEP + b"}"),
    ("/tokenize", b'{"prompt": "hi", "x": ' + DEEP + b"}"),
    ("/tokenize", b'{"messages": ' + DEEP + b"}"),
    ("/detokenize", b'{"tokens": ' + DEEP + b"}"),
    ("/v1/completions", b"[" * 100_000),
])
def test_deeply_nested_json_is_a_400(plain, path, body):
    r = httpx.post(plain.url + path, content=body, headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400
    assert r.json() == {"detail": "There was an error parsing the body"}  # FastAPI's own body, as vLLM


@pytest.mark.parametrize("method,path", [("PATCH", "/config"), ("PUT", "/log")])
def test_deeply_nested_json_on_the_control_api_is_a_422(plain, method, path):
    r = httpx.request(method, plain.control_url + path, content=b'{"a": ' + DEEP + b"}",
                      headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 422 and "nested too deeply" in r.json()["error"]


# ---- 6. the rest ---------------------------------------------------------------------------------

def test_413_closes_the_connection(plain):
    with socket.create_connection(("127.0.0.1", plain.port), timeout=10) as s:
        size = 64 * 1024 * 1024 + 1
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n" % size)
        chunk = b" " * (1 << 20)
        sent = 0
        try:
            while sent < size:
                sent += s.send(chunk[: min(len(chunk), size - sent)])
        except OSError:
            pass  # the server answered and closed while we were still sending
        data = b""
        try:
            while True:
                part = s.recv(65536)
                if not part:
                    break  # closed by the server: the point of the test
                data += part
        except ConnectionResetError:
            pass
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert b"connection: close" in data.lower()


def test_stats_reset_refuses_what_a_web_page_could_send(plain):
    url = plain.control_url + "/stats/reset"
    assert httpx.post(url, content=b"x", headers={"content-type": "text/plain"}).status_code == 415
    assert httpx.post(url, data={"a": "1"}).status_code == 415  # a form post
    r = httpx.post(url, headers={"origin": "http://evil.example"})
    assert r.status_code == 403 and "Origin" in r.json()["error"]
    assert httpx.post(url).status_code == 200  # the seed's `curl -s -X POST .../stats/reset`
    assert httpx.post(url, json={}).status_code == 200


@pytest.mark.parametrize("extra,message", [
    ({"prompt_logprobs": 1e30}, "exceeded maximum size"),
    ({"prompt_logprobs": -5}, "`prompt_logprobs` must be a positive value or -1. (parameter=prompt_logprobs, value=-5)"),
    ({"prompt_logprobs": -1}, "Requested prompt logprobs of "),
    ({"prompt_logprobs": 21}, "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
    ({"prompt_logprobs": 1, "stream": True}, "`prompt_logprobs` are not available when `stream=True`."),
    ({"truncate_prompt_tokens": -5}, "greater than or equal to -1"),
    ({"prompt_embeds": ""}, "You must set `--enable-prompt-embeds` to input `prompt_embeds`."),
])
def test_values_vllm_rejects(plain, extra, message):
    err = _error(httpx.post(plain.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", **extra}), 400)
    assert message in err["message"]


def test_chat_prompt_logprobs_checked_too(plain):
    err = _error(httpx.post(plain.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": MSGS, "prompt_logprobs": 50}), 400)
    assert "Requested prompt logprobs of 50" in err["message"]


def test_emfile_backs_off_and_recovers(serve_harness, tmp_path):
    """Out of descriptors: no busy loop, one log line per interval, served again once fds free up."""
    import resource
    import subprocess
    import sys

    port = free_port()
    log = tmp_path / "serve.log"
    limit = 96

    def low_fd_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vllm_vcr", "serve", "--host", "127.0.0.1", "--port",
                                 str(port), "--inter-token-latency", "0"], stdout=out, stderr=subprocess.STDOUT,
                                env=serve_harness.subprocess_env(), preexec_fn=low_fd_limit)
    clients: list[socket.socket] = []
    try:
        sp = serve_harness.ServeProcess.__new__(serve_harness.ServeProcess)
        sp.url, sp.proc, sp.log_path = f"http://127.0.0.1:{port}", proc, log
        serve_harness.ServeProcess.wait_ready(sp)
        for _ in range(limit + 20):
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.5)
        cpu0 = _cpu_seconds(proc.pid)
        time.sleep(2.5)
        busy = _cpu_seconds(proc.pid) - cpu0
        lines = log.read_text(errors="replace").count("accept failed")
        assert busy < 1.0, f"{busy:.2f}s of CPU in 2.5s while out of descriptors"
        assert 1 <= lines <= 2, lines
        for c in clients:
            c.close()
        clients.clear()
        deadline = time.monotonic() + scaled(10)
        while True:
            try:
                r = httpx.post(sp.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                               timeout=3)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "not served again after descriptors were freed"
        assert r.status_code == 200
    finally:
        for c in clients:
            c.close()
        proc.terminate()
        assert proc.wait(15) == 0


def _cpu_seconds(pid: int) -> float:
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_patched_max_model_len_without_room_fails_the_request(plain):
    """A prompt that a patched (smaller) max_model_len leaves no room for is failed by
    the engine with vLLM's words, and counted failed, not completed."""
    ctl = plain.control_url
    httpx.patch(ctl + "/config", json={"max_model_len": 16})
    try:
        httpx.post(ctl + "/stats/reset")
        prompt = list(range(1, 21))  # 20 token ids: fits the advertised 4096, not the patched 16
        r = httpx.post(plain.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
        err = _error(r, 400)
        assert "is longer than the maximum model length of 16" in err["message"]
        exact = httpx.post(plain.url + "/v1/completions", json={"model": MODEL, "prompt": prompt[:16],
                                                                 "max_tokens": 4})
        assert "plus the number of requested output tokens (at least 1)" in _error(exact, 400)["message"]
        s = httpx.get(ctl + "/stats").json()
        assert (s["requests_received"], s["requests_completed"], s["requests_failed"]) == (2, 0, 2)
    finally:
        httpx.patch(ctl + "/config", json={"max_model_len": 0})
