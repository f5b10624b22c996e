"""`record --http`: the recording reverse proxy, run as a real subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import scaled
from vllm_vcr.cli import main
from vllm_vcr.trace.io import read_trace, write_trace
from vllm_vcr.trace.schema import TraceMeta, TraceRecord

SRC = Path(__file__).resolve().parents[2] / "src"


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))


class Proxy:
    def __init__(self, upstream: str, trace_out: Path, *extra: str):
        from tests.conftest import free_port, wait_http_ok

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_vcr", "record", "--http", "--upstream", upstream,
             "--listen", f"127.0.0.1:{self.port}", "--trace-out", str(trace_out), *extra],
            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_http_ok(self.url + "/v1/models", 60,
                     lambda: None if self.proc.poll() is None else self.proc.stderr.read(), interval=0.1)

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=scaled(15))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        assert self.proc.returncode == 0, err
        return err


def _post(url: str, body: dict, stream_read: int | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read() if stream_read is None else resp.read(stream_read)
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_proxy_passes_bytes_through_and_records(tmp_path: Path, fake_openai):
    out = tmp_path / "rec.jsonl.gz"
    proxy = Proxy(fake_openai.url, out, "--gpu", "H100")
    try:
        body = {"model": "fake-model", "prompt": list(range(40)), "max_tokens": 5, "stream": True,
                "stream_options": {"include_usage": True}}
        st1, via = _post(proxy.url + "/v1/completions", body)
        st2, direct = _post(fake_openai.url + "/v1/completions", body)
        assert st1 == st2 == 200 and via == direct  # byte-identical SSE body
        chat = {"model": "fake-model", "messages": [{"role": "user", "content": "a b c d e f g h"}],
                "max_tokens": 3, "stream": True}
        assert _post(proxy.url + "/v1/chat/completions", chat)[0] == 200
        st, plain = _post(proxy.url + "/v1/completions", {"model": "fake-model", "prompt": "x", "max_tokens": 2})
        assert st == 200 and json.loads(plain)["usage"]["completion_tokens"] == 2
        st, err = _post(proxy.url + "/v1/completions", {"prompt": "x", "max_tokens": 0, "stream": True})
        assert st == 400 and b"max_tokens" in err  # upstream errors pass through, unrecorded
        assert _post(proxy.url + "/nope", {})[0] == 404
    finally:
        log = proxy.stop()
    assert "recorded 2 requests" in log and "1 not streamed" in log
    t = read_trace(out)  # gzip finalized on SIGINT
    assert not t.truncated
    assert t.meta.source == "http-tap" and t.meta.model == "fake-model" and t.meta.gpu == "H100"
    assert t.meta.extra["upstream"] == fake_openai.url
    comp, chat_rec = sorted(t.records, key=lambda r: r.arrival_ms)
    assert comp.arrival_ms == 0.0 and comp.prompt_tokens == 40 and comp.output_tokens == 5
    assert len(comp.itl_ms) == 4 and comp.ttft_ms >= 15.0 and comp.finish_reason == "length"
    assert len(comp.block_hashes) == 2  # 40 token ids = 2 full blocks of 16
    assert chat_rec.output_tokens == 3 and chat_rec.block_hashes is None
    assert chat_rec.extra == {"prompt_tokens_estimated": True}  # text prompt, no usage asked


def test_proxy_drops_abandoned_streams(tmp_path: Path):
    from .conftest import FakeOpenAI

    slow = FakeOpenAI(ttft_s=0.01, itl_s=0.05).start()
    out = tmp_path / "rec.jsonl"
    proxy = Proxy(slow.url, out)
    try:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": "fake-model", "prompt": [1, 2, 3], "max_tokens": 40, "stream": True}),
            {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.read(20)  # the first chunk arrived; now hang up
        conn.sock.shutdown(2)
        conn.close()
        time.sleep(0.4)
        assert _post(proxy.url + "/v1/completions", {"model": "fake-model", "prompt": [1], "max_tokens": 2,
                                                     "stream": True})[0] == 200
    finally:
        log = proxy.stop()
        slow.stop()
    assert "recorded 1 requests" in log and "1 aborted" in log
    assert [r.output_tokens for r in read_trace(out).records] == [2]


def test_record_argument_errors(capsys):
    assert main(["record", "--http", "--trace-out", "x.jsonl"]) == 2
    assert "--upstream" in capsys.readouterr().err
    assert main(["record", "--http", "--upstream", "http://127.0.0.1:1", "--listen", "nope",
                 "--trace-out", "x.jsonl"]) == 2
    assert main(["record", "--engine-handshake", "127.0.0.1:5580", "--trace-out", "x.jsonl"]) == 2
    assert "tcp://" in capsys.readouterr().err


def test_replay_through_the_proxy(tmp_path: Path, fake_openai, capsys):
    """replay-arrivals -> record --http -> server: the proxy sees what the load generator sees."""
    src, rec_out, replay_out = tmp_path / "src.jsonl", tmp_path / "rec.jsonl", tmp_path / "rep.jsonl"
    write_trace(src, TraceMeta(block_size=16), [
        TraceRecord(prompt_tokens=33, output_tokens=6, ttft_ms=5.0, itl_ms=[1.0] * 5,
                    arrival_ms=i * 20.0) for i in range(8)])
    proxy = Proxy(fake_openai.url, rec_out)
    try:
        assert main(["replay-arrivals", str(src), "--target", proxy.url, "--trace-out", str(replay_out),
                     "--json"]) == 0
    finally:
        proxy.stop()
    rec, rep = read_trace(rec_out).records, read_trace(replay_out).records
    assert len(rec) == len(rep) == 8
    assert sorted(r.prompt_tokens for r in rec) == [33] * 8
    assert sorted(r.output_tokens for r in rec) == [6] * 8
    # usage (include_usage) made the proxy's prompt counts exact, not estimated
    assert all(r.extra is None for r in rec)
    # the proxy sits closer to the server: its TTFT is not larger than the client's
    assert sum(r.ttft_ms for r in rec) <= sum(r.ttft_ms for r in rep) + 8 * 2.0


def test_proxy_counts_text_prompts_with_a_tokenizer(tmp_path: Path, fake_openai):
    tok = SRC / "vllm_vcr" / "data" / "tokenizer.json"  # the package's bundled tokenizer
    from tokenizers import Tokenizer

    out = tmp_path / "rec.jsonl"
    proxy = Proxy(fake_openai.url, out, "--tokenizer", str(tok))
    text = "the quick brown fox jumps over the lazy dog " * 3
    try:
        assert _post(proxy.url + "/v1/completions", {"model": "fake-model", "prompt": text,
                                                     "max_tokens": 2, "stream": True})[0] == 200
    finally:
        proxy.stop()
    (rec,) = read_trace(out).records
    assert rec.prompt_tokens == len(Tokenizer.from_file(str(tok)).encode(text, add_special_tokens=False).ids)
    assert rec.extra == {"prompt_tokens_estimated": True} and rec.block_hashes is None
