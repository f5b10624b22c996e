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

The estimator's vLLM MoE tables on Blackwell (B200, B300, GB200, GB300) measured gpt-oss's MXFP4
experts only with BF16 activations (FlashInfer's TRT-LLM kernel, `w4a16_mxfp4`), vLLM's default.
With MXFP8 activations (`--quantization-config '{"moe": {"activation": "mxfp8"}}'`, in earlier
releases `VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8=1`: `w4a8_mxfp4_mxfp8`, perf/aic.py) the same
TRT-LLM-gen kernel family runs FP8 MMAs: 1.4x faster at a decode batch of 128 and 2.8-3.1x at 8192
tokens. The vLLM tables have that precision only at other expert shapes; TRT-LLM's tables (the same
kernels through TRT-LLM) have it at gpt-oss's, with experts spread whole over the ranks
(`moe_ep_size` k, `moe_tp_size` 1). Where both frameworks measured `w4a8_mxfp4_mxfp8` on B200 they
agree within 10-20 % (`tests/perf/test_borrowed_tables.py` checks it), so a vLLM target of that
precision reads TRT-LLM's rows for the expert shapes vLLM's table lacks (`DERIVED_MOE`): as
measured (EP k) and as the layout vLLM serves without `--enable-expert-parallel`, each expert's
width split over k ranks (`moe_tp_size` k), which in vLLM's own `w4a8_mxfp4_mxfp8` tables is within
10 % of EP k at decode sizes and at 8192 tokens and up to 1.6x slower at 512-2048 tokens (there the
priced TP layout is optimistic).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from .catalog import BLACKWELL_GPUS, package_root
from .overlay import link_all, publish
from .qk_norm import bundled_config

# (GPU, backend, table family, the GPU whose table of that family is priced instead)
BORROWED = (("b300_sxm", "vllm", "mla", "b200_sxm"),)
# (GPU, backend, MoE precision, the backend whose MoE rows fill the shapes the backend's table lacks)
DERIVED_MOE = tuple((gpu, "vllm", "w4a8_mxfp4_mxfp8", "trtllm") for gpu in BLACKWELL_GPUS)
MOE_TABLE = "moe_perf.parquet"


def uses_mla(model: str) -> bool:
    """Whether a bundled model's attention is MLA (a compressed KV latent: `kv_lora_rank`)."""
    cfg = bundled_config(model)
    cfg = cfg.get("text_config") or cfg
    return bool(cfg.get("kv_lora_rank"))


def borrowed_tables(model: str, gpu: str, backend: str,
                    moe_quant: str | None = None) -> tuple[tuple[str, str], ...]:
    """(family, source GPU) of each table a target prices from another GPU, and (`moe:<precision>`,
    source backend) of an MoE precision whose missing shapes come from another backend's table
    (empty: all its own)."""
    out = []
    for g, b, family, source in BORROWED:
        if g == gpu and b == backend and (family != "mla" or uses_mla(model)):
            out.append((family, source))
    for g, b, quant, source in DERIVED_MOE:
        if g == gpu and b == backend and quant == moe_quant:
            out.append((f"moe:{quant}", source))
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
    families = {f: s for f, s in borrowed if not f.startswith("moe:")}
    derived = {f.split(":", 1)[1]: s for f, s in borrowed if f.startswith("moe:")}

    def build(out: Path) -> None:
        link_all(src, out, ("data",))
        link_all(src / "data", out / "data", (gpu,))
        link_all(src / "data" / gpu, out / "data" / gpu, tuple(families) + (("moe",) if derived else ()))
        if derived:
            _derive_moe(src / "data" / gpu / "moe", out / "data" / gpu / "moe", backend, derived)
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


def _version_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else -1 for p in name.replace("rc", ".").split("."))


def _derive_moe(src: Path, dst: Path, backend: str, derived: dict[str, str]) -> None:
    """data/<gpu>/moe of the overlay: the package's, but the backend's latest MoE table holds, for
    each derived precision, the source backend's rows at the expert shapes it lacks (the latest
    source version's row of a point), as measured and with EP k read as MoE TP k."""
    import pyarrow as pa  # aiconfigurator-core's own dependency
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    link_all(src, dst, (backend,))
    versions = sorted((v for v in (src / backend).iterdir() if (v / MOE_TABLE).is_file()),
                      key=lambda v: _version_key(v.name))
    latest = versions[-1]
    link_all(src / backend, dst / backend, (latest.name,))
    link_all(latest, dst / backend / latest.name, (MOE_TABLE,))
    own = pq.read_table(latest / MOE_TABLE)
    shape = ("hidden_size", "inter_size", "num_experts", "topk")
    point = shape + ("moe_tp_size", "moe_ep_size", "distribution", "num_tokens")
    parts = [own]
    for quant, source in derived.items():
        have = {tuple(r[c] for c in shape) for r in
                own.filter(pc.equal(own["moe_dtype"], quant)).select(list(shape)).to_pylist()}
        kernel = own.filter(pc.equal(own["moe_dtype"], quant))["kernel_source"]
        seen: set[tuple] = set()
        rows: list[dict] = []
        for v in sorted(((src / source).iterdir() if (src / source).is_dir() else ()),
                        key=lambda v: _version_key(v.name), reverse=True):
            if not (v / MOE_TABLE).is_file():
                continue
            other = pq.read_table(v / MOE_TABLE, columns=own.column_names)
            for r in other.filter(pc.equal(other["moe_dtype"], quant)).to_pylist():
                if tuple(r[c] for c in shape) in have or r["moe_tp_size"] != 1:
                    continue
                layouts = [(1, r["moe_ep_size"])] + ([(r["moe_ep_size"], 1)] if r["moe_ep_size"] > 1 else [])
                for tp, ep in layouts:
                    row = dict(r, moe_tp_size=tp, moe_ep_size=ep, framework=own["framework"][0].as_py(),
                               version=latest.name,
                               kernel_source=kernel[0].as_py() if len(kernel) else r["kernel_source"])
                    key = tuple(row[c] for c in point)
                    if key not in seen:
                        seen.add(key)
                        rows.append(row)
        if rows:
            parts.append(pa.Table.from_pylist(rows, schema=own.schema))
    pq.write_table(pa.concat_tables(parts), dst / backend / latest.name / MOE_TABLE)
