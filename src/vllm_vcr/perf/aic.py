"""One engine step priced by NVIDIA AIConfigurator's compiled estimator (aiconfigurator-core).

The estimator is compiled once per (model, GPU, backend, parallelism, precision) from kernels
measured on that GPU. A step's time is composed the way the estimator composes a mixed
chunked-prefill iteration, but from the step's actual contents rather than one static batch:

- the shared non-attention work (GEMMs, norms, communication) over every token of the step
  (prefill chunk tokens + one per decode);
- context attention of each prefill chunk over its own context (the chunk plus the tokens
  already computed: earlier chunks and prefix-cache hits), for the step's mean chunk;
- decode attention of the decodes over their mean context length.

A decode-only step is the estimator's own generation step. On top of the GPU time, a constant
host overhead per step (`step_overhead_ms`: the engine's scheduling, input preparation and
sampling on the CPU, which the kernel data does not contain) and a per-sequence share of it can
be set; docs/fidelity.md says how the default was fitted.
"""

from __future__ import annotations

import functools
import json
import logging
import random
from dataclasses import asdict, dataclass, replace
from typing import Any

from .catalog import check_gpu, configure_data_roots, import_aic, resolve_model
from .errors import PerfModelError

logger = logging.getLogger(__name__)

# Host time per step not in the kernel data; fitted on the training split of the silicon
# validation (bench/silicon_validation.py), see docs/fidelity.md.
DEFAULT_STEP_OVERHEAD_MS = 2.55
DEFAULT_PER_SEQ_OVERHEAD_MS = 0.0
_CTX_QUANTUM = 16  # contexts are priced to this many tokens (memoised lookups)


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
    kv_cache_quant: str | None = None
    step_overhead_ms: float = DEFAULT_STEP_OVERHEAD_MS
    per_seq_overhead_ms: float = DEFAULT_PER_SEQ_OVERHEAD_MS

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AicTarget":
        return cls(**d)

    def resolved(self) -> "AicTarget":
        """The bundled model name, with a quantisation its served name implies."""
        model, quant = resolve_model(self.model)
        return replace(self, model=model, gemm_quant=self.gemm_quant or quant, moe_quant=self.moe_quant or quant)

    def compile_kwargs(self) -> dict[str, Any]:
        return dict(tp_size=self.tensor_parallel_size, attention_dp_size=self.attention_dp_size,
                    moe_tp_size=self.moe_tp_size, moe_ep_size=self.moe_ep_size,
                    gemm_quant_mode=self.gemm_quant, moe_quant_mode=self.moe_quant,
                    kvcache_quant_mode=self.kv_cache_quant)


def _target_key(t: AicTarget) -> str:
    d = t.to_dict()
    d.pop("step_overhead_ms")
    d.pop("per_seq_overhead_ms")
    return json.dumps(d, sort_keys=True)


@functools.lru_cache(maxsize=32)
def _compiled(key: str) -> Any:
    t = AicTarget.from_dict({**json.loads(key), "step_overhead_ms": 0.0, "per_seq_overhead_ms": 0.0})
    import_aic()
    check_gpu(t.gpu, t.backend)
    configure_data_roots()
    from aiconfigurator_core.sdk.engine import EngineHandle

    quiet = logging.getLogger("aiconfigurator_core")
    level, quiet.level = quiet.level, logging.ERROR  # it logs every fallback table it loads
    try:
        handle = EngineHandle.compile(t.model, t.gpu, t.backend, backend_version=t.backend_version,
                                      **t.compile_kwargs())
        handle.decode_step_latency(1, 128, 2)  # fail now, not at the first step, on missing data
        handle.mixed_step_breakdown(128, 1, 128, 2, 0)
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


def _q(n: float) -> int:
    """A context length rounded to the memo quantum (at least 1)."""
    return max(int(n + _CTX_QUANTUM / 2) // _CTX_QUANTUM * _CTX_QUANTUM, 1)


class StepPricer:
    """Milliseconds of GPU time for one step's composition (memoised: steps repeat a lot)."""

    def __init__(self, handle: Any) -> None:
        self._h = handle
        self._memo: dict[tuple, float] = {}

    def gpu_ms(self, num_decodes: int, decode_context: int, num_prefills: int, prefill_tokens: int,
               prefill_context: int) -> float:
        """`decode_context`: the decodes' summed lengths; `prefill_context`: tokens computed before
        this step's chunks (earlier chunks and prefix hits), summed over the prefills."""
        dec_ctx = _q(decode_context / num_decodes) if num_decodes else 0
        if not prefill_tokens:
            if not num_decodes:
                return 0.0
            key = (num_decodes, dec_ctx)
        else:
            p = max(num_prefills, 1)
            key = (num_decodes, dec_ctx, p, prefill_tokens, _q(prefill_context / p))
        ms = self._memo.get(key)
        if ms is None:
            ms = self._memo[key] = self._price(*key)
        return ms

    def _price(self, num_decodes: int, dec_ctx: int, prefills: int = 0, tokens: int = 0, prefix: int = 0) -> float:
        h = self._h
        if not tokens:
            return h.decode_step_latency(num_decodes, dec_ctx, 2)
        # shared non-attention work over all the step's tokens, and the decodes' attention
        _, shared, _, dec_attn = h.mixed_step_breakdown(tokens, num_decodes, max(dec_ctx, 1), 2, 0)
        # one chunk's attention over its context: chunk tokens = isl - prefix, priced unchunked
        chunk = max(tokens // prefills, 1)
        isl = prefix + chunk
        _, _, ctx_attn, _ = h.mixed_step_breakdown(isl, 0, isl, 2, prefix)
        return shared + dec_attn + prefills * ctx_attn


class AicStepLatency:
    """The engine's latency source for `--perf-model aic`: step-composed timing (it has
    `step_duration`), so every step is priced from what it computes."""

    is_knob = False

    def __init__(self, target: AicTarget, time_scale: float = 1.0) -> None:
        self.config = None  # set by the engine; the latency knobs do not apply
        self.target = target.resolved()
        self.pricer = StepPricer(compile_target(self.target))
        self._scale = 1e-3 / time_scale

    def step_ms(self, batch: Any) -> float:
        gpu = self.pricer.gpu_ms(batch.num_decodes, batch.decode_context, batch.num_prefills,
                                 batch.num_prefill_tokens, getattr(batch, "prefill_context", 0))
        t = self.target
        return gpu + t.step_overhead_ms + t.per_seq_overhead_ms * (batch.num_decodes + batch.num_prefills)

    # --- the engine's hooks (trace/step_model.py StepLatency's interface) ----------------------
    def step_duration(self, batch: Any, rng: random.Random) -> float:
        return self.step_ms(batch) * self._scale

    def pacing(self, num_prompt_tokens: int, num_cached_tokens: int, num_running: int, rng: random.Random):
        from ..engine.step_timing import zero_pacing

        return zero_pacing(rng)


def shared_step_latency(target: dict[str, Any], time_scale: float) -> AicStepLatency:
    """One model per identity and time scale for every engine of the process (`EngineArgs.perf_model`)."""
    return _shared(json.dumps(target, sort_keys=True), time_scale)


@functools.lru_cache(maxsize=8)
def _shared(target_json: str, time_scale: float) -> AicStepLatency:
    return AicStepLatency(AicTarget.from_dict(json.loads(target_json)), time_scale)


def describe(target: AicTarget) -> str:
    t = target.resolved()
    return (f"{t.model} on {t.gpu} ({t.backend}, tp={t.tensor_parallel_size}"
            + (f", gemm={t.gemm_quant}" if t.gemm_quant else "") + ")")


__all__ = ["AicStepLatency", "AicTarget", "PerfModelError", "StepPricer", "compile_target", "describe",
           "shared_step_latency"]
