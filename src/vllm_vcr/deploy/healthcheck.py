"""The image's HEALTHCHECK: exit 0 when this container's vllm-vcr answers, 1 otherwise.

`serve` (and a pd-proxy) answer GET /health on VLLM_PORT; `play` has no HTTP port of its own
(the frontend next to it has), so it is checked through its control API when one is enabled
(with MOCK_CONTROL_TOKEN as its Bearer token when that is set).
Standard library only: it runs every few seconds and must start fast.
"""

from __future__ import annotations

import os
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


def _running_command() -> str:
    """The subcommand PID 1 runs (the entrypoint execs vllm-vcr), else `serve`."""
    try:
        with open("/proc/1/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except OSError:
        return "serve"
    return "play" if b"play" in words else "serve"


def main(args: list[str] | None = None) -> int:
    args = sys.argv[1:] if args is None else args
    command = args[0] if args else _running_command()
    try:
        url = health_url(command, dict(os.environ))
    except EntrypointError as e:
        print(f"unhealthy: {e}", file=sys.stderr)
        return 1
    if url is None:
        return 0  # play without a control API: nothing of its own to ask
    headers = {}
    token = os.environ.get("MOCK_CONTROL_TOKEN")
    if token and command == "play":  # play is asked through its control API, which wants the token
        headers["authorization"] = f"Bearer {token}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=3) as resp:
            return 0 if resp.status == 200 else 1
    except (urllib.error.URLError, OSError) as e:
        print(f"unhealthy: {url}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
