"""The /metrics of several API server processes (vllm/metrics_multiproc.py): what any of them
renders is the processes' counters and histograms added up, the `vllm:` gauges' most recent
value, as prometheus_client's multiprocess collector renders vLLM's API servers."""

from __future__ import annotations

import random
import time

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from vllm_vcr.engine.types import EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats
from vllm_vcr.vllm.metrics import FrontendMetrics
from vllm_vcr.vllm.metrics_multiproc import SharedMetrics


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def serve_requests(m: FrontendMetrics, rng: random.Random, n: int, prefix: str) -> None:
    for i in range(n):
        rid = f"{prefix}-{i}"
        tokens = rng.randint(1, 40)
        m.on_request_arrival(rid, time.time() - rng.random(), n=1, max_tokens=tokens, num_prompt_tokens=rng.randint(1, 300))
        engine = rng.randrange(2)
        for k in range(tokens):
            done = k == tokens - 1
            reason = rng.choice([FinishReason.LENGTH, FinishReason.STOP]) if done else None
            m.on_engine_outputs(engine, EngineCoreOutputs(
                engine_index=engine, timestamp=time.monotonic(),
                outputs=[EngineCoreOutput(request_id=rid, new_token_ids=[7], finish_reason=reason)],
                scheduler_stats=SchedulerStats(num_running_reqs=rng.randint(0, 9))))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32), counts=st.lists(st.integers(0, 30), min_size=1, max_size=4))
def test_any_process_renders_the_sum(tmp_path_factory, seed, counts):
    directory = tmp_path_factory.mktemp("prometheus")
    rng = random.Random(seed)
    processes = []
    for p, n in enumerate(counts):
        m = FrontendMetrics("m", engine_count=2)
        serve_requests(m, rng, n, f"p{p}")
        shared = SharedMetrics(m, str(directory))
        shared._pid = 1000 + p  # one file set per (simulated) process
        processes.append((m, shared))
    for _, shared in processes:
        shared.dump()

    alone = [samples(m.render_text()) for m, _ in processes]
    for _, shared in processes:
        together = samples(shared.render_text())
        for (name, labels), value in together.items():
            if name.endswith(("_total", "_bucket", "_count", "_sum")):
                want = sum(a.get((name, labels), 0.0) for a in alone)
                assert abs(value - want) < 1e-6 * max(1.0, abs(want)), (name, labels, value, want)
        counted = {k for k in together if k[0].endswith(("_total", "_bucket", "_count", "_sum"))}
        every = {k for a in alone for k in a if k[0].endswith(("_total", "_bucket", "_count", "_sum"))
                 and not k[0].startswith(("process_", "python_"))}
        assert counted == every
        assert not [k for k in together if k[0].endswith("_created")]


def test_gauges_show_the_most_recent_change(tmp_path):
    a, b = FrontendMetrics("m"), FrontendMetrics("m")
    sa, sb = SharedMetrics(a, str(tmp_path)), SharedMetrics(b, str(tmp_path))
    sb._pid = sa._pid + 1

    def running(m: FrontendMetrics, shared: SharedMetrics, n: int) -> None:
        m.on_engine_outputs(0, EngineCoreOutputs(scheduler_stats=SchedulerStats(num_running_reqs=n)))
        shared.dump()

    def shown() -> float:
        return samples(sa.render_text())[("vllm:num_requests_running", (("engine", "0"), ("model_name", "m")))]

    running(a, sa, 5)
    time.sleep(0.01)
    running(b, sb, 3)
    assert shown() == 3
    time.sleep(0.01)
    running(a, sa, 0)
    assert shown() == 0
    running(b, sb, 3)  # unchanged: still older than a's 0
    assert shown() == 0


def test_an_event_gauge_shows_the_last_set_even_of_an_unchanged_value(tmp_path):
    """vLLM's API server that records a wake-up writes `awake` even where it already read awake
    (it never saw the sleep, another API server did): that write is the most recent one."""
    a, b = FrontendMetrics("m"), FrontendMetrics("m")
    sa, sb = SharedMetrics(a, str(tmp_path)), SharedMetrics(b, str(tmp_path))
    sb._pid = sa._pid + 1
    sa.dump()
    sb.dump()

    def state() -> dict[str, float]:
        got = samples(sb.render_text())
        return {s: got[("vllm:engine_sleep_state", (("engine", "0"), ("model_name", "m"), ("sleep_state", s)))]
                for s in ("awake", "weights_offloaded", "discard_all")}

    time.sleep(0.01)
    a.set_sleep_state(None, 1)  # shared at once, without a scrape or the dump interval
    assert state() == {"awake": 0, "weights_offloaded": 1, "discard_all": 0}
    time.sleep(0.01)
    b.set_sleep_state(None, 0)  # b's values do not change: awake all along as far as b knows
    assert state() == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
    time.sleep(0.01)
    a.set_sleep_state(None, 2)
    assert samples(sa.render_text())[("vllm:engine_sleep_state",
                                      (("engine", "0"), ("model_name", "m"), ("sleep_state", "discard_all")))] == 1


def test_a_cleared_scripted_gauge_is_cleared_whichever_process_renders(tmp_path):
    """Scripted gauges (the control API's /gauges) with two API servers: a process that never
    rendered the scripted value still shows the engines' value once they are cleared, although
    the other process's file holds the scripted one, stamped later than its own."""
    from vllm_vcr.faults.shared import SharedFaultController
    from vllm_vcr.http.faults_adapter import install_gauges

    state = str(tmp_path / "faults")
    parent = SharedFaultController(state, create=True)
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    processes = []
    for p in range(2):
        m = FrontendMetrics("m")
        install_gauges(m, SharedFaultController(state, create=False))
        shared = SharedMetrics(m, str(metrics_dir))
        shared._pid = 2000 + p
        processes.append(shared)
    a, b = processes
    key = ("vllm:num_requests_waiting", (("engine", "0"), ("model_name", "m")))
    assert samples(a.render_text())[key] == 0
    parent.set_gauges({"vllm:num_requests_waiting": {"function": "constant", "value": 7}})
    time.sleep(0.01)
    assert samples(b.render_text())[key] == 7  # only b dumps while the scripted value holds
    parent.clear_gauges()
    time.sleep(0.01)
    assert samples(a.render_text())[key] == 0
    assert samples(b.render_text())[key] == 0
    parent.set_gauges({"vllm:num_requests_waiting": {"function": "constant", "value": 3}})
    assert samples(a.render_text())[key] == 3
