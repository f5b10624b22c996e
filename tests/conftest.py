"""Shared fixtures: free ports and real `vllm-vcr serve` processes.

    def test_x(serve_process):
        srv = serve_process("--inter-token-latency", "1")   # started, /health answered
        httpx.get(srv.url + "/v1/models")

Every process started through these fixtures is stopped (SIGTERM, then SIGKILL) at teardown.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"

try:  # the suite also runs from a plain checkout (CI installs the package; a dev may not have)
    import vllm_vcr  # noqa: F401
except ImportError:
    sys.path.insert(0, str(SRC))


@pytest.fixture(autouse=True)
def _no_logging_left_installed():
    """A test that runs a command's main() in-process installs the CLI's reloadable logging;
    uninstall it after the test so later tests see the process as an embedder would."""
    yield
    from vllm_vcr import logging_setup

    if logging_setup.reloadable_logging_installed():
        logging_setup.uninstall_reloadable_logging()


def _plugin_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.value == "vllm_vcr.testing.pytest_plugin" for ep in entry_points(group="pytest11"))


# Ports and load-scaled waits, for every test here: `from tests.conftest import free_port, scaled, ...`
from vllm_vcr.testing.waits import (  # noqa: E402,F401
    async_wait_until,
    free_port,
    scaled,
    timeout_scale,
    wait_http_ok,
    wait_until,
)

# The vllm_vcr_server fixture comes from the package's pytest11 entry point once it is installed;
# a checkout whose installed metadata predates the plugin loads it here instead.
if not _plugin_installed():
    pytest_plugins = ["vllm_vcr.testing.pytest_plugin"]


def subprocess_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


class ServeProcess:
    """A `python -m vllm_vcr serve` child process on 127.0.0.1."""

    def __init__(self, args: list[str], port: int | None = None, env: dict[str, str] | None = None,
                 log_path: Path | None = None):
        self.port = port or free_port()
        self.args = ["--host", "127.0.0.1", "--port", str(self.port), *args]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen([sys.executable, "-m", "vllm_vcr", "serve", *self.args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=subprocess_env(env))

    def wait_ready(self, timeout: float = 60.0) -> "ServeProcess":
        """Until /health answers 200; `timeout` is for an idle machine (scaled by the load)."""
        def exited() -> str | None:
            if self.proc.poll() is None:
                return None
            return f"vllm-vcr serve exited with {self.proc.returncode}:\n{self.log()}"

        try:
            wait_http_ok(self.url + "/health", timeout, exited)
        except TimeoutError as e:
            raise TimeoutError(f"vllm-vcr serve not ready: {e}\n{self.log()}") from None
        return self

    def log(self) -> str:
        if self.log_path and self.log_path.exists():
            return self.log_path.read_text(errors="replace")
        return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(scaled(timeout))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._log is not subprocess.DEVNULL:
            self._log.close()
            self._log = subprocess.DEVNULL
        return self.proc.returncode


@pytest.fixture
def serve_process(tmp_path):
    """start(*cli_args, env=None, wait=True) -> ServeProcess; all stopped at teardown."""
    started: list[ServeProcess] = []

    def start(*args: str, env: dict[str, str] | None = None, wait: bool = True) -> ServeProcess:
        sp = ServeProcess(list(args), env=env, log_path=tmp_path / f"serve-{len(started)}.log")
        started.append(sp)
        return sp.wait_ready() if wait else sp

    yield start
    for sp in started:
        sp.stop()


class _Harness:
    """What module-scoped fixtures elsewhere need (conftest modules are not importable by name)."""

    ServeProcess = ServeProcess
    free_port = staticmethod(free_port)
    scaled = staticmethod(scaled)
    wait_until = staticmethod(wait_until)
    subprocess_env = staticmethod(subprocess_env)

    @staticmethod
    def start_fast(tmp_path_factory, name: str, *args: str, env: dict[str, str] | None = None) -> ServeProcess:
        """A zero-latency `serve` with a control API (`.control` is its URL), ready."""
        control = free_port()
        log = Path(tmp_path_factory.mktemp(name)) / "serve.log"
        sp = ServeProcess(["--inter-token-latency", "0", "--time-to-first-token", "0",
                           "--control-address", f"127.0.0.1:{control}", *args], env=env, log_path=log)
        sp.control = f"http://127.0.0.1:{control}"
        return sp.wait_ready()


@pytest.fixture(scope="session")
def serve_harness() -> type[_Harness]:
    return _Harness
