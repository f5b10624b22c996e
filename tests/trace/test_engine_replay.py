"""Recorded traces driving the engine: --replay-steps, --replay-tokens, --replay-match, --latency-trace."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from vllm_vcr.engine.clock import VirtualClock
from vllm_vcr.engine.config import ConfigError, EngineArgs, EngineConfig
from vllm_vcr.engine.core import EngineCore
from vllm_vcr.engine.types import EngineCoreRequest, FinishReason, SamplingParams
from vllm_vcr.trace.block_hash import prompt_block_hashes
from vllm_vcr.trace.io import read_trace, write_trace
from vllm_vcr.replay.inputs import engine_inputs
from vllm_vcr.replay.latency_fit.cells import fit_cell_model
from vllm_vcr.replay.planner import build_planner, request_index
from vllm_vcr.trace.schema import TraceMeta, TraceRecord

FIXTURES = Path(__file__).parent / "fixtures"


def run_engine(args: EngineArgs, requests: list[EngineCoreRequest]):
    batches = []
    args = args.validate()
    core = EngineCore(args, clock=VirtualClock(0.0), output_sink=lambda c, o: batches.append(o), **engine_inputs(args))
    for r in requests:
        core.add_request(r)
    core.run_until_idle()
    per_req: dict[str, list] = {}
    for b in batches:
        for o in b.outputs:
            per_req.setdefault(o.request_id, []).append((b.timestamp, o))
    return core, per_req


def req(rid: str, prompt: list[int], max_tokens: int | None = 1000, **sp) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt,
                             sampling_params=SamplingParams(max_tokens=max_tokens, **sp))


@pytest.mark.parametrize("rid,index", [("replay-7", 7), ("cmpl-replay-7-0-1a2b3c4d", 7), ("cmpl-replay-7-0", 7), ("req-5", 5), ("replay-3-deadbeef", 3),
                                       ("chatcmpl-abc", None)])
def test_request_index(rid, index):
    assert request_index(EngineCoreRequest(request_id=rid, prompt_token_ids=[1])) == index


def test_replay_steps_reproduce_recorded_gaps_and_chunks():
    trace = read_trace(FIXTURES / "spec_decode_trace.jsonl")
    rec = trace.records[0]
    args = EngineArgs(replay_steps=str(FIXTURES / "spec_decode_trace.jsonl"))
    _, outs = run_engine(args, [req("replay-0", list(range(1, 33)))])
    got = outs["replay-0"]
    chunks = [len(o.new_token_ids) for _, o in got]
    assert chunks == [rec.first_chunk_tokens()] + rec.itl_tokens
    times = [t for t, _ in got]
    assert times[0] == pytest.approx(rec.ttft_ms / 1e3)
    assert [b - a for a, b in zip(times, times[1:])] == pytest.approx([g / 1e3 for g in rec.itl_ms])
    assert sum(chunks) == rec.output_tokens and got[-1][1].finish_reason is FinishReason.LENGTH


def test_replay_tokens_by_index_and_by_prefix(tmp_path):
    prompts = [[i * 100 + j for j in range(40)] for i in range(3)]
    recs = [TraceRecord(prompt_tokens=40, output_tokens=3, ttft_ms=1.0, itl_ms=[1.0, 1.0], arrival_ms=float(i),
                        output_token_ids=[i, i + 10, i + 20], finish_reason="stop" if i else "length",
                        block_hashes=prompt_block_hashes(prompts[i], 16)) for i in range(3)]
    path = tmp_path / "t.jsonl"
    write_trace(path, TraceMeta(block_size=16), recs)
    _, outs = run_engine(EngineArgs(replay_tokens=str(path)), [req("replay-2", [5, 6]), req("replay-0", [5, 6])])
    assert [t for _, o in outs["replay-2"] for t in o.new_token_ids] == [2, 12, 22]
    assert outs["replay-2"][-1][1].finish_reason is FinishReason.STOP
    assert outs["replay-0"][-1][1].finish_reason is FinishReason.LENGTH
    # prefix: ids carry no index; the prompt picks the record, each record used once
    _, outs = run_engine(EngineArgs(replay_tokens=str(path), replay_match="prefix"),
                         [req("a", prompts[1] + [7]), req("b", prompts[1])])
    assert [t for _, o in outs["a"] for t in o.new_token_ids] == [1, 11, 21]
    assert [t for _, o in outs["b"] for t in o.new_token_ids] != [1, 11, 21]


def test_a_trace_without_the_needed_field_is_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, TraceMeta(), [TraceRecord(prompt_tokens=4, output_tokens=1, ttft_ms=1.0)])
    with pytest.raises(ValueError, match="no record has output_token_ids"):
        build_planner(str(path), None)


def synthetic_records(n=400, seed=1):
    rng = random.Random(seed)
    recs = []
    for _ in range(n):
        conc = rng.choice([1, 8, 32])
        gap_mean = 10 + conc * 0.5
        out = rng.randint(20, 60)
        recs.append(TraceRecord(prompt_tokens=rng.choice([100, 1000]), output_tokens=out,
                                ttft_ms=30 + conc + rng.random() * 10, concurrency=conc,
                                itl_ms=[rng.gauss(gap_mean, 1.0) for _ in range(out - 1)]))
    return recs


def test_fitted_model_reproduces_recorded_quantiles_per_concurrency():
    recs = synthetic_records()
    model = fit_cell_model(recs)
    rng = random.Random(0)
    for conc in (1, 8, 32):
        pacings = [model.pacing(100, 0, conc, rng) for _ in range(300)]
        ttfts = [p.ttft * 1e3 for p in pacings]
        gaps = [p.next_step()[0] * 1e3 for p in pacings for _ in range(10)]
        rec_ttft = [r.ttft_ms for r in recs if r.concurrency == conc and r.prompt_tokens == 100]
        rec_gaps = [g for r in recs if r.concurrency == conc and r.prompt_tokens == 100 for g in r.itl_ms]
        assert statistics.median(ttfts) == pytest.approx(statistics.median(rec_ttft), rel=0.05)
        assert statistics.median(gaps) == pytest.approx(statistics.median(rec_gaps), rel=0.05)


def test_latency_trace_paces_the_engine_and_models_eos(tmp_path):
    path = tmp_path / "lat.jsonl"
    write_trace(path, TraceMeta(), synthetic_records())
    core, outs = run_engine(EngineArgs(latency_trace=str(path)),
                            [req(f"r{i}", list(range(100)), max_tokens=500, eos_token_id=7) for i in range(20)]
                            + [req("fixed", list(range(100)), max_tokens=500, ignore_eos=True)])
    assert not core.latency_source_is_knob
    lengths = [sum(len(o.new_token_ids) for _, o in outs[f"r{i}"]) for i in range(20)]
    assert all(20 <= n <= 60 for n in lengths)
    assert all(outs[f"r{i}"][-1][1].finish_reason is FinishReason.STOP for i in range(20))
    assert all(outs[f"r{i}"][-1][1].new_token_ids[-1] == 7 for i in range(20))
    assert sum(len(o.new_token_ids) for _, o in outs["fixed"]) == 500  # ignore_eos: never shortened


def test_latency_trace_excludes_the_knobs(tmp_path):
    with pytest.raises(ConfigError, match="--inter-token-latency"):
        EngineArgs(latency_trace="x.jsonl", config=EngineConfig(inter_token_latency=5)).validate()
