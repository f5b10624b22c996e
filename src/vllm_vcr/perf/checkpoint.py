"""What a checkpoint's own quantisation config tells vLLM beyond its weights' label: the kernels
its layers run (`checkpoint_kernels`) and the KV cache dtype (`kv_cache_directive`).

With `--kv-cache-dtype auto` (the default) vLLM stores the KV cache in the dtype the checkpoint
asks for, where it asks (vllm/utils/torch_utils.py `resolve_kv_cache_dtype_string`, from the
December 2025 releases, vllm-project/vllm#29980; llm-compressor checkpoints' `kv_cache_scheme`
earlier, in the attention layer): a ModelOpt checkpoint (NVIDIA's `*-FP8` / `*-NVFP4`) with
`kv_cache_quant_algo: FP8` in `hf_quant_config.json`, or a `kv_cache_scheme` of 8-bit floats in
its `config.json`, runs an FP8 KV cache without any flag. That halves the bytes per token and
doubles the tokens the cache holds, so it decides when a deployment preempts.
"""

from __future__ import annotations

import functools
import json

from .catalog import package_root

FP8_BLOCK = 128  # the weight block of block-scaled FP8 checkpoints (weight_block_size [128, 128])
HOPPER = ("h100_sxm", "h200_sxm")


def _read(model: str, suffix: str) -> dict:
    path = package_root() / "model_configs" / f"{model.replace('/', '--', 1)}_{suffix}.json"
    return json.loads(path.read_text()) if path.exists() else {}


@functools.lru_cache(maxsize=64)
def kv_cache_directive(model: str) -> str | None:
    """"fp8" when the bundled checkpoint `model` asks vLLM for an FP8 KV cache, else None."""
    for cfg in (_read(model, "hf_quant_config"), _read(model, "config").get("quantization_config") or {}):
        inner = cfg.get("quantization") if isinstance(cfg.get("quantization"), dict) else cfg
        algo = (inner.get("kv_cache_scheme") or cfg.get("kv_cache_scheme")
                or inner.get("kv_cache_quant_algo") or cfg.get("kv_cache_quant_algo"))
        if isinstance(algo, dict) and algo.get("type") == "float" and algo.get("num_bits") == 8:
            return "fp8"
        if isinstance(algo, str) and algo.lower().startswith("fp8"):
            return "fp8"
    return None


def _quant_config(model: str) -> dict:
    cfg = _read(model, "config")
    return cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config") or {}


def int4_experts_only(qcfg: dict) -> bool:
    """A compressed-tensors checkpoint of 4-bit integer weights that keeps its attention unquantised."""
    if qcfg.get("quant_method") != "compressed-tensors":
        return False
    groups = list((qcfg.get("config_groups") or {}).values())
    int4 = bool(groups) and all((g.get("weights") or {}).get("num_bits") == 4
                                and (g.get("weights") or {}).get("type") == "int" for g in groups)
    return int4 and any("self_attn" in str(i) for i in qcfg.get("ignore") or [])


@functools.lru_cache(maxsize=256)
def checkpoint_kernels(model: str, gpu: str, mlp_shards: int) -> tuple[str | None, str | None] | None:
    """(GEMM, MoE) quantisation modes of the estimator's kernels for what the bundled checkpoint
    `model` runs, where its quantisation config decides it (None: the estimator's own reading of
    the config). `mlp_shards`: the ranks one expert's (or the dense MLP's) width is split over.

    MXFP4 checkpoints (gpt-oss: attention and router in BF16) run MXFP4 experts with BF16
    activations: `w4a16_mxfp4` MoE, BF16 GEMMs. Int4 weight-only compressed-tensors checkpoints
    that leave attention and the dense and shared MLPs unquantised (Kimi-K2.5) run only the routed
    experts in int4: `int4_wo` MoE, BF16 GEMMs. Block-scaled FP8 checkpoints (`weight_block_size`)
    run vLLM's block-scaled kernels: the estimator's `fp8_block` tables where each rank's width is
    a multiple of the block (where it is not, vLLM refines the scales' block to fit the shard,
    which the estimator has no tables for: the per-tensor FP8 ones stand in). On Blackwell the
    GEMMs are priced from the per-tensor FP8 tables: the estimator's `fp8_block` GEMM tables
    there price a MiniMax-M2.5 decode step 3-4x slower than its per-tensor ones and than it was
    measured (docs/fidelity.md); its block-scaled MoE tables are in line with the per-tensor."""
    q = _quant_config(model)
    if q.get("quant_method") == "mxfp4":
        return None, "w4a16_mxfp4"
    if int4_experts_only(q):
        return None, "int4_wo"
    if q.get("quant_method") != "fp8" or "weight_block_size" not in q or _read(model, "hf_quant_config"):
        return None  # (a ModelOpt checkpoint's own config names its mixed precisions)
    cfg = _read(model, "config")
    cfg = cfg.get("text_config") or cfg
    width = cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0
    if width // max(mlp_shards, 1) % FP8_BLOCK:
        return "fp8", "fp8"
    return ("fp8_block" if gpu in HOPPER else "fp8"), "fp8_block"
