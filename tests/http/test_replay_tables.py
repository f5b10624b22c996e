"""Response replay tables through `serve`: header and vllm_xargs selection, fallbacks, bad files."""

from __future__ import annotations

import json

import httpx
import pytest

MODEL = "vllm-vcr/sim"


@pytest.fixture
def table(tmp_path):
    p = tmp_path / "replay.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [
        {"request_id": "greeting", "output_length": 4, "output_token_ids": [40, 41, 42, 43]},
        {"session_id": "chat", "output_length": 2, "output_token_ids": [50, 51]},
        {"session_id": "chat", "output_tokens": 1, "output_token_ids": [60]},
    ]) + "\n")
    return p


def completion(sp, headers=None, **body):
    r = httpx.post(sp.url + "/v1/completions", headers=headers or {}, timeout=10, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 50, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("engine_type", ["vllm", "sglang"])
def test_rows_are_selected_by_header_or_vllm_xargs(serve_process, table, engine_type):
    sp = serve_process("--response-replay-trace", str(table), "--engine-type", engine_type)
    assert f"loaded response replay token table {table}: 3 rows" in sp.log()  # once, at start-up
    assert sp.log().count("loaded response replay token table") == 1
    by_header = completion(sp, {"X-Output-Replay-Id": "greeting"})
    assert by_header["token_ids"] == [40, 41, 42, 43] and by_header["finish_reason"] == "length"
    by_xargs = completion(sp, vllm_xargs={"output_replay_id": "chat:1"})
    assert by_xargs["token_ids"] == [60]
    missing = completion(sp, {"X-Output-Replay-Id": "nope"}, max_tokens=3)
    assert len(missing["token_ids"]) == 3  # a warning, then normal generation
    assert "not found" in sp.log()


@pytest.mark.parametrize("engine_type", ["vllm", "sglang"])
def test_streaming_chat_replays_the_row(serve_process, table, engine_type):
    from openai import OpenAI

    sp = serve_process("--response-replay-trace", str(table), "--engine-type", engine_type)
    client = OpenAI(base_url=sp.url + "/v1", api_key="x")
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            stream=True, extra_headers={"X-Output-Replay-Id": "chat:0"},
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 2


def test_a_bad_table_stops_start_up_naming_the_line(serve_harness, tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"request_id": "a", "output_length": 2, "output_token_ids": [1]}\n')
    proc = subprocess.run([sys.executable, "-m", "vllm_vcr", "serve", "--port", str(serve_harness.free_port()),
                           "--response-replay-trace", str(bad)], capture_output=True, text=True, timeout=30,
                          env=serve_harness.subprocess_env())
    assert proc.returncode != 0
    assert "line 1 output_length 2 does not match output_token_ids length 1" in proc.stderr
