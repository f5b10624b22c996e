"""vLLM's async scheduling in the perf model: the host's per-step work overlaps the GPU's, so a
step lasts max(GPU time, host time) plus the exposed part instead of their sum; on in `serve`,
`play` and `simulate` by default (as in vLLM from 0.14), off with `--no-async-scheduling`."""

from __future__ import annotations

import pytest

from vllm_vcr.cli import build_parser
from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.engine.latency import StepBatch
from vllm_vcr.engine.latency.aic import AicStepLatency, StepPricer
from vllm_vcr.engine_cli import engine_args_from_cli
from vllm_vcr.simulate.silicon_harness import ServerFlags, async_scheduling

from .conftest import LLAMA_8B, needs_aic


class _Kernels:
    """A stand-in estimator: a decode step of 4 ms + 0.1 ms per sequence."""

    def decode_step_latency(self, batch: int, ctx: int, beam: int) -> float:
        return 4.0 + 0.1 * batch


def _latency(**kw) -> AicStepLatency:
    return AicStepLatency(StepPricer(_Kernels()), **kw)


def _decode(n: int) -> StepBatch:
    return StepBatch(n, 0, 0, 0, n * 512)


def test_without_async_scheduling_host_and_gpu_take_turns():
    lat = _latency(step_overhead_ms=3.0, per_seq_overhead_ms=0.01)
    assert lat.step_ms(_decode(10)) == pytest.approx(5.0 + 3.0 + 0.1)


def test_with_async_scheduling_the_host_hides_behind_the_gpu():
    lat = _latency(step_overhead_ms=3.0, async_scheduling=True, async_exposed_ms=0.5)
    assert lat.step_ms(_decode(10)) == pytest.approx(5.0 + 0.5)  # the GPU is the longer
    slow_host = _latency(step_overhead_ms=9.0, async_scheduling=True, async_exposed_ms=0.5)
    assert slow_host.step_ms(_decode(10)) == pytest.approx(9.0 + 0.5)  # the GPU waits for the host
    # never longer than taking turns, as long as the exposed part is below the host time
    sync = _latency(step_overhead_ms=3.0)
    for n in (1, 8, 64, 512):
        assert lat.step_ms(_decode(n)) < sync.step_ms(_decode(n))


def test_the_silicon_rows_run_it_per_their_script_or_vllm_version():
    assert async_scheduling(ServerFlags(), "0.12.0") is False
    assert async_scheduling(ServerFlags(), "0.14.0") is True and async_scheduling(ServerFlags(), "0.19.0")
    assert async_scheduling(ServerFlags(), "nightly-5b8c30d62b754b57") is True
    assert async_scheduling(ServerFlags(async_scheduling=True), "0.11.2") is True  # the script's flag
    assert async_scheduling(ServerFlags(async_scheduling=False), "0.19.0") is False


def _engine_args(*argv: str) -> EngineArgs:
    parser, _ = build_parser()
    return engine_args_from_cli(parser.parse_args(list(argv)))


@needs_aic
@pytest.mark.parametrize("command", [["serve", LLAMA_8B], ["play", "--model-name", LLAMA_8B]])
def test_serve_and_play_take_vllms_flag(command):
    default = _engine_args(*command, "--perf-model", "aic").perf_model
    off = _engine_args(*command, "--perf-model", "aic", "--no-async-scheduling").perf_model
    on = _engine_args(*command, "--perf-model", "aic", "--async-scheduling",
                      "--perf-async-exposed-ms", "0.25").perf_model
    assert default["async_scheduling"] is True and off["async_scheduling"] is False
    assert on["async_scheduling"] is True and on["async_exposed_ms"] == 0.25


@needs_aic
def test_simulate_takes_the_flag():
    from vllm_vcr.perf.cli import perf_target

    parser, _ = build_parser()
    ns = parser.parse_args(["simulate", LLAMA_8B, "--perf-model", "aic", "--no-async-scheduling"])
    assert perf_target(ns)["async_scheduling"] is False


@needs_aic
def test_async_scheduling_shortens_the_tpot_of_a_closed_loop_by_the_hidden_host_time():
    from vllm_vcr.perf.aic import AicTarget
    from vllm_vcr.simulate.runner import simulate
    from vllm_vcr.simulate.workload import LengthDist, SyntheticWorkload

    def tpot_ms(asynchronous: bool) -> float:
        target = AicTarget(LLAMA_8B, "h100_sxm", step_overhead_ms=3.0, per_seq_overhead_ms=0.0,
                           async_scheduling=asynchronous, async_exposed_ms=0.5).resolved().to_dict()
        args = EngineArgs(config=EngineConfig(max_num_seqs=64, max_num_batched_tokens=8192), perf_model=target,
                          kv_cache_size=20000, advertised_max_model_len=1024).validate()
        wl = SyntheticWorkload(num_requests=32, isl=LengthDist("fixed", 256), osl=LengthDist("fixed", 64),
                               arrival="closed", concurrency=16)
        done = simulate(args, wl, concurrency=16).done
        return sum((r.end - r.first) * 1e3 / (r.num_out - 1) for r in done) / len(done)

    sync, overlapped = tpot_ms(False), tpot_ms(True)
    # a Llama-3.1-8B decode step on an H100 (~7 ms) is longer than the 3 ms of host time: all but
    # the exposed 0.5 ms of it hides behind the GPU
    assert sync - overlapped == pytest.approx(2.5, abs=0.3)


@needs_aic
def test_under_async_scheduling_a_request_arriving_mid_step_joins_the_step_after_next():
    """vLLM schedules step n+1 before it reads the requests that arrived during step n
    (`step_with_batch_queue`): a request arriving while decodes run waits one more step for its
    prefill than without async scheduling; the steps themselves are as long either way."""
    from vllm_vcr.perf.aic import AicTarget
    from vllm_vcr.simulate.runner import simulate
    from vllm_vcr.simulate.workload import LengthDist, SyntheticWorkload

    def run(asynchronous: bool) -> tuple[float, float]:
        target = AicTarget(LLAMA_8B, "h100_sxm", step_overhead_ms=0.0, per_seq_overhead_ms=0.0,
                           async_scheduling=asynchronous, async_exposed_ms=0.0, frontend_ms=0.0,
                           frontend_ms_per_1k_tokens=0.0, frontend_ms_per_request=0.0).resolved().to_dict()
        args = EngineArgs(config=EngineConfig(max_num_seqs=64, max_num_batched_tokens=8192), perf_model=target,
                          kv_cache_size=20000, advertised_max_model_len=1024).validate()
        wl = SyntheticWorkload(num_requests=96, isl=LengthDist("fixed", 256), osl=LengthDist("uniform", 32, 96),
                               arrival="closed", concurrency=16, seed=3)
        later = [r for r in simulate(args, wl, concurrency=16).done if int(r.request_id.rsplit("-", 1)[1]) >= 16]
        ttft = sum((r.first - r.arrival) * 1e3 for r in later) / len(later)
        tpot = sum((r.end - r.first) * 1e3 / (r.num_out - 1) for r in later) / len(later)
        return ttft, tpot

    (sync_ttft, sync_tpot), (async_ttft, async_tpot) = run(False), run(True)
    assert async_tpot == pytest.approx(sync_tpot, rel=0.05)
    # each later request arrives when another one ends, mid-run of the others' decodes: one more
    # decode step (~7 ms for 16 sequences of a Llama-3.1-8B on an H100) before its prefill
    assert 0.6 * sync_tpot < async_ttft - sync_ttft < 1.4 * sync_tpot
