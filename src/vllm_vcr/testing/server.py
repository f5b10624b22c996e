"""MockServer: a real `vllm-vcr serve` for tests, in this process or as a child process.

    with MockServer(inter_token_latency=5) as server:
        client = server.openai_client()
        ...
        server.patch_config(failure_injection_rate=1.0)
        server.set_faults({"action": "http_error", "error": "unavailable", "count": 5})
        assert server.stats()["requests_received"] == 3

In-process (`run_in="thread"`, the default) the command line is parsed by the `vllm-vcr` parser
and run by the coroutine the CLI runs, on an event loop of its own thread; `run_in="subprocess"`
starts `python -m vllm_vcr serve` (process-wide state such as signals and GC tuning then stays
out of the test process; a server with `--api-server-count N` > 1 in `extra_args` always runs
as a subprocess, its API servers being processes). Both listen on 127.0.0.1 and enable the control API on a second port,
which the control methods (config, stats, fault scripts, gauges) use. `mode` is the engine's
output mode (`random`/`echo`), a `MockServerConfig` field like any other flag.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Any, Literal, Mapping, Sequence

import httpx

from .config import MockServerConfig
from .waits import free_port, scaled, wait_http_ok

RunIn = Literal["thread", "subprocess"]


class MockServerError(RuntimeError):
    """The server could not start (bad configuration, port taken, …); the message says why."""


class MockServer:
    """A `vllm-vcr serve` for one test or fixture: start()/stop(), or a (async) context manager."""

    def __init__(self, config: MockServerConfig | None = None, *, run_in: RunIn = "thread",
                 host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 60.0,
                 faults: Sequence[Mapping[str, Any]] | None = None, gauges: Mapping[str, Any] | None = None,
                 **fields: Any):
        """`faults` (fault-script rules) and `gauges` (scripted gauges) are installed once the server
        is up, as `set_faults(*faults)` and `set_gauges(gauges)` would."""
        if run_in not in ("thread", "subprocess"):
            raise ValueError(f"run_in must be 'thread' or 'subprocess', got {run_in!r}")
        if fields.get("mode") in ("thread", "subprocess"):
            raise ValueError(f"mode={fields['mode']!r}: `mode` is the engine's output mode ('random' or 'echo'); "
                             f"use run_in={fields['mode']!r} to choose where the server runs")
        self.config = (config or MockServerConfig()).replace(**fields)
        self.run_in = run_in
        self.initial_faults = list(faults or ())
        self.initial_gauges = dict(gauges or {})
        self.host = host
        self.port = port
        self.control_port = 0
        self.startup_timeout = startup_timeout
        self._runner: _ThreadRunner | _ProcessRunner | None = None

    # --- addresses and clients ---
    @property
    def url(self) -> str:
        """http://HOST:PORT of the OpenAI-compatible API (valid once started)."""
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def control_url(self) -> str:
        return f"http://{self.host}:{self.control_port}"

    def openai_client(self, **kwargs: Any) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key=self.config.api_key or "none", **kwargs)

    def async_openai_client(self, **kwargs: Any) -> Any:
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.base_url, api_key=self.config.api_key or "none", **kwargs)

    # --- the control API ---
    def config_now(self) -> dict[str, Any]:
        """GET /config: the engine's live configuration."""
        return self._control("GET", "/config")

    def patch_config(self, **fields: Any) -> dict[str, Any]:
        """PATCH /config with these fields (control-API names, latencies in ms); returns the new config."""
        return self._control("PATCH", "/config", json=fields)

    def stats(self) -> dict[str, int]:
        """GET /stats: requests received, completed, failed, aborted; running; waiting."""
        return self._control("GET", "/stats")

    def reset_stats(self) -> dict[str, int]:
        """POST /stats/reset; returns the counters right after the reset."""
        return self._control("POST", "/stats/reset")

    def set_faults(self, *rules: Mapping[str, Any]) -> dict[str, Any]:
        """PUT /faults: these rules, in order, replace the fault script (docs/faults.md); returns
        the script as GET /faults shows it. No rules: the script is cleared."""
        if not rules:
            return self.clear_faults()
        return self._control("PUT", "/faults", json={"rules": [dict(r) for r in rules]})

    def faults(self) -> dict[str, Any]:
        """GET /faults: the rules left (each with its `remaining` count) and the requests seen."""
        return self._control("GET", "/faults")

    def clear_faults(self) -> dict[str, Any]:
        """DELETE /faults."""
        return self._control("DELETE", "/faults")

    def set_gauges(self, gauges: Mapping[str, Any] | None = None, **by_name: Any) -> dict[str, Any]:
        """PUT /gauges: scripted values for `/metrics` (docs/faults.md), keyed by the metric name or
        by its name without `vllm:`: `set_gauges(num_requests_waiting={"function": "constant", "value": 5})`."""
        body = {**(gauges or {}), **by_name}
        body = {name if ":" in name else "vllm:" + name: dict(spec) for name, spec in body.items()}
        if not body:
            return self.clear_gauges()
        return self._control("PUT", "/gauges", json=body)

    def gauges(self) -> dict[str, Any]:
        """GET /gauges: the scripted gauges, each with its current value."""
        return self._control("GET", "/gauges")

    def clear_gauges(self) -> dict[str, Any]:
        """DELETE /gauges: `/metrics` reports the engines' own values again."""
        return self._control("DELETE", "/gauges")

    def _control(self, method: str, path: str, **kwargs: Any) -> Any:
        if self._runner is None:
            raise MockServerError("the server is not running")
        token = self._control_token()
        headers = {"authorization": f"Bearer {token}"} if token else None
        resp = httpx.request(method, self.control_url + path, timeout=10, headers=headers, **kwargs)
        if resp.status_code >= 400:
            raise MockServerError(f"{method} {path}: {resp.status_code} {resp.text}")
        return resp.json()

    def _control_token(self) -> str | None:
        """The control token the server asks for: `--control-token` in extra_args, else MOCK_CONTROL_TOKEN."""
        extra = list(self.config.extra_args)
        for i, arg in enumerate(extra):
            if arg == "--control-token" and i + 1 < len(extra):
                return extra[i + 1]
            if arg.startswith("--control-token="):
                return arg.split("=", 1)[1]
        return os.environ.get("MOCK_CONTROL_TOKEN") or None

    # --- life cycle ---
    def argv(self) -> list[str]:
        """The `vllm-vcr` command line this server runs."""
        return ["serve", *self.config.to_argv(), "--host", self.host, "--port", str(self.port),
                "--control-address", f"{self.host}:{self.control_port}"]

    def start(self) -> "MockServer":
        if self._runner is not None:
            raise MockServerError("already started")
        self.control_port = free_port(self.host)
        from ..serve.cli import default_api_server_count

        if self.run_in == "thread" and default_api_server_count(_parse(self.argv())) > 1:
            self.run_in = "subprocess"  # several API servers are processes of their own: not a thread's
        if self.run_in == "thread":
            sock = socket.create_server((self.host, self.port))
            self.port = sock.getsockname()[1]
            try:
                runner: _ThreadRunner | _ProcessRunner = _ThreadRunner(self.argv(), sock)
            except BaseException:
                sock.close()
                raise
        else:
            self.port = self.port or free_port(self.host)
            runner = _ProcessRunner(self.argv())
        self._runner = runner
        try:
            self._wait_ready(runner)
            if self.initial_faults:
                self.set_faults(*self.initial_faults)
            if self.initial_gauges:
                self.set_gauges(self.initial_gauges)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, runner: "_ThreadRunner | _ProcessRunner") -> None:
        def failure() -> str | None:
            reason = runner.failure()
            return None if reason is None else f"vllm-vcr serve did not start: {reason}"

        try:
            wait_http_ok(self.url + "/health", self.startup_timeout, failure, interval=0.02)
        except RuntimeError as e:
            raise MockServerError(str(e)) from None
        except TimeoutError:
            raise MockServerError(f"vllm-vcr serve not healthy after {scaled(self.startup_timeout):.1f}s: "
                                  f"{runner.failure() or ''}") from None

    def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.stop()

    def __enter__(self) -> "MockServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> "MockServer":
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    def __repr__(self) -> str:
        state = "running" if getattr(self, "_runner", None) is not None else "stopped"
        return f"MockServer({getattr(self, 'host', '?')}:{getattr(self, 'port', '?')}, " \
               f"run_in={getattr(self, 'run_in', '?')}, {state})"


def _parse(argv: list[str]) -> Any:
    """The `vllm-vcr` parser's namespace; a bad flag raises MockServerError with argparse's message."""
    import io

    from ..cli import build_parser

    parser, _ = build_parser()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parser.parse_args(argv)
        except SystemExit:
            raise MockServerError(err.getvalue().strip().splitlines()[-1]) from None


class _ThreadRunner:
    """`serve(args, sock=...)`, the coroutine `vllm-vcr serve` runs, on its own loop and thread."""

    def __init__(self, argv: list[str], sock: socket.socket):
        self.args = _parse(argv)
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(sock,), name="vllm-vcr-serve", daemon=True)
        self._thread.start()
        self._started.wait()

    def _run(self, sock: socket.socket) -> None:
        from ..serve.server import serve

        try:
            import uvloop

            loop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
            loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._task = loop.create_task(serve(self.args, sock=sock))
            self._started.set()
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(self._task)
        except BaseException as e:  # reported by failure() to the starting thread
            self._error = e
        finally:
            self._started.set()
            sock.close()  # serve() may have stopped before taking the socket over
            self._close(loop)

    @staticmethod
    def _close(loop: asyncio.AbstractEventLoop) -> None:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

    def failure(self) -> str | None:
        if self._error is not None:
            return f"{type(self._error).__name__}: {self._error}"
        if not self._thread.is_alive():
            return "the server stopped"
        return None

    def _request_exit(self) -> None:
        """What SIGTERM does to `vllm-vcr serve`: uvicorn's handle_exit (stop accepting, close idle
        connections, drain the engines). Signal handlers are main-thread only, so the server is
        found on the task's await chain; without one the task is cancelled."""
        import uvicorn

        coro = self._task.get_coro() if self._task is not None else None
        while coro is not None:
            frame = getattr(coro, "cr_frame", None)
            server = frame.f_locals.get("self") if frame is not None else None
            if isinstance(server, uvicorn.Server):
                server.handle_exit(signal.SIGTERM, None)
                return
            coro = getattr(coro, "cr_await", None)
        if self._task is not None:
            self._task.cancel()

    def stop(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._request_exit)
        self._thread.join(30)
        if self._thread.is_alive() and loop is not None and self._task is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._task.cancel)
            self._thread.join(10)


class _ProcessRunner:
    """`python -m vllm_vcr serve ...`: stopped with SIGTERM (then SIGKILL)."""

    def __init__(self, argv: list[str]):
        _parse(argv)  # a bad flag fails here, with argparse's message, not in the child's log
        self._log = tempfile.TemporaryFile()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "vllm_vcr", *argv], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def failure(self) -> str | None:
        if self.proc.poll() is None:
            return None
        return f"exit status {self.proc.returncode}:\n{self.log()[-3000:]}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
