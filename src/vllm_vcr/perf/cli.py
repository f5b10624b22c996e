"""`--perf-model aic` and its flags, for `serve`, `play` and `simulate`.

The model comes from the served model (MODEL, `--model`, `--served-model-name`, play's
`--model-name`) unless `--perf-model-path` names it. vLLM's own flags that matter on a GPU
(`--tensor-parallel-size`, `--gpu-memory-utilization`, `--num-gpu-blocks-override`,
`--kv-cache-dtype`, `--async-scheduling`/`--no-async-scheduling`, `--max-cudagraph-capture-size`,
`--cudagraph-capture-sizes`, `--compilation-config`'s CUDA-graph settings, `--enforce-eager`) are
honoured when the perf model is on (async scheduling on unless turned off, as in vLLM from 0.14;
CUDA graphs as vLLM captures them by default: perf/cuda_graphs.py). Dynamo mocker's spellings are
accepted as aliases: `--aic-perf-model`/`--ais-perf-model` (a switch), `--aic-system`,
`--aic-backend`, `--aic-backend-version`, `--aic-tp-size`, `--aic-moe-tp-size`,
`--aic-moe-ep-size`, `--aic-attention-dp-size`, `--aic-model-path` (and their `--ais-` forms).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace
from typing import Any

from ..cli_types import bounded
from ..engine.config import LATENCY_FIELDS, EngineArgs
from .errors import PerfModelError, json_flag

logger = logging.getLogger(__name__)

PERF_MODELS = ("none", "aic")
_IGN = "ignored__"  # serve keeps vLLM's GPU flags under this prefix (serve/cli.py)
_VLLM_GPU_FLAGS = {  # vLLM flags -> (dest, type); added to parsers that do not have them yet
    ("--tensor-parallel-size", "-tp"): ("tensor_parallel_size", int),
    ("--gpu-memory-utilization",): ("gpu_memory_utilization", float),
    ("--num-gpu-blocks-override",): ("num_gpu_blocks_override", int),
    ("--kv-cache-dtype",): ("kv_cache_dtype", str),
    ("--quantization-config",): ("quantization_config", str),
    ("--max-cudagraph-capture-size",): ("max_cudagraph_capture_size", int),
    ("--compilation-config", "-cc"): ("compilation_config", str),
}


def _both(flag: str) -> list[str]:
    return [f"--aic-{flag}", f"--ais-{flag}"]


_TIME = bounded(float, lo=0.0)  # a time added to a step: never negative


def add_perf_args(parser: argparse.ArgumentParser, *, vllm_gpu_flags: bool = False) -> None:
    """The perf-model flags; `vllm_gpu_flags` adds vLLM's GPU flags too (play has none of its own)."""
    g = parser.add_argument_group("GPU perf model (optional extra: pip install 'vllm-vcr[aic]')")
    g.add_argument("--perf-model", choices=PERF_MODELS, default=None,
                   help="price every engine step with a GPU perf model: aic = NVIDIA AIConfigurator's "
                        "measured kernels (step times and KV cache size of --gpu)")
    g.add_argument(*_both("perf-model"), dest="perf_model_switch", action="store_true", default=False,
                   help=argparse.SUPPRESS)
    g.add_argument("--gpu", *_both("system"), dest="perf_gpu", default=None, metavar="GPU",
                   help="simulated GPU (default h100_sxm): h100_sxm, h200_sxm, b200_sxm, a100_sxm, l40s, ...")
    g.add_argument("--perf-backend", *_both("backend"), dest="perf_backend", default=None,
                   choices=["vllm", "sglang", "trtllm"],
                   help="whose kernels to price (default: the --engine-type, vllm or sglang)")
    g.add_argument("--perf-backend-version", *_both("backend-version"), dest="perf_backend_version", default=None,
                   help="the estimator's data version (default: its current one)")
    g.add_argument("--perf-model-path", *_both("model-path"), dest="perf_model_path", default=None,
                   help="model to price, if not the served name (e.g. meta-llama/Llama-3.1-8B-Instruct)")
    g.add_argument(*_both("tp-size"), dest="perf_tp", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--perf-moe-tp-size", *_both("moe-tp-size"), dest="perf_moe_tp", type=int, default=None)
    g.add_argument("--perf-moe-ep-size", *_both("moe-ep-size"), dest="perf_moe_ep", type=int, default=None)
    g.add_argument("--perf-attention-dp-size", *_both("attention-dp-size"), dest="perf_attn_dp", type=int,
                   default=None)
    g.add_argument("--perf-quantization", dest="perf_quant", default=None,
                   help="GEMM precision (fp8, nvfp4, int4_wo, ...); default from the model")
    g.add_argument("--perf-step-overhead-ms", type=_TIME, default=None,
                   help="host time of every step (ms): added to the GPU time, or overlapped with it under "
                        "async scheduling; default: the fitted value (docs/fidelity.md)")
    g.add_argument("--perf-async-exposed-ms", type=_TIME, default=None,
                   help="under async scheduling, the part of a step's host time that does not overlap the "
                        "GPU (ms); default: the fitted value")
    g.add_argument("--perf-qk-norm-us", type=_TIME, default=None,
                   help="GPU time per step of each layer's attention QK norm (Qwen3, MiniMax-M2, ...; µs), "
                        "which the kernel data lacks; default: the fitted value")
    g.add_argument("--perf-qk-norm-allreduce-us", type=_TIME, default=None,
                   help="GPU time per layer and step of the all-reduce a QK norm over the whole query/key "
                        "needs under tensor parallelism (MiniMax-M2; µs); default: the fitted value")
    g.add_argument("--perf-eager-layer-us", type=_TIME, default=None,
                   help="host time per layer of a step vLLM runs without CUDA graphs (above the capture size; "
                        "µs); default 0: off (docs/fidelity.md: tried, not kept)")
    g.add_argument("--perf-frontend-ms", type=_TIME, default=None,
                   help="the API server's fixed time before the engine core sees a request (ms); default: the "
                        "fitted value (docs/fidelity.md)")
    g.add_argument("--perf-frontend-ms-per-1k-tokens", type=_TIME, default=None,
                   help="the API server's time per 1000 prompt tokens (tokenising; ms); default: the fitted value")
    g.add_argument("--perf-frontend-ms-per-request", type=_TIME, default=None,
                   help="the API server's time per request already in flight, which a new request waits behind "
                        "(ms); default: the fitted value")
    kv = parser._option_string_actions.get("--kv-cache-size")
    parser.set_defaults(_kv_cache_size_default=kv.default if kv is not None else None)
    if vllm_gpu_flags:
        for flags, (dest, typ) in _VLLM_GPU_FLAGS.items():
            if flags[0] not in parser._option_string_actions:
                g.add_argument(*flags, dest=dest, type=typ, default=None, help=argparse.SUPPRESS)
        if "--enable-expert-parallel" not in parser._option_string_actions:
            g.add_argument("--enable-expert-parallel", dest="enable_expert_parallel",
                           action=argparse.BooleanOptionalAction, default=None,
                           help="vLLM's expert parallelism: an MoE model's experts spread whole over the TP "
                                "GPUs (default: sharded over them)")
        if "--cudagraph-capture-sizes" not in parser._option_string_actions:
            g.add_argument("--cudagraph-capture-sizes", dest="cudagraph_capture_sizes", type=int, nargs="+",
                           default=None, help=argparse.SUPPRESS)
        if "--enforce-eager" not in parser._option_string_actions:
            g.add_argument("--enforce-eager", dest="enforce_eager", action=argparse.BooleanOptionalAction,
                           default=None, help=argparse.SUPPRESS)
        if "--async-scheduling" not in parser._option_string_actions:
            g.add_argument("--async-scheduling", dest="async_scheduling", action=argparse.BooleanOptionalAction,
                           default=None, help="vLLM's async scheduling (default on): the host prepares the "
                                              "next step while the GPU runs this one")


def _vllm_flag(ns: argparse.Namespace, dest: str, typ: type) -> Any:
    """A vLLM GPU flag: ours (play, simulate) or serve's accepted-and-ignored copy, which the
    perf model consumes (so it is no longer reported as ignored)."""
    value = getattr(ns, dest, None)
    if value is None and hasattr(ns, _IGN + dest):
        value = getattr(ns, _IGN + dest)
        delattr(ns, _IGN + dest)
    if value is None:
        return None
    try:
        return typ(value)
    except ValueError:
        raise PerfModelError(f"--{dest.replace('_', '-')}: invalid value {value!r}") from None


def _served_name(ns: argparse.Namespace) -> str:
    for attr in ("perf_model_path", "model_opt", "model_tag", "model", "model_name"):
        v = getattr(ns, attr, None)
        if v:
            return v
    names = getattr(ns, "served_model_name", None)
    return names[0] if names else ""


def _kv_dtype(ns: argparse.Namespace) -> str | None:
    """`--kv-cache-dtype`: fp8*, the model's 16-bit dtype when named, else None (`auto`: the
    checkpoint's directive, else the model dtype; perf/checkpoint.py)."""
    v = _vllm_flag(ns, "kv_cache_dtype", str)
    if v and v.startswith("fp8"):
        return "fp8"
    return "bfloat16" if v in ("bfloat16", "float16", "half") else None


def _moe_activation(ns: argparse.Namespace) -> str | None:
    """`--quantization-config`'s `moe.activation` (vLLM's `QuantizationConfigArgs`: the precision
    the MoE kernels' inputs are quantised to, e.g. `mxfp8`), None when not given."""
    value = json_flag(_vllm_flag(ns, "quantization_config", lambda v: v), "--quantization-config")
    moe = value.get("moe") if isinstance(value, dict) else None
    activation = moe.get("activation") if isinstance(moe, dict) else None
    return activation if isinstance(activation, str) else None


def _cuda_graphs(ns: argparse.Namespace) -> dict[str, Any]:
    """The CUDA-graph settings the flags give (perf/cuda_graphs.py): `mode`, and `given` (a max
    capture size) or `sizes` (the captured sizes), each only when set. `--enforce-eager` (or a
    compilation config without compilation) captures none; the dedicated flags win over the
    same field in `--compilation-config`, as in vLLM."""
    from .cuda_graphs import from_compilation_config

    if hasattr(ns, "_perf_cuda_graphs"):  # read once: serve's ignored copies are consumed
        return ns._perf_cuda_graphs
    out = from_compilation_config(_vllm_flag(ns, "compilation_config", lambda v: v))
    given = _vllm_flag(ns, "max_cudagraph_capture_size", int)
    if given is not None:
        if given < 0:
            raise PerfModelError(f"--max-cudagraph-capture-size must be >= 0, got {given}")
        out["given"] = given
    sizes = _vllm_flag(ns, "cudagraph_capture_sizes", lambda v: [int(x) for x in (v if isinstance(v, list) else [v])])
    if sizes:
        out["sizes"] = sizes
    if _vllm_flag(ns, "enforce_eager", bool):
        out["mode"] = "NONE"
    ns._perf_cuda_graphs = out
    return out


def perf_target(ns: argparse.Namespace) -> dict[str, Any] | None:
    """The AicTarget fields the flags select, or None when the perf model is off."""
    kind = getattr(ns, "perf_model", None) or ("aic" if getattr(ns, "perf_model_switch", False) else "none")
    if kind == "none":
        return None
    from .aic import AicTarget

    tp = ns.perf_tp or _vllm_flag(ns, "tensor_parallel_size", int) or 1
    target = AicTarget(
        model=_served_name(ns), gpu=ns.perf_gpu or "h100_sxm",
        backend=ns.perf_backend or getattr(ns, "engine_type", None) or "vllm",  # SGLang's data for an SGLang engine
        backend_version=ns.perf_backend_version, tensor_parallel_size=tp,
        attention_dp_size=ns.perf_attn_dp or 1, moe_tp_size=ns.perf_moe_tp, moe_ep_size=ns.perf_moe_ep,
        gemm_quant=ns.perf_quant, moe_quant=ns.perf_quant, kv_cache_quant=_kv_dtype(ns),
        async_scheduling=_vllm_flag(ns, "async_scheduling", bool) is not False,
        expert_parallel=bool(_vllm_flag(ns, "enable_expert_parallel", bool)), moe_activation=_moe_activation(ns),
        cudagraph_mode=_cuda_graphs(ns).get("mode", "FULL_AND_PIECEWISE"))
    given = {field: getattr(ns, flag, None) for field, flag in _FITTED_FLAGS.items()}
    return replace(target, **{f: v for f, v in given.items() if v is not None}).resolved().to_dict()


_FITTED_FLAGS = {  # AicTarget field -> flag dest; unset: the fitted default
    "step_overhead_ms": "perf_step_overhead_ms", "async_exposed_ms": "perf_async_exposed_ms",
    "qk_norm_us": "perf_qk_norm_us", "qk_norm_allreduce_us": "perf_qk_norm_allreduce_us",
    "frontend_ms": "perf_frontend_ms", "frontend_ms_per_1k_tokens": "perf_frontend_ms_per_1k_tokens",
    "frontend_ms_per_request": "perf_frontend_ms_per_request", "eager_layer_us": "perf_eager_layer_us"}


def apply_perf_args(ns: argparse.Namespace, args: EngineArgs) -> EngineArgs:
    """Turn the perf model on in `args`: compile the estimator now (a bad model/GPU fails at
    start-up, listing what is supported), size the KV cache from the GPU unless the user gave a
    size, and make a KV pull's bytes per token the model's per GPU unless --kv-bytes-per-token
    says otherwise."""
    blocks_override = _vllm_flag(ns, "num_gpu_blocks_override", int)  # vLLM's flag: honoured always
    target = perf_target(ns)
    if blocks_override is not None:
        if blocks_override < 1:
            raise PerfModelError(f"--num-gpu-blocks-override must be >= 1, got {blocks_override}")
        args.kv_cache_size = blocks_override
    if target is None:
        return args
    if args.latency_trace:
        raise PerfModelError("--perf-model and --latency-trace both pace the engine; give one")
    knobs = [f for f in LATENCY_FIELDS[:-1] if getattr(args.config, f)]
    if knobs:
        raise PerfModelError("--perf-model prices every step; it cannot be combined with "
                             + ", ".join("--" + f.replace("_", "-") for f in knobs))
    from .aic import AicTarget, compile_target, describe, with_capture_size

    graphs = _cuda_graphs(ns)
    target = with_capture_size(target, args.config.max_num_seqs, args.config.max_num_batched_tokens,
                               given=graphs.get("given"), sizes=graphs.get("sizes"))
    t = AicTarget.from_dict(target)
    compile_target(t)
    args.perf_model = target
    sized = blocks_override is None and not _explicit_kv_size(ns)
    # a KV pull moves the model's bytes per token (asked for a P/D worker; free when the KV is sized)
    pulls = getattr(ns, "kv_bytes_per_token", None) is None and (sized or args.worker_type != "aggregated")
    if sized or pulls:
        cap = kv_capacity(ns, args)
        if pulls:
            args.kv_bytes_per_token = cap.bytes_per_token
    if sized:
        args.kv_cache_size = cap.num_blocks
        side = "" if args.worker_type == "aggregated" else f" ({args.worker_type} worker)"
        logger.info("perf model%s: %s; KV cache %d blocks (%d tokens, %d B/token)", side, describe(t),
                    cap.num_blocks, cap.tokens, cap.bytes_per_token)
    return args


def kv_capacity(ns: argparse.Namespace, args: EngineArgs):
    """The KV cache the GPU holds for `args`'s perf model (kv_sizing.KVCapacity: blocks, tokens,
    bytes per token per GPU), at vLLM's --gpu-memory-utilization (0.9 unless given)."""
    from .aic import AicTarget
    from .kv_sizing import estimate_kv_capacity

    util = _vllm_flag(ns, "gpu_memory_utilization", float)
    return estimate_kv_capacity(AicTarget.from_dict(args.perf_model), block_size=args.tokens_per_block,
                                gpu_memory_utilization=0.9 if util is None else util,
                                max_num_batched_tokens=args.config.max_num_batched_tokens,
                                max_num_seqs=args.config.max_num_seqs)


def _explicit_kv_size(ns: argparse.Namespace) -> bool:
    """--kv-cache-size given (a value other than its default: 1024, or MOCK_KV_CACHE_SIZE)."""
    default = getattr(ns, "_kv_cache_size_default", None)
    return default is not None and str(ns.kv_cache_size) != str(default)
