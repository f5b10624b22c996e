"""SSE parsing, chunk timing, synthetic prompts and session inference."""

from __future__ import annotations

import json

from vllm_vcr.trace.block_hash import prompt_block_hashes, shared_prefix_blocks
from vllm_vcr.trace.chunk_timer import ChunkTimer
from vllm_vcr.replay.prompts import PromptBuilder, ids_to_text
from vllm_vcr.trace.schema import TraceRecord, validate_record
from vllm_vcr.replay.sessions import find_parents, think_gap_ms
from vllm_vcr.trace.sse import SSEParser, parse_chunk


def test_sse_parser_handles_split_and_crlf_events():
    p = SSEParser()
    raw = b'data: {"a":1}\r\n\r\n: comment\n\ndata: {"b":\ndata: 2}\n\nevent: x\ndata: [DONE]\n\n'
    out = []
    for i in range(len(raw)):  # worst case: one byte at a time
        out += p.feed(raw[i:i + 1])
    assert out == [b'{"a":1}', b'{"b":\n{"b":'.split(b"\n")[0] + b"\n2}", b"[DONE]"]
    p2 = SSEParser()
    assert p2.feed(b"data: tail-without-blank-line") == [] and p2.close() == [b"tail-without-blank-line"]


def test_parse_chunk_counts_tokens():
    def c(obj):
        return parse_chunk(json.dumps(obj).encode())

    assert c({"choices": [{"index": 0, "text": "hi", "finish_reason": None}]}).tokens == 1
    assert c({"choices": [{"index": 0, "text": "hi there", "token_ids": [1, 2, 3]}]}).tokens == 3
    assert c({"choices": [{"index": 0, "text": "ab", "logprobs": {"tokens": ["a", "b"]}}]}).tokens == 2
    assert c({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}).tokens == 0
    assert c({"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}).tokens == 1
    assert c({"choices": [{"index": 1, "text": "other seq"}]}).tokens == 0
    fin = c({"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
             "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
    assert fin.tokens == 0 and fin.finish_reason == "length" and fin.usage["prompt_tokens"] == 5
    assert parse_chunk(b"[DONE]").done
    assert c({"error": {"message": "boom"}}).error == "boom"
    assert parse_chunk(b"not json").tokens == 0


def test_chunk_timer_record():
    t = ChunkTimer(10.0)
    t.on_tokens(10.05, 1)
    t.on_tokens(10.06, 0)  # an empty chunk does not open a gap
    t.on_tokens(10.07, 2)
    t.on_tokens(10.07, 1)  # same read: merged into the previous chunk
    t.on_tokens(10.08, 1)
    t.finish_reason = "length"
    t.usage = {"prompt_tokens": 12, "completion_tokens": 5,
               "prompt_tokens_details": {"cached_tokens": 8}}
    r = t.to_record(prompt_tokens=99, arrival_ms=1.5, concurrency=3)
    assert validate_record(r) is None
    assert (r.prompt_tokens, r.cached_tokens, r.output_tokens) == (12, 8, 5)
    assert round(r.ttft_ms, 6) == 50.0 and [round(g, 3) for g in r.itl_ms] == [20.0, 10.0]
    assert r.itl_tokens == [3, 1] and r.finish_reason == "length" and r.concurrency == 3
    assert ChunkTimer(0.0).to_record(prompt_tokens=1, arrival_ms=0.0, concurrency=1) is None
    # usage reporting more tokens than seen: the surplus is in the first chunk
    t2 = ChunkTimer(0.0)
    t2.on_tokens(0.01, 1)
    t2.on_tokens(0.02, 1)
    t2.usage = {"completion_tokens": 4}
    r2 = t2.to_record(prompt_tokens=1, arrival_ms=0.0, concurrency=1)
    assert r2.output_tokens == 4 and r2.first_chunk_tokens() == 3 and validate_record(r2) is None


def test_prompt_builder_reproduces_lengths_and_shared_prefixes():
    a = TraceRecord(prompt_tokens=40, output_tokens=1, ttft_ms=1.0, block_hashes=[11, 22])
    b = TraceRecord(prompt_tokens=70, output_tokens=1, ttft_ms=1.0, block_hashes=[11, 22, 33, 44])
    c = TraceRecord(prompt_tokens=40, output_tokens=1, ttft_ms=1.0)
    pb = PromptBuilder(block_size=16, vocab_size=4000, seed=0)
    ia, ib, ic = pb.token_ids(0, a), pb.token_ids(1, b), pb.token_ids(2, c)
    assert (len(ia), len(ib), len(ic)) == (40, 70, 40)
    assert ia[:32] == ib[:32] and ia[32:] != ib[32:40]
    assert ic[:16] != ia[:16]
    assert all(10 <= t < 4000 for t in ia + ib + ic)
    assert shared_prefix_blocks(prompt_block_hashes(ia, 16), prompt_block_hashes(ib, 16)) == 2
    assert PromptBuilder(seed=0).token_ids(1, b) == ib  # deterministic
    assert PromptBuilder(seed=1).token_ids(1, b) != ib
    assert len(ids_to_text(ia).split()) == 40
    ids, hashes = PromptBuilder(seed=0).build(1, b)
    assert ids == ib and hashes == prompt_block_hashes(ib, 16) and len(hashes) == 4
    assert pb.build(2, c)[1] is None  # nothing shared, nothing hashed
    long = TraceRecord(prompt_tokens=20000, output_tokens=1, ttft_ms=1.0)
    assert len(pb.token_ids(3, long)) == 20000


def test_sessions_follow_prefix_chains():
    def rec(arr, chain, ttft=10.0):
        return TraceRecord(prompt_tokens=16 * max(len(chain), 1), output_tokens=1, ttft_ms=ttft,
                           arrival_ms=arr, block_hashes=chain or None)

    recs = [rec(0, [1, 2]), rec(5, [7]), rec(50, [1, 2, 3]), rec(60, [1, 2, 3, 4, 5]),
            rec(70, [1, 9]), rec(80, [])]
    # [1, 9] shares a block with record 0 but record 0 (the whole [1, 2]) is not its prefix
    assert find_parents(recs) == [None, None, 0, 2, None, None]
    assert think_gap_ms(recs[0], recs[2]) == 40.0
    assert think_gap_ms(recs[2], recs[0]) == 0.0
