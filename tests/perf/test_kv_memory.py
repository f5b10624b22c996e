"""The KV cache a deployment gets: the dtype its checkpoint asks for, the weights vLLM loads."""

from __future__ import annotations

from dataclasses import replace

import pytest

from .conftest import needs_aic

pytestmark = needs_aic


def test_a_modelopt_checkpoint_asks_for_an_fp8_kv_cache_and_others_do_not():
    from vllm_vcr.perf.checkpoint import kv_cache_directive

    assert kv_cache_directive("nvidia/Kimi-K2.5-NVFP4") == "fp8"  # config.json kv_cache_scheme, 8-bit float
    assert kv_cache_directive("nvidia/Llama-3.1-70B-Instruct-FP8") == "fp8"  # hf_quant_config kv_cache_quant_algo
    assert kv_cache_directive("moonshotai/Kimi-K2.5") is None
    assert kv_cache_directive("Qwen/Qwen3-32B") is None
    assert kv_cache_directive("no/such-model") is None


def test_auto_takes_the_checkpoints_kv_dtype_and_an_explicit_flag_wins():
    from vllm_vcr.perf.aic import AicTarget

    assert AicTarget(model="nvidia/Kimi-K2.5-NVFP4", gpu="b200_sxm").resolved().kv_cache_quant == "fp8"
    assert AicTarget(model="nvidia/Kimi-K2.5-NVFP4", kv_cache_quant="bfloat16").resolved().kv_cache_quant == "bfloat16"
    assert AicTarget(model="Qwen/Qwen3-32B").resolved().kv_cache_quant is None


def test_the_kv_dtype_flag_maps_onto_the_perf_model():
    import argparse

    from vllm_vcr.perf.cli import _kv_dtype

    def kv(v):
        return _kv_dtype(argparse.Namespace(kv_cache_dtype=v))

    assert (kv("fp8_e4m3"), kv("bfloat16"), kv("auto"), kv(None)) == ("fp8", "bfloat16", None, None)


def _kimi_row(**kw):
    from vllm_vcr.simulate.silicon import vllm_agg_rows

    row = next(r for r in vllm_agg_rows() if r.id == "kimik2_5_b200_vllm_fp4_agg_1024x8192_c4_cfg635")
    return replace(row, **kw)


def test_a_silicon_row_runs_its_checkpoints_kv_dtype_from_the_vllm_that_resolves_auto():
    row = _kimi_row()  # kimik2.5_fp4_b200.sh of 2026-03-27: no --kv-cache-dtype
    assert not row.server.kv_cache_fp8 and row.checkpoint == "nvidia/Kimi-K2.5-NVFP4"
    assert row.kv_cache_quant == "fp8" and row.target().kv_cache_quant == "fp8"
    assert _kimi_row(backend_version="0.12.0").kv_cache_quant == "bfloat16"  # before vLLM resolved `auto`
    from vllm_vcr.simulate.silicon import vllm_agg_rows

    llama = next(r for r in vllm_agg_rows() if r.model == "nvidia/Llama-3.1-8B-Instruct-FP8")
    assert llama.kv_cache_quant == "bfloat16" and llama.target().kv_cache_quant is None


def test_the_weights_are_those_vllm_loads_on_a_rank():
    from vllm_vcr.perf.aic import AicTarget
    from vllm_vcr.perf.kv_sizing import weights_correction

    gib = 1 << 30
    kimi = AicTarget(model="moonshotai/Kimi-K2.5", gpu="b200_sxm", tensor_parallel_size=4, gemm_quant="nvfp4",
                     moe_quant="nvfp4").resolved()
    embedding = 163840 * 7168 * 2
    moe = 61 * 2.215 * gib  # the estimator's count: an MoE in each of the 61 layers
    delta = weights_correction(kimi, {"context_embedding": embedding, "context_moe": moe})
    dense = 3 * 7168 * 18432 * (2.215 * gib / (384 * 3 * 7168 * 2048 / 4)) / 4
    assert delta == pytest.approx(-embedding * 3 / 4 - (2.215 * gib - dense))
    # an embedding the estimator already shards, a model without dense layers: nothing to correct
    assert weights_correction(kimi, {"context_embedding": embedding / 4, "context_moe": 0.0}) == 0.0
    llama = AicTarget(model="meta-llama/Llama-3.1-70B", gpu="h200_sxm", tensor_parallel_size=8).resolved()
    assert weights_correction(llama, {"context_embedding": 128256 * 8192 * 2}) == 0.0


def test_kimi_at_tp4_on_b200_holds_the_kv_its_measured_runs_needed():
    """64 users of 1024/8192 tokens (half a million tokens in the first wave) ran without
    queueing: the FP8 latent cache of the weights vLLM loads holds them."""
    from vllm_vcr.perf.kv_sizing import estimate_kv_capacity

    row = _kimi_row()
    cap = estimate_kv_capacity(row.target().resolved(), block_size=16, gpu_memory_utilization=0.9,
                               max_num_batched_tokens=8192, max_num_seqs=64)
    assert cap.bytes_per_token == (512 + 64) * 61  # the compressed latent, one byte each
    assert cap.tokens > 64 * (1024 + 0.8 * 8192)


def test_kimis_own_int4_checkpoint_is_priced_as_int4_experts_and_bf16_gemms():
    from vllm_vcr.simulate.silicon import supported, vllm_agg_rows

    rows = [r for r in vllm_agg_rows() if r.precision_label == "int4_wo"]
    assert rows and {(r.gemm_quant, r.moe_quant) for r in rows} == {(None, "int4_wo")}
    assert supported(rows[0]) is None  # the estimator has no int4 GEMM tables; the checkpoint has no int4 GEMMs
    nvfp4 = [r for r in vllm_agg_rows() if r.model == "moonshotai/Kimi-K2.5" and r.precision_label == "nvfp4"]
    assert {(r.gemm_quant, r.moe_quant) for r in nvfp4} == {("nvfp4", "nvfp4")}  # NVIDIA's checkpoint


def test_int4_experts_carry_their_group_scales():
    from vllm_vcr.perf.aic import AicTarget
    from vllm_vcr.perf.kv_sizing import weights_correction

    t = AicTarget(model="moonshotai/Kimi-K2.5", gpu="h200_sxm", tensor_parallel_size=8, gemm_quant=None,
                  moe_quant="int4_wo").resolved()
    moe = 61 * 1.0
    delta = weights_correction(t, {"context_embedding": 0.0, "context_moe": moe})
    dense = 3 * 7168 * 18432 * (1.0 / (384 * 3 * 7168 * 2048 / 8)) / 8
    assert delta == pytest.approx(-(1.0 - dense) + 60 * (2 / 32) / 0.5)


def test_sglangs_static_fraction_holds_the_weights_and_the_kv_pool_not_the_activations(monkeypatch):
    """SGLang's KV pool (`ModelRunner.profile_max_num_token`) is what is free after loading less
    `(1 - mem_fraction_static)` of the GPU: the fraction holds the weights, the runtime and the pool,
    and the activations live in the rest. vLLM's pool is its utilization share less weights,
    runtime and the profiled activations. So a deployment SGLang runs with a small pool (Qwen3-32B
    in BF16 on one H100 at SGLang's default 0.83) has one, where taking the activations out of the
    fraction too leaves none."""
    from vllm_vcr.perf import kv_sizing
    from vllm_vcr.perf.aic import AicTarget

    monkeypatch.setenv("VLLM_VCR_PERF_CACHE", "0")
    kw = dict(block_size=16, gpu_memory_utilization=0.83, max_num_batched_tokens=8192, max_num_seqs=256)
    sglang = AicTarget(model="Qwen/Qwen3-32B", gpu="h100_sxm", tensor_parallel_size=2, backend="sglang")
    est = kv_sizing._estimate(sglang.resolved(), 8192, 256, 0.83)
    m = est["memory_breakdown"]
    assert m["activations_bytes"] > 1 << 30
    pool = 0.83 * est["total_gpu_capacity_bytes"] - m["weights_bytes"] - m["runtime_overhead_bytes"] \
        - m["comm_overhead_bytes"]
    cap = kv_sizing.estimate_kv_capacity(sglang, **kw)
    assert abs(cap.tokens * cap.bytes_per_token - pool) < 2 * cap.bytes_per_token
    one_gpu = replace(sglang, tensor_parallel_size=1)
    assert kv_sizing.estimate_kv_capacity(one_gpu, **kw).tokens > 0
    m = kv_sizing._estimate(one_gpu.resolved(), 8192, 256, 0.83)["memory_breakdown"]
    assert 0.83 * est["total_gpu_capacity_bytes"] < sum(m.values())  # (with the activations taken out too: none)
