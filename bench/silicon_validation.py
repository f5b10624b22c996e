#!/usr/bin/env python
"""The perf model against measured silicon: every vLLM aggregated row of aiconfigurator-core's
systems/silicon_sample.csv that the estimator can price, simulated closed-loop through the
engine (vllm_vcr.simulate.silicon), TTFT/TPOT compared with the measured values, next to the
estimator's own static estimate (run_static, batch = concurrency).

Each row is simulated as the benchmark that measured it (silicon.py: InferenceX's burst of C
users and 10*C prompts, or a steady state; the whole benchmark by default, fewer or shorter
requests under a smaller --max-tokens, see `plan_for`). One global correction, the engine's host
time per step (a ms + b ms per running sequence; added to the GPU time, or, under async
scheduling, overlapped with it but for k ms exposed), the GPU time of the attention's QK norm
the kernel data lack (q µs per QK-normed layer + r µs per layer whose norm spans the TP ranks)
and a frontend share of TTFT, is fitted on the declared training split (rows with
crc32(id) % 3 == 0) and the held-out rows are simulated with it; no per-row tuning.
Results go to a JSONL (resumable) and the table into docs/fidelity.md between
the `silicon` markers.

usage: python bench/silicon_validation.py [--jobs 2] [--results bench/fidelity/silicon_rows.jsonl]
                                          [--max-tokens 20000000] [--budget-s 6000] [--limit N]
                                          [--render-only] [--write-docs]
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
import zlib
from multiprocessing import Pool
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from vllm_vcr.perf.catalog import resolve_model  # noqa: E402
from vllm_vcr.perf.qk_norm import bundled_config, qk_norm_layers  # noqa: E402
from vllm_vcr.simulate.silicon import (HostTime, SiliconRow, plan_for, simulate_row, static_estimate,  # noqa: E402
                                        supported, vllm_agg_rows)

DOC = ROOT / "docs" / "fidelity.md"
BEGIN, END = "<!-- silicon:begin -->", "<!-- silicon:end -->"
GRID = np.arange(0.0, 4.0001, 0.05)  # candidate host overheads per step (ms)
SEQ_GRID = np.arange(0.0, 0.0601, 0.006)  # candidate host overheads per running sequence per step (ms)
EXPOSED_GRID = np.arange(0.0, 3.0001, 0.05)  # candidate exposed host times per step under async scheduling (ms)
QK_GRID = np.arange(0.0, 40.001, 4.0)  # candidate GPU times per QK-normed layer (µs)
QK_ALLREDUCE_GRID = np.arange(0.0, 40.001, 5.0)  # candidate GPU times per cross-rank QK-norm all-reduce (µs)


def _job(task: tuple[dict, HostTime, int]) -> dict:
    row_d, host, max_tokens = task
    logging.disable(logging.WARNING)
    row = SiliconRow(**row_d)
    out = {"id": row.id, "split": row.split, "overhead_ms": host.step_ms, "per_seq_ms": host.per_seq_ms,
           "async_exposed_ms": host.async_exposed_ms, "qk_norm_us": host.qk_norm_us,
           "qk_norm_allreduce_us": host.qk_norm_allreduce_us}
    why = supported(row)
    if why is not None:
        return {**out, "unsupported": why}
    s_ttft, s_tpot = static_estimate(row)
    t0 = time.perf_counter()
    sim = simulate_row(row, host=host, max_tokens=max_tokens)
    return {**out, "static_ttft_ms": s_ttft, "static_tpot_ms": s_tpot, "sim": sim,
            "cpu_s": time.perf_counter() - t0}


def _run(rows: list[SiliconRow], overhead: HostTime, args, done: dict[str, dict], out,
         budget_s: float) -> None:
    todo = [r for r in rows if r.id not in done or _overhead_of(done[r.id]) != overhead]
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
    return HostTime(res.get("overhead_ms", 0.0), res.get("per_seq_ms", 0.0), res.get("async_exposed_ms", 0.0),
                    res.get("qk_norm_us", 0.0), res.get("qk_norm_allreduce_us", 0.0))


def _step_ms(gpu: np.ndarray, batch: np.ndarray, is_async: np.ndarray, qk_layers: np.ndarray,
             qk_spans: np.ndarray, h: HostTime) -> np.ndarray:
    """A step's time from its GPU time, as the engine prices it (engine/latency/aic.py): the QK
    norms the kernel data lacks added to the GPU time (perf/qk_norm.py), then the host time."""
    gpu = gpu + qk_layers * (h.qk_norm_us + qk_spans * h.qk_norm_allreduce_us) / 1e3
    host = h.step_ms + h.per_seq_ms * batch
    return np.where(is_async, np.maximum(gpu, host) + h.async_exposed_ms, gpu + host)


def _training_arrays(rows: list[SiliconRow], done: dict[str, dict]):
    """Per simulated training row: measured TPOT, the simulated TPOT without the correction (each
    output token takes one step: about the GPU's step time), the running batch, async or not,
    measured and simulated TTFT, ISL/1000, QK-normed layers, whether their norm spans TP ranks,
    the benchmark's concurrency."""
    out = []
    for r in rows:
        res = done.get(r.id)
        if res and "sim" in res and math.isfinite(res["sim"]["tpot_ms"]):
            h, c = _overhead_of(res), res["sim"]["per_engine_concurrency"]
            if h != HostTime():
                raise SystemExit("the fit needs the training rows simulated without the correction")
            layers, spans = qk_norm_layers(bundled_config(resolve_model(r.model)[0]))
            out.append((r.tpot_ms, res["sim"]["tpot_ms"], c, r.async_scheduling, r.ttft_ms, res["sim"]["ttft_ms"],
                        r.isl / 1000, layers, spans and r.tp > 1, r.concurrency))
    return [np.array(col) for col in zip(*out)]


def fit_overhead(rows: list[SiliconRow], done: dict[str, dict]) -> HostTime:
    """The global correction minimising the median |TPOT error| on the training rows of both
    kinds: the host time per step, a + b * running sequences (added to the step's GPU time, or
    overlapped with it under async scheduling but for k ms exposed), and the QK norms' GPU time
    (q µs per QK-normed layer + r µs per layer whose norm spans the TP ranks). a and k are
    searched at once (array axes), b, q and r in loops."""
    meas, gpu, batch, is_async, _, _, _, qk_layers, qk_spans, _ = _training_arrays(rows, done)
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


Frontend = tuple[float, float, float]  # first-token share: ms + ms per 1000 prompt tokens + ms per user


def frontend_ms(frontend: Frontend, row: SiliconRow) -> float:
    return frontend[0] + frontend[1] * row.isl / 1000 + frontend[2] * row.concurrency


def fit_frontend(rows: list[SiliconRow], done: dict[str, dict], host: HostTime) -> Frontend:
    """The frontend's share of the first token, `f0 + f1 * ISL + f2 * C` (HTTP and the first
    streamed chunk; tokenising and handing over the prompt, which grow with it; the API server's
    work for the C streams it serves at once, which a new request's input waits behind: what
    `serve`/`play` add for real and `simulate` leaves out), minimising the median |TTFT error| on the training rows,
    simulated without the correction (a step's added time adds about twice itself to TTFT: the
    step the request waits for and its prefill; of the host time, under async scheduling only
    its exposed part)."""
    _, gpu, batch, is_async, meas, sim, isl, qk_layers, qk_spans, conc = _training_arrays(rows, done)
    sim = sim + 2 * (_step_ms(gpu, batch, is_async, qk_layers, qk_spans, host) - gpu)
    f0, f1 = np.arange(0.0, 150.001, 1.0)[:, None, None], np.arange(0.0, 30.001, 0.5)[None, :, None]
    best = (math.inf,)
    for f2 in np.arange(0.0, 3.001, 0.1):  # f0 and f1 searched at once (array axes)
        err = np.median(np.abs(sim + f0 + f1 * isl + f2 * conc - meas) / meas, axis=2)
        i, j = np.unravel_index(int(err.argmin()), err.shape)
        best = min(best, (float(err[i, j]), float(f0[i, 0, 0]), float(f1[0, j, 0]), round(float(f2), 2)))
    return best[1], best[2], best[3]


def _err(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas * 100


def _stats(values: list[float]) -> str:
    if not values:
        return "– | –"  # two columns
    return f"{np.median(values):.1f} % | {np.percentile(values, 90):.1f} %"


def _natural(name: str) -> list:
    """Numbers in a name sort as numbers (c 8 before c 129, 1024/128 before 1024/1024)."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name)]


def table(rows: list[SiliconRow], done: dict[str, dict], key, title: str,
          frontend: Frontend = (0.0, 0.0, 0.0)) -> list[str]:
    groups: dict[str, list[tuple[SiliconRow, dict]]] = {}
    for r in rows:
        res = done.get(r.id)
        if res and "sim" in res:
            groups.setdefault(key(r), []).append((r, res))
    lines = [f"| {title} | rows | TPOT sim median | p90 | TPOT static median | p90 | TTFT sim median | p90 "
             f"| TTFT static median | p90 |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in sorted(groups, key=_natural) + ["**all**"]:
        items = [x for g in groups.values() for x in g] if name == "**all**" else groups[name]
        e = {k: [] for k in ("tpot", "s_tpot", "ttft", "s_ttft")}
        for r, res in items:
            e["tpot"].append(_err(res["sim"]["tpot_ms"], r.tpot_ms))
            e["ttft"].append(_err(res["sim"]["ttft_ms"] + frontend_ms(frontend, r), r.ttft_ms))
            e["s_tpot"].append(_err(res["static_tpot_ms"], r.tpot_ms))
            e["s_ttft"].append(_err(res["static_ttft_ms"], r.ttft_ms))
        lines.append(f"| {name} | {len(items)} | {_stats(e['tpot'])} | {_stats(e['s_tpot'])} | "
                     f"{_stats(e['ttft'])} | {_stats(e['s_ttft'])} |")
    return lines


def _conc_band(r: SiliconRow) -> str:
    c = r.concurrency
    return next((f"c {lo}–{hi}" for lo, hi in ((1, 8), (9, 32), (33, 128), (129, 1024)) if c <= hi), "c 1025+")


HELD_OUT_TABLES = (  # (key, title) of the held-out tables
    (lambda r: r.gpu, "GPU"),
    (lambda r: r.model, "model"),
    (lambda r: f"tp {r.tp}" + (f" × dp {r.attention_dp}" if r.attention_dp > 1 else ""), "parallelism"),
    (lambda r: r.gemm_quant or "bf16", "GEMM precision"),
    (_conc_band, "concurrency"),
    (lambda r: f"{r.isl}/{r.osl}", "ISL/OSL"),
    (lambda r: "InferenceX (burst, 10·C prompts)" if r.inferencex else "other (steady state)", "harness"),
)


def _unsupported(rows: list[SiliconRow], done: dict[str, dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        why = done.get(r.id, {}).get("unsupported")
        if why:
            k = f"{r.model} on {r.gpu} ({r.gemm_quant}): {why.split('): ', 1)[-1][:120]}"
            out[k] = out.get(k, 0) + 1
    return out


def render(rows: list[SiliconRow], done: dict[str, dict], overhead: HostTime, frontend: Frontend,
           command: str) -> str:
    held = [r for r in rows if r.split == "heldout"]
    train = [r for r in rows if r.split == "train"]
    unsupported = _unsupported(rows, done)
    sims = {r.id: done[r.id]["sim"] for r in rows if "sim" in done.get(r.id, {})}
    n_train = sum(1 for r in train if r.id in sims)
    n_held = sum(1 for r in held if r.id in sims)
    n_left = sum(1 for r in rows if r.id not in done)
    n_short = sum(1 for r in rows if r.id in sims and sims[r.id].get("sim_osl", r.osl) < r.osl)
    out = [BEGIN, "", f"Made by `{command}`.", "",
           f"{len(rows)} vLLM aggregated rows in the sample; {len(sims)} simulated ({n_short} of them with "
           f"shortened requests, see the plan above), {sum(unsupported.values())} the estimator cannot price "
           f"(below), {n_left} not simulated in the run's time (the costliest by simulated tokens). Errors are |predicted − measured| / measured, median and p90 "
           f"over the rows. *sim* = the row's benchmark through the engine with `--perf-model aic`; *static* = "
           f"the estimator's `run_static` with batch = concurrency.", "",
           f"Fitted on the training rows ({len(train)}, {n_train} simulated): host time "
           f"**{overhead.step_ms:.2f} ms per step + {overhead.per_seq_ms * 1e3:.0f} µs per running sequence** "
           f"(simulated: added to the step's GPU time, or under async scheduling overlapped with it, with "
           f"**{overhead.async_exposed_ms:.2f} ms** per step exposed), the GPU time of the attention's QK norm "
           f"**{overhead.qk_norm_us:.0f} µs per QK-normed layer + {overhead.qk_norm_allreduce_us:.0f} µs per layer "
           f"whose norm spans the TP ranks** (added to every step's GPU time; `perf/qk_norm.py`) and a "
           f"frontend share of the first token of **{frontend[0]:.0f} ms + {frontend[1]:.1f} ms per 1000 prompt "
           f"tokens + {frontend[2]:.1f} ms per concurrent user** (added to the simulated TTFT: `serve` and "
           f"`play` have a real frontend, `simulate` has none). Held-out rows ({len(held)}; {n_held} simulated "
           f"with them):", ""]
    for key, title in HELD_OUT_TABLES:
        out += [*table(held, done, key, title, frontend), ""]
    out += ["Training rows, simulated without the correction (host overhead 0, no frontend share):", "",
            *table(train, done, lambda r: r.gpu, "GPU"), "",
            "Rows the estimator cannot price (model on GPU (GEMM precision): reason, rows):", ""]
    out += [f"- {k}: {v}" for k, v in sorted(unsupported.items())]
    out += ["", END]
    return "\n".join(out)


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
    ap.add_argument("--jobs", type=int, default=max((os.cpu_count() or 2) - 0, 1))
    ap.add_argument("--results", default=str(ROOT / "bench" / "fidelity" / "silicon_rows.jsonl"))
    ap.add_argument("--max-tokens", type=int, default=20_000_000,
                    help="output tokens simulated per row, at most (the default fits every row's whole benchmark)")
    ap.add_argument("--budget-s", type=float, default=6000.0,
                    help="wall seconds for the whole run (1/3 training, 2/3 held out); the costliest rows are left out")
    ap.add_argument("--limit", type=int, default=None, help="only the first N rows (a smoke run)")
    ap.add_argument("--sample", type=int, default=None,
                    help="only N rows spread over models, GPUs and concurrencies (iterate on a slice; give it its "
                         "own --results file)")
    ap.add_argument("--overhead", type=float, nargs=5, default=None,
                    metavar=("MS_PER_STEP", "MS_PER_SEQ", "ASYNC_EXPOSED_MS", "QK_NORM_US", "QK_NORM_ALLREDUCE_US"),
                    help="skip the fit: use this correction")
    ap.add_argument("--frontend", type=float, nargs=3, default=None,
                    metavar=("MS", "MS_PER_1000_TOKENS", "MS_PER_USER"),
                    help="skip the fit: use this frontend share of TTFT")
    ap.add_argument("--render-only", action="store_true", help="simulate nothing: the table from the results file")
    ap.add_argument("--write-docs", action="store_true", help="write the table into docs/fidelity.md")
    args = ap.parse_args()
    rows = list(vllm_agg_rows())[: args.limit]
    if args.sample:
        rows = stratified_sample(rows, args.sample)
    path = Path(args.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    done: dict[str, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            res = json.loads(line)
            done[res["id"]] = res
    with path.open("a") as out:
        if not args.render_only:
            _run([r for r in rows if r.split == "train"], HostTime(), args, done, out, args.budget_s / 3)
        overhead = HostTime(*args.overhead) if args.overhead is not None else fit_overhead(
            [r for r in rows if r.split == "train"], done)
        train = [r for r in rows if r.split == "train"]
        frontend = tuple(args.frontend) if args.frontend is not None else fit_frontend(train, done, overhead)
        print(f"fitted {overhead}, frontend {frontend} (ms, ms/1000 tokens, ms/user)",
              file=sys.stderr)
        if not args.render_only:
            _run([r for r in rows if r.split == "heldout"], overhead, args, done, out, args.budget_s * 2 / 3)
    command = "python bench/silicon_validation.py --write-docs" + (f" --limit {args.limit}" if args.limit else "") \
        + (f" --sample {args.sample}" if args.sample else "")
    text = render(rows, done, overhead, frontend, command)
    print(text)
    if args.write_docs:
        doc = DOC.read_text()
        if BEGIN in doc:
            doc = doc[: doc.index(BEGIN)] + text + doc[doc.index(END) + len(END):]
        else:
            doc += "\n## The GPU perf model against measured silicon\n\n" + text + "\n"
        DOC.write_text(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
