#!/usr/bin/env python
"""The perf model against measured silicon: the vLLM aggregated rows of aiconfigurator-core's
systems/silicon_sample.csv, each row's benchmark simulated through the engine with the perf model
`serve`, `play` and `simulate` run (`--perf-model aic` and its defaults, vllm_vcr.simulate.silicon),
TTFT/TPOT compared with the measured values, next to the estimator's own static estimate
(run_static, batch = concurrency).

The protocol (docs/fidelity.md): rows are split by configuration group (model x GPU x precision x
parallelism; byte-identical twins kept once) into train / dev / test by a fixed seeded rule, frozen
in bench/fidelity/silicon_split.json. `--fit` simulates the train rows with the kernels alone and
fits the perf model's global terms (host time per step, QK norm, frontend time; printed, to be
set as the defaults in vllm_vcr/perf/aic.py), and, from a second simulation with a probe of the
host time of steps without CUDA graphs, that term with them held (printed to compare: it is off
in the shipped model); `--split dev` checks a model version while
developing it; `--split test --write-docs` is the report, run once per model version.

usage: python bench/silicon_validation.py --split dev|test|train [--jobs 2] [--write-docs]
       python bench/silicon_validation.py --fit
       python bench/silicon_validation.py --make-split        (once: the split is frozen)
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import time
import hashlib
import zlib
from dataclasses import replace
from multiprocessing import Pool
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from vllm_vcr.perf.catalog import resolve_model  # noqa: E402
from vllm_vcr.perf.qk_norm import bundled_config, qk_norm_layers  # noqa: E402
from vllm_vcr.simulate.silicon import (HostTime, SiliconRow, plan_for, simulate_row, static_estimate,  # noqa: E402
                                        supported)
from vllm_vcr.simulate.silicon_beyond import (ROW_KINDS, kind_label, row_from_dict, rows_of_kind,  # noqa: E402
                                               simulate_any, static_any, supported_any)

DOC = ROOT / "docs" / "fidelity.md"
BEGIN, END = "<!-- silicon:begin -->", "<!-- silicon:end -->"
SPLIT_FILE = ROOT / "bench" / "fidelity" / "silicon_split.json"
SPLIT_SEED = "vllm-vcr/silicon/2026-12-06"
SPLIT_RULE = ("u = first 8 hex digits of sha256(seed + '|' + group) / 16^8; test if u < 0.30, dev if u < 0.50, "
              "else train")
GRID = np.arange(0.0, 4.0001, 0.05)  # candidate host overheads per step (ms)
SEQ_GRID = np.arange(0.0, 0.1201, 0.006)  # candidate host overheads per running sequence per step (ms)
EXPOSED_GRID = np.arange(0.0, 3.0001, 0.05)  # candidate exposed host times per step under async scheduling (ms)
QK_GRID = np.arange(0.0, 40.001, 4.0)  # candidate GPU times per QK-normed layer (µs)
QK_ALLREDUCE_GRID = np.arange(0.0, 40.001, 5.0)  # candidate GPU times per cross-rank QK-norm all-reduce (µs)
EAGER_PROBE_US = 100.0  # the eager-step term (µs per layer) of the fit's second simulation (its sensitivity)
EAGER_GRID = np.arange(0.0, 400.001, 10.0)  # candidate host times per layer of a step without CUDA graphs (µs)
EAGER_TP_GRID = np.arange(0.0, 400.001, 10.0)  # candidate extra per layer when TP > 1 (µs)


def _job(task: tuple[dict, HostTime, int]) -> dict:
    row_d, host, max_tokens = task
    logging.disable(logging.WARNING)
    row = row_from_dict(row_d)  # a vLLM aggregated row, an SGLang one or a disaggregated one
    out = {"id": row.id, "host": host.__dict__}
    unknown = _unknown_deployment(row)
    if unknown is not None:  # (what ran is not known: nothing to compare with)
        return {**out, "unknown_deployment": unknown}
    why = supported(row) if type(row) is SiliconRow else supported_any(row)
    if why is not None:
        return {**out, "unsupported": why}
    s_ttft, s_tpot = static_estimate(row) if type(row) is SiliconRow else static_any(row)
    t0 = time.perf_counter()
    sim = simulate_row(row, host=host, max_tokens=max_tokens) if type(row) is SiliconRow else \
        simulate_any(row, host=host, max_tokens=max_tokens)
    return {**out, "static_ttft_ms": s_ttft, "static_tpot_ms": s_tpot, "sim": sim,
            "cpu_s": time.perf_counter() - t0}


def _unknown_deployment(row) -> str | None:
    """Why an aggregated vLLM row's deployment is not known (None: it is, or another kind of row)."""
    return row.unknown_deployment if type(row) is SiliconRow else None


def _run(rows: list[SiliconRow], overhead: HostTime, args, done: dict[str, dict], out,
         budget_s: float) -> None:
    todo = [r for r in rows if r.id not in done or _overhead_of(done[r.id]) != overhead
            or ("unknown_deployment" in done[r.id]) != (_unknown_deployment(r) is not None)]
    # cheapest first (output tokens to simulate): a time budget leaves out the most expensive rows
    todo.sort(key=lambda r: (lambda p: p.requests * p.osl)(plan_for(r, args.max_tokens)))
    tasks = [(r.__dict__, overhead, args.max_tokens) for r in todo]
    print(f"simulating {len(tasks)} rows at {overhead} with {args.jobs} job(s)",
          file=sys.stderr)
    t0 = time.time()
    pool = Pool(args.jobs)
    try:
        for i, res in enumerate(pool.imap_unordered(_job, tasks), 1):
            done[res["id"]] = res
            out.write(json.dumps(res) + "\n")
            out.flush()
            if i % 10 == 0 or i == len(tasks):
                print(f"  {i}/{len(tasks)} rows, {time.time() - t0:.0f} s", file=sys.stderr)
            if time.time() - t0 > budget_s:
                print(f"  time budget spent: {len(tasks) - i} rows left out", file=sys.stderr)
                break
    finally:
        pool.terminate()


def _overhead_of(res: dict) -> HostTime:
    return HostTime(**res.get("host", {}))


def _step_ms(gpu: np.ndarray, batch: np.ndarray, is_async: np.ndarray, qk_layers: np.ndarray,
             qk_spans: np.ndarray, h: HostTime) -> np.ndarray:
    """A step's time from its GPU time, as the engine prices it (engine/latency/aic.py): the QK
    norms the kernel data lacks added to the GPU time (perf/qk_norm.py), then the host time."""
    gpu = gpu + qk_layers * (h.qk_norm_us + qk_spans * h.qk_norm_allreduce_us) / 1e3
    host = h.step_ms + h.per_seq_ms * batch
    return np.where(is_async, np.maximum(gpu, host) + h.async_exposed_ms, gpu + host)


def _training_arrays(rows: list[SiliconRow], done: dict[str, dict], probe: dict[str, dict] | None = None):
    """Per simulated training row: measured TPOT, the simulated TPOT without the correction (each
    output token takes one step: about the GPU's step time), the running batch, async or not,
    measured and simulated TTFT, ISL/1000, QK-normed layers, whether their norm spans TP ranks,
    the benchmark's concurrency; and, from the run with the eager-step probe (`probe`), what
    EAGER_PROBE_US per layer of every step without CUDA graphs added to TTFT and to TPOT, and
    whether the row runs TP > 1."""
    out = []
    for r in rows:
        res = done.get(r.id)
        pr = (probe or {}).get(r.id)
        if probe is not None and not (pr and "sim" in pr):
            continue
        if res and "sim" in res and math.isfinite(res["sim"]["tpot_ms"]):
            h, c = _overhead_of(res), res["sim"]["per_engine_concurrency"]
            if h != HostTime():
                raise SystemExit("the fit needs the training rows simulated without the correction")
            layers, spans = qk_norm_layers(bundled_config(resolve_model(r.model)[0]))
            d_ttft = pr["sim"]["ttft_ms"] - res["sim"]["ttft_ms"] if pr else 0.0
            d_tpot = pr["sim"]["tpot_ms"] - res["sim"]["tpot_ms"] if pr else 0.0
            out.append((r.tpot_ms, res["sim"]["tpot_ms"], c, r.async_scheduling, r.ttft_ms, res["sim"]["ttft_ms"],
                        r.isl / 1000, layers, spans and r.tp > 1, r.concurrency, d_ttft, d_tpot, r.tp > 1))
    return [np.array(col) for col in zip(*out)]


def fit_overhead(rows: list[SiliconRow], done: dict[str, dict]) -> HostTime:
    """The global correction minimising the median |TPOT error| on the training rows of both
    kinds: the host time per step, a + b * running sequences (added to the step's GPU time, or
    overlapped with it under async scheduling but for k ms exposed), and the QK norms' GPU time
    (q µs per QK-normed layer + r µs per layer whose norm spans the TP ranks). a and k are
    searched at once (array axes), b, q and r in loops."""
    meas, gpu, batch, is_async, _, _, _, qk_layers, qk_spans, _, _, _, _ = _training_arrays(rows, done)
    a, k = GRID[:, None, None], EXPOSED_GRID[None, :, None]
    best = (math.inf,)
    for b in SEQ_GRID:
        host = a + b * batch
        for q in QK_GRID:
            for r in QK_ALLREDUCE_GRID:
                g = gpu + qk_layers * (q + qk_spans * r) / 1e3
                step = np.where(is_async, np.maximum(g, host) + k, g + host)
                err = np.median(np.abs(step - meas) / meas, axis=2)
                i, j = np.unravel_index(int(err.argmin()), err.shape)
                best = min(best, (float(err[i, j]), float(GRID[i]), float(b), float(EXPOSED_GRID[j]), float(q),
                                  float(r)))
    _, a_ms, b_ms, k_ms, q_us, r_us = best
    return HostTime(round(a_ms, 3), round(b_ms, 4), round(k_ms, 3), round(q_us, 1), round(r_us, 1))


def fit_frontend(rows: list[SiliconRow], done: dict[str, dict], host: HostTime) -> HostTime:
    """The API server's time before the engine sees a request, `f0 + f1 * ISL / 1000 + f2 * C`
    (HTTP and request checks; tokenising the prompt; the server's work for the C streams it
    serves at once, which a new request waits behind), minimising the median |TTFT error| on the
    training rows simulated with the kernels alone. Fitted as a share added to the simulated TTFT
    (a step's added time adds about twice itself to TTFT: the step the request waits for and its
    prefill; of the host time, under async scheduling only its exposed part); the perf model
    applies it before the request enters the scheduler (engine/latency/aic.py)."""
    _, gpu, batch, is_async, meas, sim, isl, qk_layers, qk_spans, conc, _, _, _ = _training_arrays(rows, done)
    sim = sim + 2 * (_step_ms(gpu, batch, is_async, qk_layers, qk_spans, host) - gpu)
    f0, f1 = np.arange(0.0, 150.001, 1.0)[:, None, None], np.arange(0.0, 30.001, 0.5)[None, :, None]
    best = (math.inf,)
    for f2 in np.arange(0.0, 3.001, 0.1):  # f0 and f1 searched at once (array axes)
        err = np.median(np.abs(sim + f0 + f1 * isl + f2 * conc - meas) / meas, axis=2)
        i, j = np.unravel_index(int(err.argmin()), err.shape)
        best = min(best, (float(err[i, j]), float(f0[i, 0, 0]), float(f1[0, j, 0]), round(float(f2), 2)))
    return replace(host, frontend_ms=best[1], frontend_ms_per_1k_tokens=best[2], frontend_ms_per_request=best[3])


def fit_eager(rows: list[SiliconRow], done: dict[str, dict], host: HostTime, probe: dict[str, dict]) -> HostTime:
    """The host time of a step vLLM runs without CUDA graphs, `e0 + e1 [TP > 1]` µs per layer,
    minimising the sum of the median |TTFT error| and the median |TPOT error| on the training rows
    with the other terms of `host` (each row's share of the term from the probe run)."""
    tpot_meas, gpu, batch, is_async, meas, sim, isl, qk_layers, qk_spans, conc, d_ttft, d_tpot, tp = \
        _training_arrays(rows, done, probe)
    step = _step_ms(gpu, batch, is_async, qk_layers, qk_spans, host)
    ttft = sim + 2 * (step - gpu) + host.frontend_ms + host.frontend_ms_per_1k_tokens * isl \
        + host.frontend_ms_per_request * conc
    e0, e1 = EAGER_GRID[:, None, None], EAGER_TP_GRID[None, :, None]
    per_layer = (e0 + tp * e1) / EAGER_PROBE_US
    err = (np.median(np.abs(ttft + d_ttft * per_layer - meas) / meas, axis=2)
           + np.median(np.abs(step + d_tpot * per_layer - tpot_meas) / tpot_meas, axis=2))
    i, j = np.unravel_index(int(err.argmin()), err.shape)
    return replace(host, eager_layer_us=float(EAGER_GRID[i]), eager_layer_tp_us=float(EAGER_TP_GRID[j]))


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas * 100


def _stats(values: list[float]) -> str:
    """median |error|, p90 |error|, median signed error (three columns)."""
    if not values:
        return "– | – | –"
    a = np.abs(values)
    return f"{np.median(a):.1f} % | {np.percentile(a, 90):.1f} % | {np.median(values):+.1f} %"


def _natural(name: str) -> list:
    """Numbers in a name sort as numbers (c 8 before c 129, 1024/128 before 1024/1024)."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name)]


def errors(items: list[tuple[SiliconRow, dict]]) -> dict[str, list[float]]:
    e = {k: [] for k in ("tpot", "s_tpot", "ttft", "s_ttft")}
    for r, res in items:
        e["tpot"].append(_err(res["sim"]["tpot_ms"], r.tpot_ms))
        e["ttft"].append(_err(res["sim"]["ttft_ms"], r.ttft_ms))
        e["s_tpot"].append(_err(res["static_tpot_ms"], r.tpot_ms))
        e["s_ttft"].append(_err(res["static_ttft_ms"], r.ttft_ms))
    return e


def table(rows: list[SiliconRow], done: dict[str, dict], key, title: str) -> list[str]:
    groups: dict[str, list[tuple[SiliconRow, dict]]] = {}
    for r in rows:
        res = done.get(r.id)
        if res and "sim" in res:
            groups.setdefault(key(r), []).append((r, res))
    lines = [f"| {title} | rows | TPOT sim med | p90 | bias | TPOT static med | p90 | bias "
             f"| TTFT sim med | p90 | bias | TTFT static med | p90 | bias |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in sorted(groups, key=_natural) + ["**all**"]:
        items = [x for g in groups.values() for x in g] if name == "**all**" else groups[name]
        e = errors(items)
        lines.append(f"| {name} | {len(items)} | {_stats(e['tpot'])} | {_stats(e['s_tpot'])} | "
                     f"{_stats(e['ttft'])} | {_stats(e['s_ttft'])} |")
    return lines


def _conc_band(r: SiliconRow) -> str:
    c = r.concurrency
    return next((f"c {lo}–{hi}" for lo, hi in ((1, 8), (9, 32), (33, 128), (129, 1024)) if c <= hi), "c 1025+")


TABLES = (  # (key, title)
    (lambda r: r.gpu, "GPU"),
    (lambda r: r.family, "model family"),
    (_conc_band, "load (concurrency)"),
    (lambda r: f"tp {r.tp}" + (f" × dp {r.attention_dp}" if r.attention_dp > 1 else ""), "parallelism"),
    (lambda r: r.precision_label, "precision (sample's label)"),
    (lambda r: "InferenceX (burst, 10·C prompts)" if r.inferencex else
     "other (burst)" if r.burst else "other (steady state)", "harness"),
)


def tables_for(rows: list[SiliconRow]) -> tuple:
    """The report's tables; rows beyond aggregated vLLM (SGLang, disaggregated) first by engine type and deployment."""
    if all(type(r) is SiliconRow for r in rows):
        return TABLES
    return ((kind_label, "engine type, deployment"),) + TABLES


def _left_out(rows: list[SiliconRow], done: dict[str, dict], field: str, label) -> dict[str, int]:
    """Rows whose result says why they were not simulated (`field`), counted by `label(row, why)`."""
    out: dict[str, int] = {}
    for r in rows:
        why = done.get(r.id, {}).get(field)
        if why:
            k = label(r, why)
            out[k] = out.get(k, 0) + 1
    return out


def _unsupported(rows: list[SiliconRow], done: dict[str, dict]) -> dict[str, int]:
    return _left_out(rows, done, "unsupported",
                     lambda r, why: f"{r.model} on {r.gpu} ({r.gemm_quant}): {why.split('): ', 1)[-1][:120]}")


def _unknown(rows: list[SiliconRow], done: dict[str, dict]) -> dict[str, int]:
    return _left_out(rows, done, "unknown_deployment",
                     lambda r, why: f"{r.model} on {r.gpu} at concurrency {r.concurrency}: {why}")


def render(split: str, rows: list[SiliconRow], done: dict[str, dict], host: HostTime, command: str,
           n_twins: int, n_groups: int) -> str:
    unsupported = _unsupported(rows, done)
    unknown = _unknown(rows, done)
    sims = {r.id: done[r.id]["sim"] for r in rows if "sim" in done.get(r.id, {})}
    n_left = sum(1 for r in rows if r.id not in done)
    n_short = sum(1 for r in rows if r.id in sims and sims[r.id].get("sim_osl", r.osl) < r.osl)
    out = [f"Made by `{command}`.", "",
           f"The **{split}** split: {n_groups} configuration groups, {len(rows)} rows ({n_twins} byte-identical "
           f"twins of other rows left out); {len(sims)} simulated ({n_short} with shortened requests), "
           f"{sum(unsupported.values())} the estimator cannot price (below), "
           + (f"{sum(unknown.values())} whose deployment the row does not tell (below), " if unknown else "")
           + f"{n_left} not simulated in the run's "
           f"time. Error = (predicted − measured) / measured: *med* and *p90* of its absolute value, *bias* its "
           f"signed median. *sim* = the row's benchmark through the engine with the perf model's defaults "
           f"(`--perf-model aic`: host {host.step_ms:.2f} ms per step + {host.per_seq_ms * 1e3:.0f} µs per "
           f"sequence, {host.async_exposed_ms:.2f} ms exposed under async scheduling, QK norm "
           f"{host.qk_norm_us:.0f} + {host.qk_norm_allreduce_us:.0f} µs per layer, frontend "
           f"{host.frontend_ms:.1f} ms + {host.frontend_ms_per_1k_tokens:.1f} ms per 1000 prompt tokens + "
           f"{host.frontend_ms_per_request:.2f} ms per request in flight); *static* = the estimator's "
           f"`run_static` with batch = concurrency.", ""]
    for key, title in tables_for(rows):
        out += [*table(rows, done, key, title), ""]
    if unsupported:
        out += ["Rows the estimator cannot price (model on GPU (GEMM precision): reason, rows):", ""]
        out += [f"- {k}: {v}" for k, v in sorted(unsupported.items())]
    if unknown:
        out += ["", "Rows whose deployment the row does not tell (not simulated; reason, rows):", ""]
        out += [f"- {k}: {v}" for k, v in sorted(unknown.items())]
    return "\n".join(out)


# --- the split -------------------------------------------------------------------------------------
def dedupe(rows: list[SiliconRow]) -> tuple[list[SiliconRow], int]:
    """One row per measurement: rows with the same model, GPU, lengths, concurrency and the very
    same TTFT and TPOT are one measurement under two ids (or two spellings of its deployment)."""
    seen: dict[tuple, SiliconRow] = {}
    for r in sorted(rows, key=lambda r: r.id):
        seen.setdefault((r.model, r.gpu, r.isl, r.osl, r.concurrency, r.ttft_ms, r.tpot_ms), r)
    kept = sorted(seen.values(), key=lambda r: r.id)
    return kept, len(rows) - len(kept)


def split_of_group(group: str) -> str:
    u = int(hashlib.sha256(f"{SPLIT_SEED}|{group}".encode()).hexdigest()[:8], 16) / 16 ** 8
    return "test" if u < 0.30 else "dev" if u < 0.50 else "train"


def make_split(rows: list[SiliconRow]) -> dict:
    groups = sorted({r.group for r in rows})
    out: dict = {"seed": SPLIT_SEED, "rule": SPLIT_RULE, "train": [], "dev": [], "test": []}
    for g in groups:
        out[split_of_group(g)].append(g)
    return out


def split_file(kind: str = "vllm-agg") -> Path:
    """The frozen split of a row kind (the vLLM aggregated rows': SPLIT_FILE; the others' beside it, same rule)."""
    return SPLIT_FILE if kind == "vllm-agg" else SPLIT_FILE.with_name(f"silicon_split_{kind}.json")


def load_split(path: Path = SPLIT_FILE) -> dict[str, str]:
    data = json.loads(path.read_text())
    return {g: name for name in ("train", "dev", "test") for g in data[name]}


def stratified_sample(rows: list[SiliconRow], n: int) -> list[SiliconRow]:
    """`n` rows spread over models, GPUs and concurrency bands (a fixed pick: crc32 order), for
    iterating on a slice; the split of each row is kept."""
    groups: dict[tuple, list[SiliconRow]] = {}
    for r in sorted(rows, key=lambda r: zlib.crc32(r.id.encode())):
        groups.setdefault((r.model, r.gpu, _conc_band(r)), []).append(r)
    picked: list[SiliconRow] = []
    while len(picked) < n and any(groups.values()):
        for g in groups.values():
            if g and len(picked) < n:
                picked.append(g.pop(0))
    return picked


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", choices=("train", "dev", "test"), default="dev",
                    help="the rows to simulate with the perf model's defaults (test: the report, once per model "
                         "version)")
    ap.add_argument("--rows", choices=ROW_KINDS, default="vllm-agg",
                    help="which measured rows: vLLM aggregated (default), SGLang aggregated (--engine-type sglang, "
                         "SGLang's kernel data), or disaggregated (prefill and decode workers, the KV transfer)")
    ap.add_argument("--fit", action="store_true",
                    help="simulate the train rows with the kernels alone and fit the perf model's global terms")
    ap.add_argument("--make-split", action="store_true", help="write the frozen split (refuses to overwrite it)")
    ap.add_argument("--jobs", type=int, default=max(os.cpu_count() or 2, 1))
    ap.add_argument("--results", default=None,
                    help="per-row results (resumable; default bench/fidelity/silicon_<split>.jsonl)")
    ap.add_argument("--max-tokens", type=int, default=20_000_000,
                    help="output tokens simulated per row, at most (the default fits every row's whole benchmark)")
    ap.add_argument("--budget-s", type=float, default=6000.0, help="wall seconds; the costliest rows are left out")
    ap.add_argument("--sample", type=int, default=None,
                    help="only N rows of the split, spread over models, GPUs and concurrencies (a slice)")
    ap.add_argument("--group", default=None, help="only the split's groups whose name contains this")
    ap.add_argument("--cheapest", type=int, default=None,
                    help="only the N rows of the split cheapest to simulate (a quick check)")
    ap.add_argument("--render-only", action="store_true", help="simulate nothing: the table from the results file")
    ap.add_argument("--write-docs", action="store_true", help="write the table into docs/fidelity.md")
    args = ap.parse_args()
    rows, n_twins = dedupe(rows_of_kind(args.rows))
    frozen = split_file(args.rows)
    if args.make_split:
        if frozen.exists():
            raise SystemExit(f"{frozen} exists: the split is frozen")
        frozen.write_text(json.dumps(make_split(rows), indent=1) + "\n")
        return 0
    split_of = load_split(frozen)
    new = sorted({r.group for r in rows} - set(split_of))
    if new:
        raise SystemExit(f"groups not in the frozen split: {new}")
    name = "train" if args.fit else args.split
    mine = [r for r in rows if split_of[r.group] == name]
    if args.group:
        mine = [r for r in mine if args.group in r.group]
    n_groups = len({r.group for r in mine})
    twins = n_twins if not (args.sample or args.cheapest or args.group) else 0
    if args.sample:
        mine = stratified_sample(mine, args.sample)
    if args.cheapest:
        mine = sorted(mine, key=lambda r: (lambda p: p.requests * p.osl)(plan_for(r, args.max_tokens)))
        mine = sorted(mine[: args.cheapest], key=lambda r: r.id)
    kind = "" if args.rows == "vllm-agg" else f"{args.rows}_"
    path = Path(args.results or ROOT / "bench" / "fidelity" / f"silicon_{kind}{'fit' if args.fit else name}.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    done: dict[str, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            res = json.loads(line)
            done[res["id"]] = res
    host = HostTime() if args.fit else HostTime.fitted()
    if not args.render_only:
        with path.open("a") as out:
            _run(mine, host, args, done, out, args.budget_s)
    if args.fit:
        probe: dict[str, dict] = {}  # the same rows with the eager-step probe: each row's share of that term
        probe_path = path.with_name(path.stem + "_eager.jsonl")
        if probe_path.exists():
            for line in probe_path.read_text().splitlines():
                res = json.loads(line)
                probe[res["id"]] = res
        if not args.render_only:
            with probe_path.open("a") as out:
                _run(mine, HostTime(eager_layer_us=EAGER_PROBE_US), args, probe, out, args.budget_s)
        fitted = fit_frontend(mine, done, fit_overhead(mine, done))
        print(f"fitted on {len(mine)} train rows: {fitted}")
        # the eager-step term with those held: off in the shipped model (docs/fidelity.md), printed to compare
        print(f"steps without CUDA graphs, fitted with them held: {fit_eager(mine, done, fitted, probe).eager_layer_us} "
              "us per layer (the default is 0: off)")
        return 0
    command = f"python bench/silicon_validation.py --split {name}" + (f" --rows {args.rows}" if kind else "") + (" --write-docs" if args.write_docs else "") \
        + (f" --sample {args.sample}" if args.sample else "") + (f" --cheapest {args.cheapest}" if args.cheapest else "") \
        + (f" --group '{args.group}'" if args.group else "")
    text = render(name, mine, done, host, command, twins, n_groups)
    print(text)
    if args.write_docs:
        tag = f"silicon:{args.rows}:{name}" if kind else f"silicon:{name}"
        begin, end = BEGIN.replace("silicon", tag), END.replace("silicon", tag)
        doc = DOC.read_text()
        if begin not in doc:
            raise SystemExit(f"docs/fidelity.md has no {begin} marker")
        doc = doc[: doc.index(begin) + len(begin)] + "\n\n" + text + "\n\n" + doc[doc.index(end):]
        DOC.write_text(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
