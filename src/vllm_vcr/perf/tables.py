"""Which of the estimator's kernel tables a target is priced from, where a shipped table did not
measure what vLLM serves.

aiconfigurator-core prices vLLM's MLA attention (DeepSeek-style models: Kimi-K2.5, DeepSeek-V3)
from whole-module tables (`mla_{context,generation}_module_perf`, the projections, norms and
attention kernel of one layer). Its B200 tables were re-collected with a fixed collector (their
`collection_meta.yaml`: the RMSNorm of the module dispatched to vLLM's own kernels, as the serving
engine runs it; the earlier rows ran a norm chain vLLM never serves and were +34 % at the
measured anchor). The B300 tables were not re-collected: they are 1.7x the B200 ones at the
median (1.9-2.2x at decode batches of 1-32), where the estimator's SGLang and TRT-LLM MLA tables,
measured on the same B300 machine, are 0.9-1.0x their B200 counterparts. B300 and B200 are one
Blackwell generation with the same HBM bandwidth, so a B300 target prices vLLM's MLA module
from the re-collected B200 tables (`BORROWED`). Every other table stays the GPU's own.

The estimator reads its tables from a systems directory; a borrowed table is given to it as an
overlay of that directory (symbolic links to the package's files, the borrowed table's in place
of the stale one), kept beside the perf cache and made once.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from .catalog import package_root
from .overlay import link_all, publish
from .qk_norm import bundled_config

# (GPU, backend, table family, the GPU whose table of that family is priced instead)
BORROWED = (("b300_sxm", "vllm", "mla", "b200_sxm"),)


def uses_mla(model: str) -> bool:
    """Whether a bundled model's attention is MLA (a compressed KV latent: `kv_lora_rank`)."""
    cfg = bundled_config(model)
    cfg = cfg.get("text_config") or cfg
    return bool(cfg.get("kv_lora_rank"))


def borrowed_tables(model: str, gpu: str, backend: str) -> tuple[tuple[str, str], ...]:
    """(family, source GPU) of each table a target prices from another GPU (empty: all its own)."""
    out = []
    for g, b, family, source in BORROWED:
        if g == gpu and b == backend and (family != "mla" or uses_mla(model)):
            out.append((family, source))
    return tuple(out)


def systems_path(gpu: str, backend: str, borrowed: tuple[tuple[str, str], ...]) -> str | None:
    """The systems directory the estimator reads for these borrowed tables (None: the package's)."""
    if not borrowed:
        return None
    from .spec_cache import cache_dir

    src = package_root() / "systems"
    tag = "|".join([str(src), gpu, backend, *(f"{f}<{s}" for f, s in borrowed)])
    name = hashlib.sha256(tag.encode()).hexdigest()[:16]
    specs = cache_dir()
    roots = [Path(tempfile.gettempdir()) / f"vllm-vcr-{os.getuid()}"]
    if specs is not None:
        roots.insert(0, specs.parent)
    for root in roots:
        target = root / "aic-systems" / name
        if (target / "systems").is_dir():
            return str(target / "systems")
        try:
            return str(_build(target, src, gpu, backend, borrowed))
        except OSError as e:  # not writable: the next place
            error = e
    raise error


def _build(target: Path, src: Path, gpu: str, backend: str, borrowed: tuple[tuple[str, str], ...]) -> Path:
    """The overlay (its systems directory): every entry the package's systems directory has,
    linked, but for data/<gpu>/<family>/<backend>, which links the source GPU's."""
    families = {f: s for f, s in borrowed}

    def build(out: Path) -> None:
        link_all(src, out, ("data",))
        link_all(src / "data", out / "data", (gpu,))
        link_all(src / "data" / gpu, out / "data" / gpu, tuple(families))
        for name, source_gpu in families.items():
            entry = src / "data" / gpu / name
            if not entry.is_dir():
                continue
            link_all(entry, out / "data" / gpu / name, (backend,))
            source = src / "data" / source_gpu / name / backend
            if not source.is_dir():
                source = entry / backend
            if source.is_dir():
                (out / "data" / gpu / name / backend).symlink_to(source.resolve())

    return publish(target, build)
