"""Token budget, chunked prefill, max_num_seqs and policies."""

import pytest

from vllm_vcr.engine.config import ConfigError
from vllm_vcr.engine.types import EngineCoreEventType, FinishReason


def iteration_tokens(h):
    """Scheduled prompt tokens per step, read back from the KV state is awkward: use step outputs."""
    return [b for _, b in h.batches]


def test_long_prompt_is_chunked_by_the_token_budget(harness):
    h = harness(max_num_batched_tokens=64, tokens_per_block=16)
    h.add("r", prompt_len=200, max_tokens=2)
    sched = h.core.scheduler
    steps = []
    orig = sched.schedule

    def spy(now):
        out = orig(now)
        steps.append([(r.request_id, n) for r, n, _ in out])
        return out

    sched.schedule = spy
    h.run()
    prefill = [n for s in steps for rid, n in s if n > 1]
    assert prefill == [64, 64, 64, 8]
    assert h.tokens("r") and h.finish("r") is FinishReason.LENGTH


def test_long_prefill_token_threshold_caps_each_chunk(harness):
    h = harness(max_num_batched_tokens=256, long_prefill_token_threshold=50)
    h.add("r", prompt_len=120, max_tokens=1)
    seen = []
    orig = h.core.scheduler.schedule
    h.core.scheduler.schedule = lambda now: (lambda out: (seen.extend(n for _, n, _ in out), out)[1])(orig(now))
    h.run()
    assert [n for n in seen if n > 1] == [50, 50, 20]


def test_decodes_take_budget_before_prefills(harness):
    h = harness(max_num_batched_tokens=32, inter_token_latency=1, time_to_first_token=1)
    h.add("a", prompt_len=8, max_tokens=50)
    h.run(until=0.010)  # a is decoding
    h.add("b", prompt_len=100, max_tokens=1)
    steps = []
    orig = h.core.scheduler.schedule
    h.core.scheduler.schedule = lambda now: (lambda out: (steps.append({r.request_id: n for r, n, _ in out}), out)[1])(orig(now))
    h.run()
    mixed = [s for s in steps if "a" in s and "b" in s]
    assert mixed and all(s["b"] <= 31 for s in mixed)


@pytest.mark.parametrize("limits", [{"max_num_seqs": 2}, {"max_num_seqs": 8, "max_num_active_seqs": 2}])
def test_the_running_batch_is_bounded(harness, limits):
    """max_num_seqs, or vLLM's lower --max-num-active-seqs: admission into RUNNING stops at it."""
    h = harness(**limits, inter_token_latency=10)
    for i in range(5):
        h.add(f"r{i}", max_tokens=3)
    h.run(until=0.001)
    assert h.stats().running == 2 and h.stats().waiting == 3
    h.run()
    assert all(h.finish(f"r{i}") is FinishReason.LENGTH for i in range(5))


def test_max_num_active_seqs_is_at_most_max_num_seqs(harness):
    with pytest.raises(ConfigError, match=r"max_num_active_seqs \(9\) cannot be greater than max_num_seqs \(8\)"):
        harness(max_num_seqs=8, max_num_active_seqs=9)


def test_max_num_scheduled_tokens_is_the_step_budget(harness):
    """vLLM's --max-num-scheduled-tokens: a step schedules at most that many tokens (the batched-
    tokens budget stays larger)."""
    h = harness(max_num_batched_tokens=256, max_num_scheduled_tokens=64, tokens_per_block=16)
    h.add("r", prompt_len=200, max_tokens=2)
    seen = []
    orig = h.core.scheduler.schedule
    h.core.scheduler.schedule = lambda now: (lambda out: (seen.extend(n for _, n, _ in out), out)[1])(orig(now))
    h.run()
    assert [n for n in seen if n > 1] == [64, 64, 64, 8]


def test_fcfs_admits_in_arrival_order(harness):
    h = harness(max_num_seqs=1, inter_token_latency=1)
    for rid in ["x", "y", "z"]:
        h.add(rid, max_tokens=2)
    h.run()
    firsts = {rid: h.emission_times(rid)[0] for rid in "xyz"}
    assert firsts["x"] < firsts["y"] < firsts["z"]


def test_priority_policy_admits_lowest_priority_value_first(harness):
    h = harness(max_num_seqs=1, inter_token_latency=1, scheduling_policy="priority")
    h.add("blocker", max_tokens=2)
    h.add("low", max_tokens=2, priority=5, arrival_time=1.0)
    h.add("high", max_tokens=2, priority=-1, arrival_time=2.0)
    h.add("mid", max_tokens=2, priority=0, arrival_time=0.5)
    h.run()
    order = sorted(["low", "high", "mid"], key=lambda r: h.emission_times(r)[0])
    assert order == ["high", "mid", "low"]


def test_first_output_carries_queued_and_scheduled_events_and_prefill_stats(harness):
    h = harness(time_to_first_token=5)
    h.add("r", prompt_len=20, max_tokens=2)
    h.run()
    first = h.outputs("r")[0][1]
    assert [e.type for e in first.events] == [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED]
    assert first.prefill_stats.num_prompt_tokens == 20
    assert h.outputs("r")[1][1].events is None and h.outputs("r")[1][1].prefill_stats is None


def test_stop_token_ids_eos_and_min_tokens(harness):
    h = harness(mode="echo")
    h.add("stop", prompt=[5, 6, 7, 8], max_tokens=10, stop_token_ids=[7])
    h.add("eos", prompt=[5, 6, 7, 8], max_tokens=10, eos_token_id=6)
    h.add("ignore", prompt=[5, 6, 7, 8], max_tokens=3, eos_token_id=6, ignore_eos=True)
    h.add("min", prompt=[5, 6, 7, 8], max_tokens=10, stop_token_ids=[6], min_tokens=4)
    h.run()
    assert h.tokens("stop") == [5, 6, 7] and h.outputs("stop")[-1][1].stop_reason == 7
    assert h.tokens("eos") == [5, 6] and h.outputs("eos")[-1][1].stop_reason is None
    assert h.finish("eos") is FinishReason.STOP
    assert h.tokens("ignore") == [5, 6, 7] and h.finish("ignore") is FinishReason.LENGTH
    assert h.tokens("min") == [5, 6, 7, 8, 5, 6]


def test_same_seed_gives_same_tokens(harness):
    h = harness(vocab_size=50000)
    h.add("a", max_tokens=20, seed=42)
    h.add("b", max_tokens=20, seed=42)
    h.add("c", max_tokens=20)
    h.run()
    assert h.tokens("a") == h.tokens("b") != h.tokens("c")
    assert all(0 <= t < 50000 for t in h.tokens("c"))


def _preemptions(h, rid: str) -> int:
    return sum(1 for _, o in h.outputs(rid) for e in (o.events or ()) if e.type == EngineCoreEventType.PREEMPTED)


@pytest.mark.parametrize("full_isl", [True, False])
def test_admission_waits_for_the_whole_sequence_to_fit(harness, full_isl):
    """vLLM's scheduler_reserve_full_isl (on by default): with 20 blocks of 16 tokens, a running
    200-token request holds 13; another 200-token prompt needs 13 more, so it waits for the first to
    finish instead of starting on its first 64-token chunk and being preempted when blocks run out.
    With the gate off (`--no-scheduler-reserve-full-isl`), the first chunk fitting is enough."""
    h = harness(max_num_batched_tokens=64, tokens_per_block=16, kv_cache_size=20, inter_token_latency=1,
                time_to_first_token=1, scheduler_reserve_full_isl=full_isl)
    h.add("a", prompt_len=200, max_tokens=40, ignore_eos=True)
    h.add("b", prompt_len=200, max_tokens=40, ignore_eos=True)
    h.run()
    assert h.finish("a") is FinishReason.LENGTH and h.finish("b") is FinishReason.LENGTH
    first_b = h.outputs("b")[0][0]
    if full_isl:
        assert _preemptions(h, "a") + _preemptions(h, "b") == 0
        assert first_b > h.outputs("a")[-1][0]  # b starts after a has finished
    else:
        assert _preemptions(h, "a") + _preemptions(h, "b") > 0


def test_the_gate_counts_prefix_hits_and_spares_other_engine_types(harness):
    """The blocks a prefix hit brings need not be free (the ones in use are shared); SGLang's
    scheduler has its own admission (its reserve ratio), not vLLM's gate."""
    h = harness(max_num_batched_tokens=64, tokens_per_block=16, kv_cache_size=20, inter_token_latency=1,
                time_to_first_token=1)
    shared = harness.prompt_of("shared", 192)
    h.add("a", prompt=shared + [7, 7, 7, 7, 7, 7, 7, 7], max_tokens=40, ignore_eos=True)
    h.run(until=0.02)  # a has its 13 blocks
    h.add("b", prompt=shared + [9] * 8, max_tokens=2, ignore_eos=True)  # 12 shared blocks + 1 of its own
    h.run()
    assert h.outputs("b")[0][0] < h.outputs("a")[-1][0]  # started beside a: only 1-2 new blocks needed
    sg = harness(max_num_batched_tokens=64, tokens_per_block=16, kv_cache_size=20, engine_type="sglang")
    assert not sg.core.scheduler.reserve_full_isl


@pytest.mark.parametrize("watermark", [0.0, 0.25])
def test_the_watermark_keeps_blocks_free_at_admission(harness, watermark):
    """vLLM's --watermark: an admission beside running requests leaves that fraction of the blocks
    free. 7 of 20 blocks are free beside a 200-token request; a 40-token prompt needs 3: with a
    watermark of 0.25 (5 blocks) it waits for the first request to finish."""
    h = harness(max_num_batched_tokens=256, tokens_per_block=16, kv_cache_size=20, inter_token_latency=1,
                time_to_first_token=1, watermark=watermark)
    h.add("a", prompt_len=200, max_tokens=30, ignore_eos=True)
    h.run(until=0.005)
    h.add("b", prompt_len=40, max_tokens=2, ignore_eos=True)
    h.run()
    waited = h.outputs("b")[0][0] > h.outputs("a")[-1][0]
    assert waited is (watermark > 0)


@pytest.mark.parametrize("active,scheduled", [(None, None), (12, 100)])
def test_the_admission_gates_keep_both_paths_equal(monkeypatch, active, scheduled):
    """The timing-only path admits exactly as the plain one under the gates (KV pressure, a watermark,
    fewer active sequences and scheduled tokens than max_num_seqs and the batched-token budget)."""
    from vllm_vcr.engine.config import EngineArgs, EngineConfig
    from vllm_vcr.simulate import driver as driver_mod
    from vllm_vcr.simulate.report import build_report
    from vllm_vcr.simulate.runner import simulate
    from vllm_vcr.simulate.workload import LengthDist, SyntheticWorkload

    from .test_decode_cohort import _latency

    monkeypatch.setattr(driver_mod, "engine_inputs", lambda a: {"latency": _latency()})
    reports = []
    for timing_only in (False, True):
        args = EngineArgs(config=EngineConfig(max_num_seqs=32, max_num_batched_tokens=256), kv_cache_size=120,
                          tokens_per_block=16, watermark=0.1, advertised_max_model_len=1 << 20,
                          max_num_active_seqs=active, max_num_scheduled_tokens=scheduled).validate()
        wl = SyntheticWorkload(num_requests=80, isl=LengthDist.parse("lognormal:300:150", "--isl"),
                               osl=LengthDist.parse("uniform:10:120", "--osl"), arrival="closed", concurrency=20, seed=3)
        report = build_report(simulate(args, wl, concurrency=20, timing_only=timing_only))
        reports.append((report["latency_ms"], report["preemptions"]["total"]))
    assert reports[0] == reports[1] and (reports[0][1] > 0 or active is not None)
