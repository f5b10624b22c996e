"""The AIConfigurator perf model's identity and its compiled estimator (aiconfigurator-core).

`AicTarget` names what to price (model, GPU, backend, parallelism, precision, host overhead);
the estimator is compiled once per identity from kernels measured on that GPU and handed to the
engine's latency model (engine/latency/aic.py), which prices every step from its composition.
The default host overhead per step was fitted on measured deployments (docs/fidelity.md).
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..engine.latency.aic import AicStepLatency, StepPricer
from .catalog import BLACKWELL_GPUS, check_gpu, configure_data_roots, import_aic, resolve_model
from .checkpoint import checkpoint_kernels, kv_cache_directive
from .cuda_graphs import capture_size, eager_step_ms
from .errors import PerfModelError
from .native import NativeHandle
from .qk_norm import bundled_config, qk_norm_ms
from . import compact
from .sdk_lean import lean_compile
from .sdk_yaml import c_yaml
from .spec_cache import cache_dir, kept_prices, load_or_compile, spec_key
from .tables import borrowed_tables, systems_path

logger = logging.getLogger(__name__)

# Host time per step not in the kernel data, and the part of a step async scheduling cannot
# overlap with the GPU; fitted on the training split of the silicon validation
# (bench/silicon_validation.py --fit), see docs/fidelity.md.
DEFAULT_STEP_OVERHEAD_MS = 0.8
DEFAULT_PER_SEQ_OVERHEAD_MS = 0.066
DEFAULT_ASYNC_EXPOSED_MS = 0.3
# GPU time of the attention's QK norm, which the estimator does not price (perf/qk_norm.py): per
# QK-normed layer, and per all-reduce of a norm that spans the TP ranks; fitted the same way.
DEFAULT_QK_NORM_US = 12.0
DEFAULT_QK_NORM_ALLREDUCE_US = 20.0
# The deployment's API server before the engine core sees a request (engine/latency/aic.py
# `frontend_delay`): fixed, per 1000 prompt tokens (tokenising), per request already in flight
# (the server's work for the streams it serves); fitted the same way.
DEFAULT_FRONTEND_MS = 0.0
DEFAULT_FRONTEND_MS_PER_1K_TOKENS = 9.5
DEFAULT_FRONTEND_MS_PER_REQUEST = 0.4
# A step vLLM runs without CUDA graphs (perf/cuda_graphs.py): host time per layer, and per layer
# when TP > 1. Off: fitted on train (120 µs per layer) and kept by dev, it priced the held-out
# configurations' TTFT worse (docs/fidelity.md), so `--perf-eager-layer-us` sets it.
DEFAULT_EAGER_LAYER_US = 0.0
DEFAULT_EAGER_LAYER_TP_US = 0.0


@dataclass(frozen=True)
class AicTarget:
    """What to price: the estimator's identity for one engine (one DP rank)."""

    model: str  # a served name; resolved to a bundled config by catalog.resolve_model
    gpu: str = "h100_sxm"
    backend: str = "vllm"
    backend_version: str | None = None  # None: the estimator's current data for the backend
    tensor_parallel_size: int = 1
    attention_dp_size: int = 1
    moe_tp_size: int | None = None
    moe_ep_size: int | None = None
    gemm_quant: str | None = None  # None: from the model's config (or its name's suffix)
    moe_quant: str | None = None
    kv_cache_quant: str | None = None  # None: vLLM's `auto` (the checkpoint's directive, else the model dtype)
    step_overhead_ms: float = DEFAULT_STEP_OVERHEAD_MS
    per_seq_overhead_ms: float = DEFAULT_PER_SEQ_OVERHEAD_MS
    async_scheduling: bool = False  # vLLM's --async-scheduling: host time overlaps the GPU's
    async_exposed_ms: float = DEFAULT_ASYNC_EXPOSED_MS
    qk_norm_us: float = DEFAULT_QK_NORM_US
    qk_norm_allreduce_us: float = DEFAULT_QK_NORM_ALLREDUCE_US
    frontend_ms: float = DEFAULT_FRONTEND_MS
    frontend_ms_per_1k_tokens: float = DEFAULT_FRONTEND_MS_PER_1K_TOKENS
    frontend_ms_per_request: float = DEFAULT_FRONTEND_MS_PER_REQUEST
    expert_parallel: bool = False  # vLLM's --enable-expert-parallel (MoE layout when no MoE sizes are given)
    fmha_quant: str | None = None  # the attention kernels' precision; None: the estimator's choice from the GEMMs
    moe_activation: str | None = None  # `--quantization-config` moe.activation (mxfp8: MXFP4 experts on MXFP8 inputs)
    cudagraph_mode: str = "FULL_AND_PIECEWISE"  # vLLM's compilation_config.cudagraph_mode (NONE: --enforce-eager)
    cudagraph_capture_size: int | None = None  # the engine's effective max capture size; None: not resolved
    eager_layer_us: float = DEFAULT_EAGER_LAYER_US
    eager_layer_tp_us: float = DEFAULT_EAGER_LAYER_TP_US

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AicTarget":
        return cls(**d)

    def resolved(self) -> "AicTarget":
        """The bundled model name, with a quantisation its served name implies, the KV cache dtype
        its checkpoint asks for under `--kv-cache-dtype auto` (perf/checkpoint.py), an MoE model's
        expert layout as vLLM lays it out from `-tp N` (and `-dp D`) alone: the experts sharded
        over all TP x DP GPUs, or, with `--enable-expert-parallel`, spread whole over them; and,
        without a quantisation given, the kernels its checkpoint runs at that layout
        (perf/checkpoint.py `checkpoint_kernels`: the same the validation's rows are priced with)."""
        model, quant = resolve_model(self.model)
        t = replace(self, model=model, gemm_quant=self.gemm_quant or quant, moe_quant=self.moe_quant or quant,
                    kv_cache_quant=self.kv_cache_quant or kv_cache_directive(model))
        width = t.tensor_parallel_size * t.attention_dp_size
        if width > 1 and is_moe(model):
            tp, ep = t.moe_tp_size, t.moe_ep_size
            if tp is None and ep is None:
                tp, ep = (1, width) if t.expert_parallel else (width, 1)
            elif tp is None:
                tp = max(width // ep, 1)
            elif ep is None:
                ep = max(width // tp, 1)
            t = replace(t, moe_tp_size=tp, moe_ep_size=ep)
        if self.gemm_quant is None and self.moe_quant is None and quant is None:
            kernels = checkpoint_kernels(model, t.gpu, t.moe_tp_size or t.tensor_parallel_size)
            if kernels is not None:
                t = replace(t, gemm_quant=kernels[0], moe_quant=kernels[1])
        return replace(t, moe_quant=moe_activation_quant(t.moe_quant, t.moe_activation, t.gpu), moe_activation=None)

    def compile_kwargs(self) -> dict[str, Any]:
        return dict(tp_size=self.tensor_parallel_size, attention_dp_size=self.attention_dp_size,
                    moe_tp_size=self.moe_tp_size, moe_ep_size=self.moe_ep_size,
                    gemm_quant_mode=self.gemm_quant, moe_quant_mode=self.moe_quant,
                    kvcache_quant_mode=self.kv_cache_quant,
                    **({"fmha_quant_mode": self.fmha_quant} if self.fmha_quant else {}))


def moe_activation_quant(moe_quant: str | None, activation: str | None, gpu: str) -> str | None:
    """The MoE kernels' precision when vLLM is asked for an activation precision of the experts
    (`--quantization-config '{"moe": {"activation": "mxfp8"}}'`; in earlier releases the environment's
    `VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8=1`): MXFP4 experts (`w4a16_mxfp4`, BF16 inputs, vLLM's
    default) on Blackwell run FlashInfer's TRT-LLM MXFP4 x MXFP8 kernel, `w4a8_mxfp4_mxfp8`
    (vllm/model_executor/layers/fused_moe/oracle/mxfp4.py `select_mxfp4_moe_backend`: backends of
    the requested activation first; elsewhere none has it and the BF16 one serves)."""
    if moe_quant == "w4a16_mxfp4" and activation == "mxfp8" and gpu in BLACKWELL_GPUS:
        return "w4a8_mxfp4_mxfp8"
    return moe_quant


# The host's share of a step: not part of the compiled estimator's identity.
_HOST_FIELDS = ("step_overhead_ms", "per_seq_overhead_ms", "async_scheduling", "async_exposed_ms", "qk_norm_us",
                "qk_norm_allreduce_us", "frontend_ms", "frontend_ms_per_1k_tokens", "frontend_ms_per_request",
                "cudagraph_mode", "cudagraph_capture_size", "eager_layer_us", "eager_layer_tp_us")


def _target_key(t: AicTarget) -> str:
    d = t.to_dict()
    for f in _HOST_FIELDS:
        d.pop(f)
    d.pop("moe_activation")  # resolved into moe_quant
    borrowed = borrowed_tables(t.model, t.gpu, t.backend, t.moe_quant)
    if borrowed:  # tables priced from another GPU's (perf/tables.py): part of the identity
        d["borrowed_tables"] = [list(b) for b in borrowed]
    return json.dumps(d, sort_keys=True)


@functools.lru_cache(maxsize=32)
def _compiled(key: str) -> Any:
    # the price answers kept for this identity, the estimator loaded at the first one never asked
    return kept_prices(key, lambda: _load(key))


def _load(key: str) -> Any:
    d = json.loads(key)
    borrowed = tuple(tuple(b) for b in d.pop("borrowed_tables", ()))
    t = AicTarget.from_dict(d)
    import_aic()
    check_gpu(t.gpu, t.backend)
    configure_data_roots()

    quiet = logging.getLogger("aiconfigurator_core")
    level, quiet.level = quiet.level, logging.ERROR  # it logs every fallback table it loads
    def probed(handle: Any) -> Any:  # fail now, not at the first step, on missing data
        handle.decode_step_latency(1, 128, 2)
        handle.mixed_step_breakdown(128, 1, 128, 2, 0)
        return handle

    cache, cut = cache_dir(), spec_key("compact", key)  # the kernel tables cut to this target (perf/compact.py)

    def with_cut(handle: Any) -> Any:  # made once, by a process that has the whole tables loaded
        if not compact.tried(cache, cut):
            tries = compact.plans(t.gemm_quant, t.moe_quant, t.kv_cache_quant,
                                  compact.model_head_dim(bundled_config(t.model)))
            compact.make(cache, cut, systems, t.gpu, t.backend, tries,
                         lambda path: NativeHandle(handle.spec_bytes, systems_path=path), handle)
        return handle

    def from_spec(spec: bytes) -> Any:
        cut_systems = compact.kept(cache, cut)
        if cut_systems is not None:
            try:
                return probed(NativeHandle(spec, systems_path=cut_systems))
            except Exception as e:  # noqa: BLE001 - e.g. the package moved under its links: the whole tables
                logger.debug("compact tables at %s do not load (%s)", cut_systems, e)
        return with_cut(probed(NativeHandle(spec, systems_path=systems)))

    def compiled() -> Any:
        from aiconfigurator_core.sdk.engine import EngineHandle

        with c_yaml(), lean_compile():  # its YAML parsed by libyaml, its unread work skipped (perf/sdk_lean.py)
            handle = EngineHandle.compile(t.model, t.gpu, t.backend, backend_version=t.backend_version,
                                          systems_path=systems, **t.compile_kwargs())
        return with_cut(probed(handle))

    try:
        systems = systems_path(t.gpu, t.backend, borrowed)  # None: the package's own tables
        handle = load_or_compile(  # a spec compiled by an earlier process loads in a millisecond
            key, compiled, from_spec)
    except PerfModelError:
        raise
    except Exception as e:  # unsupported combination: missing kernels, flops, configs
        raise PerfModelError(f"--perf-model aic: the estimator cannot price {t.model} on {t.gpu} with "
                             f"{t.backend} (tp={t.tensor_parallel_size}, gemm={t.gemm_quant or 'auto'}): "
                             f"{str(e).splitlines()[0][:300]}") from None
    finally:
        quiet.level = level
    return handle


def compile_target(target: AicTarget) -> Any:
    """The compiled estimator (an aiconfigurator_core EngineHandle), shared per identity."""
    return _compiled(_target_key(target.resolved()))


def step_latency(target: AicTarget, time_scale: float = 1.0) -> AicStepLatency:
    """The engine's latency model for `target` (engine/latency/aic.py), its estimator compiled here."""
    t = target.resolved()
    return AicStepLatency(StepPricer(compile_target(t)), step_overhead_ms=t.step_overhead_ms,
                          per_seq_overhead_ms=t.per_seq_overhead_ms, async_scheduling=t.async_scheduling,
                          async_exposed_ms=t.async_exposed_ms, time_scale=time_scale,
                          frontend_ms=t.frontend_ms, frontend_ms_per_1k_tokens=t.frontend_ms_per_1k_tokens,
                          frontend_ms_per_request=t.frontend_ms_per_request, moe=is_moe(t.model),
                          unpriced_gpu_ms=qk_norm_ms(t.model, t.tensor_parallel_size, t.qk_norm_us,
                                                     t.qk_norm_allreduce_us),
                          **eager_terms(t))


def eager_terms(t: AicTarget) -> dict[str, Any]:
    """The latency model's steps without CUDA graphs (perf/cuda_graphs.py): vLLM's graphs only;
    nothing while the capture size is not resolved (`with_capture_size`) or the term is off."""
    if t.backend != "vllm" or t.cudagraph_capture_size is None or not (t.eager_layer_us or t.eager_layer_tp_us):
        return {}
    return dict(eager_step_ms=eager_step_ms(t.model, t.tensor_parallel_size, t.eager_layer_us, t.eager_layer_tp_us),
                graph_capture_size=t.cudagraph_capture_size, graph_mode=t.cudagraph_mode)


def with_capture_size(target: dict[str, Any], max_num_seqs: int, max_num_batched_tokens: int, *,
                      given: int | None = None, sizes: list[int] | None = None,
                      blackwell_1024: bool = True) -> dict[str, Any]:
    """`target` (AicTarget fields) with the engine's effective CUDA-graph capture size, from the
    engine's limits and the capture size or sizes the deployment gave (vLLM's defaults if none):
    `serve`, `play`, `simulate` and the silicon rows alike."""
    return {**target, "cudagraph_capture_size": capture_size(
        target.get("gpu", ""), max_num_seqs, max_num_batched_tokens, given=given, sizes=sizes,
        blackwell_1024=blackwell_1024)}


def shared_step_latency(target: dict[str, Any], time_scale: float) -> AicStepLatency:
    """One model per identity and time scale for every engine of the process (`EngineArgs.perf_model`)."""
    return _shared(json.dumps(target, sort_keys=True), time_scale)


@functools.lru_cache(maxsize=8)
def _shared(target_json: str, time_scale: float) -> AicStepLatency:
    return step_latency(AicTarget.from_dict(json.loads(target_json)), time_scale)


def is_moe(model: str) -> bool:
    """Whether a bundled model routes its MLPs to experts (its config names an expert count)."""
    cfg = bundled_config(model)
    cfg = cfg.get("text_config") or cfg
    return any(cfg.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"))


def describe(target: AicTarget) -> str:
    t = target.resolved()
    return (f"{t.model} on {t.gpu} ({t.backend}, tp={t.tensor_parallel_size}"
            + (f", gemm={t.gemm_quant}" if t.gemm_quant else "") + ")")


__all__ = ["AicStepLatency", "AicTarget", "PerfModelError", "StepPricer", "compile_target", "describe",
           "shared_step_latency", "step_latency"]
