"""The security posture of docs/reliability.md ("Security"), through the real processes:

- default bind addresses: `serve` on every interface (vLLM's `--host` default), the control API
  on loopback when the image's MOCK_CONTROL_PORT turns it on;
- `--api-key` / VLLM_API_KEY as vLLM's AuthenticationMiddleware enforces them (the openai SDK
  and raw HTTP; tests/conformance/test_api_key.py compares with the real frontend);
- the control API's token (`--control-token` / MOCK_CONTROL_TOKEN) on serve and play;
- request size limits (head, body);
- no client-supplied value reaches the file system or a template outside the sandbox.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import ServeProcess, free_port, scaled, subprocess_env, wait_until
from vllm_vcr.testing.waits import listening

MODEL = "vllm-vcr/sim"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
HOSTILE_IDS = ["../../../../tmp/vcr-pwn", "/etc/passwd", "a/../../b", "x\x00y", "C:\\Windows\\x", "~/.ssh/id",
               "{{ 7*7 }}", "%2e%2e%2f", "$(touch /tmp/vcr-pwn)"]


def _listening(port: int) -> set[str]:
    return listening(port) or set()


def _wait_listening(port: int, proc: subprocess.Popen, log: Path) -> set[str]:
    def ready() -> bool:
        assert proc.poll() is None, log.read_text(errors="replace")
        return bool(_listening(port))

    wait_until(ready, 60, interval=0.1)
    return _listening(port)


# ---- default bind addresses --------------------------------------------------------------------

def test_default_binds_serve_on_every_interface_and_the_control_api_on_loopback(tmp_path):
    if not Path("/proc/net/tcp").exists():
        pytest.skip("reads the listening sockets from /proc/net/tcp")
    port, control = free_port(), free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        # no --host, no --control-address: the image's way to turn the control API on
        proc = subprocess.Popen([sys.executable, "-m", "vllm_vcr", "serve", "--port", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, env=subprocess_env({"MOCK_CONTROL_PORT": str(control)}))
    try:
        assert _wait_listening(port, proc, log) == {"00000000"}  # 0.0.0.0, as `vllm serve` binds ("")
        assert _wait_listening(control, proc, log) == {"0100007F"}  # 127.0.0.1 only
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200, 60)
        assert httpx.get(f"http://127.0.0.1:{control}/stats", timeout=5).status_code == 200
    finally:
        proc.terminate()
        proc.wait(scaled(15))


# ---- --api-key, as vLLM enforces it ------------------------------------------------------------

@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    log = tmp_path_factory.mktemp("keyed") / "serve.log"
    control = free_port()
    sp = ServeProcess(["--api-key", "key-one", "key-two", "--control-address", f"127.0.0.1:{control}",
                       "--control-token", "control-secret"], env={"VLLM_API_KEY": "env-key"}, log_path=log)
    sp.control = f"http://127.0.0.1:{control}"
    try:
        yield sp.wait_ready()
    finally:
        sp.stop()


def test_the_openai_sdk_needs_one_of_the_keys(keyed):
    with openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0, timeout=30) as c:
        with pytest.raises(openai.AuthenticationError) as err:
            c.chat.completions.create(**CHAT)
        assert err.value.status_code == 401
    with openai.OpenAI(base_url=keyed.url + "/v1", api_key="env-key", max_retries=0, timeout=30) as c:
        with pytest.raises(openai.AuthenticationError):  # --api-key wins over VLLM_API_KEY, as in vLLM
            c.models.list()
    for key in ("key-one", "key-two"):
        with openai.OpenAI(base_url=keyed.url + "/v1", api_key=key, max_retries=0, timeout=30) as c:
            assert c.chat.completions.create(**CHAT).choices[0].finish_reason == "length"
            stream = c.completions.create(model=MODEL, prompt="x", max_tokens=3, stream=True)
            assert len([chunk for chunk in stream]) >= 3


@pytest.mark.parametrize("authorization,ok", [
    (None, False), ("Bearer key-one", True), ("bearer key-two", True), ("BEARER key-one", True),
    ("Bearer wrong", False), ("Basic key-one", False), ("Bearer  key-one", False),
    ("Bearerkey-one", False), ("key-one", False), ("Bearer key-onekey-two", False),
])
def test_the_authorization_header_is_read_as_vllm_reads_it(keyed, authorization, ok):
    headers = {"authorization": authorization} if authorization is not None else {}
    r = httpx.get(keyed.url + "/v1/models", headers=headers, timeout=10)
    if ok:
        assert r.status_code == 200, r.text
    else:
        assert (r.status_code, r.content, r.headers["content-type"]) == (401, b'{"error":"Unauthorized"}',
                                                                           "application/json")


@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
    ("POST", "/v1/responses"), ("POST", "/v1/messages"), ("POST", "/v1/embeddings"),
    ("POST", "/v1/load_lora_adapter"), ("GET", "/v1/no-such-route"), ("GET", "/v1x"), ("GET", "/v2/anything"),
    ("POST", "/inference/v1/generate"), ("POST", "/cohere/v2/rerank"), ("GET", "/%761/models"),
])
def test_guarded_prefixes_answer_401_before_anything_else(keyed, method, path):
    r = httpx.request(method, keyed.url + path, content=b"{not json", timeout=10,
                      headers={"content-type": "application/json"})
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}


@pytest.mark.parametrize("method,path,body", [
    ("GET", "/health", None), ("GET", "/metrics", None), ("GET", "/version", None), ("GET", "/ping", None),
    ("GET", "/openapi.json", None), ("GET", "/load", None),
    ("POST", "/tokenize", {"model": MODEL, "prompt": "hi"}), ("POST", "/detokenize", {"model": MODEL, "tokens": [1]}),
    ("POST", "/invocations", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
])
def test_routes_outside_the_prefixes_stay_open_as_in_vllm(keyed, method, path, body):
    r = httpx.request(method, keyed.url + path, json=body, timeout=30)
    assert r.status_code != 401, (path, r.status_code, r.text)
    if path in ("/health", "/metrics", "/tokenize", "/invocations"):
        assert r.status_code == 200, r.text


def test_a_cors_preflight_passes_without_a_key(keyed):
    r = httpx.options(keyed.url + "/v1/chat/completions", timeout=10,
                      headers={"origin": "http://app.example", "access-control-request-method": "POST"})
    assert r.status_code != 401


def test_vllm_api_key_alone_turns_auth_on(serve_process):
    srv = serve_process(env={"VLLM_API_KEY": "from-env"})
    assert httpx.get(srv.url + "/v1/models", timeout=10).status_code == 401
    ok = httpx.get(srv.url + "/v1/models", headers={"authorization": "Bearer from-env"}, timeout=10)
    assert ok.status_code == 200
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_an_empty_api_key_turns_auth_off_even_with_vllm_api_key_set(serve_process):
    srv = serve_process("--api-key", "", env={"VLLM_API_KEY": "from-env"})  # vLLM: [""] wins, then is dropped
    assert httpx.get(srv.url + "/v1/models", timeout=10).status_code == 200


# ---- the control API's token -------------------------------------------------------------------

CONTROL_ROUTES = [("GET", "/config", None), ("PATCH", "/config", {"inter_token_latency": 1}), ("GET", "/stats", None),
                  ("GET", "/stats/kv", None), ("POST", "/stats/reset", None), ("PUT", "/log", {"filter": "info"}),
                  ("GET", "/faults", None), ("DELETE", "/faults", None), ("GET", "/gauges", None),
                  ("GET", "/loras", None), ("GET", "/no-such-route", None)]


@pytest.mark.parametrize("method,path,body", CONTROL_ROUTES)
def test_every_control_route_needs_the_token(keyed, method, path, body):
    url = keyed.control + path
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Bearer key-one"},
                    {"authorization": "Basic control-secret"}, {"x-api-key": "control-secret"}):
        r = httpx.request(method, url, json=body, headers=headers, timeout=10)
        assert r.status_code == 401, (headers, r.text)
        assert "control token" in r.json()["error"] and "routes" not in r.json()["error"]  # no route list
        assert r.headers["www-authenticate"].startswith("Bearer")
    r = httpx.request(method, url, json=body, headers={"authorization": "Bearer control-secret"}, timeout=10)
    assert r.status_code == (404 if path == "/no-such-route" else 200), r.text


def test_the_control_token_does_not_open_the_api_and_the_api_key_does_not_open_the_control_api(keyed):
    assert httpx.get(keyed.url + "/v1/models", headers={"authorization": "Bearer control-secret"}).status_code == 401
    assert httpx.get(keyed.control + "/stats", headers={"authorization": "Bearer key-one"}).status_code == 401


def test_play_reads_the_control_token_from_its_environment(tmp_path):
    control = free_port()
    log = tmp_path / "play.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_vcr", "play", "--handshake-address", f"tcp://127.0.0.1:{free_port()}",
             "--control-address", f"127.0.0.1:{control}"], stdout=out, stderr=subprocess.STDOUT,
            env=subprocess_env({"MOCK_CONTROL_TOKEN": "play-secret"}))
    try:
        _wait_listening(control, proc, log)
        url = f"http://127.0.0.1:{control}/stats"
        wait_until(lambda: httpx.get(url, timeout=2).status_code == 401, 30)
        # no frontend has connected: "no engine", but past the token
        r = httpx.get(url, headers={"authorization": "Bearer play-secret"}, timeout=10)
        assert (r.status_code, r.json()) == (500, {"error": "no engine is running"})
    finally:
        proc.terminate()
        proc.wait(scaled(15))


# ---- request size limits -----------------------------------------------------------------------

def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        try:
            s.sendall(request)
        except OSError:
            pass  # answered and closed while we were still sending
        data = b""
        try:
            while part := s.recv(65536):
                data += part
        except ConnectionResetError:
            pass
    return data


def test_a_request_head_over_4_mib_is_refused_and_the_connection_closed(serve_process):
    srv = serve_process()
    below = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-big: " + b"a" * (3 << 20) + b"\r\n\r\n"
    assert _raw(srv.port, below).startswith(b"HTTP/1.1 200")
    above = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (5 << 20) + b"\r\n\r\n"
    data = _raw(srv.port, above)
    assert data.startswith(b"HTTP/1.1 400") and b"connection: close" in data.lower()
    many = b"GET /health HTTP/1.1\r\nhost: x\r\n" + b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 100)
                                                           for i in range(50_000)) + b"\r\n"
    assert _raw(srv.port, many).startswith(b"HTTP/1.1 400")  # 5.5 MB of small headers
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200  # and the server is fine
    # keep-alive: the bound is per request, not per connection
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        for _ in range(3):
            assert c.get("/health", headers={"x-big": "a" * (2 << 20)}).status_code == 200


# ---- no client value reaches the file system or a template outside the sandbox -----------------

def test_hostile_ids_and_log_targets_write_no_file(tmp_path):
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    port, control = free_port(), free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_vcr", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--control-address", f"127.0.0.1:{control}", "--enable-request-id-headers"],
            stdout=out, stderr=subprocess.STDOUT, cwd=workdir, env=subprocess_env())
    try:
        wait_until(lambda: proc.poll() is None and _listening_ok(port), 60)
        url = f"http://127.0.0.1:{port}"
        for rid in HOSTILE_IDS:
            safe_header = rid.replace("\x00", "")
            r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "request_id": rid},
                           headers={"x-request-id": safe_header}, timeout=30)
            assert r.status_code == 200, r.text
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                          "stream": True, "request_id": rid}, timeout=30)
            assert r.status_code == 200
            httpx.put(f"http://127.0.0.1:{control}/log", json={"filter": f"{rid}=debug"}, timeout=10)
        assert list(workdir.iterdir()) == []
        assert not Path("/tmp/vcr-pwn").exists()
    finally:
        proc.terminate()
        proc.wait(scaled(15))


def _listening_ok(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def trusting(tmp_path_factory):
    log = tmp_path_factory.mktemp("trusting") / "serve.log"
    sp = ServeProcess(["--trust-request-chat-template", "--enable-lora"],
                      env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}, log_path=log)
    try:
        yield sp.wait_ready()
    finally:
        sp.stop()


@pytest.mark.parametrize("template", [
    "{% include '/etc/passwd' %}",
    "{% import '/etc/passwd' as p %}{{ p }}",
    "{% extends '/etc/hostname' %}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ self._TemplateReference__context }}",
    "{% set x = namespace() %}{{ x.__init__.__globals__ }}",
])
def test_a_request_chat_template_cannot_leave_the_sandbox(trusting, template):
    r = httpx.post(trusting.url + "/v1/chat/completions", json={**CHAT, "chat_template": template}, timeout=30)
    assert r.status_code == 400, r.text
    text = r.text
    assert "root:" not in text and "uid=" not in text and "<class" not in text and "__builtins__" not in text


def test_a_request_chat_template_without_the_flag_is_refused(serve_process):
    srv = serve_process()
    r = httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "chat_template": "{{ 1 }}"}, timeout=30)
    assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/etc", "/etc/passwd", "../../../../etc", "/proc/self", "~root", "/dev/zero",
                                  "/nonexistent/" + "a" * 300])
def test_load_lora_adapter_reads_only_an_adapter_config_and_shows_no_file(trusting, path):
    r = httpx.post(trusting.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path}, timeout=30)
    # vLLM's answers: 404 "No adapter found for <the client's path>", or 500 "Call to add_lora method
    # failed: ..." with server paths replaced by <path>; never what a file holds
    err = r.json()["error"]
    assert r.status_code in (404, 500) and err["code"] == r.status_code, r.text
    assert "root:" not in r.text and "/etc/" not in err["message"].replace(path, "")


def test_runtime_lora_loading_is_off_unless_the_operator_turns_it_on(serve_process):
    srv = serve_process("--enable-lora")
    r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/etc"}, timeout=30)
    assert r.status_code == 404


def test_a_control_body_over_4_mib_is_a_413(keyed):
    auth = {"authorization": "Bearer control-secret"}
    big = b'{"filter": "' + b"a" * (4 << 20) + b'"}'
    r = httpx.put(keyed.control + "/log", content=big, headers={**auth, "content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and "body over" in r.json()["error"]

    def chunks():  # no Content-Length: counted as it comes in
        yield b'{"rules": ['
        for _ in range(1100):
            yield b'{"kind": "http_error", "status": 503, "pad": "' + b"x" * 4096 + b'"},'
        yield b"{}]}"

    r = httpx.put(keyed.control + "/faults", content=chunks(), headers={**auth, "content-type": "application/json"},
                  timeout=30)
    assert r.status_code == 413 and "body over" in r.json()["error"]
    assert httpx.get(keyed.control + "/stats", headers=auth, timeout=10).status_code == 200


def test_a_control_request_head_over_64_kib_is_a_400(keyed):
    port = int(keyed.control.rsplit(":", 1)[1])
    head = b"GET /stats HTTP/1.1\r\nhost: x\r\nauthorization: Bearer control-secret\r\nconnection: close\r\n"
    assert _raw(port, head + b"x-pad: " + b"a" * 32_000 + b"\r\n\r\n").startswith(b"HTTP/1.1 200")
    data = _raw(port, head + b"x-pad: " + b"a" * (1 << 20) + b"\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 400")
