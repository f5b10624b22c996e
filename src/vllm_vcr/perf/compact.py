"""The estimator's GEMM and attention tables cut down to what one target reads, kept beside the
perf cache.

A process that prices a step composition no earlier process priced loads the estimator, and
its first query reads its kernel tables (perf/spec_cache.py): ~0.5 CPU s, most of it the GEMM
and attention tables, which aiconfigurator-core reads row by row (on an H100 for vLLM: 107,188
GEMM rows of 10 columns, every precision it measured plus the collection's name, version,
device, op and kernel columns; 50,830 context and 62,166 decode attention rows, every head
size and KV-cache precision). It folds them into grids keyed by what an op looks up exactly
(a GEMM's precision; an attention's KV-cache precision and head size, among others) over the
axes it interpolates (m, n, k; heads, tokens, batch), and a query reads its own op's grid only.
So a target is given a systems directory (an overlay of the package's, like perf/tables.py's)
whose GEMM tables keep the five columns that loader reads (`gemm_dtype`, `m`, `n`, `k`,
`latency`) and the rows of the precisions the target's GEMMs run (its GEMM and MoE precisions,
and bfloat16), and whose attention tables keep the rows of its head size and KV-cache
precision, every row in its order (a loader keeps the first row of a point). Every other table
is the package's own file.

An overlay is made once per estimator identity, in a process that has the whole tables loaded
anyway, and used only after the estimator on it answered a set of step compositions exactly as
the estimator on the whole tables did; if it does not (a model whose ops look up other keys),
the GEMM cut alone is tried, then none (`unusable`: the target keeps reading the whole tables).
Equal grids give equal prices; tests/perf/test_compact_tables.py checks dense, MoE, MLA and FP8
targets over hostile compositions. This relies on the loaders' columns and grid keys:
aiconfigurator-core is pinned below 0.13 in pyproject.toml.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .catalog import package_root
from .overlay import link_all, publish

logger = logging.getLogger(__name__)

GEMM_COLUMNS = ("gemm_dtype", "m", "n", "k", "latency")  # what the estimator's GEMM loader reads
ATTENTION_TABLES = ("context_attention_perf.parquet", "generation_attention_perf.parquet")
# what the check asks both estimators: decode (requests, context) and mixed (tokens, decodes, isl, prefix)
CHECK_DECODES = ((1, 1), (1, 128), (7, 300), (64, 2048), (256, 8000), (1024, 512))
CHECK_MIXED = ((1, 0, 1, 0), (128, 1, 128, 0), (500, 3, 500, 0), (2048, 32, 1024, 0), (8192, 0, 8192, 4096),
               (3, 200, 1500, 0), (4096, 128, 6000, 2048))
_QUANT_ALIASES = {"fp8_static": "fp8"}  # the GEMM loader's lookup name for a precision


@dataclass(frozen=True)
class Cut:
    """One table of a family cut: the columns kept (None: all) and the rows whose column values
    are among the given ones."""

    family: str
    table: str
    columns: tuple[str, ...] | None
    rows: tuple[tuple[str, tuple], ...]


def plans(gemm_quant: str | None, moe_quant: str | None, kv_cache_quant: str | None,
          head_dim: int | None) -> list[tuple[Cut, ...]]:
    """The cuts to try for a target, most first. A precision not given: the estimator infers it
    from the model's config (bfloat16 for an unquantised one; if it infers another, the check
    finds the cut table lacking and the next plan is tried)."""
    dtypes = tuple(sorted({_QUANT_ALIASES.get(q, q) for q in ("bfloat16", gemm_quant, moe_quant) if q}))
    gemm = Cut("gemm", "gemm_perf.parquet", GEMM_COLUMNS, (("gemm_dtype", dtypes),))
    out = []
    if head_dim:
        attention = (("head_dim", (head_dim,)), ("kv_cache_dtype", (kv_cache_quant or "bfloat16",)))
        out.append((gemm, *(Cut("attention", t, None, attention) for t in ATTENTION_TABLES)))
    out.append((gemm,))
    return out


def model_head_dim(config: dict) -> int | None:
    """An attention head's size from a model config (None: not stated)."""
    config = config.get("text_config") or config
    if config.get("head_dim"):
        return int(config["head_dim"])
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    return hidden // heads if heads and hidden else None


def _root(cache: Path) -> Path:
    return cache.parent / "aic-compact"


def kept(cache: Path | None, name: str) -> str | None:
    """The checked overlay's systems directory for `name` (None: none made, or none usable)."""
    if cache is None:
        return None
    d = _root(cache) / name
    try:
        plan = (d / "ok").read_text().strip()
    except OSError:
        return None
    return str(d / plan / "systems") if plan.isdigit() and (d / plan / "systems").is_dir() else None


def tried(cache: Path | None, name: str) -> bool:
    """Whether the overlays for `name` were made and checked (one usable, or none)."""
    if cache is None:
        return True
    d = _root(cache) / name
    return (d / "ok").is_file() or (d / "unusable").is_file()


def make(cache: Path | None, name: str, base: str | None, gpu: str, backend: str, tries: list[tuple[Cut, ...]],
         engine_on: Callable[[str], Any], whole: Any) -> str | None:
    """Make the overlays of `tries` in turn (from `base`, None: the package's systems directory)
    until the estimator `engine_on(its systems directory)` answers as `whole` (the estimator on
    the whole tables) does; that one's systems directory (None: none did)."""
    if cache is None:
        return None
    d = _root(cache) / name
    src = Path(base) if base else package_root() / "systems"
    want = None
    for i, cuts in enumerate(tries):
        try:
            systems = _build(d / str(i), src, gpu, backend, cuts)
        except Exception as e:  # noqa: BLE001 - unwritable place, unreadable table: the whole tables serve
            logger.debug("compact tables: cannot make %s (%s)", d / str(i), e)
            return None
        try:
            want = _answers(whole) if want is None else want
            same = _answers(engine_on(str(systems))) == want
        except Exception as e:  # noqa: BLE001 - e.g. a key the cut table lacks
            logger.debug("compact tables: %s does not price (%s)", systems, e)
            same = False
        if same:
            _mark(d, "ok", str(i))
            return str(systems)
        shutil.rmtree(d / str(i), ignore_errors=True)
    _mark(d, "unusable", "")
    return None


def _answers(handle: Any) -> list:
    out: list = [handle.decode_step_latency(n, ctx, 2) for n, ctx in CHECK_DECODES]
    out += [tuple(handle.mixed_step_breakdown(t, d, isl, 2, p)) for t, d, isl, p in CHECK_MIXED]
    return out


def _mark(d: Path, word: str, text: str) -> None:
    try:
        fd, tmp = tempfile.mkstemp(dir=d, prefix=word)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, d / word)
    except OSError as e:
        logger.debug("compact tables: cannot mark %s (%s)", d, e)


def _cut(src: Path, dst: Path, cut: Cut) -> None:
    import pyarrow as pa  # aiconfigurator-core's own dependency
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(src, columns=list(cut.columns) if cut.columns else None)
    for column, values in cut.rows:
        table = table.filter(pc.is_in(table[column], value_set=pa.array(list(values), type=table[column].type)))
    pq.write_table(table, dst)


def _build(target: Path, src: Path, gpu: str, backend: str, cuts: tuple[Cut, ...]) -> Path:
    """The overlay's systems directory: `src`'s entries linked, but in every version directory of
    data/<gpu>/<family>/<backend>, whose tables named by `cuts` are cut."""
    families = sorted({c.family for c in cuts})

    def build(out: Path) -> None:
        link_all(src, out, ("data",))
        link_all(src / "data", out / "data", (gpu,))
        link_all(src / "data" / gpu, out / "data" / gpu, tuple(families))
        for family in families:
            fam = src / "data" / gpu / family
            if not fam.is_dir():
                continue
            link_all(fam, out / "data" / gpu / family, (backend,))
            if not (fam / backend).is_dir():
                continue
            tables = {c.table: c for c in cuts if c.family == family}
            (out / "data" / gpu / family / backend).mkdir()
            for version in (fam / backend).iterdir():
                dst = out / "data" / gpu / family / backend / version.name
                if not version.is_dir():
                    dst.symlink_to(version.resolve())
                    continue
                link_all(version, dst, tuple(tables))
                for name, cut in tables.items():
                    if (version / name).exists():
                        _cut(version / name, dst / name, cut)

    return publish(target, build)
