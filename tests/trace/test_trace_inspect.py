"""`vllm-vcr inspect`: summarize, perfetto, plot, converters and gen-demo."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from vllm_vcr.cli import main
from vllm_vcr.inspect.convert_guidellm import ConvertError, convert_guidellm
from vllm_vcr.inspect.gen_demo import gen_demo
from vllm_vcr.inspect.perfetto import to_chrome_trace
from vllm_vcr.inspect.summarize import summarize
from vllm_vcr.trace.io import read_trace, write_trace
from vllm_vcr.trace.stats import (
    Samples,
    bucket_label,
    concurrency_bucket,
    nearest_rank,
    weighted_nearest_rank,
)

FIXTURES = Path(__file__).parent / "fixtures"


def test_nearest_rank_quantiles():
    v = list(range(1, 101))
    assert nearest_rank(v, 50) == 50 and nearest_rank(v, 99) == 99 and nearest_rank(v, 100) == 100
    assert nearest_rank([7.0], 99) == 7.0 and math.isnan(nearest_rank([], 50))
    # weights behave like repeated values
    vals, w = np.array([3.0, 1.0, 2.0]), np.array([1.0, 1.0, 98.0])
    rep = sorted([3.0] + [1.0] + [2.0] * 98)
    for p in (1, 2, 50, 99, 100):
        assert weighted_nearest_rank(vals, w, p) == nearest_rank(rep, p)


def test_concurrency_buckets():
    assert [bucket_label(concurrency_bucket(c)) for c in (0, 1, 2, 4, 5, 6, 7, 8, 9, 33, 64, 65, 500)] == [
        "1", "1", "2-4", "2-4", "5-6", "5-6", "7-8", "7-8", "9-16", "33-64", "33-64", "65+", "65+"]


def test_summarize_rows_and_itl_per_token():
    t = read_trace(FIXTURES / "speculative_trace.jsonl")
    s = summarize(t)
    assert [r["concurrency"] for r in s["rows"]] == ["1", "all"]
    row = s["rows"][-1]
    assert row["count"] == 4 and row["output_total"] == 110
    # the per-token ITL of a 20 ms gap closing a 3-token chunk is 6.67 ms
    per_token = sorted(g / n for r in t.records for g, n in zip(r.itl_ms, r.itl_tokens))
    assert row["itl_p50_ms"] == pytest.approx(nearest_rank(per_token, 50))
    assert row["ttft_p99_ms"] == 120.0


def test_summarize_cli_json_and_table(capsys):
    assert main(["inspect", "summarize", str(FIXTURES / "edge_cases_trace.jsonl"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["records"] == 8 and out["finish_reasons"]["abort"] == 1
    assert {r["concurrency"] for r in out["rows"]} >= {"1", "17-32", "all"}
    assert main(["inspect", "summarize", str(FIXTURES / "batch_context_trace.jsonl")]) == 0
    table = capsys.readouterr().out
    assert "TTFT p50" in table and "all" in table
    assert main(["inspect", "summarize", str(FIXTURES / "nope.jsonl")]) == 1
    assert "no such file" in capsys.readouterr().err


def test_summarize_exact_grouping():
    s = summarize(read_trace(FIXTURES / "batch_context_trace.jsonl"), by="exact")
    assert [r["concurrency"] for r in s["rows"]] == ["1", "2", "4", "6", "8", "all"]


def test_gen_demo_is_deterministic_and_valid(tmp_path: Path, capsys):
    out = tmp_path / "demo.jsonl.gz"
    assert main(["inspect", "gen-demo", "-o", str(out), "--records", "120", "--seed", "3"]) == 0
    t = read_trace(out)
    assert len(t.records) == 120 and t.meta.source == "gen-demo"
    _, recs2 = gen_demo(120, seed=3)
    assert recs2 == t.records
    arrivals = [r.arrival_ms for r in t.records]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert all(r.ttft_ms >= 1.0 and min(r.itl_ms) >= 0.5 for r in t.records)
    ttft = sorted(r.ttft_ms for r in t.records)
    assert nearest_rank(ttft, 99) / nearest_rank(ttft, 50) >= 3.0  # heavy tail
    _, fast = gen_demo(50, seed=0, fast=True)
    assert all(4 <= r.output_tokens <= 8 for r in fast)


def test_from_guidellm(tmp_path: Path, capsys):
    out = tmp_path / "g.jsonl"
    assert main(["inspect", "from-guidellm", str(FIXTURES / "guidellm_sample.json"), "-o", str(out),
                 "--gpu", "H100", "--tp", "2"]) == 0
    t = read_trace(out)
    assert t.meta.source == "guidellm" and t.meta.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert t.meta.gpu == "H100" and t.meta.tp == 2
    assert [r.concurrency for r in t.records] == [4, 4, 4, 1]
    r0 = t.records[0]
    assert (r0.prompt_tokens, r0.output_tokens, r0.ttft_ms) == (128, 100, 45.2)
    assert r0.itl_summary.mean_ms == 14.7 and r0.itl_summary.count == 99
    assert all(r.arrival_ms is None for r in t.records)


def test_guidellm_strategies_and_errors():
    def report(strategy, **req):
        base = {"prompt_tokens": 5, "output_tokens": 1, "time_to_first_token_ms": 3.0}
        base.update(req)
        return {"args": {"target": "http://x"}, "benchmarks": [
            {"config": {"strategy": strategy}, "requests": {"successful": [base]}}]}

    meta, recs = convert_guidellm(report({"type_": "throughput", "max_concurrency": 32}))
    assert recs[0].concurrency == 32 and recs[0].itl_summary is None and meta.model == "http://x"
    assert convert_guidellm(report({"type_": "poisson"}))[1][0].concurrency == 1
    with pytest.raises(ConvertError, match=r"successful\[0\].*time_to_first_token_ms"):
        convert_guidellm(report({"type_": "synchronous"}, time_to_first_token_ms=None))
    with pytest.raises(ConvertError, match="benchmarks"):
        convert_guidellm({})


def test_from_aiperf(tmp_path: Path, capsys):
    out = tmp_path / "a.jsonl"
    assert main(["inspect", "from-aiperf", str(FIXTURES / "aiperf_profile_export.jsonl"),
                 "-o", str(out), "--model", "m"]) == 0
    t = read_trace(out)
    assert t.meta.source == "aiperf" and t.meta.model == "m"
    assert len(t.records) == 3  # the errored and the cancelled request are dropped
    a, b, c = t.records
    assert a.itl_ms == [15.0, 14.5, 15.5, 14.5] and a.itl_tokens is None and a.arrival_ms == 0.0
    assert b.itl_tokens == [2, 2, 2] and b.first_chunk_tokens() == 3 and b.arrival_ms == 50.0
    assert b.concurrency == 2  # a0 was still in flight
    assert c.ttft_ms == pytest.approx(120.0) and c.itl_summary.count == 3 and c.concurrency == 1


def test_perfetto_structure(tmp_path: Path, capsys):
    t = read_trace(FIXTURES / "batch_context_trace.jsonl")
    doc = to_chrome_trace(t.records)
    evs = doc["traceEvents"]
    prefills = [e for e in evs if e.get("name") == "prefill"]
    assert len(prefills) == 5 and prefills[0]["ts"] == 0.0 and prefills[0]["dur"] == 45000.0
    decodes = [e for e in evs if e.get("ph") == "X" and e["name"].startswith("decode")]
    assert len(decodes) == sum(len(r.itl_ms) for r in t.records)
    assert any(e["cname"] == "rail_load" for e in decodes)  # gaps closed by a prefill step
    counters = {e["name"] for e in evs if e["ph"] == "C"}
    assert {"active_requests", "waiting_requests", "engine_running", "prefill_tokens"} <= counters
    active = [e["args"]["value"] for e in evs if e.get("name") == "active_requests"]
    assert active[-1] == 0 and max(active) >= 2
    # lanes never overlap
    lanes: dict[int, list[tuple[float, float]]] = {}
    for e in prefills:
        lanes.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    per_req = to_chrome_trace(t.records, track_per_request=True)
    assert len({e["tid"] for e in per_req["traceEvents"] if e.get("name") == "prefill"}) == 5
    # step-stats sidecar + CLI
    side = tmp_path / "steps.jsonl"
    side.write_text("\n".join(json.dumps({"ts_ms": i * 10.0, "scheduler": {
        "num_running_reqs": i, "num_waiting_reqs": 1, "kv_cache_usage": 0.1 * i,
        "spec_decoding_stats": {"num_draft_tokens": 4, "num_accepted_tokens": 2}}}) for i in range(4)))
    out = tmp_path / "p.json"
    assert main(["inspect", "perfetto", str(FIXTURES / "batch_context_trace.jsonl"), "-o", str(out),
                 "--step-stats", str(side)]) == 0
    doc = json.loads(out.read_text())
    names = {e["name"] for e in doc["traceEvents"]}
    assert {"sched_running_reqs", "sched_waiting_reqs", "sched_kv_cache_usage", "sched_accept_rate",
            "step B1"} <= names


def test_perfetto_drops_records_without_arrival(capsys):
    t = read_trace(FIXTURES / "spec_decode_trace.jsonl")  # no arrival_ms at all
    doc = to_chrome_trace(t.records)
    assert not [e for e in doc["traceEvents"] if e.get("name") == "prefill"]
    assert main(["inspect", "perfetto", str(FIXTURES / "simple_trace.jsonl")]) == 0
    assert json.loads(capsys.readouterr().out)["displayTimeUnit"] == "ms"


def test_plot_writes_pngs(tmp_path: Path, capsys):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed: pip install 'vllm-vcr[plot]'")
    demo = tmp_path / "demo.jsonl"
    write_trace(demo, *gen_demo(80, seed=1, fast=True))
    outdir = tmp_path / "plots"
    assert main(["inspect", "plot", str(demo), str(FIXTURES / "edge_cases_trace.jsonl"),
                 "-o", str(outdir), "--label", "demo"]) == 0
    names = sorted(p.name for p in outdir.iterdir())
    assert names == ["itl_cdf.png", "latency_vs_concurrency.png", "timeline-demo.png",
                     "timeline-edge_cases_trace.png", "ttft_cdf.png"]
    for p in outdir.iterdir():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_samples_cdf():
    s = Samples()
    s.add(2.0, 3)
    s.add(1.0)
    x, y = s.cdf()
    assert list(x) == [1.0, 2.0] and list(y) == [0.25, 1.0] and s.mean() == 1.75


def test_summarize_reports_a_truncated_capture(tmp_path: Path, capsys):
    from vllm_vcr.trace.io import TraceWriter

    path = tmp_path / "cut.jsonl.gz"
    w = TraceWriter(path, None)
    for r in gen_demo(10, seed=0, fast=True)[1]:
        w.write(r)
    data = path.read_bytes()  # sync-flushed records, no gzip trailer yet
    w.close()
    path.write_bytes(data)
    assert main(["inspect", "summarize", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["truncated"] is True and out["records"] == 10
