"""The attention's QK norm, which the estimator's op list lacks, in the perf model: a GPU cost per
QK-normed layer and step (Qwen3, MiniMax-M2, ...), plus a per-layer all-reduce where the norm
spans the TP ranks (MiniMax-M2 at TP > 1); the same in `serve`, `play` and `simulate`."""

from __future__ import annotations

import pytest

from vllm_vcr.cli import build_parser
from vllm_vcr.engine.latency import StepBatch
from vllm_vcr.engine.latency.aic import AicStepLatency, StepPricer
from vllm_vcr.engine_cli import engine_args_from_cli

from .conftest import LLAMA_8B, needs_aic


class _Kernels:
    def decode_step_latency(self, batch: int, ctx: int, beam: int) -> float:
        return 4.0 + 0.1 * batch


def test_the_unpriced_gpu_time_is_in_every_step_with_tokens_and_hides_no_host_time():
    lat = AicStepLatency(StepPricer(_Kernels()), unpriced_gpu_ms=1.2, step_overhead_ms=3.0,
                         async_scheduling=True, async_exposed_ms=0.1)
    assert lat.step_ms(StepBatch(10, 0, 0, 0, 5120)) == pytest.approx(5.0 + 1.2 + 0.1)
    slow_host = AicStepLatency(StepPricer(_Kernels()), unpriced_gpu_ms=1.2, step_overhead_ms=9.0,
                               async_scheduling=True, async_exposed_ms=0.1)
    assert slow_host.step_ms(StepBatch(10, 0, 0, 0, 5120)) == pytest.approx(9.0 + 0.1)  # GPU still shorter
    sync = AicStepLatency(StepPricer(_Kernels()), unpriced_gpu_ms=1.2, step_overhead_ms=3.0)
    assert sync.step_ms(StepBatch(10, 0, 0, 0, 5120)) == pytest.approx(5.0 + 1.2 + 3.0)
    assert sync.step_ms(StepBatch(0, 0, 0, 0, 0)) == pytest.approx(3.0)  # nothing on the GPU


def test_which_layers_have_a_qk_norm():
    from vllm_vcr.perf.qk_norm import qk_norm_layers

    assert qk_norm_layers({"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 64}) == (64, False)
    minimax = {"architectures": ["MiniMaxM2ForCausalLM"], "use_qk_norm": True, "qk_norm_type": "per_layer",
               "num_hidden_layers": 62}
    assert qk_norm_layers(minimax) == (62, True)
    assert qk_norm_layers({"text_config": {"use_qk_norm": True, "num_hidden_layers": 48}}) == (48, False)
    assert qk_norm_layers({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 80}) == (0, False)


@needs_aic
def test_the_bundled_models_qk_norm_cost():
    from vllm_vcr.perf.qk_norm import qk_norm_ms

    assert qk_norm_ms("MiniMaxAI/MiniMax-M2.5", 4, 20.0, 15.0) == pytest.approx(62 * 35e-3)
    assert qk_norm_ms("MiniMaxAI/MiniMax-M2.5", 1, 20.0, 15.0) == pytest.approx(62 * 20e-3)  # no TP group
    assert qk_norm_ms("Qwen/Qwen3-32B", 4, 20.0, 15.0) == pytest.approx(64 * 20e-3)  # per head: no all-reduce
    assert qk_norm_ms("meta-llama/Meta-Llama-3.1-70B", 4, 20.0, 15.0) == 0.0


@needs_aic
def test_a_qwen3_decode_step_pays_its_qk_norms_and_a_llama_step_does_not():
    from vllm_vcr.perf.aic import AicTarget, step_latency

    decode = StepBatch(8, 0, 0, 0, 8 * 1024)

    def ms(model: str, qk_us: float) -> float:
        return step_latency(AicTarget(model, "h100_sxm", tensor_parallel_size=2, step_overhead_ms=0.0,
                                      per_seq_overhead_ms=0.0, qk_norm_us=qk_us)).step_ms(decode)

    assert ms("Qwen/Qwen3-32B", 20.0) - ms("Qwen/Qwen3-32B", 0.0) == pytest.approx(64 * 0.020)
    assert ms(LLAMA_8B, 20.0) == pytest.approx(ms(LLAMA_8B, 0.0))


@needs_aic
@pytest.mark.parametrize("command", [["serve", LLAMA_8B], ["play", "--model-name", LLAMA_8B],
                                     ["simulate", LLAMA_8B]])
def test_the_flags_reach_the_perf_model_in_every_command(command):
    from vllm_vcr.perf.aic import DEFAULT_QK_NORM_ALLREDUCE_US, DEFAULT_QK_NORM_US
    from vllm_vcr.perf.cli import perf_target

    parser, _ = build_parser()
    default = perf_target(parser.parse_args([*command, "--perf-model", "aic"]))
    given = perf_target(parser.parse_args([*command, "--perf-model", "aic", "--perf-qk-norm-us", "7",
                                           "--perf-qk-norm-allreduce-us", "3.5"]))
    assert (default["qk_norm_us"], default["qk_norm_allreduce_us"]) == (DEFAULT_QK_NORM_US,
                                                                        DEFAULT_QK_NORM_ALLREDUCE_US)
    assert (given["qk_norm_us"], given["qk_norm_allreduce_us"]) == (7.0, 3.5)
    if command[0] != "simulate":
        assert engine_args_from_cli(parser.parse_args([*command, "--perf-model", "aic", "--perf-qk-norm-us",
                                                       "7"])).perf_model["qk_norm_us"] == 7.0
