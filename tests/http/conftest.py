"""Servers for the `serve` tests: real `vllm-vcr serve` processes, one per configuration and
module, plus an in-process app (real AsyncEngine + uvicorn) for tests that inspect the engine."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import scaled

MODEL = "vllm-vcr/sim"
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
FAST = ["--inter-token-latency", "1", "--time-to-first-token", "2"]


@pytest.fixture(scope="session")
def tiny_tool_model(tmp_path_factory):
    """scripts/make_tiny_tool_model.py's model: a byte-level BPE of 600 ids (15 specials first, 128
    pieces of multi-byte characters) with tool-call chat templates."""
    out = tmp_path_factory.mktemp("tools-model")
    subprocess.run([sys.executable, str(SCRIPTS / "make_tiny_tool_model.py"), str(out), "--vocab-size", "600"],
                   check=True, capture_output=True)
    return out


def _start(harness, tmp_path_factory, name: str, *args: str):
    log = Path(tmp_path_factory.mktemp(name)) / "serve.log"
    return harness.ServeProcess(list(args), log_path=log).wait_ready()


@pytest.fixture(scope="module")
def server(serve_harness, tmp_path_factory):
    """Random tokens, 2 engines, max_model_len 512, a second served name, cached-token details."""
    sp = _start(serve_harness, tmp_path_factory, "main", *FAST, "--engine-count", "2", "--max-model-len", "512",
                "--served-model-name", MODEL, "alias-model", "--seed", "7",
                "--enable-prompt-tokens-details")
    yield sp
    sp.stop()


@pytest.fixture(scope="module")
def echo_server(serve_harness, tmp_path_factory):
    sp = _start(serve_harness, tmp_path_factory, "echo", *FAST, "--mode", "echo")
    yield sp
    sp.stop()


@pytest.fixture
async def inprocess(serve_harness):
    """start(**engine_arg_overrides) -> (url, AsyncEngine): build_app served by uvicorn in this loop."""
    import uvicorn

    from vllm_vcr.engine.async_engine import AsyncEngine
    from vllm_vcr.engine.config import EngineArgs, EngineConfig
    from vllm_vcr.frontend.tokenizer import load_tokenizer
    from vllm_vcr.http.serving_base import ServeSettings
    from vllm_vcr.serve.app import build_app

    running = []

    async def start(itl_ms: float = 2.0, engine_count: int = 1, sndbuf: int | None = None, stamped: bool = True):
        """`stamped`: serve's own HTTP protocol (acceptor.stamping_arrival), as serve runs; False:
        uvicorn's plain one (streams then never join steady batches: it does not report paused
        or lost sockets)."""
        tok = load_tokenizer()
        args = EngineArgs(config=EngineConfig(inter_token_latency=itl_ms, time_to_first_token=1.0,
                                              max_model_len=4096, log_requests=False),
                          vocab_size=4096, eos_token_id=tok.eos_token_id).validate()
        engine = AsyncEngine(args, engine_count=engine_count)
        await engine.start()
        settings = ServeSettings(engine_count=engine_count)
        app = build_app(engine, tok, settings)
        sock = socket.socket()
        if sndbuf:  # accepted sockets inherit it: a small one makes uvicorn pause writing sooner
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        sock.setblocking(False)
        http: Any = "auto"
        if stamped:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

            from vllm_vcr.http.uvicorn_internals import stamping_arrival
            http = stamping_arrival(HttpToolsProtocol)
        server = uvicorn.Server(uvicorn.Config(app, http=http, lifespan="off", log_config=None, access_log=False))
        server.config.setup_event_loop = lambda: None
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        running.append((server, task, engine, sock))
        return f"http://127.0.0.1:{sock.getsockname()[1]}", engine

    yield start
    for server, task, engine, sock in running:
        server.should_exit = True
        await engine.stop(0)
        await asyncio.wait_for(task, scaled(10))
        sock.close()
