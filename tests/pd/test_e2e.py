"""End to end: two real `vllm-vcr serve` processes (prefill, decode) behind `vllm-vcr pd-proxy`,
driven by the openai SDK. TTFT must include the simulated KV pull, and the prefill instance's
held blocks must be released by the decode side (not by the hold timeout)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ..conftest import free_port, scaled, subprocess_env, wait_http_ok

PROMPT = list(range(100, 400))  # 300 tokens
# 300 tokens x 1 MB per token at 1 GB/s = 300 ms of KV pull
KV_FLAGS = ["--kv-bytes-per-token", "1000000", "--kv-transfer-bandwidth", "1.0", "--kv-cache-size", "1000"]
PULL_S = 0.3


class Proxy:
    def __init__(self, *args: str, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "wb")
        self.log_path = log
        self.proc = subprocess.Popen([sys.executable, "-m", "vllm_vcr", "pd-proxy", "--port", str(self.port), *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=subprocess_env())
        try:
            wait_http_ok(self.url + "/health", 15, lambda: None if self.proc.poll() is None
                         else f"pd-proxy exited with {self.proc.returncode}:\n{log.read_text()}")
        except TimeoutError as e:
            raise TimeoutError(f"{e}\n{log.read_text()}") from None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


@pytest.fixture
def proxy(tmp_path):
    started = []

    def start(*args):
        p = Proxy(*args, log=tmp_path / f"proxy-{len(started)}.log")
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def kv_usage(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:kv_cache_usage_perc in /metrics")


def wait_usage_zero(url: str, timeout: float = 3.0) -> float:
    deadline = time.monotonic() + scaled(timeout)
    usage = kv_usage(url)
    while usage != 0.0 and time.monotonic() < deadline:
        time.sleep(0.05)
        usage = kv_usage(url)
    return usage


def streamed_ttft(base_url: str) -> tuple[float, str, str]:
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
    model = client.models.list().data[0].id
    t0 = time.monotonic()
    ttft = None
    text = ""
    finish = None
    for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=5, stream=True):
        if ttft is None and chunk.choices and chunk.choices[0].text:
            ttft = time.monotonic() - t0
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    return ttft, text, finish


def test_nixl_two_step_flow_through_the_proxy(serve_process, proxy):
    side = free_port()
    prefill = serve_process("--worker-type", "prefill", "--side-channel-port", str(side), *KV_FLAGS)
    decode = serve_process("--worker-type", "decode", "--inter-token-latency", "5", *KV_FLAGS)
    px = proxy("--prefill", prefill.url, "--decode", decode.url)
    ttft, text, finish = streamed_ttft(px.url)
    assert ttft is not None and ttft >= PULL_S, ttft
    assert finish == "length" and text
    assert wait_usage_zero(prefill.url) == 0.0, "the prefill's held KV was not released by the decode side"


def test_bootstrap_flow_through_the_proxy(serve_process, proxy):
    boot = free_port()
    prefill = serve_process("--worker-type", "prefill", "--side-channel-port", str(free_port()),
                            "--bootstrap-port", str(boot), "--time-to-first-token", "100", *KV_FLAGS)
    decode = serve_process("--worker-type", "decode", "--inter-token-latency", "5", *KV_FLAGS)
    px = proxy("--prefill", prefill.url, "--decode", decode.url, "--bootstrap", f"127.0.0.1:{boot}")
    ttft, text, finish = streamed_ttft(px.url)
    assert ttft is not None and ttft >= 0.1 + PULL_S, ttft  # prefill's TTFT, then the pull
    assert finish == "length" and text
    assert wait_usage_zero(prefill.url) == 0.0, "the prefill's held KV was not released by the decode side"
