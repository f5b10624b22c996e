"""GPU work the estimator's kernel data leaves out: the QK norm of the attention.

The estimator prices a layer as its GEMMs, attention, the norms around the blocks, the MoE and
the TP all-reduces; some attentions also normalise the query and key before RoPE, and that has
no entry in its op list. In vLLM's model code:

- Qwen3 (dense, MoE, VL) and configs with `use_qk_norm` (Qwen3-Coder, Llama-4, MiniMax-M3)
  normalise each head: an RMSNorm over `head_dim` of q and of k, every layer;
- MiniMax-M2 (`qk_norm_type: per_layer`) normalises the whole query and key, whose heads are
  split over the TP ranks: each rank's partial variance is summed over the TP group (vLLM's
  `MiniMaxText01RMSNormTP`), one more all-reduce per layer when TP > 1.

At decode these are fixed-latency kernels: a cost per layer and step, not per token. Their two
global constants (µs per QK-normed layer, µs per cross-rank QK-norm all-reduce) are fitted on
the training split of the silicon validation (docs/fidelity.md).
"""

from __future__ import annotations

import functools
import json

from .catalog import package_root

_PER_HEAD_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3VLForConditionalGeneration",
                           "Qwen3VLMoeForConditionalGeneration")


@functools.lru_cache(maxsize=64)
def bundled_config(model: str) -> dict:
    """The estimator's bundled HF config of a bundled model name (`org/name`), {} if none."""
    path = package_root() / "model_configs" / f"{model.replace('/', '--', 1)}_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def qk_norm_layers(config: dict) -> tuple[int, bool]:
    """(layers whose attention has a QK norm, whether that norm spans the TP ranks)."""
    cfg = config.get("text_config") or config
    archs = config.get("architectures") or cfg.get("architectures") or []
    if not (cfg.get("use_qk_norm") or any(a in _PER_HEAD_ARCHITECTURES for a in archs)):
        return 0, False
    return int(cfg.get("num_hidden_layers") or 0), cfg.get("qk_norm_type") == "per_layer"


def qk_norm_ms(model: str, tensor_parallel_size: int, norm_us: float, allreduce_us: float) -> float:
    """GPU time per step of the model's QK norms (`model`: a bundled name)."""
    layers, spans_tp = qk_norm_layers(bundled_config(model))
    return layers * (norm_us + (allreduce_us if spans_tp and tensor_parallel_size > 1 else 0.0)) / 1e3
