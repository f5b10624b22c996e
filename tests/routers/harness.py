"""Start real `vllm-vcr serve` workers and the real `vllm-router` / `smg` binaries in front of them.

The routers come from scripts/install-routers.sh (a cached venv under $VLLM_VCR_PEERS/routers).
Every process runs in its own session on 127.0.0.1 and is stopped by process group.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from vllm_vcr.testing.waits import free_port, scaled, wait_http_ok, wait_until

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("VLLM_VCR_PEERS") or Path.home() / ".cache" / "vllm-vcr" / "peers")
VENV = CACHE / "routers"
VLLM_ROUTER = VENV / "bin" / "vllm-router"
SMG = VENV / "bin" / "smg"
MODEL = "vllm-vcr/sim"
BLOCK = 16  # serve's default --block-size; vllm-router's --kv-event-block-size default
ANSI = re.compile(r"\x1b\[[0-9;]*m")
FREE = "<free-port>"  # in a worker's or router's args: a free port, picked again on every (re)start


def _ports(args) -> list[str]:
    return [str(free_port()) if a == FREE else a for a in args]


def missing_reason() -> str | None:
    if os.environ.get("VLLM_VCR_ROUTERS", "").strip() == "0":
        return "VLLM_VCR_ROUTERS=0"
    if not (VENV / ".vllm-vcr-ready").is_file() or not VLLM_ROUTER.is_file() or not SMG.is_file():
        return f"vllm-router / smg not installed in {VENV}; run scripts/install-routers.sh"
    return None


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    src = str(REPO / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["NO_COLOR"] = "1"
    env.update(extra or {})
    return env


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        try:
            return ANSI.sub("", self.log_path.read_text(errors="replace"))
        except OSError:
            return ""

    def stop(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(scaled(10))
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)

    def exited(self) -> str | None:
        if self.alive():
            return None
        return f"{self.name} exited with {self.popen.returncode}:\n{self.log()[-4000:]}"


def _spawn(name: str, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Proc:
    with open(log, "wb") as f:
        p = subprocess.Popen(cmd, env=_env(env), stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    return Proc(name, p, log)


class Worker(Proc):
    """A `vllm-vcr serve` worker with its control API."""

    url: str
    control: str
    kv_endpoint: str | None

    def stats(self) -> dict:
        return httpx.get(self.control + "/stats", timeout=10).json()

    def served(self) -> int:
        """Generation requests this worker has received (the control API's counter)."""
        return self.stats()["requests_received"]

    def kv(self) -> dict:
        return httpx.get(self.control + "/stats/kv", timeout=10).json()

    def faults(self, rules: list[dict] | None) -> dict:
        if rules is None:
            return httpx.delete(self.control + "/faults", timeout=10).json()
        r = httpx.put(self.control + "/faults", json={"rules": rules}, timeout=10)
        r.raise_for_status()
        return r.json()

    def requests_seen(self) -> int:
        return httpx.get(self.control + "/faults", timeout=10).json()["requests_seen"]


class Fleet:
    """Workers and routers of one test; everything is stopped by `close()`."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.procs: list[Proc] = []

    def worker(self, *args: str, kv_events: bool = False, env: dict[str, str] | None = None) -> Worker:
        n = sum(isinstance(p, Worker) for p in self.procs)
        w = Worker(f"worker-{n}", None, self.workdir / f"worker-{n}.log")  # type: ignore[arg-type]
        w.spec = (args, kv_events, env)
        self._spawn_worker(w)
        self.procs.append(w)
        return w

    def _spawn_worker(self, w: Worker) -> None:
        args, kv_events, env = w.spec
        port, control = free_port(), free_port()
        cmd = [sys.executable, "-m", "vllm_vcr", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--control-address", f"127.0.0.1:{control}", *_ports(args)]
        w.kv_endpoint = None
        if kv_events:
            pub = free_port()
            # vLLM binds a PUB endpoint only when its host is a wildcard; the router connects to loopback
            cmd += ["--kv-events-config", f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{pub}"}}']
            w.kv_endpoint = f"tcp://127.0.0.1:{pub}"
        w.popen = _spawn(w.name, cmd, w.log_path, env).popen
        w.url, w.control = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{control}"

    def ready(self, *workers: Worker) -> None:
        for w in workers:
            for attempt in range(3):
                try:
                    wait_http_ok(w.url + "/health", 60, w.exited)
                    break
                except RuntimeError as e:
                    # a free port taken by another process before ours bound it: new ports, again
                    if "already in use" not in str(e) or attempt == 2:
                        raise
                    self._spawn_worker(w)
                except TimeoutError as e:
                    raise TimeoutError(f"{w.name} not ready: {e}\n{w.log()[-3000:]}") from None

    def router(self, binary: Path, *args: str, ready_path: str = "/health") -> "Router":
        name = binary.name
        n = sum(isinstance(p, Router) for p in self.procs)
        for attempt in range(3):
            port = free_port()
            cmd = [str(binary), *_ports(args), "--host", "127.0.0.1", "--port", str(port)]
            p = _spawn(name, cmd, self.workdir / f"{name}-{n}.log")
            r = Router(p.name, p.popen, p.log_path)
            r.url = f"http://127.0.0.1:{port}"
            self.procs.append(r)
            try:
                wait_http_ok(r.url + ready_path, 60, r.exited)
                return r
            except RuntimeError as e:
                if "in use" not in str(e) or attempt == 2:
                    raise
            except TimeoutError as e:
                raise TimeoutError(f"{name} not ready: {e}\n{r.log()[-3000:]}") from None
        raise AssertionError("unreachable")

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()


class Router(Proc):
    url: str

    def complete(self, prompt: str | list[int], max_tokens: int = 4, timeout: float = 60, **extra) -> httpx.Response:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra}
        return httpx.post(self.url + "/v1/completions", json=body, timeout=scaled(timeout))

    def chat(self, text: str, max_tokens: int = 4, timeout: float = 60) -> httpx.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
        return httpx.post(self.url + "/v1/chat/completions", json=body, timeout=scaled(timeout))

    def lines(self, needle: str) -> list[str]:
        return [line for line in self.log().splitlines() if needle in line]


def check_breaker_opens_and_recovers(r, bad, timeout_s: float) -> None:
    """`bad` fails every request: after two failures the router's breaker sends it nothing; once
    it recovers, the breaker half-opens after `timeout_s`, a trial reaches it, and it closes."""
    bad.faults([{"action": "http_error", "error": "unavailable"}])  # every request, until deleted
    wait_until(lambda: r.complete("trip").status_code == 200 and bad.requests_seen() >= 2, 20,
               "two failures on the bad worker")
    seen = bad.requests_seen()
    for i in range(6):
        assert r.complete(f"open {i}").status_code == 200
    assert bad.requests_seen() == seen, "the breaker did not open: the failing worker still gets requests"
    bad.faults(None)
    before = bad.stats()["requests_completed"]
    wait_until(lambda: r.complete("probe").status_code == 200 and bad.stats()["requests_completed"] > before,
               timeout_s + 20, "the breaker to half-open and let a request through", interval=0.2)
    for i in range(4):
        assert r.complete(f"closed {i}").status_code == 200
    assert bad.stats()["requests_completed"] >= before + 2, "the breaker did not close after the trial"
