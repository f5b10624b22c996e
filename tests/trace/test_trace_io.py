"""Trace schema and file I/O: fixtures, round trips, gzip, truncation, validation errors."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest

from vllm_vcr.trace.io import (
    TraceError,
    TraceWriter,
    dumps_trace,
    read_trace,
    write_trace,
)
from vllm_vcr.trace.schema import (
    ItlCtx,
    TraceMeta,
    TraceRecord,
    replay_index,
    replay_subset,
)

FIXTURES = Path(__file__).parent / "fixtures"

TRACE_FIXTURES = sorted(FIXTURES.glob("*_trace.jsonl"))


def _rec(**kw) -> TraceRecord:
    base = dict(prompt_tokens=10, output_tokens=3, ttft_ms=5.0, itl_ms=[1.0, 2.0])
    base.update(kw)
    return TraceRecord(**base)


@pytest.mark.parametrize("path", TRACE_FIXTURES, ids=lambda p: p.name)
def test_every_fixture_loads_and_round_trips(path: Path, tmp_path: Path):
    trace = read_trace(path)
    assert trace.records
    assert trace.meta is not None
    out = tmp_path / "out.jsonl"
    write_trace(out, trace.meta, trace.records)
    again = read_trace(out)
    assert again.meta == trace.meta
    assert again.records == trace.records
    # the JSON content is identical, field by field (defaults are filled in, never lost)
    src = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    dst = [json.loads(l) for l in out.read_text().splitlines() if l.strip()]
    for a, b in zip(src[1:], dst[1:]):
        a.setdefault("cached_tokens", 0)
        a.setdefault("concurrency", 1)
        assert a == b


def test_fixture_contents():
    spec = read_trace(FIXTURES / "speculative_trace.jsonl")
    r = spec.records[0]
    assert r.itl_tokens == [3, 4, 2, 3] and r.first_chunk_tokens() == 3
    edge = read_trace(FIXTURES / "edge_cases_trace.jsonl")
    assert {r.finish_reason for r in edge.records} == {"stop", "length", "abort", "error", "repetition"}
    assert edge.records[0].concurrency == 1 and edge.records[0].cached_tokens == 0
    mm = read_trace(FIXTURES / "gemma4_mm_trace.jsonl")
    assert mm.meta.gpu == "H200" and mm.records[0].block_hashes[0] == 6088233159400289621


def test_unknown_fields_survive_a_round_trip(tmp_path: Path):
    src = tmp_path / "t.jsonl"
    src.write_text(
        '{"meta":{"model":"m","future_key":{"a":1}}}\n'
        '{"prompt_tokens":4,"output_tokens":1,"ttft_ms":2.5,"new_field":[1,2],"session":"s1"}\n'
    )
    t = read_trace(src)
    assert t.meta.extra == {"future_key": {"a": 1}}
    assert t.records[0].extra == {"new_field": [1, 2], "session": "s1"}
    out = tmp_path / "o.jsonl"
    write_trace(out, t.meta, t.records)
    lines = [json.loads(l) for l in out.read_text().splitlines()]
    assert lines[0] == {"meta": {"model": "m", "future_key": {"a": 1}}}
    assert lines[1]["new_field"] == [1, 2] and lines[1]["session"] == "s1"


def test_none_fields_are_omitted():
    line = dumps_trace(None, [TraceRecord(prompt_tokens=1, output_tokens=1, ttft_ms=1.0)])
    assert json.loads(line) == {"prompt_tokens": 1, "cached_tokens": 0, "output_tokens": 1,
                                "ttft_ms": 1.0, "concurrency": 1}


def test_gzip_round_trip(tmp_path: Path):
    recs = [_rec(arrival_ms=float(i), concurrency=i + 1) for i in range(50)]
    path = tmp_path / "t.jsonl.gz"
    write_trace(path, TraceMeta(model="m", source="test"), recs)
    assert path.read_bytes()[:2] == b"\x1f\x8b"
    t = read_trace(path)
    assert t.records == recs and not t.truncated and t.meta.source == "test"


def test_multi_member_gzip(tmp_path: Path):
    path = tmp_path / "t.jsonl.gz"
    part1 = dumps_trace(TraceMeta(model="m"), [_rec(arrival_ms=0.0)])
    part2 = dumps_trace(None, [_rec(arrival_ms=1.0)])
    path.write_bytes(gzip.compress(part1) + gzip.compress(part2))
    assert len(read_trace(path).records) == 2


def test_truncated_gzip_keeps_complete_records(tmp_path: Path, caplog):
    path = tmp_path / "cut.jsonl.gz"
    w = TraceWriter(path, TraceMeta(model="m"))
    for i in range(20):
        w.write(_rec(arrival_ms=float(i)))
    w.flush()
    data = path.read_bytes()  # no close(): the gzip trailer was never written
    w.close()
    cut = tmp_path / "cut2.jsonl.gz"
    cut.write_bytes(data)
    with caplog.at_level(logging.WARNING):
        t = read_trace(cut)
    assert t.truncated and len(t.records) == 20
    assert "trailer" in caplog.text
    # cut in the middle of the deflate stream: a partial last line is dropped, not an error
    cut.write_bytes(data[: len(data) - 7])
    t = read_trace(cut)
    assert t.truncated and 0 < len(t.records) <= 20


def test_blank_lines_and_no_meta(tmp_path: Path):
    p = tmp_path / "t.jsonl"
    p.write_text('\n{"prompt_tokens":1,"output_tokens":1,"ttft_ms":1}\n\n')
    t = read_trace(p)
    assert t.meta is None and len(t.records) == 1 and t.records[0].ttft_ms == 1.0


@pytest.mark.parametrize(
    "line, field, needle",
    [
        ('{"prompt_tokens":"x","output_tokens":1,"ttft_ms":1}', "prompt_tokens", "Expected `int`"),
        ('{"prompt_tokens":1,"output_tokens":1}', "ttft_ms", "missing"),
        ('{"prompt_tokens":1,"output_tokens":5,"ttft_ms":1}', "itl_ms", "itl_summary"),
        ('{"prompt_tokens":1,"output_tokens":3,"ttft_ms":1,"itl_ms":[1,1],'
         '"itl_ctx":{"num_running":[1],"prefill_tokens":[0,0]}}', "itl_ctx.num_running", "1 entries"),
        ('{"prompt_tokens":1,"output_tokens":3,"ttft_ms":1,"itl_ms":[1,1],"itl_tokens":[1,2]}',
         "itl_tokens", "must be < output_tokens"),
        ('{"prompt_tokens":1,"output_tokens":3,"ttft_ms":1,"itl_ms":[1,1],"itl_tokens":[0,1]}',
         "itl_tokens", "> 0"),
        ('{"prompt_tokens":1,"output_tokens":2,"ttft_ms":1,"itl_ms":[1],"output_token_ids":[1]}',
         "output_token_ids", "1 entries"),
        ('{"prompt_tokens":1,"output_tokens":2,"ttft_ms":1,"itl_summary":{"mean_ms":"a","count":1}}',
         "itl_summary.mean_ms", "Expected `float`"),
    ],
)
def test_validation_errors_name_line_and_field(tmp_path: Path, line: str, field: str, needle: str):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"meta":{"model":"m"}}\n{"prompt_tokens":1,"output_tokens":1,"ttft_ms":1}\n\n' + line + "\n")
    with pytest.raises(TraceError) as ei:
        read_trace(p)
    err = ei.value
    assert err.line == 4 and err.field == field, str(err)
    assert f"bad.jsonl:4: field `{field}`" in str(err) and needle in str(err)


def test_invalid_json_and_misplaced_meta(tmp_path: Path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt_tokens":1,"output_tokens":1,"ttft_ms":1}\n{oops\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:2: invalid JSON"):
        read_trace(p)
    p.write_text('{"prompt_tokens":1,"output_tokens":1,"ttft_ms":1}\n{"meta":{}}\n')
    with pytest.raises(TraceError, match=r":2: field `meta`"):
        read_trace(p)
    with pytest.raises(TraceError, match="no such file"):
        read_trace(tmp_path / "missing.jsonl")


def test_replay_subset_and_index():
    recs = [_rec(arrival_ms=5.0, prompt_tokens=1), _rec(prompt_tokens=2),
            _rec(arrival_ms=1.0, prompt_tokens=3), _rec(arrival_ms=5.0, prompt_tokens=4)]
    assert [r.prompt_tokens for r in replay_subset(recs)] == [3, 1, 4]
    assert replay_index("replay-12") == 12
    assert replay_index("cmpl-replay-7-0") == 0
    assert replay_index("42") == 42 and replay_index("abc") is None


def test_derived_views():
    r = _rec(output_tokens=6, itl_ms=[1.0, 2.0], itl_tokens=[2, 3],
             itl_ctx=ItlCtx(num_running=[1, 1], prefill_tokens=[0, 0]))
    assert r.first_chunk_tokens() == 1 and r.decode_ms() == 3.0 and r.latency_ms() == 8.0
