"""`--perf-model aic` through the command lines: serve (a real server and client), play's flags,
the KV size vLLM would get, clear errors."""

from __future__ import annotations

import importlib

import httpx
import pytest

from vllm_vcr.cli import build_parser
from vllm_vcr.engine_cli import engine_args_from_cli
from vllm_vcr.perf.errors import PerfModelError

from .conftest import LLAMA_8B, needs_aic


def _engine_args(*argv: str):
    parser, _ = build_parser()
    return engine_args_from_cli(parser.parse_args(list(argv)))


def test_missing_extra_says_how_to_install_it(monkeypatch):
    from vllm_vcr.perf import catalog

    real = importlib.import_module

    def no_aic(name, *a, **kw):
        if name == "aiconfigurator_core":
            raise ImportError("No module named 'aiconfigurator_core'")
        return real(name, *a, **kw)

    monkeypatch.setattr(catalog.importlib, "import_module", no_aic)
    with pytest.raises(PerfModelError, match=r"pip install 'vllm-vcr\[aic\]'"):
        _engine_args("serve", LLAMA_8B, "--perf-model", "aic")


def test_without_the_perf_model_the_gpu_flags_stay_ignored():
    args = _engine_args("serve", LLAMA_8B, "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.5")
    assert args.perf_model is None and args.kv_cache_size == 1024


@needs_aic
def test_kv_cache_is_sized_from_the_gpu_as_vllm_would():
    from vllm_vcr.perf.aic import AicTarget
    from vllm_vcr.perf.kv_sizing import estimate_kv_capacity

    base = _engine_args("serve", LLAMA_8B, "--perf-model", "aic", "--gpu", "h100_sxm")
    cap = estimate_kv_capacity(AicTarget(LLAMA_8B, "h100_sxm"), block_size=16, gpu_memory_utilization=0.9,
                               max_num_batched_tokens=base.config.max_num_batched_tokens,
                               max_num_seqs=base.config.max_num_seqs)
    assert base.kv_cache_size == cap.num_blocks
    # 80 GiB × 0.9 less 16 GB of bf16 weights and the runtime: ~400k tokens of 128 KiB
    assert 350_000 < cap.tokens < 500_000 and cap.bytes_per_token == 128 * 1024
    half = _engine_args("serve", LLAMA_8B, "--perf-model", "aic", "--gpu-memory-utilization", "0.5")
    tp2 = _engine_args("serve", LLAMA_8B, "--perf-model", "aic", "-tp", "2")
    assert half.kv_cache_size < base.kv_cache_size < tp2.kv_cache_size
    fixed = _engine_args("serve", LLAMA_8B, "--perf-model", "aic", "--num-gpu-blocks-override", "777")
    assert fixed.kv_cache_size == 777


@needs_aic
@pytest.mark.parametrize("command", ["serve", "play"])
def test_a_decode_workers_kv_pulls_move_the_models_bytes_per_token(command):
    """With the perf model a P/D worker's KV pull is the model's KV bytes per token on one GPU
    (Llama-3.1-8B: 128 KiB at TP 1, half at TP 2), unless --kv-bytes-per-token says otherwise."""
    decode = ("--perf-model", "aic", "--gpu", "h100_sxm", "--worker-type", "decode", "--kv-cache-size", "500")
    assert _engine_args(command, LLAMA_8B, *decode).kv_bytes_per_token == 128 * 1024
    assert _engine_args(command, LLAMA_8B, *decode, "-tp", "2").kv_bytes_per_token == 64 * 1024
    assert _engine_args(command, LLAMA_8B, *decode, "--kv-bytes-per-token", "777").kv_bytes_per_token == 777
    assert _engine_args(command, LLAMA_8B, "--worker-type", "decode").kv_bytes_per_token == 131072  # (no perf model)


@needs_aic
def test_dynamo_mocker_flag_names_are_aliases():
    a = _engine_args("serve", "--aic-perf-model", "--aic-model-path", LLAMA_8B, "--aic-system", "h200_sxm",
                     "--aic-tp-size", "2", "--aic-backend", "vllm")
    assert a.perf_model["gpu"] == "h200_sxm" and a.perf_model["tensor_parallel_size"] == 2
    assert a.perf_model["model"] == "meta-llama/Meta-Llama-3.1-8B"


@needs_aic
def test_play_takes_the_same_flags():
    a = _engine_args("play", "--model-name", LLAMA_8B, "--perf-model", "aic", "--gpu", "a100_sxm",
                     "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.8")
    assert a.perf_model["gpu"] == "a100_sxm" and a.perf_model["tensor_parallel_size"] == 2
    assert a.kv_cache_size > 1024


@needs_aic
@pytest.mark.parametrize("argv, says", [
    (("--gpu", "h999"), "supported GPUs for vllm: a100_sxm"),
    (("--perf-model-path", "acme/NoSuchModel-7B"), "supported models:"),
    (("--time-to-first-token", "100"), "cannot be combined with --time-to-first-token"),
])
def test_unsupported_choices_are_clear_cli_errors(argv, says, capsys):
    from vllm_vcr.cli import main

    assert main(["serve", LLAMA_8B, "--perf-model", "aic", *argv]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "play", "simulate"])
@pytest.mark.parametrize("flag", ["--perf-step-overhead-ms", "--perf-async-exposed-ms", "--perf-qk-norm-us",
                                  "--perf-qk-norm-allreduce-us"])
def test_a_negative_step_time_is_a_cli_error_naming_the_flag(command, flag, capsys):
    from vllm_vcr.cli import main

    with pytest.raises(SystemExit) as e:
        main([command, "--perf-model", "aic", flag, "-5"])
    assert e.value.code == 2
    assert f"argument {flag}: must be >= 0.0, got -5.0" in capsys.readouterr().err


@needs_aic
def test_serve_paces_with_the_perf_model_and_refuses_latency_patches(serve_process, serve_harness):
    from openai import OpenAI

    control = f"127.0.0.1:{serve_harness.free_port()}"
    srv = serve_process(LLAMA_8B, "--perf-model", "aic", "--gpu", "h100_sxm", "--time-scale", "10",
                        "--control-address", control, wait=False).wait_ready(90)
    client = OpenAI(base_url=srv.url + "/v1", api_key="none")
    stream = client.completions.create(model=LLAMA_8B, prompt="hello " * 200, max_tokens=8, stream=True)
    chunks = [c for c in stream if c.choices and c.choices[0].text]
    assert chunks
    r = httpx.patch(f"http://{control}/config", json={"inter_token_latency": 5})
    assert r.status_code == 409, r.text
    assert httpx.patch(f"http://{control}/config", json={"max_num_seqs": 64}).status_code == 200
    metrics = httpx.get(srv.url + "/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("vllm:cache_config_info"))
    blocks = int(line.split('num_gpu_blocks="')[1].split('"')[0])
    assert blocks > 20_000


@needs_aic
def test_step_overhead_flag_sets_the_host_time_per_step():
    default = _engine_args("serve", LLAMA_8B, "--perf-model", "aic")
    set_ = _engine_args("serve", LLAMA_8B, "--perf-model", "aic", "--perf-step-overhead-ms", "0.5")
    assert set_.perf_model["step_overhead_ms"] == 0.5 and default.perf_model["step_overhead_ms"] != 0.5


@needs_aic
@pytest.mark.parametrize("command", ["serve", "play"])
def test_an_moe_model_starts_with_tp_alone_as_vllm_lays_out_its_experts(command):
    model = ("Qwen/Qwen3-30B-A3B",) if command == "serve" else ("--model-name", "Qwen/Qwen3-30B-A3B")
    plain = _engine_args(command, *model, "--perf-model", "aic", "-tp", "4", "--gpu", "h200_sxm")
    assert (plain.perf_model["moe_tp_size"], plain.perf_model["moe_ep_size"]) == (4, 1)  # experts sharded
    ep = _engine_args(command, *model, "--perf-model", "aic", "-tp", "4", "--gpu", "h200_sxm",
                      "--enable-expert-parallel")
    assert (ep.perf_model["moe_tp_size"], ep.perf_model["moe_ep_size"]) == (1, 4)  # experts whole, spread
    dense = _engine_args(command, *(model[:-1] + (LLAMA_8B,)), "--perf-model", "aic", "-tp", "2")
    assert dense.perf_model["moe_tp_size"] is None  # a dense model has no expert layout


@needs_aic
@pytest.mark.parametrize("command", ["serve", "simulate"])
def test_a_block_fp8_moe_model_starts_with_tp_8_alone(command):
    """vLLM (from its block-shape refinement) shards a [128, 128]-block FP8 checkpoint's experts
    over 8 ranks even where a rank's width (Qwen3-235B-A22B: 1536 / 8 = 192) is not a whole
    block; the estimator has no tables at that block, so its per-tensor FP8 ones price it (as the
    validation's rows of that layout are priced), and `-tp 8` alone starts."""
    from vllm_vcr.perf.aic import AicTarget, compile_target
    from vllm_vcr.perf.cli import perf_target

    parser, _ = build_parser()
    ns = parser.parse_args([command, "Qwen/Qwen3-235B-A22B-FP8", "--perf-model", "aic", "-tp", "8",
                            "--gpu", "h200_sxm"])
    target = AicTarget.from_dict(perf_target(ns)).resolved()
    assert (target.moe_tp_size, target.gemm_quant, target.moe_quant) == (8, "fp8", "fp8")
    assert compile_target(target).decode_step_latency(8, 1024, 2) > 0
    # where a rank holds whole blocks, the block-scaled tables price it on Hopper
    tp4 = AicTarget("Qwen/Qwen3-235B-A22B-FP8", "h200_sxm", tensor_parallel_size=4).resolved()
    assert (tp4.gemm_quant, tp4.moe_quant) == ("fp8_block", "fp8_block")
    b200 = AicTarget("MiniMaxAI/MiniMax-M2.5", "b200_sxm", tensor_parallel_size=4).resolved()
    assert (b200.gemm_quant, b200.moe_quant) == ("fp8", "fp8_block")  # Blackwell: per-tensor GEMM tables
    oss = AicTarget("openai/gpt-oss-120b", "h200_sxm", tensor_parallel_size=8).resolved()
    assert (oss.gemm_quant, oss.moe_quant) == (None, "w4a16_mxfp4")
    given = AicTarget("Qwen/Qwen3-235B-A22B-FP8", "h200_sxm", tensor_parallel_size=4, gemm_quant="fp8").resolved()
    assert given.gemm_quant == "fp8" and given.moe_quant is None  # a quantisation given is kept


@needs_aic
def test_the_frontend_time_is_part_of_the_model_serve_runs():
    from vllm_vcr.perf.aic import DEFAULT_FRONTEND_MS, DEFAULT_FRONTEND_MS_PER_1K_TOKENS

    default = _engine_args("serve", LLAMA_8B, "--perf-model", "aic")
    assert default.perf_model["frontend_ms"] == DEFAULT_FRONTEND_MS
    assert default.perf_model["frontend_ms_per_1k_tokens"] == DEFAULT_FRONTEND_MS_PER_1K_TOKENS
    set_ = _engine_args("serve", LLAMA_8B, "--perf-model", "aic", "--perf-frontend-ms", "0",
                        "--perf-frontend-ms-per-1k-tokens", "0", "--perf-frontend-ms-per-request", "0")
    assert (set_.perf_model["frontend_ms"], set_.perf_model["frontend_ms_per_request"]) == (0.0, 0.0)


@needs_aic
@pytest.mark.parametrize("command", ["serve", "play", "simulate"])
def test_mxfp8_moe_activations_price_the_mxfp4_x_mxfp8_kernels_on_blackwell(command):
    """`--quantization-config '{"moe": {"activation": "mxfp8"}}'` (vLLM's MXFP4 x MXFP8 MoE kernels;
    InferenceX's gpt-oss B200 runs set the environment variable older vLLMs read for it) prices
    gpt-oss's experts from `w4a8_mxfp4_mxfp8` tables on Blackwell, where they are faster than the
    default BF16-input kernels; on Hopper no backend has it and the default serves."""
    from vllm_vcr.perf.aic import AicTarget, compile_target

    model = ("openai/gpt-oss-120b",) if command != "play" else ("--model-name", "openai/gpt-oss-120b")
    qc = ("--quantization-config", '{"moe": {"activation": "mxfp8"}}')
    mx = _engine_args(command, *model, "--perf-model", "aic", "--gpu", "b200_sxm", "-tp", "2", *qc)
    plain = _engine_args(command, *model, "--perf-model", "aic", "--gpu", "b200_sxm", "-tp", "2")
    assert (mx.perf_model["moe_quant"], plain.perf_model["moe_quant"]) == ("w4a8_mxfp4_mxfp8", "w4a16_mxfp4")
    hopper = _engine_args(command, *model, "--perf-model", "aic", "--gpu", "h200_sxm", "-tp", "2", *qc)
    assert hopper.perf_model["moe_quant"] == "w4a16_mxfp4"
    fast, slow = (compile_target(AicTarget.from_dict(a.perf_model)) for a in (mx, plain))
    assert fast.decode_step_latency(128, 4096, 2) < 0.85 * slow.decode_step_latency(128, 4096, 2)
    assert fast.mixed_step_breakdown(8192, 0, 8192, 2, 0)[0] < 0.7 * slow.mixed_step_breakdown(8192, 0, 8192, 2, 0)[0]
