"""Finished requests' observations, kept as rows and folded in bulk (FrontendMetrics._finish,
Histogram.observe_all), give the histograms one observe() per value gives: the same counts and
the same total, bit for bit, whatever the values (hostile floats and ints included)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.vllm.metrics import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    FrontendMetrics,
    Histogram,
)

values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.sampled_from([0, 0.0, -0.0, 1, 0.3, 0.5, 2.5, 7680.0, 1e-300, 5e-324]),
)


def same(a: Histogram, b: Histogram) -> None:
    assert a.counts == b.counts
    assert math.isnan(a.total) and math.isnan(b.total) or (a.total == b.total and repr(a.total) == repr(b.total))


@given(st.lists(values, max_size=200), st.sampled_from([REQUEST_LATENCY_BUCKETS, ITL_BUCKETS, (1, 2, 5, 10)]))
@settings(max_examples=300, deadline=None)
def test_observe_all_is_observe_per_value(vals, bounds):
    plain, bulk = Histogram(bounds), Histogram(bounds)
    for v in vals:
        plain.observe(v)
    bulk.observe_all(vals)
    same(plain, bulk)


def plain_finish(h: dict[str, Histogram], parents: dict, r, now: float) -> None:
    """A finished request's observations, one observe() each (what the rows stand for)."""
    queued = r.scheduled_ts - r.queued_ts
    prefill = r.first_ts - r.scheduled_ts
    decode = r.last_ts - r.first_ts
    inference = r.last_ts - r.scheduled_ts
    h["e2e"].observe(now - r.arrival)
    h["queue"].observe(queued)
    h["prefill"].observe(prefill)
    h["inference"].observe(inference)
    h["decode"].observe(decode)
    h["num_preemptions"].observe(r.num_preempt)
    prompt_len = r.prompt_len or 0
    h["prefill_kv_computed"].observe(prompt_len - max(r.num_cached, 0))
    h["prompt_tokens"].observe(prompt_len)
    h["generation_tokens"].observe(r.num_gen)
    h["tpot"].observe(decode / (r.num_gen - 1) if r.num_gen > 1 else 0)
    if r.max_tokens:
        h["params_max_tokens"].observe(r.max_tokens)
    if r.parent is None:
        h["params_n"].observe(r.n)
        h["max_num_generation_tokens"].observe(r.num_gen)
    else:
        p = parents.get(r.parent)
        if p is None:
            return
        p[1] = max(p[1], r.num_gen)
        p[0] -= 1
        if p[0] <= 0:
            del parents[r.parent]
            h["params_n"].observe(p[2])
            h["max_num_generation_tokens"].observe(p[1])


time_ = st.floats(allow_nan=True, allow_infinity=True)
finish = st.tuples(
    time_, time_, time_, time_, time_, time_,  # now, arrival, queued, scheduled, first, last
    st.integers(0, 1 << 60), st.one_of(st.none(), st.integers(-5, 1 << 60)),  # num_gen, prompt_len
    st.integers(-3, 1 << 60), st.integers(0, 50),  # num_cached, num_preempt
    st.one_of(st.none(), st.integers(-2, 1 << 60)),  # max_tokens
    st.one_of(st.none(), st.sampled_from(["p1", "p2"])), st.integers(1, 4),  # parent, n
)
ATTRS = ("e2e", "queue", "prefill", "inference", "decode", "num_preemptions", "prefill_kv_computed",
         "prompt_tokens", "generation_tokens", "tpot", "params_max_tokens", "params_n", "max_num_generation_tokens")


@given(st.lists(finish, max_size=40), st.integers(1, 7))
@settings(max_examples=300, deadline=None)
def test_finished_rows_fold_to_per_request_observations(reqs, fold_at):
    """Requests finished through the metrics (rows folded every `fold_at`, and at a scrape) leave
    the histograms exactly as observing each request's values on its finish would."""
    m = FrontendMetrics("m")
    m.FOLD_AT = fold_at
    eng = m._engines[0]
    expected = {attr: Histogram(getattr(eng, "h_" + attr).bounds) for attr in ATTRS}
    parents: dict[str, list] = {}
    for i, (now, arrival, queued, scheduled, first, last, num_gen, prompt_len, cached, preempt, max_tokens,
            parent, n) in enumerate(reqs):
        rid = f"r{i}"
        m.on_request_arrival(rid, 0.0, n=n, max_tokens=max_tokens, num_prompt_tokens=prompt_len, parent_id=parent)
        if parent is not None and parent not in parents:
            parents[parent] = [max(1, n), 0, max(1, n)]  # remaining, max_gen, n
        r = m._reqs.pop(rid)
        r.arrival, r.queued_ts, r.scheduled_ts, r.first_ts, r.last_ts = arrival, queued, scheduled, first, last
        r.num_gen, r.num_cached, r.num_preempt = num_gen, cached, preempt
        plain_finish(expected, parents, r, now)
        m._finish(eng, r, 0, now)
        assert len(eng.finished) < fold_at
    m.render_text()  # a scrape folds what waits
    assert eng.finished == []
    for attr, h in expected.items():
        same(h, getattr(eng, "h_" + attr))


def test_every_scrape_sees_each_finished_request():
    """A request's finish shows in the next scrape under vLLM's and SGLang's names alike, folded
    or not yet (its row waits for FOLD_AT)."""
    from prometheus_client.parser import text_string_to_metric_families

    from vllm_vcr.sglang.metrics import SGLangFrontendMetrics

    for cls, e2e in ((FrontendMetrics, "vllm:e2e_request_latency_seconds"),
                     (SGLangFrontendMetrics, "sglang:e2e_request_latency_seconds")):
        m = cls("m")
        for i in range(3):
            m.on_request_arrival(f"r{i}", 0.0, max_tokens=4, num_prompt_tokens=3)
            m.on_request_finished(f"r{i}", "stop", num_generation_tokens=2, engine_index=0)
            counts = [s.value for fam in text_string_to_metric_families(m.render_text().decode())
                      for s in fam.samples if s.name == e2e + "_count"]
            assert sum(counts) == i + 1
