"""Differential: `--api-key` on the real vLLM frontend and on `vllm-vcr serve`.

The same requests (raw HTTP, so headers reach both servers byte for byte) go to both; which ones
answer 401, and the 401's status, body and content type, must be the same. Covered: the guarded
prefixes (/v1, /v2, /inference, /cohere) and the open routes beside them, every way of writing the
Authorization header, a second Authorization header, OPTIONS, percent-encoded paths.
"""

from __future__ import annotations

import socket

import pytest

from . import peers
from .test_differential import _start_sim

pytestmark = pytest.mark.conformance

KEYS = ["key-one", "key-two"]
FLAGS = ["--api-key", *KEYS]

AUTHORIZATIONS = [
    [], ["Bearer key-one"], ["Bearer key-two"], ["bearer key-one"], ["BeArEr key-two"], ["Bearer wrong"],
    ["Basic key-one"], ["Bearer  key-one"], ["Bearerkey-one"], ["key-one"], ["Bearer"], ["Bearer key-one\tx"],
    ["Bearer key-one key-two"], ["Bearer wrong", "Bearer key-one"], ["Bearer key-one", "Bearer wrong"],
    ["Token key-one"], ["Bearer KEY-ONE"],
]
PATHS = [
    ("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1"),
    ("GET", "/v1x"), ("GET", "/v1/no-such-route"), ("GET", "/v2/x"), ("POST", "/inference/v1/generate"),
    ("POST", "/cohere/v2/rerank"), ("GET", "/%761/models"), ("GET", "/V1/models"), ("GET", "//v1/models"),
    ("GET", "/health"), ("GET", "/metrics"), ("GET", "/version"), ("GET", "/ping"), ("GET", "/load"),
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/invocations"), ("GET", "/openapi.json"),
    ("GET", "/no-such-route"), ("OPTIONS", "/v1/models"), ("POST", "/pooling"), ("POST", "/score"),
    ("POST", "/rerank"), ("POST", "/classify"), ("GET", "/docs"),
]


@pytest.fixture(scope="module")
def real(vllm_version):
    st = peers.start_stack(vllm_version, play_args=["--vocab-size", str(peers.VOCAB_SIZE)], frontend_args=FLAGS)
    yield st
    st.stop()


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    st = _start_sim(tmp_path_factory, FLAGS)
    yield st
    st["proc"].stop()


def _request(base_url: str, method: str, path: str, authorizations: list[str], body: bytes = b"{}") -> tuple:
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    head = [f"{method} {path} HTTP/1.1", f"host: {host}", "connection: close", "content-type: application/json",
            f"content-length: {len(body)}"]
    head += [f"authorization: {a}" for a in authorizations]
    if method == "OPTIONS":
        head += ["origin: http://app.example", "access-control-request-method: POST"]
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        data = b""
        while part := s.recv(65536):
            data += part
    status_line, _, rest = data.partition(b"\r\n")
    headers, _, payload = rest.partition(b"\r\n\r\n")
    status = int(status_line.split()[1])
    content_type = next((line.split(b":", 1)[1].strip() for line in headers.split(b"\r\n")
                         if line.lower().startswith(b"content-type:")), b"")
    if status != 401:
        return ("not 401",)
    return status, payload, content_type


def test_the_same_requests_need_the_same_keys(real, sim):
    differences = []
    checked = refused = 0
    for method, path in PATHS:
        for auth in (AUTHORIZATIONS if path == "/v1/models" else [[], ["Bearer wrong"], ["Bearer key-two"]]):
            ours = _request(sim["base_url"], method, path, auth)
            theirs = _request(real.base_url, method, path, auth)
            checked += 1
            refused += ours[0] == 401
            if ours != theirs:
                differences.append((method, path, auth, ours, theirs))
    assert not differences, "\n".join(map(repr, differences))
    assert checked > 80 and 20 < refused < checked - 20  # both answers were seen, many times
