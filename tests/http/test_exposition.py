"""/metrics' renderer (vllm/exposition.py) against prometheus_client.generate_latest, byte for byte.

The renderer keeps text between scrapes (family headers, sample prefixes, the texts of families a
FamilyMemo builds), so every property here renders with one warm renderer through a sequence of
updates and compares after each step. Where a collector has a memo, the reference is
generate_latest over the same registry with the memo switched off (every family rebuilt from the
current values), so a stale text fails the comparison."""

from __future__ import annotations

import contextlib
import math
import tomllib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info, Summary, generate_latest
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric

import vllm_vcr
from vllm_vcr.engine.types import (
    EngineCoreEvent,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    PrefillStats,
    PrefixCacheStats,
    SchedulerStats,
)
from vllm_vcr.faults import FaultController
from vllm_vcr.http.faults_adapter import install_gauges
from vllm_vcr.sglang.metrics import SGLangFrontendMetrics
from vllm_vcr.vllm import exposition
from vllm_vcr.vllm.exposition import FamilyMemo, TextExposition, exact
from vllm_vcr.vllm.http_metrics import HttpMetrics
from vllm_vcr.vllm.metrics import FrontendMetrics

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# label values and help texts that need escaping, or are not ASCII, or cannot be UTF-8 at all
hostile_text = st.one_of(
    st.text(alphabet=st.sampled_from('"\\\n\t a=,{}}é中🙂\u2028\x00'), max_size=8),
    st.text(max_size=6),
    st.sampled_from(["", '\\"', "\\n", "a\\", "\ud800"]),  # the lone surrogate cannot be encoded
)
# metric and label names: legacy ones, and UTF-8 ones the `underscores` escaping rewrites
names = st.one_of(st.from_regex(r"\A[a-zA-Z_:][a-zA-Z0-9_:]{0,8}\Z"),
                  st.text(alphabet=st.sampled_from("ab:_.9-é中 \""), min_size=1, max_size=6))
special_floats = st.sampled_from([0.0, -0.0, math.nan, math.inf, -math.inf, 1e6, 999999.0, 1234567.0, 1e300,
                                  -1e-300, 5e-324, 0.1, 2.5e16])
values = st.one_of(special_floats, st.floats(allow_nan=True), st.integers(-(10 ** 20), 10 ** 20),
                   st.integers(0, 2_000_000), st.booleans())
timestamps = st.one_of(st.none(), st.floats(-1e12, 1e12, allow_nan=False), st.integers(0, 2 ** 40))
TYPES = ["counter", "gauge", "histogram", "gaugehistogram", "summary", "info", "stateset", "unknown"]
SUFFIXES = ["", "_total", "_bucket", "_count", "_sum", "_created", "_gsum", "_gcount", "_info"]


def outcome(render) -> object:
    """The bytes, or the type of the exception raised."""
    try:
        return render()
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return type(e)


def both(registry, renderer: TextExposition) -> tuple[object, object]:
    """(renderer's result, generate_latest's)."""
    return outcome(renderer.render), outcome(lambda: generate_latest(registry))


# ------------------------------------------------------------------ any family a collector yields

@st.composite
def family(draw):
    name = draw(names)
    try:
        m = Metric(name, draw(hostile_text), draw(st.sampled_from(TYPES)))
    except ValueError:
        m = Metric("fallback", "doc", draw(st.sampled_from(TYPES)))
    label_names = draw(st.lists(names, max_size=3, unique=True))
    for _ in range(draw(st.integers(0, 6))):
        labels = {k: draw(hostile_text) for k in label_names if draw(st.booleans())}
        m.add_sample(m.name + draw(st.sampled_from(SUFFIXES)), labels, draw(values), draw(timestamps))
    return m


class Yields:
    """A collector that yields whatever families the test sets (new objects, or memo-kept ones)."""

    def __init__(self):
        self.families: list = []

    def collect(self):
        return list(self.families)


@SETTINGS
@given(st.lists(st.lists(family(), max_size=4), min_size=1, max_size=5))
def test_any_families_render_as_generate_latest_renders_them(scrapes):
    registry = CollectorRegistry(auto_describe=False)
    c = Yields()
    registry.register(c)
    renderer = TextExposition(registry)
    for fams in scrapes:  # one warm renderer, the families changing between scrapes
        c.families = fams
        fast, ref = both(registry, renderer)
        assert fast == ref


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.lists(values, min_size=1, max_size=3),
                          hostile_text), min_size=1, max_size=12))
def test_memo_kept_families_change_when_their_key_does(updates):
    """A family the memo keeps is rendered once; a new key (values told apart as exact() tells them)
    gives a new family and new text."""
    registry = CollectorRegistry(auto_describe=False)
    memo = FamilyMemo()
    state = {"a": ([0.0], "x"), "b": ([1], "y")}

    class Collector:
        def __init__(self, memo):
            self.memo = memo

        def collect(self):
            for slot, (vals, label) in state.items():
                def build(slot=slot, vals=vals, label=label):
                    m = Metric("fam_" + slot, "doc", "gauge")
                    for i, v in enumerate(vals):
                        m.add_sample("fam_" + slot, {"i": str(i), "l": label}, v)
                    return m
                yield self.memo.get(slot, (tuple(exact(v) for v in vals), label), build)

    c = Collector(memo)
    registry.register(c)
    renderer = TextExposition(registry)
    for slot, vals, label in updates:
        state[slot] = (vals, label)
        fast = outcome(renderer.render)
        c.memo = NoMemo()  # the reference: every family built from the current state
        try:
            assert fast == outcome(lambda: generate_latest(registry))
        finally:
            c.memo = memo


def test_exact_tells_apart_what_formats_differently():
    assert exact(0.0) != exact(-0.0)
    assert exact(math.nan) == exact(float("nan"))
    assert exact(1) != exact(1.5) and exact(3) == 3


# ------------------------------------------------------------------ prometheus_client's own metrics

ops = st.lists(st.tuples(st.sampled_from(["inc", "set", "observe", "info", "state", "remove", "clear"]),
                         hostile_text, values), max_size=25)


@SETTINGS
@given(ops)
def test_library_metrics_through_updates(sequence):
    registry = CollectorRegistry(auto_describe=False)
    counter = Counter("reqs", "Requests \\ with\nnewline", ["who"], registry=registry)
    gauge = Gauge("vllm:depth", 'a "gauge"', ["who", "engine"], registry=registry)
    hist = Histogram("lat_seconds", "latency", ["who"], registry=registry, buckets=(0.1, 1, 1e6, 2e6, math.inf))
    summ = Summary("size_bytes", "sizes", ["who"], registry=registry)
    info = Info("build", "build info", registry=registry)
    enum = Enum("state", "states", states=["a", "b"], registry=registry)
    renderer = TextExposition(registry)
    for op, who, v in sequence:
        fv = float(v) if not isinstance(v, float) or not math.isnan(v) else v
        with contextlib.suppress(ValueError, OverflowError):
            if op == "inc":
                counter.labels(who).inc(abs(fv) if fv == fv else 1)
            elif op == "set":
                gauge.labels(who, "0").set(fv)
            elif op == "observe":
                hist.labels(who).observe(fv)
                summ.labels(who).observe(fv)
            elif op == "info":
                info.info({"version": who, "path": who + "\\"})
            elif op == "state":
                enum.state("a" if fv != fv or fv > 0 else "b")
            elif op == "remove":
                with contextlib.suppress(KeyError):
                    counter.remove(who)
                    hist.remove(who)
            else:
                gauge.clear()
        fast, ref = both(registry, renderer)
        assert fast == ref


# ------------------------------------------------------------------ serve's collectors, memo on

class NoMemo(FamilyMemo):
    """Builds every family from the current values: what the memo must always agree with."""

    def get(self, slot, key, build):
        return build()


def reference(m: FrontendMetrics) -> object:
    kept = m._memo, m.http._memo
    m._memo, m.http._memo = NoMemo(), NoMemo()
    try:
        return outcome(lambda: generate_latest(m.registry))
    finally:
        m._memo, m.http._memo = kept


def stats(kv):
    return SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, num_skipped_waiting_reqs=1, kv_cache_usage=kv,
                          prefix_cache_stats=PrefixCacheStats(requests=1, queries=16, hits=8), num_preemptions=1)


update = st.one_of(
    st.tuples(st.just("arrive"), st.integers(0, 5), st.integers(1, 300)),
    st.tuples(st.just("token"), st.integers(0, 5), st.floats(0, 100)),
    st.tuples(st.just("finish"), st.integers(0, 5), st.sampled_from(list(FinishReason))),
    st.tuples(st.just("stats"), st.integers(0, 1), values.filter(lambda v: not isinstance(v, int) or abs(v) < 1e15)),
    st.tuples(st.just("idle_step"), st.integers(0, 1), st.integers(0, 3)),
    st.tuples(st.just("sleep"), st.integers(0, 1), st.integers(0, 2)),
    st.tuples(st.just("reject"), st.sampled_from(["max_num_queued_reqs", "max_num_queued_tokens"]), st.none()),
    st.tuples(st.just("tool"), st.booleans(), st.booleans()),
    st.tuples(st.just("http"), hostile_text, st.floats(0, 100)),
    st.tuples(st.just("first_engine"), st.integers(0, 3), st.none()),
    st.tuples(st.just("scrape_twice"), st.none(), st.none()),
    # scripted gauges (faults): set, moved by the clock (a ramp), cleared
    st.tuples(st.just("gauges"), st.sampled_from(["vllm:num_requests_waiting", "vllm:num_requests_running",
                                                  "vllm:kv_cache_usage_perc"]),
              st.one_of(st.none(), st.floats(0, 1), st.just(-0.0))),
)


def apply(m: FrontendMetrics, op, a, b, clock: list[float]) -> None:
    clock[0] += 0.25
    ts = clock[0]
    rid = f"r{a}"
    if op == "arrive":
        m.on_request_arrival(rid, None, n=1, max_tokens=b, num_prompt_tokens=b)
        m.on_engine_outputs(0, EngineCoreOutputs(engine_index=0, timestamp=ts, outputs=[EngineCoreOutput(
            request_id=rid, new_token_ids=[1], events=[EngineCoreEvent(1, ts - 0.1), EngineCoreEvent(2, ts - 0.05)],
            prefill_stats=PrefillStats(num_prompt_tokens=b, num_computed_tokens=b))]))
    elif op == "token":
        clock[0] += b
        m.on_engine_outputs(0, EngineCoreOutputs(engine_index=0, timestamp=clock[0], outputs=[
            EngineCoreOutput(request_id=rid, new_token_ids=[2, 3])]))
    elif op == "finish":
        m.on_engine_outputs(0, EngineCoreOutputs(engine_index=0, timestamp=ts, outputs=[
            EngineCoreOutput(request_id=rid, new_token_ids=[4], finish_reason=b)]))
    elif op == "stats":
        m.on_engine_outputs(a, EngineCoreOutputs(engine_index=a, timestamp=ts, scheduler_stats=stats(b)))
    elif op == "idle_step":
        m._engines[min(a, len(m._engines) - 1)].tokens_taken = b
        m.on_engine_outputs(a, EngineCoreOutputs(engine_index=a, timestamp=ts))
    elif op == "sleep":
        m.set_sleep_state(a, b)
    elif op == "reject":
        m.record_admission_rejection(a)
    elif op == "tool":
        m.record_tool_parser_invocation(a, b)
    elif op == "http":
        handler = "/" + a
        if not m.http.excluded(handler):
            m.http.observe(handler, "POST" if b > 50 else "GET", 200 if b > 10 else 404, int(b), 7, b)
    elif op == "first_engine":
        m.first_engine = a
    elif op == "gauges":
        faults = m.faults
        if b is None:
            faults.gauges.clear()
        else:
            faults.set_gauges({a: {"function": "ramp", "start": -0.0, "end": b, "period_s": 60}})


def check_every_step(metrics_type, updates, model_name):
    registry = CollectorRegistry(auto_describe=False)
    m = metrics_type(model_name, 2, registry, block_size=16, num_gpu_blocks=64, max_model_len=512)
    m.http = HttpMetrics(registry)
    m.enable_tool_parser_series()
    clock = [1000.0]
    m.faults = FaultController(clock=lambda: clock[0])  # (a ramp moves with the test's clock)
    install_gauges(m, m.faults)
    assert outcome(m.render_text) == reference(m)
    for op, a, b in updates:
        apply(m, op, a, b, clock)
        fast = outcome(m.render_text)
        assert fast == reference(m), (op, a, b)
        if op == "scrape_twice":
            assert outcome(m.render_text) == reference(m)
            # generate_latest over the memo itself: outside render() it builds every family
            assert outcome(lambda: generate_latest(registry)) == fast
    for accept in ("text/plain; version=1.0.0", "application/openmetrics-text; version=1.0.0", "*/*"):
        encoder, content_type = choose_encoder(accept)
        assert outcome(lambda: m.render(accept)) == outcome(lambda: (encoder(registry), content_type))


@SETTINGS
@given(st.lists(update, max_size=20), st.sampled_from(["tiny", 'mo"del\\\n中']))
def test_vllm_series_through_updates(updates, model_name):
    check_every_step(FrontendMetrics, updates, model_name)


@SETTINGS
@given(st.lists(update, max_size=20), st.sampled_from(["tiny", 'mo"del\\\n中']))
def test_sglang_series_through_updates(updates, model_name):
    check_every_step(SGLangFrontendMetrics, updates, model_name)


def test_a_scrape_with_nothing_new_renders_no_family_again(monkeypatch):
    """The point of the memo: after one scrape, an unchanged worker's own series cost no formatting."""
    m = FrontendMetrics("tiny", 1)
    m.render_text()
    formatted = []
    real = TextExposition._family
    monkeypatch.setattr(TextExposition, "_family", lambda self, metric: formatted.append(metric.name)
                        or real(self, metric))
    m.render_text()
    assert formatted == []
    m.on_engine_outputs(0, EngineCoreOutputs(engine_index=0, timestamp=1.0, scheduler_stats=stats(0.5)))
    m.render_text()
    assert "vllm:kv_cache_usage_perc" in formatted and "vllm:time_to_first_token_seconds" not in formatted


# ------------------------------------------------------------------ the prometheus-client it was checked with

def test_pyproject_bounds_prometheus_client_to_the_release_line_checked_here():
    from importlib.metadata import version

    from packaging.specifiers import SpecifierSet

    pyproject = Path(vllm_vcr.__file__).resolve().parents[2] / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    spec = next(d for d in deps if d.startswith("prometheus-client"))
    assert "<" in spec, f"prometheus-client is not bounded above: {spec}"
    installed = version("prometheus-client")
    if installed not in SpecifierSet(spec.removeprefix("prometheus-client")):
        pytest.fail(f"the installed prometheus-client {installed} is outside {spec}")
    # what the renderer imports from it
    assert callable(exposition.escape_label_name) and callable(exposition.escape_metric_name)
    assert exposition.UNDERSCORES == "underscores"
