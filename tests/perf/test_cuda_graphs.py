"""Steps vLLM runs without CUDA graphs: the capture size vLLM resolves from an engine's limits
and flags (perf/cuda_graphs.py), the step-time term of such a step (engine/latency/aic.py), and
the flags `serve`, `play` and `simulate` take for it, on the virtual clock."""

from __future__ import annotations

import pytest

from vllm_vcr.cli import build_parser
from vllm_vcr.engine.latency import StepBatch
from vllm_vcr.engine.latency.aic import AicStepLatency, StepPricer
from vllm_vcr.engine_cli import engine_args_from_cli
from vllm_vcr.perf.cuda_graphs import capture_size, eager_step_ms, from_compilation_config, num_layers
from vllm_vcr.perf.errors import PerfModelError
from vllm_vcr.simulate.silicon_harness import inferencex_flags

from .conftest import LLAMA_8B, needs_aic


class _Kernels:
    """A stand-in estimator: 4 ms per decode step, 10 ms per mixed step's shared work."""

    def decode_step_latency(self, batch: int, ctx: int, beam: int) -> float:
        return 4.0

    def mixed_step_breakdown(self, tokens: int, decodes: int, ctx: int, beam: int, prefix: int):
        return 0.0, 10.0, 1.0, 0.0


def _latency(**kw) -> AicStepLatency:
    return AicStepLatency(StepPricer(_Kernels()), **kw)


def _decode(n: int) -> StepBatch:
    return StepBatch(n, 0, 0, 0, n * 512)


def _mixed(decodes: int, prefill: int) -> StepBatch:
    return StepBatch(decodes, prefill, 1, 1, decodes * 512)


def test_vllms_default_capture_size():
    # min(2 x max_num_seqs, 512), 1024 on data-center Blackwell in current releases
    assert capture_size("h100_sxm", 1024, 8192) == 512
    assert capture_size("b200_sxm", 1024, 8192) == 1024
    assert capture_size("b200_sxm", 1024, 8192, blackwell_1024=False) == 512
    assert capture_size("h200_sxm", 4, 8192) == 8  # --max-num-seqs $CONC: 2 x C
    assert capture_size("h200_sxm", 12, 8192) == 24
    assert capture_size("h100_sxm", 256, 256) == 256  # never above the token budget
    assert capture_size("h100_sxm", 1024, 300) == 300  # the budget itself is captured when it fits


def test_a_given_capture_size_lands_on_the_captured_grid():
    assert capture_size("b200_sxm", 512, 8192, given=2048) == 2048
    assert capture_size("h100_sxm", 512, 8192, given=300) == 288  # 16-token steps above 256
    assert capture_size("h100_sxm", 512, 1024, given=2048) == 1024  # the budget bounds it
    assert capture_size("h100_sxm", 512, 8192, sizes=[1, 2, 64, 16384]) == 64  # above the budget: dropped
    assert capture_size("h100_sxm", 512, 8192, given=0) == 0


def test_the_compilation_configs_graph_settings():
    assert from_compilation_config('{"cudagraph_mode": "FULL_DECODE_ONLY"}') == {"mode": "FULL_DECODE_ONLY"}
    assert from_compilation_config({"cudagraph_mode": "piecewise", "max_cudagraph_capture_size": 64}) == \
        {"mode": "PIECEWISE", "given": 64}
    assert from_compilation_config('{"pass_config": {"fuse_allreduce_rms": true}}') == {}
    assert from_compilation_config({"cudagraph_capture_sizes": [1, 8]}) == {"sizes": [1, 8]}
    with pytest.raises(PerfModelError, match="cudagraph_mode"):
        from_compilation_config('{"cudagraph_mode": "SOMETIMES"}')
    with pytest.raises(PerfModelError, match="--compilation-config"):
        from_compilation_config("{not json")
    assert from_compilation_config('{"max_cudagraph_capture_size": "64"}') == {"given": 64}
    for bad in ('{"max_cudagraph_capture_size": "x"}', '{"max_cudagraph_capture_size": -1}',
                '{"max_cudagraph_capture_size": true}', '{"cudagraph_capture_sizes": 5}',
                '{"cudagraph_capture_sizes": [1, "a"]}', '{"cudagraph_capture_sizes": [[8]]}'):
        with pytest.raises(PerfModelError, match="^--compilation-config: "):
            from_compilation_config(bad)


def test_a_step_above_the_capture_size_pays_the_eager_term():
    lat = _latency(eager_step_ms=5.0, graph_capture_size=512)
    assert lat.step_ms(_decode(512)) == pytest.approx(4.0)  # a graph replays
    assert lat.step_ms(_mixed(8, 504)) == pytest.approx(11.0)  # 512 tokens: within the capture size
    assert lat.step_ms(_mixed(8, 505)) == pytest.approx(11.0 + 5.0)  # 513: no graph
    assert lat.step_ms(_decode(513)) == pytest.approx(4.0 + 5.0)


def test_the_graph_mode_decides_which_steps_replay_one():
    decode_only = _latency(eager_step_ms=5.0, graph_capture_size=512, graph_mode="FULL_DECODE_ONLY")
    assert decode_only.step_ms(_decode(64)) == pytest.approx(4.0)
    assert decode_only.step_ms(_mixed(1, 16)) == pytest.approx(11.0 + 5.0)  # any prefill: no graph
    none = _latency(eager_step_ms=5.0, graph_capture_size=512, graph_mode="NONE")
    assert none.step_ms(_decode(1)) == pytest.approx(4.0 + 5.0)
    unknown = _latency(eager_step_ms=5.0)  # no capture size resolved: every step as if graphed
    assert unknown.step_ms(_mixed(8, 4096)) == pytest.approx(11.0)


def test_async_scheduling_does_not_hide_it():
    """The launches hold the GPU: under async scheduling the step is still longer by the term."""
    plain = _latency(step_overhead_ms=3.0, async_scheduling=True, async_exposed_ms=0.5, graph_capture_size=512)
    eager = _latency(step_overhead_ms=3.0, async_scheduling=True, async_exposed_ms=0.5, graph_capture_size=512,
                     eager_step_ms=2.0)
    assert eager.step_ms(_mixed(8, 1024)) - plain.step_ms(_mixed(8, 1024)) == pytest.approx(2.0)
    assert eager.step_ms(_decode(8)) == plain.step_ms(_decode(8))


@needs_aic
def test_the_term_is_per_layer_and_per_layer_of_tp():
    from vllm_vcr.perf.catalog import resolve_model

    model = resolve_model("meta-llama/Llama-3.1-70B")[0]  # the bundled config's name
    assert num_layers(model) == 80
    assert eager_step_ms(model, 1, 100.0, 50.0) == pytest.approx(8.0)
    assert eager_step_ms(model, 8, 100.0, 50.0) == pytest.approx(12.0)


def test_the_inferencex_scripts_graph_flags():
    assert inferencex_flags("meta-llama/Llama-3.1-70B", "b200_sxm", "fp8", "measured=2025-10-29").cudagraph_mode == \
        "FULL_DECODE_ONLY"
    assert inferencex_flags("openai/gpt-oss-120b", "h200_sxm", "nvfp4", "measured=2026-03-27") \
        .max_cudagraph_capture_size == 2048
    early = inferencex_flags("MiniMaxAI/MiniMax-M2.5", "b200_sxm", "fp8", "measured=2026-03-11")
    late = inferencex_flags("MiniMaxAI/MiniMax-M2.5", "b200_sxm", "fp8", "measured=2026-04-22")
    assert (early.max_cudagraph_capture_size, late.max_cudagraph_capture_size) == (None, 2048)
    assert late.kv_cache_fp8 and late.block_size == 32  # the other flags of that date stay
    assert inferencex_flags("MiniMaxAI/MiniMax-M2.5", "h200_sxm", "fp8", "measured=2026-03-27") \
        .max_cudagraph_capture_size is None


def _engine_args(*argv: str):
    parser, _ = build_parser()
    return engine_args_from_cli(parser.parse_args(list(argv)))


@needs_aic
@pytest.mark.parametrize("command", ["serve", "play", "simulate"])
def test_serve_play_and_simulate_take_vllms_graph_flags(command):
    model = (LLAMA_8B,) if command != "play" else ("--model-name", LLAMA_8B)
    base = (command, *model, "--perf-model", "aic", "--max-num-seqs", "64", "--max-num-batched-tokens", "8192")
    default = _engine_args(*base).perf_model
    assert (default["cudagraph_capture_size"], default["cudagraph_mode"]) == (128, "FULL_AND_PIECEWISE")
    assert _engine_args(*base, "--gpu", "b200_sxm", "--max-num-seqs", "1024").perf_model["cudagraph_capture_size"] \
        == 1024
    assert _engine_args(*base, "--max-cudagraph-capture-size", "2048").perf_model["cudagraph_capture_size"] == 2048
    assert _engine_args(*base, "--cudagraph-capture-sizes", "1", "8", "32").perf_model["cudagraph_capture_size"] == 32
    cc = _engine_args(*base, "--compilation-config", '{"cudagraph_mode": "FULL_DECODE_ONLY"}').perf_model
    assert cc["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert _engine_args(*base, "--enforce-eager").perf_model["cudagraph_mode"] == "NONE"
    # the term is off unless asked for (docs/fidelity.md: version 7, not shipped): the steps priced
    # are version 6's, eager or not
    from vllm_vcr.perf.aic import AicTarget, eager_terms

    eager = _engine_args(*base, "--enforce-eager").perf_model
    assert eager["eager_layer_us"] == 0 and eager_terms(AicTarget(**eager)) == {}
    on = _engine_args(*base, "--enforce-eager", "--perf-eager-layer-us", "120").perf_model
    assert on["eager_layer_us"] == 120 and eager_terms(AicTarget(**on))["eager_step_ms"] > 0


@needs_aic
@pytest.mark.parametrize("command", ["serve", "simulate"])
@pytest.mark.parametrize("flag, value, field", [
    ("--compilation-config", '{"cudagraph_mode": "X"}', "cudagraph_mode"),
    ("--compilation-config", '{"cudagraph_capture_sizes": 5}', "cudagraph_capture_sizes"),
    ("--compilation-config", '{"max_cudagraph_capture_size": "x"}', "max_cudagraph_capture_size"),
    ("--quantization-config", "{x", "invalid JSON")])
def test_a_bad_graph_mode_is_a_one_line_error_naming_the_flag(command, flag, value, field, capsys):
    """(serve's own vLLM option table refuses invalid JSON as it parses, with argparse's exit 2)"""
    from vllm_vcr.cli import main

    try:
        code = main([command, LLAMA_8B, "--perf-model", "aic", flag, value])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and flag in err[-1] and field in err[-1]


@needs_aic
def test_a_prefill_above_the_capture_size_lengthens_ttft_on_the_virtual_clock():
    """A closed loop whose prefills (1024 tokens) exceed a capture size of 512: each request's
    prefill step runs without graphs, and its TTFT grows by about the term per such step; with
    a capture size of 2048 nothing changes."""
    from vllm_vcr.engine.config import EngineArgs, EngineConfig
    from vllm_vcr.perf.aic import AicTarget, with_capture_size
    from vllm_vcr.simulate.runner import simulate
    from vllm_vcr.simulate.workload import LengthDist, SyntheticWorkload

    def ttft_ms(layer_us: float, given: int) -> float:
        target = AicTarget(LLAMA_8B, "h100_sxm", frontend_ms_per_1k_tokens=0.0, frontend_ms_per_request=0.0,
                           eager_layer_us=layer_us).resolved().to_dict()
        target = with_capture_size(target, 64, 8192, given=given)
        args = EngineArgs(config=EngineConfig(max_num_seqs=64, max_num_batched_tokens=8192), perf_model=target,
                          kv_cache_size=20000, advertised_max_model_len=2048).validate()
        wl = SyntheticWorkload(num_requests=16, isl=LengthDist("fixed", 1024), osl=LengthDist("fixed", 32),
                               arrival="closed", concurrency=1)
        done = simulate(args, wl, concurrency=1).done
        return sum((r.first - r.arrival) * 1e3 for r in done) / len(done)

    base = ttft_ms(0.0, 512)
    # 32 layers x 250 µs = 8 ms on the one prefill step of each request (alone: no queueing)
    assert ttft_ms(250.0, 512) - base == pytest.approx(8.0, abs=0.5)
    assert ttft_ms(250.0, 2048) == pytest.approx(base)
