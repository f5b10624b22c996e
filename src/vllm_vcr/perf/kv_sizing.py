"""The KV cache's size in blocks, as vLLM sizes it on the simulated GPU.

vLLM profiles the GPU at start-up: of `gpu_memory_utilization` × total memory, what the weights,
the peak activations of a `max_num_batched_tokens` forward pass and the runtime (CUDA graphs,
NCCL, allocator) do not take is the KV cache, divided into blocks of `block_size` tokens of the
model's per-token KV bytes (per rank: KV heads split by tensor parallelism). The estimator's
memory model (`aiconfigurator_core.sdk.memory`) computes those terms from the same measured
system data as its kernels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .aic import AicTarget
from .catalog import configure_data_roots, import_aic
from .errors import PerfModelError
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
                memory_fraction_value=gpu_memory_utilization, **t.compile_kwargs())
    try:
        est = load_or_compute("kv-estimate", call, lambda: _json_safe(_estimator()(
            t.model, t.gpu, t.backend, t.backend_version or "current",
            max_num_tokens=max_num_batched_tokens, max_batch_size=max_num_seqs,
            memory_fraction_kind="of_total", memory_fraction_value=gpu_memory_utilization,
            **t.compile_kwargs())))
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


def _estimator():
    from aiconfigurator_core.sdk.memory import estimate_kv_cache  # (pandas: imported only when computing)

    return estimate_kv_cache


def _json_safe(est: dict) -> dict:
    """The estimate's numbers this module reads, as plain JSON values (kept by spec_cache.py)."""
    breakdown = est.get("memory_breakdown") or {}
    return {"total_kv_size_tokens": int(est["total_kv_size_tokens"]),
            "kv_size_per_token_bytes": int(est["kv_size_per_token_bytes"]),
            "total_gpu_capacity_bytes": int(est["total_gpu_capacity_bytes"]),
            "memory_breakdown": {"weights_bytes": int(breakdown.get("weights_bytes", 0))}}
