"""Start and stop real vLLM frontends and `vllm-vcr play` for the conformance tests.

The frontends come from scripts/install-peers.sh (cached virtual environments). Every process is
started in its own session on 127.0.0.1 and stopped by process group. A frontend accepts only one
engine HELLO per life, so each stack gets a fresh one; one that never got an engine ignores
SIGTERM, so it is killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from vllm_vcr.testing.waits import free_port, listening, scaled  # noqa: F401  (bench/fidelity imports free_port from here)

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("VLLM_VCR_PEERS") or Path.home() / ".cache" / "vllm-vcr" / "peers")
VERSIONS = ("0.32", "0.33")
MODEL_DIR = CACHE / "tinymodel"
VOCAB_SIZE = 4096  # scripts/make_tiny_model.py's default: random tokens must be real ids
TOOL_MODEL_DIR = CACHE / "tinymodel-tools"  # scripts/make_tiny_tool_model.py: llama3 / mistral tool tokens


def tool_model_dir() -> Path:
    """The tiny tool-token model, written on first use (a few seconds: no download)."""
    if not (TOOL_MODEL_DIR / "config.json").is_file():
        building = TOOL_MODEL_DIR.with_name(f"{TOOL_MODEL_DIR.name}.{os.getpid()}")
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_tool_model.py"), str(building)],
                       check=True, capture_output=True)
        with contextlib.suppress(OSError):  # another run got there first: keep its copy
            building.rename(TOOL_MODEL_DIR)
        shutil.rmtree(building, ignore_errors=True)
    return TOOL_MODEL_DIR


def venv(version: str) -> Path:
    return CACHE / f"vllm-{version}"


def installed(version: str) -> bool:
    return (venv(version) / ".vllm-vcr-ready").is_file() and (MODEL_DIR / "config.json").is_file()


def missing_reason(version: str) -> str | None:
    if not (venv(version) / ".vllm-vcr-ready").is_file():
        return (f"real vLLM {version} frontend not installed in {venv(version)}; "
                f"run scripts/install-peers.sh (or scripts/run-conformance.sh)")
    if not (MODEL_DIR / "config.json").is_file():
        return f"tiny model missing in {MODEL_DIR}; run scripts/install-peers.sh"
    return None




VLLM_CACHE = Path(tempfile.gettempdir()) / "vllm-vcr-vllm-cache"


def vllm_env(version: str, **extra: str) -> dict[str, str]:
    """The environment a real vLLM process of `version` runs in: this one without VLLM_* and MOCK_*,
    offline, on CPU, and one VLLM_CACHE_ROOT per version shared by all its processes, as a user's
    ~/.cache/vllm is. vLLM keeps there what it learnt about a model class by importing its module in
    a subprocess (`modelinfos/`, checked against the module's hash on every read): ~6 s of each
    start-up when missing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "MOCK_"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CACHE_ROOT=str(VLLM_CACHE / version),
               VLLM_TARGET_DEVICE="cpu", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def send_signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, sig: int = signal.SIGTERM, grace: float = 10.0) -> None:
        if self.alive():
            self.send_signal(sig)
            self.wait(grace)
        self.send_signal(signal.SIGKILL)  # whatever is left of the group (engine workers, API children)
        self.wait(5)

    def tail(self, n: int = 40) -> str:
        return f"--- {self.name} ({self.log}) ---\n{_tail(self.log, n)}"


def _spawn(name: str, cmd: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> Proc:
    with open(log, "wb") as f:  # the child keeps its own copy of the descriptor
        p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, cwd=cwd)
    return Proc(name, p, log)


LOG_ROOT = Path(tempfile.gettempdir()) / "vllm-vcr-conformance"
KEEP_RUNS = 20  # log directories kept for post-mortems; older ones are pruned


def _new_workdir(version: str) -> Path:
    LOG_ROOT.mkdir(parents=True, exist_ok=True)
    old = sorted(LOG_ROOT.iterdir(), key=lambda p: p.stat().st_mtime)
    for d in old[:max(0, len(old) - KEEP_RUNS + 1)]:
        shutil.rmtree(d, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{version}-", dir=LOG_ROOT))


@dataclass
class Stack:
    """A real frontend and the `vllm-vcr play` engine(s) behind it."""

    version: str
    http_port: int
    rpc_port: int
    control_port: int
    workdir: Path
    frontend: Proc | None = None
    play: Proc | None = None
    engine_count: int = 1
    got_engine: bool = False
    extra: dict = field(default_factory=dict)
    model_dir: Path = MODEL_DIR

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def control_url(self) -> str:
        return f"http://127.0.0.1:{self.control_port}"

    @property
    def model(self) -> str:
        return str(self.model_dir)

    def logs(self) -> str:
        return "\n".join(p.tail() for p in (self.frontend, self.play) if p is not None)

    def stop(self) -> None:
        if self.play is not None:
            self.play.stop(signal.SIGTERM, grace=15)
        if self.frontend is not None:
            if self.got_engine:
                self.frontend.stop(signal.SIGTERM, grace=15)
            else:
                self.frontend.stop(signal.SIGKILL, grace=5)


def start_stack(version: str, *, engine_count: int = 1, api_server_count: int | None = None,
                play_args: list[str] = (), frontend_args: list[str] = (), timeout: float = 240.0,
                frontend_env: dict[str, str] | None = None, model_dir: Path = MODEL_DIR,
                vocab_size: int | None = VOCAB_SIZE) -> Stack:
    """A real frontend and `vllm-vcr play` joined to it; play gets `--vocab-size vocab_size` unless
    that is None (then its vocabulary comes from `play_args`: MODEL, or the range every vocabulary has)."""
    workdir = _new_workdir(version)
    st = Stack(version, free_port(), free_port(), free_port(), workdir, engine_count=engine_count,
               model_dir=model_dir)
    env = vllm_env(version, VLLM_SERVER_DEV_MODE="1")
    env.update(frontend_env or {})
    fe_cmd = [str(venv(version) / "bin" / "vllm"), "serve", str(model_dir),
              "--host", "127.0.0.1", "--port", str(st.http_port),
              "--data-parallel-size", str(engine_count), "--data-parallel-size-local", "0",
              "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(st.rpc_port),
              "--max-model-len", "1024", *frontend_args]
    if api_server_count is not None:
        fe_cmd += ["--api-server-count", str(api_server_count)]
    st.frontend = _spawn(f"vllm {version} frontend", fe_cmd, env, workdir / "frontend.log", cwd=workdir)

    # play starts once the frontend listens on the handshake port: a connection to that port before
    # it listens can end up being the port's own (TCP's simultaneous open, ZMQ retrying every 100 ms
    # while the frontend starts), and the frontend then fails to bind it
    deadline = time.monotonic() + scaled(timeout)
    while listening(st.rpc_port) == set() and time.monotonic() < deadline:
        if not st.frontend.alive():
            st.stop()
            raise RuntimeError(f"frontend exited ({st.frontend.popen.returncode})\n{st.logs()}")
        time.sleep(0.2)
    penv = {k: v for k, v in os.environ.items() if not k.startswith("MOCK_")}
    penv["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), penv.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    penv["PYTHONUNBUFFERED"] = "1"
    play_cmd = [sys.executable, "-m", "vllm_vcr", "play",
                "--handshake-address", f"tcp://127.0.0.1:{st.rpc_port}",
                "--engine-count", str(engine_count), *(["--vocab-size", str(vocab_size)] if vocab_size else []),
                "--control-address", f"127.0.0.1:{st.control_port}", *play_args]
    st.play = _spawn("vllm-vcr play", play_cmd, penv, workdir / "play.log", cwd=REPO)

    deadline = time.monotonic() + scaled(timeout)
    try:
        with httpx.Client(timeout=2.0) as c:
            while time.monotonic() < deadline:
                if not st.frontend.alive():
                    raise RuntimeError(f"frontend exited ({st.frontend.popen.returncode})\n{st.logs()}")
                if not st.play.alive():
                    raise RuntimeError(f"play exited ({st.play.popen.returncode})\n{st.logs()}")
                if not st.got_engine and "READY" in _tail(st.play.log, 200):
                    st.got_engine = True  # from here on the frontend stops on SIGTERM
                try:
                    if c.get(f"{st.base_url}/health").status_code == 200:
                        st.got_engine = True
                        return st
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        raise RuntimeError(f"not healthy after {timeout:.0f} s\n{st.logs()}")
    except BaseException:
        st.stop()
        raise


def metrics(base_url: str) -> dict[tuple[str, frozenset], float]:
    """/metrics as {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    out: dict[tuple[str, frozenset], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def metric_sum(m: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in m.items() if n == name and want <= lab)
