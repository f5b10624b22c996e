"""FrontendMetrics: synthetic EngineCoreOutputs in, vLLM-shaped Prometheus exposition out."""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from vllm_vcr.engine.types import (
    EngineCoreEvent,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    PrefillStats,
    PrefixCacheStats,
    SchedulerStats,
)
from vllm_vcr.vllm.metrics import FrontendMetrics, build_1_2_5_buckets

QUEUED, SCHEDULED, PREEMPTED = 1, 2, 3


def samples(m: FrontendMetrics) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} parsed back from the exposition text."""
    body, _ = m.render()
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def val(m_or_samples, name: str, **labels) -> float:
    s = samples(m_or_samples) if isinstance(m_or_samples, FrontendMetrics) else m_or_samples
    labels.setdefault("model_name", "tiny")
    labels.setdefault("engine", "0")
    return s[(name, frozenset((k, str(v)) for k, v in labels.items()))]


def first_output(rid: str, t_queued: float, t_sched: float, *, prompt=10, computed=None, cached=0, tokens=(7,),
                 finish=None) -> EngineCoreOutput:
    computed = prompt - cached if computed is None else computed
    return EngineCoreOutput(
        request_id=rid, new_token_ids=list(tokens), finish_reason=finish,
        events=[EngineCoreEvent(QUEUED, t_queued), EngineCoreEvent(SCHEDULED, t_sched)],
        prefill_stats=PrefillStats(num_prompt_tokens=prompt, num_computed_tokens=computed, num_cached_tokens=cached,
                                   num_local_cached_tokens=cached))


def step(ts: float, *outs: EngineCoreOutput, stats: SchedulerStats | None = None, engine=0,
         finished=None) -> EngineCoreOutputs:
    return EngineCoreOutputs(engine_index=engine, timestamp=ts, outputs=list(outs), scheduler_stats=stats,
                             finished_requests=finished)


@pytest.fixture
def m() -> FrontendMetrics:
    return FrontendMetrics("tiny", 1, block_size=16, num_gpu_blocks=1000, max_model_len=2048)


# ------------------------------------------------------------------ shape of the exposition

REQUIRED = [
    ("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
    ("vllm:num_requests_waiting_by_reason", "gauge"), ("vllm:kv_cache_usage_perc", "gauge"),
    ("vllm:prefix_cache_queries", "counter"), ("vllm:prefix_cache_hits", "counter"),
    ("vllm:prompt_tokens", "counter"), ("vllm:generation_tokens", "counter"),
    ("vllm:prompt_tokens_by_source", "counter"), ("vllm:prompt_tokens_cached", "counter"),
    ("vllm:request_success", "counter"), ("vllm:num_preemptions", "counter"),
    ("vllm:iteration_tokens_total", "histogram"), ("vllm:time_to_first_token_seconds", "histogram"),
    ("vllm:inter_token_latency_seconds", "histogram"), ("vllm:e2e_request_latency_seconds", "histogram"),
    ("vllm:request_queue_time_seconds", "histogram"), ("vllm:request_prefill_time_seconds", "histogram"),
    ("vllm:request_decode_time_seconds", "histogram"), ("vllm:request_inference_time_seconds", "histogram"),
    ("vllm:request_time_per_output_token_seconds", "histogram"), ("vllm:request_prompt_tokens", "histogram"),
    ("vllm:request_generation_tokens", "histogram"), ("vllm:request_params_n", "histogram"),
    ("vllm:request_params_max_tokens", "histogram"), ("vllm:request_max_num_generation_tokens", "histogram"),
    ("vllm:cache_config_info", "gauge"),
]


def test_families_types_and_labels_for_two_engines():
    m = FrontendMetrics("tiny", 2, block_size=16, num_gpu_blocks=512, max_model_len=2048)
    body, ctype = m.render()
    assert ctype.startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    for name, typ in REQUIRED:
        assert name in fams, name
        assert fams[name].type == typ, name
        engines = {s.labels.get("engine") for s in fams[name].samples}
        assert engines == {"0", "1"}, name
        if name != "vllm:cache_config_info":
            assert {s.labels["model_name"] for s in fams[name].samples} == {"tiny"}
    text = body.decode()
    assert "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds." in text
    assert "# TYPE vllm:prompt_tokens_total counter" in text
    assert "vllm:prompt_tokens_created{" in text  # prometheus_client counters carry _created, as vLLM's do
    reasons = {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples if s.name.endswith("_total")}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}
    assert {s.labels["reason"] for s in fams["vllm:num_requests_waiting_by_reason"].samples} == {"capacity",
                                                                                                 "deferred"}
    assert {s.labels["source"] for s in fams["vllm:prompt_tokens_by_source"].samples} == {
        "local_compute", "local_cache_hit", "external_kv_transfer"}


def bucket_bounds(m: FrontendMetrics, name: str) -> list[str]:
    body, _ = m.render()
    fam = next(f for f in text_string_to_metric_families(body.decode()) if f.name == name)
    return [s.labels["le"] for s in fam.samples if s.name == name + "_bucket" and s.labels["engine"] == "0"]


def test_histogram_buckets_are_vllms(m):
    assert bucket_bounds(m, "vllm:time_to_first_token_seconds") == [
        "0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75", "1.0", "2.5", "5.0",
        "7.5", "10.0", "20.0", "40.0", "80.0", "160.0", "640.0", "2560.0", "+Inf"]
    assert bucket_bounds(m, "vllm:inter_token_latency_seconds") == [
        "0.01", "0.025", "0.05", "0.075", "0.1", "0.15", "0.2", "0.3", "0.4", "0.5", "0.75", "1.0", "2.5", "5.0",
        "7.5", "10.0", "20.0", "40.0", "80.0", "+Inf"]
    assert bucket_bounds(m, "vllm:request_time_per_output_token_seconds") == bucket_bounds(
        m, "vllm:inter_token_latency_seconds")
    latency = ["0.3", "0.5", "0.8", "1.0", "1.5", "2.0", "2.5", "5.0", "10.0", "15.0", "20.0", "30.0", "40.0", "50.0",
               "60.0", "120.0", "240.0", "480.0", "960.0", "1920.0", "7680.0", "+Inf"]
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):
        assert bucket_bounds(m, "vllm:" + name) == latency
    assert bucket_bounds(m, "vllm:iteration_tokens_total") == [
        "1.0", "8.0", "16.0", "32.0", "64.0", "128.0", "256.0", "512.0", "1024.0", "2048.0", "4096.0", "8192.0",
        "16384.0", "+Inf"]
    assert bucket_bounds(m, "vllm:request_params_n") == ["1.0", "2.0", "5.0", "10.0", "20.0", "+Inf"]
    tokens = ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0", "2000.0", "+Inf"]
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens",
                 "request_max_num_generation_tokens"):
        assert bucket_bounds(m, "vllm:" + name) == tokens


def test_build_1_2_5_buckets():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4096) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]


def test_cache_config_info(m):
    s = samples(m)
    info = [(dict(k[1]), v) for k, v in s.items() if k[0] == "vllm:cache_config_info"]
    assert len(info) == 1
    labels, value = info[0]
    assert value == 1.0
    assert labels["block_size"] == "16" and labels["num_gpu_blocks"] == "1000" and labels["engine"] == "0"
    assert labels["kv_cache_size_tokens"] == "16000"
    assert labels["enable_prefix_caching"] == "True"
    assert "model_name" not in labels  # vLLM's info gauge carries CacheConfig fields + engine only


# ------------------------------------------------------------------ values


def test_one_request_lifecycle(m):
    t = time.monotonic()
    m.on_request_arrival("r1", time.time() - 0.5, n=1, max_tokens=3, num_prompt_tokens=10)
    m.on_engine_outputs(0, step(t + 0.30, first_output("r1", t + 0.10, t + 0.25, prompt=10, cached=4)))
    m.on_engine_outputs(0, step(t + 0.32, EngineCoreOutput(request_id="r1", new_token_ids=[8])))
    m.on_engine_outputs(0, step(t + 0.36, EngineCoreOutput(request_id="r1", new_token_ids=[9],
                                                           finish_reason=FinishReason.LENGTH), finished=["r1"]))
    s = samples(m)
    assert val(s, "vllm:request_success_total", finished_reason="length") == 1
    assert val(s, "vllm:request_success_total", finished_reason="stop") == 0
    assert val(s, "vllm:prompt_tokens_total") == 10
    assert val(s, "vllm:generation_tokens_total") == 3
    assert val(s, "vllm:prompt_tokens_by_source_total", source="local_compute") == 6
    assert val(s, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 4
    assert val(s, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert val(s, "vllm:prompt_tokens_cached_total") == 4
    # TTFT: frontend wall clock from arrival (0.5 s ago) to the first output
    assert val(s, "vllm:time_to_first_token_seconds_count") == 1
    assert 0.5 <= val(s, "vllm:time_to_first_token_seconds_sum") < 0.6
    assert val(s, "vllm:time_to_first_token_seconds_bucket", le="0.5") == 0
    assert val(s, "vllm:time_to_first_token_seconds_bucket", le="0.75") == 1
    # ITL: engine timestamps of consecutive outputs: 20 ms and 40 ms
    assert val(s, "vllm:inter_token_latency_seconds_count") == 2
    assert val(s, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.06)
    assert val(s, "vllm:inter_token_latency_seconds_bucket", le="0.025") == 1
    assert val(s, "vllm:inter_token_latency_seconds_bucket", le="0.05") == 2
    # phases from the QUEUED / SCHEDULED events and output timestamps
    assert val(s, "vllm:request_queue_time_seconds_sum") == pytest.approx(0.15)
    assert val(s, "vllm:request_prefill_time_seconds_sum") == pytest.approx(0.05)
    assert val(s, "vllm:request_decode_time_seconds_sum") == pytest.approx(0.06)
    assert val(s, "vllm:request_inference_time_seconds_sum") == pytest.approx(0.11)
    assert val(s, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.03)
    assert 0.5 <= val(s, "vllm:e2e_request_latency_seconds_sum") < 0.6
    assert val(s, "vllm:e2e_request_latency_seconds_bucket", le="0.5") == 0
    assert val(s, "vllm:e2e_request_latency_seconds_bucket", le="0.8") == 1
    # per-request count histograms
    assert val(s, "vllm:request_prompt_tokens_sum") == 10
    assert val(s, "vllm:request_prompt_tokens_bucket", le="5.0") == 0
    assert val(s, "vllm:request_prompt_tokens_bucket", le="10.0") == 1
    assert val(s, "vllm:request_generation_tokens_sum") == 3
    assert val(s, "vllm:request_params_max_tokens_sum") == 3
    assert val(s, "vllm:request_params_n_sum") == 1
    assert val(s, "vllm:request_params_n_bucket", le="1.0") == 1
    assert val(s, "vllm:request_max_num_generation_tokens_sum") == 3
    assert val(s, "vllm:request_prefill_kv_computed_tokens_sum") == 6
    assert val(s, "vllm:request_num_preemptions_count") == 1
    # iteration tokens: 6 computed prompt + 1 generated, then 1, then 1
    assert val(s, "vllm:iteration_tokens_total_count") == 3
    assert val(s, "vllm:iteration_tokens_total_sum") == 9
    assert val(s, "vllm:iteration_tokens_total_bucket", le="1.0") == 2
    assert val(s, "vllm:iteration_tokens_total_bucket", le="8.0") == 3
    assert m._reqs == {}  # nothing left behind


def test_a_token_taken_by_its_stream_counts_as_its_output_would():
    """A steady token a stream took straight from the step (token_observer, then the step's batch
    without it) leaves the same exposition as the same token in an output."""
    def run(taken: bool) -> dict:
        m = FrontendMetrics("tiny", 1, block_size=16, num_gpu_blocks=1000, max_model_len=2048)
        t = time.monotonic()
        m.on_request_arrival("r1", time.time() - 0.5, n=1, max_tokens=3, num_prompt_tokens=10)
        m.on_engine_outputs(0, step(t + 0.30, first_output("r1", t + 0.10, t + 0.25, prompt=10, cached=4)))
        if taken:
            m.token_observer(0, "r1")(t + 0.32)
            m.on_engine_outputs(0, step(t + 0.32, stats=SchedulerStats()))
        else:
            m.on_engine_outputs(0, step(t + 0.32, EngineCoreOutput(request_id="r1", new_token_ids=[8]),
                                        stats=SchedulerStats()))
        m.on_engine_outputs(0, step(t + 0.36, EngineCoreOutput(request_id="r1", new_token_ids=[9],
                                                               finish_reason=FinishReason.LENGTH), finished=["r1"]))
        got = samples(m)
        # (the wall-clock series differ by the microseconds between the two runs)
        return {k: v for k, v in got.items()
                if not k[0].startswith(("vllm:e2e_request", "vllm:time_to_first")) and not k[0].endswith("_created")}

    assert run(taken=True) == run(taken=False)
    s = run(taken=True)
    assert val(s, "vllm:generation_tokens_total") == 3
    assert val(s, "vllm:inter_token_latency_seconds_count") == 2
    assert val(s, "vllm:iteration_tokens_total_sum") == 9
    m = FrontendMetrics("tiny", 1)
    assert m.token_observer(0, "never-announced") is None


def test_tokens_a_steady_batch_took_count_as_their_outputs_would():
    """TakenTokens (a steady batch's streams, one observation per step): members that joined at
    different steps, one that declined a token (it came as an output) and left, the others
    leaving before their last token; the same exposition as with every token an output."""
    def run(batched: bool) -> dict:
        m = FrontendMetrics("tiny", 1, block_size=16, num_gpu_blocks=1000, max_model_len=2048)
        t = time.monotonic()
        rids = ["r1", "r2", "r3"]
        for rid in rids:
            m.on_request_arrival(rid, time.time() - 0.5, n=1, max_tokens=6, num_prompt_tokens=10)
        m.on_engine_outputs(0, step(t + 0.30, *(first_output(r, t + 0.1, t + 0.2) for r in rids)))

        def tokens(ts, taken, outputs, finish=False):
            if batched:
                for observe in taken:
                    observe(ts)
            else:
                outputs = [*(rids[i] for i in taken_ids[id(taken)]), *outputs] if taken else outputs
            m.on_engine_outputs(0, step(ts, *(EngineCoreOutput(
                request_id=r, new_token_ids=[5], finish_reason=FinishReason.LENGTH if finish else None)
                for r in outputs), stats=SchedulerStats(), finished=outputs if finish else None))

        observers = [m.token_observer(0, r) for r in rids]
        taken_ids: dict[int, list[int]] = {}
        solo12 = observers[:2]
        taken_ids[id(solo12)] = [0, 1]
        tokens(t + 0.32, solo12, [])  # r1, r2 take their second token alone, then join
        group = observers[0].new_group()
        group.add(observers[0])
        group.add(observers[1])
        solo3 = observers[2:]
        taken_ids[id(solo3)] = [2]
        tokens(t + 0.33, solo3, [])  # r3 alone, then joins
        group.add(observers[2])
        if batched:
            group.observe(t + 0.34, None)
        tokens(t + 0.34, [], [] if batched else rids)
        if batched:
            group.observe(t + 0.36, [1])  # r2's token declined: an output
            group.drop(1)
        tokens(t + 0.36, [], ["r2"] if batched else rids)
        if batched:
            group.observe(t + 0.38, None)  # r1, r3
            group.drop(0)
            group.drop(0)
        tokens(t + 0.38, [], [] if batched else ["r1", "r3"])
        tokens(t + 0.40, [], rids, finish=True)
        got = samples(m)
        return {k: v for k, v in got.items()
                if not k[0].startswith(("vllm:e2e_request", "vllm:time_to_first")) and not k[0].endswith("_created")}

    batched, plain = run(True), run(False)
    assert batched == plain
    assert val(batched, "vllm:inter_token_latency_seconds_count") == 3 * 5 - 1  # r2 had no 0.38 token
    assert val(batched, "vllm:inter_token_latency_seconds_sum") == pytest.approx(
        plain[("vllm:inter_token_latency_seconds_sum", frozenset({("model_name", "tiny"), ("engine", "0")}))])


def test_multi_token_outputs_count_tokens_once_per_output(m):
    """k tokens in one output: generation_tokens += k, one ITL sample (vLLM measures per output)."""
    t = time.monotonic()
    m.on_request_arrival("r", time.time())
    m.on_engine_outputs(0, step(t + 0.01, first_output("r", t, t, tokens=(1,))))
    m.on_engine_outputs(0, step(t + 0.05, EngineCoreOutput(request_id="r", new_token_ids=[2, 3, 4, 5],
                                                           finish_reason=FinishReason.STOP)))
    s = samples(m)
    assert val(s, "vllm:generation_tokens_total") == 5
    assert val(s, "vllm:inter_token_latency_seconds_count") == 1
    assert val(s, "vllm:request_generation_tokens_sum") == 5
    assert val(s, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.04 / 4)
    assert val(s, "vllm:request_success_total", finished_reason="stop") == 1


def test_scheduler_stats_gauges_and_prefix_deltas(m):
    stats = SchedulerStats(num_running_reqs=5, num_waiting_reqs=3, num_skipped_waiting_reqs=2, kv_cache_usage=0.375,
                           prefix_cache_stats=PrefixCacheStats(requests=2, queries=64, hits=32))
    m.on_engine_outputs(0, step(1.0, stats=stats))
    m.on_engine_outputs(0, step(2.0, stats=SchedulerStats(
        num_running_reqs=4, kv_cache_usage=0.5, prefix_cache_stats=PrefixCacheStats(queries=16, hits=0))))
    s = samples(m)
    assert val(s, "vllm:num_requests_running") == 4  # gauges: the latest report
    assert val(s, "vllm:num_requests_waiting") == 0
    assert val(s, "vllm:kv_cache_usage_perc") == 0.5
    assert val(s, "vllm:prefix_cache_queries_total") == 80  # counters: sum of per-report deltas
    assert val(s, "vllm:prefix_cache_hits_total") == 32
    assert val(s, "vllm:prompt_tokens_cached_by_source_total", source="device") == 32
    # stats-only messages are not engine iterations with outputs
    assert val(s, "vllm:iteration_tokens_total_count") == 0

    m.on_engine_outputs(0, step(3.0, stats=stats))
    s = samples(m)
    assert val(s, "vllm:num_requests_waiting") == 5  # waiting + skipped (deferred)
    assert val(s, "vllm:num_requests_waiting_by_reason", reason="capacity") == 3
    assert val(s, "vllm:num_requests_waiting_by_reason", reason="deferred") == 2


def test_preemptions_from_events(m):
    t = time.monotonic()
    m.on_request_arrival("r", time.time())
    m.on_engine_outputs(0, step(t + 0.01, first_output("r", t, t)))
    m.on_engine_outputs(0, step(t + 0.05, EngineCoreOutput(
        request_id="r", new_token_ids=[1],
        events=[EngineCoreEvent(PREEMPTED, t + 0.02), EngineCoreEvent(SCHEDULED, t + 0.04)])))
    m.on_engine_outputs(0, step(t + 0.06, EngineCoreOutput(request_id="r", new_token_ids=[1],
                                                           finish_reason=FinishReason.LENGTH),
                                stats=SchedulerStats(num_preemptions=1)))
    s = samples(m)
    assert val(s, "vllm:num_preemptions_total") == 1  # events win; the stats field is not added on top
    assert val(s, "vllm:request_num_preemptions_sum") == 1
    # a re-SCHEDULED event after preemption does not move scheduled_ts: queue time stays 0
    assert val(s, "vllm:request_queue_time_seconds_sum") == 0


def test_preemptions_from_scheduler_stats_when_no_events(m):
    m.on_engine_outputs(0, step(1.0, stats=SchedulerStats(num_preemptions=2)))
    m.on_engine_outputs(0, step(2.0, stats=SchedulerStats(num_preemptions=1)))
    assert val(m, "vllm:num_preemptions_total") == 3


def test_client_abort_records_nothing_and_frees_state(m):
    t = time.monotonic()
    m.on_request_arrival("a", time.time())
    m.on_request_arrival("b", time.time())
    m.on_engine_outputs(0, step(t, first_output("a", t, t), first_output("b", t, t)))
    m.on_request_aborted("a")
    # the engine reports b finished without an output for it (client-side abort through the engine)
    m.on_engine_outputs(0, step(t + 0.01, stats=SchedulerStats(), finished=["b"]))
    s = samples(m)
    assert sum(v for (n, _), v in s.items() if n == "vllm:request_success_total") == 0
    assert val(s, "vllm:e2e_request_latency_seconds_count") == 0
    assert val(s, "vllm:generation_tokens_total") == 2  # tokens produced before the abort still count
    assert m._reqs == {}
    # late outputs for forgotten requests are ignored
    m.on_engine_outputs(0, step(t + 0.02, EngineCoreOutput(request_id="a", new_token_ids=[1],
                                                           finish_reason=FinishReason.ABORT)))
    assert val(m, "vllm:request_success_total", finished_reason="abort") == 0


def test_engine_side_abort_and_error_are_counted(m):
    t = time.monotonic()
    for rid in ("x", "y"):
        m.on_request_arrival(rid, time.time())
    m.on_engine_outputs(0, step(t, EngineCoreOutput(request_id="x", new_token_ids=[], finish_reason=FinishReason.ERROR,
                                                    events=[EngineCoreEvent(QUEUED, t)])))
    m.on_engine_outputs(0, step(t, first_output("y", t, t)))
    m.on_engine_outputs(0, step(t + 0.1, EngineCoreOutput(request_id="y", new_token_ids=[],
                                                          finish_reason=FinishReason.ABORT)))
    s = samples(m)
    assert val(s, "vllm:request_success_total", finished_reason="error") == 1
    assert val(s, "vllm:request_success_total", finished_reason="abort") == 1


def test_unannounced_request_is_adopted_from_its_queued_event(m):
    t = time.monotonic() - 0.2  # queued 0.2 s ago
    m.on_engine_outputs(0, step(t + 0.2, first_output("u", t, t + 0.1, prompt=7)))
    m.on_engine_outputs(0, step(t + 0.3, EngineCoreOutput(request_id="u", new_token_ids=[1],
                                                          finish_reason=FinishReason.STOP)))
    s = samples(m)
    assert val(s, "vllm:request_success_total", finished_reason="stop") == 1
    assert val(s, "vllm:request_prompt_tokens_sum") == 7  # from prefill_stats
    assert val(s, "vllm:request_params_max_tokens_count") == 0  # unknown without on_request_arrival
    # TTFT runs from the QUEUED event (mapped to wall clock) to the first output's receipt: >= 0.2 s
    assert 0.19 < val(s, "vllm:time_to_first_token_seconds_sum") < 5


def test_frontend_finished_request(m):
    t = time.monotonic()
    m.on_request_arrival("s", time.time(), max_tokens=100)
    m.on_engine_outputs(0, step(t, first_output("s", t, t)))
    m.on_request_finished("s", "stop")  # e.g. the detokenizer matched a stop string
    m.on_request_finished("s", "stop")  # idempotent
    m.on_engine_outputs(0, step(t + 0.1, EngineCoreOutput(request_id="s", new_token_ids=[1],
                                                          finish_reason=FinishReason.ABORT)))
    s = samples(m)
    assert val(s, "vllm:request_success_total", finished_reason="stop") == 1
    assert val(s, "vllm:request_success_total", finished_reason="abort") == 0
    assert val(s, "vllm:request_params_max_tokens_sum") == 100


def test_parallel_sampling_observes_n_once(m):
    t = time.monotonic()
    for i in range(3):
        m.on_request_arrival(f"p-{i}", time.time(), n=3, max_tokens=10, parent_id="p")
    m.on_engine_outputs(0, step(t, *(first_output(f"p-{i}", t, t) for i in range(3))))
    for i, k in enumerate((2, 5, 3)):
        m.on_engine_outputs(0, step(t + 0.01 * (i + 1), EngineCoreOutput(
            request_id=f"p-{i}", new_token_ids=[1] * k, finish_reason=FinishReason.LENGTH)))
        if i < 2:
            assert val(m, "vllm:request_params_n_count") == 0
    s = samples(m)
    assert val(s, "vllm:request_params_n_count") == 1
    assert val(s, "vllm:request_params_n_bucket", le="2.0") == 0
    assert val(s, "vllm:request_params_n_bucket", le="5.0") == 1
    assert val(s, "vllm:request_max_num_generation_tokens_sum") == 6  # the longest child: 1 + 5
    assert val(s, "vllm:request_success_total", finished_reason="length") == 3


def test_outputs_are_labelled_with_their_engine():
    m = FrontendMetrics("tiny", 2)
    t = time.monotonic()
    m.on_request_arrival("e1", time.time())
    m.on_engine_outputs(1, step(t, first_output("e1", t, t, finish=FinishReason.STOP), engine=1,
                                stats=SchedulerStats(num_running_reqs=7)))
    s = samples(m)
    assert val(s, "vllm:request_success_total", engine=1, finished_reason="stop") == 1
    assert val(s, "vllm:request_success_total", engine=0, finished_reason="stop") == 0
    assert val(s, "vllm:num_requests_running", engine=1) == 7
    assert val(s, "vllm:num_requests_running", engine=0) == 0


def test_sleep_state(m):
    m.set_sleep_state(0, 1)
    s = samples(m)
    assert val(s, "vllm:engine_sleep_state", sleep_state="awake") == 0
    assert val(s, "vllm:engine_sleep_state", sleep_state="weights_offloaded") == 1
    m.set_sleep_state(None, 0)
    assert val(m, "vllm:engine_sleep_state", sleep_state="awake") == 1


def test_private_registry_and_positional_registry_argument():
    reg = CollectorRegistry()
    a = FrontendMetrics("tiny", 1, reg)  # the registry may come third, positionally
    b = FrontendMetrics("other", 1)
    assert a.registry is reg and b.registry is not reg
    assert b"vllm:" not in __import__("prometheus_client").generate_latest(REGISTRY)
    assert b'model_name="other"' not in a.render()[0]


def test_openmetrics_negotiation(m):
    body, ctype = m.render("application/openmetrics-text; version=1.0.0")
    assert ctype.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")
