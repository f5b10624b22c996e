"""The record → replay fidelity benchmark (docs/fidelity.md).

    record:   replay-arrivals(schedule W) ─▶ real frontend ─▶ record tap ─▶ real CPU engine
              writes W.jsonl.gz (engine side, tap) and W.client.jsonl.gz (client side)
    replay:   replay-arrivals(W.jsonl.gz) ─▶ real frontend ─▶ record tap ─▶ vllm-vcr play
              play paced by --latency-trace A.jsonl.gz (held-out fit; both models of the repo,
              chosen with --latency-trace-model) or by --replay-steps W (sanity check), and in
              that run also --replay-tokens W, whose token ids the client checks against W.
    compare:  TTFT and per-token ITL p50/p90/p99, client vs client and tap vs tap.

The same topology (tap included) on both sides, so the tap's own cost is in both. Everything
binds 127.0.0.1 on free ports; every process started is stopped by process group.

usage: python bench/fidelity/run_fidelity.py [--out DIR] [--phase record|replay|calibrate|report ...]
                                             [--workloads a,b] [--runs NAME,...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "src"))

import schedules
import stack

from vllm_vcr.trace.io import read_trace
from vllm_vcr.trace.schema import replay_subset
from vllm_vcr.trace.stats import itl_samples, ttft_samples

QUANTILES = (50, 90, 99)
# (target workload, fitted on, pacing): the held-out replays. "cells" = the cell model
# (engine/latency/cells.py), "stepm" = the step-time model (engine/latency/steps.py: the engine
# with timed steps), "steps" = --replay-steps of the target itself (+ --replay-tokens).
# The "fit" (latency_fit.py, the Rust vllm-vcr's fitted model ported), "cells0" and "cells1" variants
# of docs/fidelity.md were removed from the code: their rows there are historical and cannot be re-run.
MODEL_FLAG = {"cells": "cells", "stepm": "steps"}
RUNS = [
    ("poisson_hi", "poisson_lo", "cells"), ("poisson_lo", "poisson_hi", "cells"), ("sessions", "poisson_hi", "cells"),
    ("poisson_hi", "poisson_hi", "steps"), ("poisson_lo", "poisson_lo", "steps"),
    ("sessions", "sessions", "steps"),
    ("poisson_hi", "poisson_lo", "stepm"), ("poisson_lo", "poisson_hi", "stepm"),
    ("sessions", "poisson_hi", "stepm"),
]


def run_name(target: str, fit: str, model: str) -> str:
    return f"{target}__steps" if model == "steps" else f"{target}__fit-{fit}__{model}"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def replay_arrivals(trace: Path, url: str, trace_out: Path, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "vllm_vcr", "replay-arrivals", str(trace), "--target", url,
           "--trace-out", str(trace_out), "--json", "--request-timeout", "120"]
    env = dict(os.environ, PYTHONPATH=str(stack.REPO / "src"))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode not in (0, 1) or not p.stdout.strip():
        raise RuntimeError(f"replay-arrivals failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads(p.stdout)


# -- token capture: replay-arrivals' own load generator, keeping each response's token ids -------

async def _replay_with_tokens(trace: Path, url: str, trace_out: Path) -> tuple[dict, dict[int, list[int]]]:
    import msgspec

    from vllm_vcr.trace.io import TraceWriter
    from vllm_vcr.replay.loadgen import ReplayConfig, Replayer, resolve_model
    from vllm_vcr.trace.schema import TraceMeta

    tr = read_trace(str(trace))
    records = replay_subset(tr.records)
    ids: dict[int, list[int]] = {}

    class TokenReplayer(Replayer):
        def _feed(self, timer, events, now, i):
            for payload in events:
                if payload.strip() == b"[DONE]":
                    continue
                try:
                    obj = msgspec.json.decode(payload)
                except msgspec.DecodeError:
                    continue
                for ch in obj.get("choices") or []:
                    ids.setdefault(i, []).extend(ch.get("token_ids") or [])
            return super()._feed(timer, events, now, i)

    cfg = ReplayConfig(target=url, block_size=(tr.meta.block_size if tr.meta else None) or 16,
                       request_timeout_s=120)
    await resolve_model(cfg, None)
    with TraceWriter(str(trace_out), TraceMeta(model=cfg.model, source="replay-arrivals")) as w:
        res = await TokenReplayer(records, cfg, writer=w).run()
    summary = {"scheduled": res.scheduled, "ok": res.ok, "errors": res.errors, "timeouts": res.timeouts,
               "max_send_lag_ms": round(res.max_lag_ms, 2), "wall_s": round(res.wall_s, 2),
               "error_samples": res.error_samples}
    return summary, ids


# -- phases --------------------------------------------------------------------------------------

def record(out: Path, name: str) -> None:
    sched = out / f"{name}.schedule.jsonl.gz"
    n = schedules.write(name, sched)
    wd = out / "work" / f"record-{name}"
    tap = out / f"{name}.jsonl.gz"
    log(f"record {name}: {n} requests; starting frontend + tap + real CPU engine")
    st = stack.start(wd, engine="real", trace_out=tap)
    try:
        log(f"record {name}: healthy at {st.url}; replaying the schedule")
        summary = replay_arrivals(sched, st.url, out / f"{name}.client.jsonl.gz", timeout=900)
        time.sleep(1.0)
    finally:
        st.stop()
    (out / f"{name}.record.json").write_text(json.dumps(summary, indent=1))
    log(f"record {name}: ok {summary['ok']}/{summary['scheduled']}, max send lag {summary['max_send_lag_ms']} ms")


def replay(out: Path, target: str, fit: str, model: str) -> None:
    name = run_name(target, fit, model)
    wd = out / "work" / f"replay-{name}"
    src = out / f"{target}.jsonl.gz"
    # the real engine's KV block is 128 tokens (CPU backend): mirror it so prefix hits match
    play_args = ["--block-size", "128", "--seed", "1"]
    env: dict[str, str] = {}
    if model == "steps":
        play_args += ["--replay-steps", str(src), "--replay-tokens", str(src)]
    else:
        play_args += ["--latency-trace", str(out / f"{fit}.jsonl.gz"), "--latency-trace-model", MODEL_FLAG[model]]
    log(f"replay {name}: starting frontend + tap + play")
    st = stack.start(wd, engine="play", trace_out=out / f"{name}.tap.jsonl.gz", record_tokens=(model == "steps"),
                     play_args=play_args, play_env=env)
    try:
        if model == "steps":
            summary, ids = asyncio.run(_replay_with_tokens(src, st.url, out / f"{name}.client.jsonl.gz"))
            summary["tokens"] = token_check(src, ids)
        else:
            summary = replay_arrivals(src, st.url, out / f"{name}.client.jsonl.gz", timeout=900)
        time.sleep(1.0)
    finally:
        st.stop()
    (out / f"{name}.replay.json").write_text(json.dumps(summary, indent=1))
    log(f"replay {name}: ok {summary['ok']}/{summary['scheduled']}, max send lag {summary['max_send_lag_ms']} ms"
        + (f", tokens {summary['tokens']}" if "tokens" in summary else ""))


def token_check(src: Path, ids: dict[int, list[int]]) -> dict:
    recs = replay_subset(read_trace(str(src)).records)
    same = differ = missing = 0
    for i, r in enumerate(recs):
        got = ids.get(i)
        if got is None:
            missing += 1
        elif got == list(r.output_token_ids or []):
            same += 1
        else:
            differ += 1
    return {"records": len(recs), "identical": same, "different": differ, "missing": missing}


def calibrate(out: Path, target: str, fit: str, model: str) -> dict:
    cmd = [sys.executable, "-m", "vllm_vcr", "inspect", "calibrate", str(out / f"{target}.jsonl.gz"),
           "--fit", str(out / f"{fit}.jsonl.gz"), "--max-num-seqs", str(stack.MAX_NUM_SEQS),
           "--max-num-batched-tokens", "2048", "--block-size", "128", "--latency-trace-model", MODEL_FLAG[model],
           "--json"]
    env = dict(os.environ, PYTHONPATH=str(stack.REPO / "src"))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if not p.stdout.strip():
        raise RuntimeError(p.stderr[-2000:])
    return json.loads(p.stdout)


# -- comparison ----------------------------------------------------------------------------------

def quantiles(path: Path) -> dict[str, float]:
    recs = read_trace(str(path)).records
    out = {"n": len(recs)}
    for metric, fn in (("ttft", ttft_samples), ("itl", itl_samples)):
        s = fn(recs)
        for p in QUANTILES:
            out[f"{metric}_p{p}"] = round(float(s.quantile(p)), 3) if len(s) else None
    return out


def compare(src: Path, rep: Path) -> dict:
    a, b = quantiles(src), quantiles(rep)
    rows = {}
    for k in a:
        if k == "n" or a[k] is None or b.get(k) is None:
            continue
        rows[k] = {"recorded": a[k], "replayed": b[k], "err": round((b[k] - a[k]) / a[k], 4) if a[k] else None}
    return {"n_recorded": a["n"], "n_replayed": b["n"], "rows": rows}


def noise_floor(path: Path, reps: int = 400) -> dict[str, float]:
    """Mean relative error between two bootstrap resamples of a recording (same size): what a
    perfect model would still show, from sampling alone, at each quantile."""
    import random

    from vllm_vcr.trace.stats import Samples, add_itl_samples

    recs = read_trace(str(path)).records
    rng = random.Random(0)
    out = {}
    for metric in ("ttft", "itl"):
        errs: dict[int, list[float]] = {p: [] for p in QUANTILES}
        for _ in range(reps):
            qs = []
            for _ in range(2):
                s = Samples()
                for r in rng.choices(recs, k=len(recs)):
                    if metric == "ttft":
                        s.add(r.ttft_ms)
                    else:
                        add_itl_samples(s, r)
                qs.append({p: s.quantile(p) for p in QUANTILES})
            for p in QUANTILES:
                errs[p].append(abs(qs[0][p] - qs[1][p]) / qs[0][p] if qs[0][p] else 0.0)
        for p in QUANTILES:
            out[f"{metric}_p{p}"] = round(sum(errs[p]) / len(errs[p]), 4)
    return out


def frontend_overhead(client: Path, tap: Path) -> dict[str, float] | None:
    """Client TTFT minus engine (tap) TTFT, per request, in ms: the frontend's and the box's share
    of what the client sees. Requests are paired in arrival order when their sizes agree."""
    import numpy as np

    a = replay_subset(read_trace(str(client)).records)
    b = replay_subset(read_trace(str(tap)).records)
    diffs = [x.ttft_ms - y.ttft_ms for x, y in zip(a, b)
             if (x.prompt_tokens, x.output_tokens) == (y.prompt_tokens, y.output_tokens)]
    if len(diffs) < 10:
        return None
    v = np.array(diffs)
    return {"paired": len(diffs), **{f"p{p}": round(float(np.percentile(v, p)), 2) for p in QUANTILES}}


def report(out: Path) -> dict:
    res: dict = {"runs": {}, "calibrate": {}}
    for target, fit, model in RUNS:
        name = run_name(target, fit, model)
        entry: dict = {"target": target, "fit": fit, "model": model}
        for side, src, rep in (("client", out / f"{target}.client.jsonl.gz", out / f"{name}.client.jsonl.gz"),
                               ("engine", out / f"{target}.jsonl.gz", out / f"{name}.tap.jsonl.gz")):
            if src.exists() and rep.exists():
                entry[side] = compare(src, rep)
        if (out / f"{name}.client.jsonl.gz").exists() and (out / f"{name}.tap.jsonl.gz").exists():
            entry["frontend_overhead_ms"] = frontend_overhead(out / f"{name}.client.jsonl.gz",
                                                              out / f"{name}.tap.jsonl.gz")
        meta = out / f"{name}.replay.json"
        if meta.exists():
            entry["summary"] = json.loads(meta.read_text())
        if len(entry) > 3:
            res["runs"][name] = entry
    for w in schedules.WORKLOADS:
        p = out / f"{w}.jsonl.gz"
        if p.exists():
            res.setdefault("recorded", {})[w] = {"engine": quantiles(p)}
            c = out / f"{w}.client.jsonl.gz"
            if c.exists():
                res["recorded"][w]["client"] = quantiles(c)
                res["recorded"][w]["frontend_overhead_ms"] = frontend_overhead(c, p)
    # the real engine against itself: the same schedule recorded twice
    rep = out / "poisson_lo_repeat.jsonl.gz"
    if rep.exists():
        e = {"target": "poisson_lo", "fit": "-", "model": "real engine, recorded again",
             "engine": compare(out / "poisson_lo.jsonl.gz", rep)}
        if (out / "poisson_lo_repeat.client.jsonl.gz").exists():
            e["client"] = compare(out / "poisson_lo.client.jsonl.gz", out / "poisson_lo_repeat.client.jsonl.gz")
        res["runs"]["poisson_lo__real-repeat"] = e
    res["noise_floor"] = {w: noise_floor(out / f"{w}.jsonl.gz") for w in schedules.WORKLOADS
                          if (out / f"{w}.jsonl.gz").exists()}
    cal = out / "calibrate.json"
    if cal.exists():
        res["calibrate"] = json.loads(cal.read_text())
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "results.md").write_text(markdown(res))
    print_table(res)
    return res


MODEL_LABEL = {"cells": "cell model (improved)", "cells1": "cell model, TTFT tail fix only",
               "cells0": "cell model (before)", "fit": "fit model (latency_fit.py)", "steps": "--replay-steps (verbatim)",
               "stepm": "step-time model"}


def markdown(res: dict) -> str:
    cols = [f"{m}_p{p}" for m in ("ttft", "itl") for p in QUANTILES]
    head = "| " + " | ".join(f"{c.split('_')[0].upper()} {c.split('_')[1]}" for c in cols) + " |"
    lines = ["### Recorded workloads (real CPU engine)", "",
             "| workload | side | n | " + head[2:], "|---|---|---|" + "---|" * len(cols)]
    for w, v in res.get("recorded", {}).items():
        for side in ("engine", "client"):
            if side in v:
                q = v[side]
                lines.append(f"| {w} | {side} | {q['n']} | " + " | ".join(f"{q[c]:.1f}" for c in cols) + " |")
    lines += ["", "### Error of the replay vs the recording ((replayed − recorded) / recorded)", "",
              "| target | fitted on | pacing | side | " + head[2:], "|---|---|---|---|" + "---|" * len(cols)]
    order = {"stepm": -1, "cells": 0, "cells1": 1, "cells0": 2, "fit": 3, "steps": 4}
    for name, e in sorted(res["runs"].items(), key=lambda kv: (kv[1]["target"], order.get(kv[1]["model"], 9))):
        for side in ("engine", "client"):
            if side not in e:
                continue
            rows = e[side]["rows"]
            cells = [f"{100 * rows[c]['err']:+.0f}%" if c in rows and rows[c]["err"] is not None else "-" for c in cols]
            lines.append(f"| {e['target']} | {e['fit']} | {MODEL_LABEL.get(e['model'], e['model'])} | {side} | "
                         + " | ".join(cells) + " |")
    if res.get("noise_floor"):
        lines += ["", "### Sampling noise floor (mean |error| between two bootstrap resamples of the recording)", "",
                  "| workload | " + head[2:], "|---|" + "---|" * len(cols)]
        for w, v in res["noise_floor"].items():
            lines.append(f"| {w} | " + " | ".join(f"{100 * v[c]:.0f}%" for c in cols) + " |")
    if res.get("calibrate"):
        lines += ["", "### `inspect calibrate` (offline, virtual clock) — error vs the recording (engine side)", "",
                  "| target | fitted on | model | " + head[2:], "|---|---|---|" + "---|" * len(cols)]
        for name, v in res["calibrate"].items():
            rows = v["rows"] if isinstance(v, dict) else v
            errs = {f"{r['metric'].split('_')[0]}_{r['quantile']}": (r["simulated"] - r["recorded"]) / r["recorded"]
                    for r in rows}
            t, f, m = name.split("__")[0], name.split("__fit-")[1].split("__")[0], name.rsplit("__", 1)[1]
            lines.append(f"| {t} | {f} | {MODEL_LABEL.get(m, m)} | "
                         + " | ".join(f"{100 * errs[c]:+.0f}%" if c in errs else "-" for c in cols) + " |")
    lines += ["", "### Frontend + box overhead: client TTFT − engine (tap) TTFT per request, ms", "",
              "| run | p50 | p90 | p99 |", "|---|---|---|---|"]
    for w, v in res.get("recorded", {}).items():
        o = v.get("frontend_overhead_ms")
        if o:
            lines.append(f"| {w} recorded (real engine) | {o['p50']} | {o['p90']} | {o['p99']} |")
    for name, e in res["runs"].items():
        o = e.get("frontend_overhead_ms")
        if o:
            lines.append(f"| {name} (play) | {o['p50']} | {o['p90']} | {o['p99']} |")
    toks = [(n, e["summary"]["tokens"]) for n, e in res["runs"].items() if "tokens" in e.get("summary", {})]
    if toks:
        lines += ["", "### Token replay (`--replay-tokens`, ids from `return_token_ids`)", "",
                  "| run | requests | identical | different | missing |", "|---|---|---|---|---|"]
        for n, t in toks:
            lines.append(f"| {n} | {t['records']} | {t['identical']} | {t['different']} | {t['missing']} |")
    return "\n".join(lines) + "\n"


def print_table(res: dict) -> None:
    cols = [f"{m}_p{p}" for m in ("ttft", "itl") for p in QUANTILES]
    print("| run | side | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for name, e in res["runs"].items():
        for side in ("client", "engine"):
            if side not in e:
                continue
            rows = e[side]["rows"]
            cells = [f"{100 * rows[c]['err']:+.1f}%" if c in rows and rows[c]["err"] is not None else "-"
                     for c in cols]
            print(f"| {name} | {side} | " + " | ".join(cells) + " |")


def plots(out: Path, fig_dir: Path) -> None:
    """Recorded vs replayed CDFs (engine side and client side) per target, and latency vs
    concurrency for the busiest workload; PNGs re-encoded with a palette to stay small."""
    fig_dir.mkdir(parents=True, exist_ok=True)
    jobs = []
    for target in ("poisson_hi", "poisson_lo", "sessions"):
        fits = {m: run_name(t, f, m) for t, f, m in RUNS if t == target and m in ("stepm", "cells", "fit", "steps")}
        for side, suffix, rec in (("engine", "tap", f"{target}.jsonl.gz"), ("client", "client", f"{target}.client.jsonl.gz")):
            files, labels = [out / rec], ["recorded (real engine)"]
            for m, name in fits.items():
                f = out / f"{name}.{suffix}.jsonl.gz"
                if f.exists():
                    files.append(f)
                    labels.append({"stepm": "play, step-time model", "cells": "play, cell model", "fit": "play, fit model",
                                   "steps": "play, --replay-steps"}[m])
            if len(files) > 1:
                jobs.append((f"{target}-{side}", files, labels, ["cdf"]))
    name = run_name("poisson_hi", "poisson_lo", "cells")
    if (out / f"{name}.tap.jsonl.gz").exists():
        jobs.append(("poisson_hi-engine", [out / "poisson_hi.jsonl.gz", out / f"{name}.tap.jsonl.gz"],
                     ["recorded (real engine)", "play, cell model"], ["concurrency"]))
    for prefix, files, labels, kinds in jobs:
        tmp = out / "plots" / prefix
        cmd = [sys.executable, "-m", "vllm_vcr", "inspect", "plot", *map(str, files), "-o", str(tmp)]
        for lab in labels:
            cmd += ["--label", lab]
        for k in kinds:
            cmd += ["--kind", k]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(stack.REPO / "src")))
        for png in tmp.glob("*.png"):
            dst = fig_dir / f"{prefix}-{png.name}"
            try:
                from PIL import Image

                Image.open(png).convert("RGB").quantize(colors=64).save(dst, optimize=True)
            except ImportError:
                dst.write_bytes(png.read_bytes())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/vllm-vcr-fidelity")
    ap.add_argument("--phase", action="append", choices=["record", "replay", "calibrate", "report", "plots"])
    ap.add_argument("--figures", default=str(stack.REPO / "docs" / "fidelity"))
    ap.add_argument("--workloads", default=",".join(schedules.WORKLOADS))
    ap.add_argument("--runs", default=None, help="comma list of run names (default: all)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if reason := stack.missing_reason():
        print(f"error: {reason}", file=sys.stderr)
        return 2
    phases = args.phase or ["record", "replay", "calibrate", "report"]
    if "record" in phases:
        for w in args.workloads.split(","):
            record(out, w)
    wanted = set(args.runs.split(",")) if args.runs else None
    if "replay" in phases:
        for t, f, m in RUNS:
            if wanted is None or run_name(t, f, m) in wanted:
                replay(out, t, f, m)
    if "calibrate" in phases:
        cal = {}
        # the held-out pairs of the live runs, plus each workload fitted on itself (in-sample:
        # what the model can reproduce at best, without the box's run-to-run drift)
        pairs = [(t, f, m) for t, f, m in RUNS if m != "steps"]
        pairs += [(w, w, m) for w in ("poisson_lo", "poisson_hi", "sessions") for m in ("cells", "stepm")]
        for t, f, m in pairs:
            if (out / f"{t}.jsonl.gz").exists() and (out / f"{f}.jsonl.gz").exists():
                log(f"calibrate {t} fit {f} model {m}")
                cal[run_name(t, f, m)] = calibrate(out, t, f, m)
        (out / "calibrate.json").write_text(json.dumps(cal, indent=1))
    if "report" in phases:
        report(out)
    if "plots" in phases:
        plots(out, Path(args.figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
