"""What the estimator knows: its bundled models and GPUs, and served names mapped onto them.

A served name rarely matches the estimator's bundled config name exactly
(`meta-llama/Llama-3.1-70B` vs its `meta-llama/Meta-Llama-3.1-70B`,
`nvidia/Llama-3.1-8B-Instruct-FP8`): names are compared after dropping the organisation,
`Meta-`, `-Instruct`/`-Chat`/`-Base`/`-hf` and a quantisation suffix (which then selects the
GEMM precision, unless one is given).
"""

from __future__ import annotations

import functools
import importlib
import os
import re
from pathlib import Path
from types import ModuleType

from .errors import AIC_EXTRA_HINT, PerfModelError
from .sdk_lean import defer_network

BACKENDS = ("vllm", "sglang", "trtllm")
# data-center Blackwell (compute capability 10.x): its own kernels (MXFP8 MoE inputs) and defaults
BLACKWELL_GPUS = ("b200_sxm", "b300_sxm", "gb200", "gb300")
_QUANT_SUFFIXES = {"fp8": "fp8", "fp8-dynamic": "fp8", "nvfp4": "nvfp4", "fp4": "nvfp4", "awq": "int4_wo",
                   "gptq": "int4_wo", "int4": "int4_wo", "w4a16": "int4_wo"}
_DROP = re.compile(r"^(meta-)|(-(instruct|chat|base|hf|it))+$")


def import_aic() -> ModuleType:
    """aiconfigurator_core, or a PerfModelError saying how to install it."""
    try:
        return importlib.import_module("aiconfigurator_core")
    except ImportError as e:
        raise PerfModelError(f"--perf-model aic needs the optional extra: {AIC_EXTRA_HINT} ({e})") from None


def package_root() -> Path:
    return Path(import_aic().__file__).parent


@functools.lru_cache(maxsize=16)
def gpu_system(gpu: str) -> dict:
    """The estimator's system file of `gpu` (`systems/<gpu>.yaml`: its node, links, memory)."""
    import yaml

    with open(package_root() / "systems" / f"{gpu}.yaml") as f:
        return yaml.safe_load(f)


def kv_link(gpu: str, gpus: int) -> tuple[float, str]:
    """(bytes per second per GPU, which link) a prompt's KV crosses from a prefill worker to a decode
    worker, in a deployment of `gpus` GPUs of `gpu`: the node's NVLink when all of them fit in one
    node (a GB200/GB300 rack is one NVLink domain, whose `inter_node_bw` it is), else the NICs'."""
    node = gpu_system(gpu).get("node") or {}
    per_node = int(node.get("num_gpus_per_node", 8))
    if gpu.startswith("gb") or gpus <= per_node:
        key = "inter_node_bw" if gpu.startswith("gb") else "intra_node_bw"
    else:
        key = "inter_node_bw"
    return float(node[key]), key


def pull_bytes_per_token(prefill: int, decode: int) -> int:
    """Bytes per prompt token a KV pull moves over one GPU's link, given a prefill GPU's and a
    decode GPU's KV bytes per token: each prefill GPU sends its share, each decode GPU receives
    its share, and the pull goes at the pace of the busier end. A GQA model's KV heads split over
    more prefill GPUs than decode GPUs land on fewer links (the decode side's); an MLA latent is
    whole on every GPU, the same at both ends."""
    return max(prefill, decode)


def configure_data_roots() -> None:
    """Point the estimator at its bundled data (it reads these variables, never the network, whose
    modules the SDK imports are deferred: perf/sdk_lean.py `defer_network`)."""
    defer_network()
    root = package_root()
    os.environ.setdefault("AICONFIGURATOR_SYSTEMS_PATH", str(root / "systems"))
    os.environ.setdefault("AICONFIGURATOR_MODEL_CONFIGS_PATH", str(root / "model_configs"))


@functools.lru_cache(maxsize=1)
def bundled_models() -> tuple[str, ...]:
    """`org/name` of every model config the package ships."""
    names = []
    for p in sorted((package_root() / "model_configs").glob("*_config.json")):
        stem = p.name[: -len("_config.json")]
        if stem.endswith("_hf_quant"):
            continue
        names.append(stem.replace("--", "/", 1))
    return tuple(names)


@functools.lru_cache(maxsize=8)
def supported_gpus(backend: str = "vllm") -> tuple[str, ...]:
    """Systems with measured data for `backend` (a system YAML and a data/<gpu>/gemm/<backend> tree)."""
    systems = package_root() / "systems"
    return tuple(sorted(p.stem for p in systems.glob("*.yaml")
                        if (systems / "data" / p.stem / "gemm" / backend).is_dir()))


def _norm(name: str) -> tuple[str, str | None]:
    """(normalised base name, quantisation implied by a suffix)."""
    base = name.rstrip("/").rsplit("/", 1)[-1].lower().replace("_", "-")
    quant = None
    for suffix, q in sorted(_QUANT_SUFFIXES.items(), key=lambda kv: -len(kv[0])):
        if base.endswith("-" + suffix):
            base, quant = base[: -len(suffix) - 1], q
            break
    prev = None
    while prev != base:
        prev, base = base, _DROP.sub("", base)
    return base, quant


def resolve_model(name: str) -> tuple[str, str | None]:
    """The bundled model a served name means, and the GEMM quantisation its name implies."""
    if not name:
        raise PerfModelError("--perf-model aic needs a model: give MODEL / --served-model-name / "
                             "--perf-model-path (one of: " + ", ".join(bundled_models()) + ")")
    models = bundled_models()
    if name in models:
        return name, None
    lowered = {m.lower(): m for m in models}
    if name.lower() in lowered:
        return lowered[name.lower()], None
    base, quant = _norm(name)
    exact_quant = [m for m in models if _norm(m) == (base, quant)]
    plain = [m for m in models if _norm(m) == (base, None)]
    if exact_quant:
        return exact_quant[0], None
    if plain:
        return plain[0], quant
    raise PerfModelError(f"--perf-model aic: model {name!r} is not one the estimator knows; supported models: "
                         + ", ".join(models))


def check_gpu(gpu: str, backend: str) -> None:
    if backend not in BACKENDS:
        raise PerfModelError(f"--perf-backend: {backend!r} is not supported; choose from {', '.join(BACKENDS)}")
    gpus = supported_gpus(backend)
    if gpu not in gpus:
        raise PerfModelError(f"--gpu: {gpu!r} has no measured {backend} data; supported GPUs for {backend}: "
                             + ", ".join(gpus))
