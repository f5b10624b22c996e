"""The image's HEALTHCHECK: exit 0 when this container's vllm-vcr answers, 1 otherwise.

`serve` (and a pd-proxy) answer GET /health on VLLM_PORT (or the `--port` PID 1 was given),
over HTTPS when PID 1 runs with `--ssl-certfile` (its own certificate is not checked: this is the
container asking itself); `serve --grpc` has no HTTP: its gRPC port taking a connection is the
check. `play` has no HTTP port of its own (the frontend next to it has), so it is checked through
its control API when one is enabled (with MOCK_CONTROL_TOKEN as its Bearer token when that is set).
Standard library only: it runs every few seconds and must start fast.
"""

from __future__ import annotations

import os
import socket
import ssl
import sys
import urllib.error
import urllib.request

from .entrypoint import EntrypointError, control_address, default_port


def health_url(command: str, env: dict[str, str]) -> str | None:
    if command == "play":
        address = control_address(env)
        if address is None:
            return None
        port = address.rsplit(":", 1)[1]
        return f"http://127.0.0.1:{port}/stats"
    return f"http://127.0.0.1:{default_port(env)}/health"


def _pid1_words() -> list[str]:
    """PID 1's command line (the entrypoint execs vllm-vcr); [] when it cannot be read."""
    try:
        with open("/proc/1/cmdline", "rb") as f:
            return [w.decode(errors="replace") for w in f.read().split(b"\0") if w]
    except OSError:
        return []


def _running_command(words: list[str]) -> str:
    return "play" if "play" in words else "serve"


def _flag(words: list[str], name: str) -> str | None:
    value = None
    for i, w in enumerate(words):
        if w == name and i + 1 < len(words):
            value = words[i + 1]
        elif w.startswith(name + "="):
            value = w.split("=", 1)[1]
    return value


def serve_transport(words: list[str], env: dict[str, str]) -> tuple[str, str]:
    """How `serve` listens, from its command line: ("http" | "https" | "grpc", port)."""
    port = _flag(words, "--port") or default_port(env)
    if "--grpc" in words:
        return "grpc", port
    return ("https" if _flag(words, "--ssl-certfile") else "http"), port


def main(args: list[str] | None = None, words: list[str] | None = None) -> int:
    args = sys.argv[1:] if args is None else args
    words = _pid1_words() if words is None else words
    command = args[0] if args else _running_command(words)
    env = dict(os.environ)
    try:
        url = health_url(command, env)
        if command != "play":
            scheme, port = serve_transport(words, env)
            if scheme == "grpc":
                return _connects(int(port))
            url = f"{scheme}://127.0.0.1:{port}/health"
    except (EntrypointError, ValueError) as e:
        print(f"unhealthy: {e}", file=sys.stderr)
        return 1
    if url is None:
        return 0  # play without a control API: nothing of its own to ask
    headers = {}
    token = os.environ.get("MOCK_CONTROL_TOKEN")
    if token and command == "play":  # play is asked through its control API, which wants the token
        headers["authorization"] = f"Bearer {token}"
    context = None
    if url.startswith("https:"):
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=3, context=context) as resp:
            return 0 if resp.status == 200 else 1
    except (urllib.error.URLError, OSError) as e:
        print(f"unhealthy: {url}: {e}", file=sys.stderr)
        return 1


def _connects(port: int) -> int:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=3):
            return 0
    except OSError as e:
        print(f"unhealthy: gRPC port {port}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
