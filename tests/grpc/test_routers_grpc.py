"""`serve --grpc` behind the routers users put in front of vLLM's gRPC engine: SMG with a
`grpc://` worker (tokenizing and detokenizing itself, Generate over the VllmEngine service).
Skipped, with the reason, when the routers are not installed (scripts install them into
~/.cache/vllm-vcr/peers/routers)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from ..conformance.peers import CACHE
from ..conftest import free_port, scaled, wait_http_ok
from .test_serve_grpc import DATA, start_grpc_serve

ROUTERS_BIN = CACHE / "routers" / "bin"


def router(name: str) -> Path:
    path = ROUTERS_BIN / name
    if not path.exists():
        pytest.skip(f"{name} is not installed in {ROUTERS_BIN} (pip install vllm-router smg into a venv there)")
    return path


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A local model directory: the embedded tokenizer, which both the worker and the router load."""
    d = tmp_path / "model"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DATA / name, d / name)
    return d


def test_smg_routes_chat_to_a_grpc_worker(tmp_path, model_dir):
    smg = router("smg")
    control = free_port()
    worker = start_grpc_serve(tmp_path, str(model_dir), "--control-address", f"127.0.0.1:{control}")
    port = free_port()
    log = open(tmp_path / "smg.log", "wb")
    proc = subprocess.Popen([str(smg), "launch", "--host", "127.0.0.1", "--port", str(port),
                             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                             "--worker-urls", f"grpc://127.0.0.1:{worker.port}", "--model-path", str(model_dir),
                             "--shutdown-grace-period-secs", "0"],  # (its 5 s wait at exit: nothing is in flight)
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        def exited() -> str | None:
            return None if proc.poll() is None else f"smg exited {proc.returncode}"

        wait_http_ok(f"http://127.0.0.1:{port}/readiness", 60, exited)
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=scaled(30))
        chat = client.chat.completions.create(model=str(model_dir), max_tokens=6,
                                              messages=[{"role": "user", "content": "hello"}])
        assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens >= 1
        stream = client.completions.create(model=str(model_dir), prompt="hello there", max_tokens=5, stream=True)
        text = "".join(c.choices[0].text for c in stream if c.choices)
        assert isinstance(text, str)
        stats = httpx.get(f"http://127.0.0.1:{control}/stats", timeout=10).json()
        assert stats["requests_completed"] >= 2 and stats["requests_failed"] == 0
    finally:
        proc.terminate()
        try:
            proc.wait(scaled(10))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()
        assert worker.stop() == 0


def test_vllm_router_grpc_workers():
    router("vllm-router")
    pytest.skip("vllm-router's grpc:// workers speak vLLM's Rust-frontend services (vllm.Inference/GenerateStream, "
                "vllm.Control), which `vllm serve --grpc` does not serve (VLLM_USE_RUST_FRONTEND=1 with "
                "--grpc-port does); `serve --grpc` serves the VllmEngine service that SMG uses")
