"""What a checkpoint's own quantisation config tells vLLM beyond its weights: the KV cache dtype.

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
