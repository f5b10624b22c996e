"""The KV cache's size in blocks, as vLLM sizes it on the simulated GPU.

vLLM profiles the GPU at start-up: of `gpu_memory_utilization` × total memory, what the weights,
the peak activations of a `max_num_batched_tokens` forward pass and the runtime (CUDA graphs,
NCCL, allocator) do not take is the KV cache, divided into blocks of `block_size` tokens of the
model's per-token KV bytes (per rank: KV heads split by tensor parallelism). The estimator's
memory model (`aiconfigurator_core.sdk.memory`) computes those terms from the same measured
system data as its kernels.

Its weights are corrected where its model of a DeepSeek-style (MLA) checkpoint counts what vLLM
does not load on a rank (`weights_correction`): the input embedding whole on every rank, where
vLLM's `VocabParallelEmbedding` shards it over tensor parallelism, and experts in every layer,
where the checkpoint's first `first_k_dense_replace` layers are dense MLPs; and int4 experts'
group scales, which it leaves out. For Kimi-K2.5 in NVFP4 at TP 4 that is 3.8 GiB per GPU less,
116k more FP8 KV tokens; in its own int4 checkpoint at TP 8, 4.5 GiB more.

SGLang divides the memory another way (`ModelRunner.profile_max_num_token`): the KV pool is what
is free after the weights are loaded less `(1 - mem_fraction_static)` × total memory, so
`mem_fraction_static` × total holds the weights, the runtime already allocated and the KV pool,
and the activations and CUDA graphs of the forward passes live in the rest (SGLang's own default
fraction reserves room for them, `simulate/silicon_beyond.py` `sglang_server_defaults`). For the
`sglang` backend the activations are not taken out of the fraction a second time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .aic import AicTarget
from .catalog import configure_data_roots, import_aic
from .qk_norm import bundled_config
from .errors import PerfModelError
from .sdk_lean import import_memory
from .spec_cache import load_or_compute


@dataclass(frozen=True)
class KVCapacity:
    num_blocks: int
    tokens: int
    bytes_per_token: int
    gpu_bytes: int
    weights_bytes: int


def estimate_kv_capacity(target: AicTarget, *, block_size: int, gpu_memory_utilization: float,
                         max_num_batched_tokens: int, max_num_seqs: int) -> KVCapacity:
    """KV blocks one engine (one DP rank) gets on `target.gpu`."""
    if not 0 < gpu_memory_utilization <= 1:
        raise PerfModelError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    t = target.resolved()
    import_aic()
    configure_data_roots()
    quiet = logging.getLogger("aiconfigurator_core")
    level, quiet.level = quiet.level, logging.ERROR
    call = dict(model=t.model, gpu=t.gpu, backend=t.backend, version=t.backend_version or "current",
                max_num_tokens=max_num_batched_tokens, max_batch_size=max_num_seqs,
                memory_fraction_value=gpu_memory_utilization, weights="vllm-loaded-2", **t.compile_kwargs(),
                **({"static_fraction": "weights+kv"} if t.backend == "sglang" else {}))
    try:
        est = load_or_compute("kv-estimate", call, lambda: _json_safe(_estimate(
            t, max_num_batched_tokens, max_num_seqs, gpu_memory_utilization)))
    except Exception as e:
        raise PerfModelError(f"--perf-model aic: cannot size the KV cache of {t.model} on {t.gpu} "
                             f"(tp={t.tensor_parallel_size}): {str(e).splitlines()[0][:300]}; "
                             f"give --num-gpu-blocks-override") from None
    finally:
        quiet.level = level
    tokens = int(est["total_kv_size_tokens"])
    if tokens < block_size:
        raise PerfModelError(f"--gpu-memory-utilization {gpu_memory_utilization}: no memory left for the KV cache "
                             f"of {t.model} on {t.gpu} with tp={t.tensor_parallel_size}")
    breakdown = est.get("memory_breakdown") or {}
    return KVCapacity(num_blocks=tokens // block_size, tokens=tokens,
                      bytes_per_token=int(est["kv_size_per_token_bytes"]),
                      gpu_bytes=int(est["total_gpu_capacity_bytes"]),
                      weights_bytes=int(breakdown.get("weights_bytes", 0)))


def _estimate(t: AicTarget, max_num_batched_tokens: int, max_num_seqs: int, fraction: float) -> dict:
    """The estimator's KV estimate (`estimate_kv_cache`'s native path) with the weights vLLM loads."""
    KVCacheEstimator = import_memory().KVCacheEstimator  # (without pandas: perf/sdk_lean.py)

    kw = t.compile_kwargs()
    est = KVCacheEstimator.from_request(
        t.model, t.gpu, t.backend, t.backend_version or "current", max_num_tokens=max_num_batched_tokens,
        max_batch_size=max_num_seqs, tp_size=kw["tp_size"], attention_dp_size=kw["attention_dp_size"],
        moe_tp_size=kw["moe_tp_size"], moe_ep_size=kw["moe_ep_size"], gemm_quant_mode=kw["gemm_quant_mode"],
        moe_quant_mode=kw["moe_quant_mode"], kvcache_quant_mode=kw["kvcache_quant_mode"])
    breakdown = dict(est.breakdown)
    delta = weights_correction(t, breakdown_model_ops(t))
    breakdown["weights_bytes"] += delta
    breakdown["non_kv_bytes"] += delta
    if t.backend == "sglang":  # its static fraction holds weights, runtime and KV; activations are outside it
        breakdown["non_kv_bytes"] -= breakdown["activations_bytes"]
    return KVCacheEstimator(breakdown).estimate(is_of_free=False, fraction=fraction,
                                                gpu_memory_capacity_bytes_override=None)


def breakdown_model_ops(t: AicTarget) -> dict[str, float]:
    """Bytes per rank of the estimator's model's embedding and MoE ops, as it counts them."""
    from aiconfigurator_core.sdk.config_builders import build_model_config
    from aiconfigurator_core.sdk.models import get_model

    kw = t.compile_kwargs()
    cfg = build_model_config(tp_size=kw["tp_size"], pp_size=1, attention_dp_size=kw["attention_dp_size"],
                             moe_tp_size=kw["moe_tp_size"] or 1, moe_ep_size=kw["moe_ep_size"] or 1,
                             gemm_quant_mode=kw["gemm_quant_mode"], kvcache_quant_mode=kw["kvcache_quant_mode"],
                             fmha_quant_mode=None, moe_quant_mode=kw["moe_quant_mode"], comm_quant_mode=None)
    model = get_model(t.model, cfg, t.backend)
    ops: dict[str, float] = {}
    for op in model.context_ops:
        name = getattr(op, "_name", "")
        if name in ("context_embedding", "context_moe"):
            ops[name] = ops.get(name, 0.0) + float(op.get_weights())
    return ops


def weights_correction(t: AicTarget, ops: dict[str, float]) -> float:
    """Bytes per rank to add to the estimator's weights (negative: it counts more than vLLM loads).

    For a DeepSeek-style checkpoint (`first_k_dense_replace` in its config):
    - the input embedding, vocab x hidden x 2 bytes: vLLM shards it over the TP ranks; the
      estimator's op holds it whole on each;
    - the experts: the estimator counts one MoE layer per decoder layer; the checkpoint's first
      k layers carry a dense MLP (`intermediate_size`, sharded over TP) instead.
    For experts in int4 weight-only from a group-quantised checkpoint (compressed-tensors,
    `group_size` g, 16-bit scales): 2 / g bytes of scale per weight on top of the half byte the
    estimator counts (Kimi-K2.5, g = 32: an eighth more).
    Each is applied only where the estimator's count is the one it is checked against."""
    full = bundled_config(t.model)
    cfg = full.get("text_config") or full
    tp = max(t.tensor_parallel_size, 1)
    delta = 0.0
    moe = ops.get("context_moe", 0.0)
    k = int(cfg.get("first_k_dense_replace") or 0)
    hidden, layers = int(cfg.get("hidden_size") or 0), int(cfg.get("num_hidden_layers") or 0)
    if k:
        whole = int(cfg["vocab_size"]) * hidden * 2
        emb = ops.get("context_embedding", 0.0)
        if tp > 1 and abs(emb - whole) <= 0.01 * whole:
            delta -= whole * (1 - 1 / tp)
        experts, width = int(cfg.get("n_routed_experts") or 0), int(cfg.get("moe_intermediate_size") or 0)
        if moe > 0 and experts and width and 0 < k < layers:
            per_layer = moe / layers
            per_param = per_layer / (experts * 3 * hidden * width) * ((t.moe_tp_size or 1) * (t.moe_ep_size or 1))
            dense = 3 * hidden * int(cfg.get("intermediate_size") or 0) * per_param / tp
            delta -= k * (per_layer - dense)
            moe -= k * per_layer
    group = _int4_group_size(full.get("quantization_config") or cfg.get("quantization_config") or {})
    if t.moe_quant == "int4_wo" and group and moe > 0 and _estimator_int4_bytes() == 0.5:
        delta += moe * (2 / group) / 0.5
    return delta


def _int4_group_size(qcfg: dict) -> int | None:
    """The group size of a compressed-tensors checkpoint's 4-bit integer weights, if that is what it is."""
    if qcfg.get("quant_method") != "compressed-tensors":
        return None
    for g in (qcfg.get("config_groups") or {}).values():
        w = g.get("weights") or {}
        if w.get("num_bits") == 4 and w.get("type") == "int" and w.get("group_size"):
            return int(w["group_size"])
    return None


def _estimator_int4_bytes() -> float:
    from aiconfigurator_core.sdk.common import MoEQuantMode

    return float(MoEQuantMode.int4_wo.value.memory)


def _json_safe(est: dict) -> dict:
    """The estimate's numbers this module reads, as plain JSON values (kept by spec_cache.py)."""
    breakdown = est.get("memory_breakdown") or {}
    return {"total_kv_size_tokens": int(est["total_kv_size_tokens"]),
            "kv_size_per_token_bytes": int(est["kv_size_per_token_bytes"]),
            "total_gpu_capacity_bytes": int(est["total_gpu_capacity_bytes"]),
            "memory_breakdown": {"weights_bytes": int(breakdown.get("weights_bytes", 0))}}
