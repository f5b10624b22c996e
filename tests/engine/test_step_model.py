"""The step-time model (engine/latency/steps.py, fitted by replay/latency_fit/steps.py): step reconstruction, fit,
and the engine with timed steps."""

from __future__ import annotations

import random

import pytest

from vllm_vcr.engine.clock import VirtualClock
from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.engine.core import EngineCore
from vllm_vcr.engine.latency import CellLatency, LatencyModel, StepBatch, StepLatency, zero_pacing
from vllm_vcr.engine.types import EngineCoreRequest, SamplingParams
from vllm_vcr.trace.io import write_trace
from vllm_vcr.trace.schema import TraceMeta, TraceRecord
from vllm_vcr.replay.inputs import clear_shared_inputs, engine_inputs
from vllm_vcr.replay.latency_fit.steps import busy_arrivals, fit_input_delay, fit_step_model, lad_fit, reconstruct_steps

# the law the synthetic engine follows (ms): intercept, per decode, per prefill token, per first token
TRUE = (3.0, 0.8, 0.05, 6.0)


class KnownLaw(LatencyModel):
    times_steps = True

    def __init__(self, input_delay_ms: float = 0.0) -> None:
        self.delay = input_delay_ms * 1e-3

    def input_delay(self, rng: random.Random) -> float:
        return self.delay

    def step_duration(self, b: StepBatch, rng: random.Random) -> float:
        line = TRUE[0] + TRUE[1] * b.num_decodes + TRUE[2] * b.num_prefill_tokens + TRUE[3] * b.num_first_tokens
        return line * rng.uniform(0.9, 1.1) * 1e-3

    def pacing(self, num_prompt_tokens, num_cached_tokens, num_running, rng):
        return zero_pacing(rng)


def synthetic_trace(n: int = 300, seed: int = 3, input_delay_ms: float = 0.0) -> list[TraceRecord]:
    """Records as an engine tap would write them, from the engine running the known law."""
    rng = random.Random(seed)
    times: dict[str, list[float]] = {}

    def sink(_c, outs):
        for o in outs.outputs:
            if o.new_token_ids:
                times.setdefault(o.request_id, []).append(outs.timestamp)

    clock = VirtualClock(0.0)
    core = EngineCore(EngineArgs(config=EngineConfig(max_num_seqs=8)).validate(), clock=clock,
                      latency=KnownLaw(input_delay_ms), output_sink=sink)
    t, shape = 0.0, {}
    for i in range(n):
        t += rng.expovariate(25.0)
        core.run_until_idle(until=t)
        prompt, out = rng.randint(16, 600), rng.randint(4, 40)
        shape[f"r{i}"] = (t, prompt, out)
        core.add_request(EngineCoreRequest(
            request_id=f"r{i}", prompt_token_ids=[rng.randint(1, 30000) for _ in range(prompt)],
            sampling_params=SamplingParams(max_tokens=out, ignore_eos=True)))
    core.run_until_idle()
    recs = []
    for rid, (arr, prompt, out) in shape.items():
        ts = times[rid]
        recs.append(TraceRecord(prompt_tokens=prompt, output_tokens=out, ttft_ms=(ts[0] - arr) * 1e3,
                                itl_ms=[(b - a) * 1e3 for a, b in zip(ts, ts[1:])], arrival_ms=arr * 1e3))
    return recs


def test_fit_recovers_the_step_law():
    model = fit_step_model(synthetic_trace())
    c = model.coefficients()
    assert c["intercept"] == pytest.approx(TRUE[0], rel=0.15)
    assert c["decodes"] == pytest.approx(TRUE[1], rel=0.15)
    assert c["prefill_tokens"] == pytest.approx(TRUE[2], rel=0.1)
    assert c["first_tokens"] == pytest.approx(TRUE[3], rel=0.15)
    # the residual ratios carry the ±10 % noise
    for r in model.residuals.values():
        assert 0.85 <= r.ratios[0] and r.excess[-1] < 0.15 * 40


def test_fit_recovers_a_known_input_delay():
    recs = synthetic_trace(input_delay_ms=2.0)
    model = fit_step_model(recs)
    samples = busy_arrivals(recs, reconstruct_steps(recs))
    assert len(samples) > 50
    # every busy arrival with less than 2 ms left in the step in flight missed the next one
    assert all(missed == (lead < 2.0) for lead, missed in samples if abs(lead - 2.0) > 0.01)
    d = model.input_delay_model
    assert d is not None and d.plateau == 0
    for u in (0.1, 0.5, 0.9):
        assert d.draw_ms(u) == pytest.approx(2.0, abs=0.3)
    assert model.input_delay(random.Random(0)) == pytest.approx(2e-3, abs=3e-4)
    # without a delay, no busy arrival misses its step and the fitted delay is ~0
    model0 = fit_step_model(synthetic_trace())
    assert model0.input_delay_model.draw_ms(0.5) < 0.3


def test_input_delay_drops_the_plateau_of_late_misses():
    # half the requests seen after 1 ms, all after 2 ms; 10 % "misses" at long leads (tap bursts)
    samples = [(0.05 * k, 0.05 * k < 1.0 or (0.05 * k < 2.0 and k % 2 == 0)) for k in range(60)]
    samples += [(3.0 + 0.5 * k, k % 10 == 0) for k in range(100)]
    d = fit_input_delay(samples)
    assert d.plateau == pytest.approx(0.1, abs=0.03)
    assert d.draw_ms(0.0) <= d.horizon and d.draw_ms(0.99) >= 0.9
    assert 1.0 <= d.draw_ms(0.5) <= 2.0


def test_reconstructed_steps_and_idle_starts():
    # a arrives at 0 (idle engine), first token at 20 ms, decodes at 25 and 30;
    # b arrives at 22 (busy), first token with a's 30 ms step; the engine then idles until c at 100
    recs = [
        TraceRecord(prompt_tokens=100, output_tokens=3, ttft_ms=20.0, itl_ms=[5.0, 5.0], arrival_ms=0.0),
        TraceRecord(prompt_tokens=50, cached_tokens=16, output_tokens=2, ttft_ms=8.0, itl_ms=[4.0], arrival_ms=22.0),
        TraceRecord(prompt_tokens=10, output_tokens=1, ttft_ms=12.0, arrival_ms=100.0),
    ]
    steps = reconstruct_steps(recs)
    got = [(s.start_ms, s.end_ms, s.num_decodes, s.num_prefill_tokens, s.num_first_tokens, s.after_idle) for s in steps]
    assert got == [(0.0, 20.0, 0, 100, 1, True), (20.0, 25.0, 1, 0, 0, False), (25.0, 30.0, 1, 34, 1, False),
                   (30.0, 34.0, 1, 0, 0, False), (100.0, 112.0, 0, 10, 1, True)]


def test_lad_fit_ignores_stalls_and_keeps_coefficients_non_negative():
    rng = random.Random(0)
    x = [[1.0, float(rng.randint(0, 8)), 0.0] for _ in range(400)]
    y = [2.0 + 1.5 * row[1] + (200.0 if i % 20 == 0 else 0.0) for i, row in enumerate(x)]
    import numpy as np

    coef = lad_fit(np.array(x), np.array(y))
    assert coef[0] == pytest.approx(2.0, abs=0.05) and coef[1] == pytest.approx(1.5, abs=0.05) and coef[2] == 0


def test_time_scale_divides_step_durations():
    recs = synthetic_trace(60)
    b = StepBatch(2, 100, 1, 1, 300)
    one = fit_step_model(recs).step_duration(b, random.Random(1))
    two = fit_step_model(recs, time_scale=2.0).step_duration(b, random.Random(1))
    assert two == pytest.approx(one / 2)


def _engine(path, which: str = "auto", **kw) -> EngineCore:
    args = EngineArgs(latency_trace=str(path), latency_trace_model=which, **kw).validate()
    return EngineCore(args, clock=VirtualClock(0.0), **engine_inputs(args))


def test_a_tap_trace_selects_timed_steps_unless_the_flag_asks_for_cells(tmp_path):
    tap, http = tmp_path / "tap.jsonl", tmp_path / "http.jsonl"
    write_trace(tap, TraceMeta(source="tap"), synthetic_trace(60))
    write_trace(http, TraceMeta(source="http-tap"), synthetic_trace(60))
    clear_shared_inputs()
    core = _engine(tap)  # the default for an engine tap trace: timed steps
    assert core.latency.times_steps and isinstance(core.latency, StepLatency)
    assert isinstance(_engine(http).latency, CellLatency)  # a client-side capture: the cell model
    assert isinstance(_engine(tap, "cells").latency, CellLatency)
    assert isinstance(_engine(http, "steps").latency, StepLatency)
    assert _engine(tap).latency is core.latency  # one model per trace for every engine of the process
    clear_shared_inputs()


def test_a_tap_trace_the_step_model_cannot_fit_falls_back_to_cells(tmp_path):
    path = tmp_path / "t.jsonl"  # no arrival times: no step timeline
    write_trace(path, TraceMeta(source="tap"), [TraceRecord(prompt_tokens=10, output_tokens=3, ttft_ms=20.0,
                                                           itl_ms=[5.0, 5.0]) for _ in range(5)])
    clear_shared_inputs()
    assert isinstance(_engine(path).latency, CellLatency)
    clear_shared_inputs()


def test_an_engine_without_its_injected_latency_model_is_refused():
    with pytest.raises(ValueError, match="--latency-trace"):
        EngineCore(EngineArgs(latency_trace="x.jsonl").validate(), clock=VirtualClock(0.0))


def test_calibrate_with_timed_steps_reproduces_its_own_synthetic_trace(tmp_path):
    from vllm_vcr.inspect.calibrate import compare, simulate
    from vllm_vcr.trace.schema import replay_subset

    recs = synthetic_trace(200)
    path = tmp_path / "t.jsonl"
    write_trace(path, TraceMeta(source="tap"), recs)
    clear_shared_inputs()
    args = EngineArgs(config=EngineConfig(max_num_seqs=8), latency_trace=str(path), latency_trace_model="steps")
    sims = simulate(recs, args.validate(), 16)
    clear_shared_inputs()
    rows = {(r["metric"], r["quantile"]): r["error"] for r in compare(replay_subset(recs), sims, 0.05, 0.1)}
    assert rows[("ttft_ms", "p50")] < 0.1 and rows[("itl_ms", "p50")] < 0.1
