"""The optional `{"fpm": ...}` record kind of traces: written beside request records, read apart."""

from __future__ import annotations

import pytest

from vllm_vcr.trace.io import TraceError, TraceWriter, iter_trace, read_trace
from vllm_vcr.trace.schema import TraceMeta, TraceRecord


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_step_records_round_trip_beside_request_records(tmp_path, name):
    path = tmp_path / name
    with TraceWriter(path, TraceMeta(model="m")) as w:
        w.write_fpm({"version": 1, "dp_rank": 0, "step": 1, "scheduled_requests": {"sum_prefill_tokens": 9}})
        w.write(TraceRecord(prompt_tokens=9, output_tokens=1, ttft_ms=3.0))
        w.write_fpm({"version": 1, "dp_rank": 0, "step": 2})
    trace = read_trace(path)
    assert [d["step"] for d in trace.fpm] == [1, 2]
    assert trace.fpm[0]["scheduled_requests"]["sum_prefill_tokens"] == 9
    assert len(trace.records) == 1  # request records are untouched
    assert [type(x).__name__ for x in iter_trace(path)] == ["TraceMeta", "TraceRecord"]


def test_a_bad_step_record_names_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"meta": {}}\n{"fpm": 3}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:2: field `fpm`: must be a JSON object"):
        read_trace(path)
