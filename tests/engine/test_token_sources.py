"""Response replay tables, reasoning spans and echo mode."""

import json

import pytest

from vllm_vcr.replay.table import ReplayTableError, ResponseReplayTable
from vllm_vcr.engine.tokens import ReasoningConfig
from vllm_vcr.engine.types import EngineCoreRequest, FinishReason, SamplingParams


def write(tmp_path, rows):
    p = tmp_path / "replay.jsonl"
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return p


def test_replay_table_keys(tmp_path):
    p = write(tmp_path, [
        {"request_id": "explicit", "output_length": 2, "output_token_ids": [1, 2]},
        {"session_id": "s", "output_length": 3},  # no ids: still counts a turn
        "",
        {"session_id": "s", "output_tokens": 1, "output_token_ids": [7]},
        {"output_length": 1, "output_token_ids": [9]},
    ])
    t = ResponseReplayTable.from_path(p)
    assert t.get("explicit") == [1, 2] and t.get("s:1") == [7] and t.get("line:4") == [9]
    assert len(t) == 3


@pytest.mark.parametrize("rows,message", [
    ([{"request_id": "a", "output_token_ids": [1]}], "line 1 has output_token_ids but no output_length"),
    ([{"request_id": "a", "output_length": 2, "output_token_ids": [1]}], "line 1 output_length 2 does not match"),
    ([{"request_id": "a", "output_length": 1, "output_token_ids": [1]},
      {"request_id": "a", "output_length": 1, "output_token_ids": [2]}], "line 2 duplicates output_replay_id key a"),
    (["{not json"], "line 1: not JSON"),
])
def test_replay_table_errors_name_the_line(tmp_path, rows, message):
    with pytest.raises(ReplayTableError, match=message):
        ResponseReplayTable.from_path(write(tmp_path, rows))


def replay_req(rid, key, max_tokens=50):
    return EngineCoreRequest(request_id=rid, prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(
        max_tokens=max_tokens, extra_args={"output_replay_id": key} if key else None))


def test_requests_replay_their_planned_tokens(harness, tmp_path, caplog):
    p = write(tmp_path, [{"request_id": "k", "output_length": 4, "output_token_ids": [11, 12, 13, 14]}])
    h = harness(response_replay_trace=str(p))
    h.add_req(replay_req("a", "k"))
    h.add_req(replay_req("b", "missing", max_tokens=3))
    h.run()
    assert h.tokens("a") == [11, 12, 13, 14] and h.finish("a") is FinishReason.LENGTH
    assert len(h.tokens("b")) == 3
    assert "not found" in caplog.text


@pytest.mark.parametrize("engine_type", ["vllm", "sglang"])
@pytest.mark.parametrize("worker_type,expected", [("prefill", [5]), ("aggregated", [5, 6, 7])])
def test_prefill_worker_replays_only_the_first_planned_token(harness, tmp_path, engine_type, worker_type, expected):
    p = write(tmp_path, [{"request_id": "k", "output_length": 3, "output_token_ids": [5, 6, 7]}])
    h = harness(response_replay_trace=str(p), worker_type=worker_type, engine_type=engine_type)
    h.add_req(replay_req("a", "k"))
    h.run()
    assert h.tokens("a") == expected


def test_replay_without_a_table_warns_and_generates(harness, caplog):
    h = harness()
    h.add_req(replay_req("a", "k", max_tokens=2))
    h.run()
    assert len(h.tokens("a")) == 2 and "no response replay trace" in caplog.text


@pytest.mark.parametrize("max_tokens,expected", [(10, 3), (1, 0), (4, 2), (100, 30)])
def test_thinking_length(max_tokens, expected):
    assert ReasoningConfig(1, 2, 0.3).thinking_tokens(max_tokens) == expected


def test_reasoning_span_wraps_the_first_part(harness):
    h = harness(reasoning="900,901,0.5", vocab_size=1000)
    h.add("r", max_tokens=10)
    h.run()
    t = h.tokens("r")
    assert t[0] == 900 and t[4] == 901
    assert 900 not in t[1:] and 901 not in t[5:]


def test_reasoning_flag_is_validated():
    from vllm_vcr.engine.config import ConfigError, EngineArgs

    with pytest.raises(ConfigError, match="--reasoning"):
        EngineArgs(reasoning="1,2").validate()


def test_chunked_prefill_off_rejects_prompts_over_the_budget(harness):
    h = harness(enable_chunked_prefill=False, max_num_batched_tokens=64)
    h.add("big", prompt_len=100)
    h.add("ok", prompt_len=64)
    h.run()
    assert h.finish("big") is FinishReason.ERROR and "chunked prefill is disabled" in h.outputs("big")[-1][1].error.message
    assert h.finish("ok") is FinishReason.LENGTH


def test_random_ids_drawn_ahead_on_admission_are_the_ids_drawn_with_the_first_token():
    """Admission draws a request's first batch of ids ahead (the first tokens of a burst are all
    due together); the ids are the same as drawn at the first token, in any take sizes."""
    import random

    from vllm_vcr.engine.tokens import RandomTokens

    avoid = frozenset({3, 7})
    ahead = RandomTokens(random.Random("s"), 50, avoid)
    ahead.draw_ahead()
    ahead.draw_ahead()  # a second call draws nothing more
    late = RandomTokens(random.Random("s"), 50, avoid)
    got = ahead.take(1) + ahead.take(100) + [ahead.next_token(0) for _ in range(30)]
    assert got == late.take(131)
    assert not avoid & set(got)


def test_stop_ids_covering_the_vocabulary_end_at_the_first_token():
    """Nothing is left for a random draw that avoids every stop id: the first token stops the
    request (as any token a model picked would), instead of the draw searching forever."""
    import asyncio

    from vllm_vcr.engine.async_engine import AsyncEngine
    from vllm_vcr.engine.config import EngineArgs
    from vllm_vcr.engine.types import EngineCoreRequest, FinishReason, SamplingParams

    async def run():
        engine = AsyncEngine(EngineArgs(vocab_size=40))
        await engine.start()
        try:
            sp = SamplingParams(max_tokens=5, stop_token_ids=list(range(40)), output_kind=2)
            outs = [o async for o in engine.generate(EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2],
                                                                       sampling_params=sp, arrival_time=0.0))]
        finally:
            await engine.stop(0)
        return outs[-1]

    last = asyncio.run(run())
    assert last.finish_reason == FinishReason.STOP and len(last.new_token_ids) == 1
    assert last.stop_reason == last.new_token_ids[0]
