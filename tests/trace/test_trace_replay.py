"""`replay-arrivals` against a small streaming server and against `vllm-vcr serve`."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.conftest import scaled
from vllm_vcr.cli import main
from vllm_vcr.inspect.gen_demo import gen_demo
from vllm_vcr.trace.block_hash import shared_prefix_blocks
from vllm_vcr.trace.io import read_trace, write_trace
from vllm_vcr.trace.schema import TraceMeta, TraceRecord

def _constant_trace(path: Path, n: int = 12, gap_ms: float = 25.0) -> None:
    recs = [TraceRecord(prompt_tokens=20 + i, output_tokens=4, ttft_ms=5.0, itl_ms=[1.0] * 3,
                        arrival_ms=i * gap_ms) for i in range(n)]
    write_trace(path, TraceMeta(model="m", block_size=16), recs)


def test_replay_sends_at_recorded_offsets(tmp_path: Path, fake_openai, capsys):
    src, out = tmp_path / "src.jsonl", tmp_path / "out.jsonl.gz"
    _constant_trace(src)
    t0 = time.monotonic()
    assert main(["replay-arrivals", str(src), "--target", fake_openai.url, "--trace-out", str(out),
                 "--json"]) == 0
    wall = time.monotonic() - t0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] == 12 and summary["errors"] == 0 and summary["model"] == "fake-model"
    assert wall >= 11 * 0.025
    t = read_trace(out)
    assert t.meta.source == "replay-arrivals" and t.meta.model == "fake-model"
    assert t.meta.extra["replay_of"] == "src.jsonl"
    recs = sorted(t.records, key=lambda r: r.arrival_ms)
    assert len(recs) == 12
    offsets = [r.arrival_ms for r in recs]
    for i, off in enumerate(offsets):
        assert abs(off - i * 25.0) < scaled(60.0)  # open loop, on schedule (loose: shared CI cores)
    assert all(r.output_tokens == 4 and r.ttft_ms >= 15.0 for r in recs)
    assert sorted(r.prompt_tokens for r in recs) == list(range(20, 32))
    bodies = fake_openai.requests
    assert all(b["stream"] and b["ignore_eos"] and b["max_tokens"] == 4 for b in bodies)
    assert all(isinstance(b["prompt"], list) for b in bodies)
    assert {h["x-request-id"] for h in fake_openai.headers} == {f"replay-{i}" for i in range(12)}



def test_replay_multi_token_chunks_and_chat(tmp_path: Path, capsys):
    from .conftest import FakeOpenAI

    srv = FakeOpenAI(ttft_s=0.01, itl_s=0.01, burst=3).start()
    try:
        src, out = tmp_path / "src.jsonl", tmp_path / "out.jsonl"
        write_trace(src, TraceMeta(model="m"), [
            TraceRecord(prompt_tokens=30, output_tokens=10, ttft_ms=5.0, itl_ms=[1.0] * 9,
                        arrival_ms=float(i * 1000)) for i in range(6)])
        assert main(["replay-arrivals", str(src), "--target", srv.url + "/v1", "--trace-out", str(out),
                     "--time-scale", "50", "--max-requests", "4", "--json"]) == 0
        s = json.loads(capsys.readouterr().out)
        assert s["scheduled"] == 4 and s["ok"] == 4
        for r in read_trace(out).records:
            assert r.output_tokens == 10 and r.itl_tokens == [3, 3, 3] and r.first_chunk_tokens() == 1
        srv.requests.clear()
        assert main(["replay-arrivals", str(src), "--target", srv.url, "--api", "chat",
                     "--time-scale", "100", "--max-tokens-cap", "2", "--json"]) == 0
        s = json.loads(capsys.readouterr().out)
        assert s["ok"] == 6
        assert all(b["max_tokens"] == 2 and len(b["messages"][0]["content"].split()) == 30
                   for b in srv.requests)
    finally:
        srv.stop()


def test_replay_holds_a_turn_until_its_parent_finished(tmp_path: Path, capsys):
    from .conftest import FakeOpenAI

    srv = FakeOpenAI(ttft_s=0.25, itl_s=0.001).start()
    try:
        src, out = tmp_path / "src.jsonl", tmp_path / "out.jsonl"
        # the child arrives 10 ms after its parent in the file, but its prompt extends the
        # parent's, so it is the next turn and must wait for the parent's answer
        write_trace(src, TraceMeta(block_size=16), [
            TraceRecord(prompt_tokens=32, output_tokens=2, ttft_ms=1.0, itl_ms=[1.0],
                        arrival_ms=0.0, block_hashes=[1, 2]),
            TraceRecord(prompt_tokens=48, output_tokens=2, ttft_ms=1.0, itl_ms=[1.0],
                        arrival_ms=10.0, block_hashes=[1, 2, 3]),
        ])
        assert main(["replay-arrivals", str(src), "--target", srv.url, "--trace-out", str(out),
                     "--json"]) == 0
        recs = sorted(read_trace(out).records, key=lambda r: r.arrival_ms)
        assert recs[1].arrival_ms >= recs[0].arrival_ms + 250.0
        assert recs[1].concurrency == 1
        assert shared_prefix_blocks(recs[0].block_hashes, recs[1].block_hashes) == 2
        a, b = srv.requests[0]["prompt"], srv.requests[1]["prompt"]
        assert a[:32] == b[:32]
        # without sessions both go out on schedule, overlapping
        assert main(["replay-arrivals", str(src), "--target", srv.url, "--trace-out", str(out),
                     "--no-sessions", "--json"]) == 0
        recs = sorted(read_trace(out).records, key=lambda r: r.arrival_ms)
        assert recs[1].arrival_ms < 200.0 and recs[1].concurrency == 2
    finally:
        srv.stop()


def test_replay_errors_are_counted(tmp_path: Path, capsys):
    src = tmp_path / "src.jsonl"
    _constant_trace(src, n=3, gap_ms=1.0)
    from tests.conftest import free_port

    dead = free_port()
    assert main(["replay-arrivals", str(src), "--target", f"http://127.0.0.1:{dead}",
                 "--model", "x", "--json"]) == 1
    s = json.loads(capsys.readouterr().out)
    assert s["errors"] == 3 and s["ok"] == 0 and s["error_samples"]
    nots = tmp_path / "noarrival.jsonl"
    write_trace(nots, None, [TraceRecord(prompt_tokens=1, output_tokens=1, ttft_ms=1.0)])
    assert main(["replay-arrivals", str(nots), "--target", "http://127.0.0.1:1"]) == 1
    assert "arrival_ms" in capsys.readouterr().err


def test_replay_against_vllm_vcr_serve(tmp_path: Path, capsys, serve_process):
    sp = serve_process("--time-to-first-token", "15", "--inter-token-latency", "3")
    src, out = tmp_path / "demo.jsonl", tmp_path / "out.jsonl"
    write_trace(src, *gen_demo(20, seed=2, fast=True, mean_gap_ms=15.0))
    assert main(["replay-arrivals", str(src), "--target", sp.url, "--trace-out", str(out), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["ok"] == 20, s
    recs = read_trace(out).records
    src_recs = read_trace(src).records
    assert sorted(r.output_tokens for r in recs) == sorted(r.output_tokens for r in src_recs)
    assert sorted(r.prompt_tokens for r in recs) == sorted(r.prompt_tokens for r in src_recs)
    assert all(r.ttft_ms >= 10.0 for r in recs)


def test_replay_duration_bound(tmp_path: Path, fake_openai, capsys):
    src = tmp_path / "src.jsonl"
    _constant_trace(src, n=20, gap_ms=50.0)
    assert main(["replay-arrivals", str(src), "--target", fake_openai.url, "--duration", "0.2",
                 "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["scheduled"] == 5 and s["ok"] == 5  # offsets 0, 50, ..., 200 ms
