"""The http_* series keep each request as a row and fold the rows in bulk (HttpMetrics.fold): the
counts, sizes, sums and buckets equal adding each request at once, one addition at a time in
arrival order, for hostile handlers, methods, statuses, sizes and durations, whenever the rows
are folded (a small FOLD_AT folds them mid-way, a scrape at the end)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from vllm_vcr.vllm.http_metrics import HttpMetrics

requests = st.lists(st.tuples(
    st.sampled_from(["/v1/chat/completions", "/v1/completions", "none"]) | st.text(max_size=8),
    st.sampled_from(["POST", "GET"]) | st.text(max_size=4),
    st.sampled_from([200, 400, 404, 500, 599]),
    st.integers(-2**62, 2**62) | st.integers(0, 10_000),
    st.integers(-2**62, 2**62) | st.integers(0, 10_000),
    st.floats(allow_nan=True, allow_infinity=True) | st.floats(0, 100)), max_size=60)


def one_at_a_time(m: HttpMetrics, handler, method, status, request_size, response_size, duration) -> None:  # noqa: ANN001
    """Each request added at once (what the rows, folded, must equal)."""
    key = (method, status, handler)
    entry = m._entries.get(key)
    if entry is None:
        entry = m._entries[key] = m._entry(method, status, handler)
    c, s_in, s_out, lowr = entry
    c[0] += 1
    s_in[0] += 1
    s_in[1] += request_size
    s_out[0] += 1
    s_out[1] += response_size
    m.highr.observe(duration)
    lowr.observe(duration)


def values(m: HttpMetrics) -> tuple:
    def r(x):  # noqa: ANN001 - NaN compares by its repr
        return repr(x) if isinstance(x, float) and math.isnan(x) else x

    return ({k: r(v[0]) for k, v in m.requests.items()},
            {k: tuple(map(r, v[:2])) for k, v in m.in_size.items()},
            {k: tuple(map(r, v[:2])) for k, v in m.out_size.items()},
            (tuple(m.highr.counts), r(m.highr.total)),
            {k: (tuple(h.counts), r(h.total)) for k, h in m.lowr.items()})


def assert_folds_alike(reqs: list, fold_at: int = HttpMetrics.FOLD_AT) -> None:
    """The rows of `reqs`, folded every `fold_at` and at the end, equal each request added at once."""
    folded, plain = HttpMetrics(), HttpMetrics()
    folded.FOLD_AT = fold_at
    for r in reqs:
        folded.observe(*r)
        one_at_a_time(plain, *r)
    folded.fold()
    assert values(folded) == values(plain)


@settings(max_examples=300, deadline=None)
@given(reqs=requests, fold_at=st.integers(1, 8))
def test_folded_rows_equal_one_request_at_a_time(reqs, fold_at):
    assert_folds_alike(reqs, fold_at)


def test_a_scrape_folds_the_rows_first():
    registry = CollectorRegistry()
    m = HttpMetrics(registry)
    m.observe("/v1/chat/completions", "POST", 200, 120, 0, 0.3)
    text = generate_latest(registry).decode()
    assert 'http_requests_total{handler="/v1/chat/completions",method="POST",status="2xx"} 1.0' in text
    assert 'http_request_size_bytes_sum{handler="/v1/chat/completions"} 120.0' in text
    assert 'http_request_duration_seconds_bucket{handler="/v1/chat/completions",le="0.5",method="POST"} 1.0' in text


def test_records_shared_by_kinds_of_request_take_their_rows_in_arrival_order():
    """A 200 and a 400 to one handler share its size summaries and its latency histogram: a float
    sum near 2**53 tells the order its additions ran in."""
    assert_folds_alike([("/v1/chat/completions", "POST", 400, 0, 0, 3.0),
                        ("/v1/chat/completions", "POST", 200, 0, 0, 0.0),
                        ("/v1/chat/completions", "POST", 200, 2**53 - 2, 2**53 - 2, 9007199254740990.0),
                        ("/v1/chat/completions", "POST", 400, 3, 3, 1.0)])


near_2_53 = st.sampled_from([0, 1, 3, 2**53 - 2, 2**53, -2**53])
mixed_kinds = st.lists(st.tuples(
    st.sampled_from(["/v1/chat/completions", "/v1/completions"]), st.sampled_from(["POST", "GET"]),
    st.sampled_from([200, 201, 400, 404]), near_2_53, near_2_53, near_2_53.map(float)), max_size=30)


@settings(max_examples=300, deadline=None)
@given(reqs=mixed_kinds, fold_at=st.integers(1, 40))
def test_mixed_kinds_of_request_fold_in_arrival_order(reqs, fold_at):
    """Few handlers, methods and statuses (so records are shared) and sums where order shows."""
    assert_folds_alike(reqs, fold_at)
