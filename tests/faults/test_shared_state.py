"""The fault state shared by the API servers of `serve --api-server-count N` (faults/shared.py)
decides exactly what one process's FaultController decides, whichever process each request
reaches: counts, request indexes, expiry, rates patched and gauges set through any of them."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.faults import FaultController, RequestInfo
from vllm_vcr.faults.shared import SharedFaultController


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


match = st.fixed_dictionaries({}, optional={
    "path": st.sampled_from(["/v1/completions", "/v1/chat/*", "/v1/c*", "/nope", ""]),
    "model": st.sampled_from(["m", "other", "é\u0000x"]),
    "header": st.dictionaries(st.sampled_from(["x-tenant", "x-a"]), st.sampled_from(["*", "blue", "red"]),
                              max_size=2),
    "request_index": st.tuples(st.integers(0, 6), st.integers(0, 6)).map(sorted),
})
rule = st.fixed_dictionaries({"action": st.sampled_from(["http_error", "stream_error", "stall", "reset"]),
                              "match": match}, optional={
    "count": st.integers(1, 4), "expires_in": st.floats(0.5, 20), "after_tokens": st.integers(0, 3)})
request = st.tuples(st.integers(0, 2),  # which process
                    st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
                    st.dictionaries(st.sampled_from([b"x-tenant", b"x-a", b"x-return-error"]),
                                    st.sampled_from([b"blue", b"red", b"429", b"bad"]), max_size=2),
                    st.sampled_from(["m", "other", None]),
                    st.floats(0, 3))  # seconds before it arrives


def _fix(r: dict) -> dict:
    r = dict(r)
    if r["action"] == "http_error":
        r["error"] = "rate_limit"
    if r["action"] == "stall":
        r["stall_ms"] = 5
    return r


def _outcome(c, path, headers, model):
    if b"x-return-error" in headers:
        try:
            a = c.from_header(headers[b"x-return-error"])
        except Exception as e:  # noqa: BLE001 - the same refusal either way
            return ("refused", type(e).__name__)
        return (a.action, a.failure.status if a.failure else None)
    if not c.active:
        return None
    a = c.decide(RequestInfo(path, headers, lambda: model))
    return None if a is None else (a.action, a.source, a.after_tokens, a.failure.status if a.failure else None)


@settings(max_examples=150, deadline=None)
@given(rules=st.lists(rule, max_size=5), requests=st.lists(request, max_size=30),
       rate_at=st.integers(0, 30), gauge_at=st.integers(0, 30))
def test_shared_state_decides_as_one_controller(tmp_path_factory, rules, requests, rate_at, gauge_at):
    path = str(tmp_path_factory.mktemp("faults") / "state")
    clock = Clock()
    one = FaultController(clock=clock, seed=1)
    parent = SharedFaultController(path, create=True, clock=clock, seed=1)
    procs = [SharedFaultController(path, create=False, clock=clock, seed=1) for _ in range(3)]
    script = {"rules": [_fix(r) for r in rules]}
    assert parent.set_script(script) == one.set_script(script)
    gauge = {"vllm:num_requests_waiting": {"function": "ramp", "start": 0, "end": 10, "period_s": 5}}
    for i, (proc, path_, headers, model, wait) in enumerate(requests):
        clock.t += wait
        if i == rate_at:  # a rate of 1 draws nothing random: the same in every process
            patch = {"reset_rate": 1.0, "reset_after_tokens": 2}
            assert procs[(proc + 1) % 3].patch_rates(patch) == one.patch_rates(patch)
        if i == gauge_at:
            assert parent.set_gauges(gauge) == one.set_gauges(gauge)
        assert _outcome(procs[proc], path_, headers, model) == _outcome(one, path_, headers, model)
        assert procs[proc].active == one.active
        assert procs[(proc + 2) % 3].gauge_value("vllm:num_requests_waiting") == one.gauge_value(
            "vllm:num_requests_waiting")
    assert parent.describe_script() == one.describe_script()
    assert procs[1].stats() == one.stats()
    assert parent.describe_gauges() == one.describe_gauges()
    parent.reset_stats()
    one.reset_stats()
    parent.clear_script()
    one.clear_script()
    assert procs[2].stats() == one.stats() and procs[0].describe_script() == one.describe_script()
    for c in (parent, *procs):
        c.close()
