#!/usr/bin/env python
"""Speed of `vllm-vcr simulate`: simulated requests per CPU (and wall) second on one core.

The workload: a 1,000-request trace at concurrency 64 with the GPU perf model
(Llama-3.1-8B on one H100, vLLM): closed loop, ISL/OSL drawn per request. Each repeat runs the
engines' plain path (`timing_only=False`: every token an output) and the timing-only path (the
default of `simulate`: engine/decode_cohort.py) back to back, alternating which goes first, and
reports CPU seconds (process time: the box may be shared) and wall seconds of the simulation
alone (the estimator's one-off compile is timed apart), with the load average. Before each run
the cyclic garbage of the previous one is collected (untimed): a `simulate` process runs one.

`--dynamo PYTHON` also runs Dynamo's offline replay (`dynamo.replay.run_synthetic_trace_replay`,
its default timing: it has no AIC without aiconfigurator-core in its venv) on the fixed-length
shape ISL 1024 / OSL 256 in a subprocess of that interpreter, timed the same way, and
`--fixed` runs our side on that shape too. Dynamo simulates the deployment ours does (its
`extra_engine_args`: KV blocks of 16 tokens, our KV estimate's block count, 1,024 sequences and
8,192 batched tokens per step), so both replay one workload; and once more with its own defaults
(16,384 blocks of 64 tokens, 256 sequences), whose load is lighter (a KV usage its timing model
prices lower), for reference. Each row also says what was simulated (seconds of
simulated time, mean TPOT). `--engine-type sglang` runs SGLang's scheduler and kernel data on
our side and Dynamo's SGLang scheduler (`backend: sglang`) on its side.

`--trace` also writes a Mooncake-format trace of the same number of requests (timestamps of a
Poisson process at `--trace-rate` requests per second, ISL/OSL drawn from `--isl`/`--osl`, every
request's 512-token blocks its own) and has both sides replay that file (ours: `TraceWorkload`,
the simulation timed without the file's reading; Dynamo: `run_trace_replay`, its reading
included): the same arrivals and lengths on both, not a closed loop of one fixed shape.

`--disagg P:D` makes both sides one disaggregated deployment of P prefill and D decode workers,
each with the same engine args (ours: `simulate --num-prefill-workers`, the KV pulled at the
engine's default 131,072 bytes per token over 25 GB/s; Dynamo: its disaggregated replay with
`prefill_engine_args` / `decode_engine_args` and its own transfer model).

`--sizes 1000,10000,100000` measures the cost per request at each size (timing-only path, fixed
shape; Dynamo too with `--dynamo`), `--startup` the `vllm-vcr simulate` process itself (CPU
seconds, child-process rusage: `--help`; a 10-request run with the latency knobs; with the perf
model, nothing kept, then with the estimator kept by an earlier run but step compositions no
earlier run priced, then with its step prices kept; a whole 1,000-request run with them kept;
each with the package compiled to bytecode beforehand, as installed, and without, every module
compiled by the process, alternating), `--startup-only` that table alone, and `--markdown`
prints the tables of docs/benchmarks.md after the JSON.

usage: python bench/simulate_speed.py [--requests 1000] [--concurrency 64] [--isl lognormal:1024:512]
          [--osl lognormal:256:128] [--repeat 3] [--fixed] [--dynamo ~/.cache/vllm-vcr/peers/dynamo/bin/python]
          [--trace [--trace-rate 15]] [--sizes 1000,10000,100000] [--startup | --startup-only] [--markdown]
          [--engine-type vllm|sglang] [--disagg 2:1]
"""

from __future__ import annotations

import argparse
import compileall
import gc
import json
import os
import random
import resource
import shutil
import statistics
import tempfile
import subprocess
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from vllm_vcr.engine.config import EngineArgs, EngineConfig  # noqa: E402
from vllm_vcr.perf.aic import AicTarget, compile_target  # noqa: E402
from vllm_vcr.perf.kv_sizing import estimate_kv_capacity  # noqa: E402
from vllm_vcr.simulate.disagg import Disaggregation  # noqa: E402
from vllm_vcr.simulate.runner import simulate  # noqa: E402
from vllm_vcr.simulate.workload import MOONCAKE_BLOCK, LengthDist, SyntheticWorkload, TraceWorkload  # noqa: E402

# a child process of Dynamo's venv: one replay (the call given), timed, its counts as JSON
# (its last argument: the engine's arguments as JSON, `{}` for Dynamo's defaults)
_DYNAMO_TIMED = """
import json, sys, time
from dynamo.replay import run_synthetic_trace_replay, run_trace_replay
engine = json.loads(sys.argv[-1]) or None
# (a disaggregated deployment: its two sides' engine args and worker counts; else one engine's args)
replay = engine.pop("disagg") if engine and "disagg" in engine else {{"extra_engine_args": engine}}
c0, w0 = time.process_time(), time.perf_counter()
r = {call}
cpu, wall = time.process_time() - c0, time.perf_counter() - w0
s = r["summary"] if isinstance(r, dict) else r.summary
print(json.dumps({{"cpu_s": cpu, "wall_s": wall, "requests": s["completed_requests"],
                  "output_tokens": s["total_output_tokens"], "simulated_s": s["duration_ms"] / 1e3,
                  "mean_tpot_ms": s["mean_tpot_ms"]}}))
"""
DYNAMO_RUN = _DYNAMO_TIMED.format(call="run_synthetic_trace_replay(*(int(x) for x in sys.argv[1:4]), "
                                       "replay_concurrency=int(sys.argv[4]), **replay)")
DYNAMO_TRACE = _DYNAMO_TIMED.format(call="run_trace_replay([sys.argv[1]], trace_block_size=512, **replay)")
TRACE_SHAPE = "Mooncake trace"


def _engine_args(engine_type: str = "vllm") -> tuple[EngineArgs, float]:
    t0 = time.perf_counter()
    target = AicTarget("meta-llama/Llama-3.1-8B-Instruct", "h100_sxm", backend=engine_type).resolved()
    handle = compile_target(target)
    getattr(handle, "handle", None)  # kept price answers: load the estimator now, not in a timed run
    compile_s = time.perf_counter() - t0
    cap = estimate_kv_capacity(target, block_size=16, gpu_memory_utilization=0.9, max_num_batched_tokens=8192,
                               max_num_seqs=1024)
    args = EngineArgs(config=EngineConfig(max_num_seqs=1024, max_num_batched_tokens=8192),
                      kv_cache_size=cap.num_blocks, perf_model=target.to_dict(), engine_type=engine_type,
                      advertised_max_model_len=1 << 20).validate()
    return args, compile_s


def dynamo_engine(args: EngineArgs) -> dict:
    """Dynamo's `extra_engine_args` for the deployment `args` simulates (its KV blocks and their
    size, the scheduler's limits): the same workload on both sides."""
    engine = {"block_size": args.tokens_per_block, "num_gpu_blocks": args.kv_cache_size,
              "max_num_seqs": args.config.max_num_seqs, "max_num_batched_tokens": args.config.max_num_batched_tokens}
    if args.engine_type != "vllm":  # (its scheduler's model: Dynamo's `backend`, vllm by default)
        engine["backend"] = args.engine_type
    return {"engine": engine}


def dynamo_disagg(args: EngineArgs, prefill_workers: int, decode_workers: int) -> dict:
    """Dynamo's disaggregated replay of the deployment `simulate --num-prefill-workers` runs: the
    same engine args on both sides, their worker counts."""
    engine = dynamo_engine(args)["engine"]
    return {"engine": engine, "disagg": {
        "prefill_engine_args": {"engine": {**engine, "worker_type": "prefill"}},
        "decode_engine_args": {"engine": {**engine, "worker_type": "decode"}},
        "num_prefill_workers": prefill_workers, "num_decode_workers": decode_workers}}


def dynamo_defaults(args: EngineArgs) -> dict | None:
    """Dynamo's own deployment (None: its defaults), with our engine type's scheduler."""
    return None if args.engine_type == "vllm" else {"engine": {"backend": args.engine_type}}


def _simulated(done: list) -> dict:
    """What a run simulated: seconds from the first arrival to the last finish, mean TPOT."""
    t0 = min(r.arrival for r in done)
    tpot = [(r.end - r.first) / (r.num_out - 1) for r in done if r.num_out > 1]
    return {"simulated_s": max(r.end for r in done) - t0, "mean_tpot_ms": 1e3 * sum(tpot) / len(tpot)}


def _disaggregation(args: EngineArgs, workers: str | None) -> tuple[EngineArgs, Disaggregation | None]:
    """For `--disagg P:D`: the decode workers' args and the prefill side (the same engine args)."""
    if not workers:
        return args, None
    p, d = (int(x) for x in workers.split(":"))
    side = lambda worker: msgspec.structs.replace(args, worker_type=worker).validate()  # noqa: E731
    return side("decode"), Disaggregation(side("prefill"), p, 1, d)


def _ours(args: EngineArgs, isl: str, osl: str, requests: int, concurrency: int, seed: int,
          timing_only: bool, disagg: Disaggregation | None = None) -> dict:
    wl = SyntheticWorkload(num_requests=requests, isl=LengthDist.parse(isl, "--isl"),
                           osl=LengthDist.parse(osl, "--osl"), arrival="closed", concurrency=concurrency, seed=seed)
    gc.collect()  # the previous run's object graph (cyclic) is freed here, not inside this run's time
    load = os.getloadavg()[0]
    w0, c0 = time.perf_counter(), time.process_time()
    sim = simulate(args, wl, concurrency=concurrency, timing_only=timing_only, disagg=disagg)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    tokens = sum(r.num_out for r in sim.done)
    return {"path": "timing_only" if timing_only else "plain", "isl": isl, "osl": osl, "seed": seed, "n": requests,
            "cpu_s": cpu, "wall_s": wall, "requests_per_cpu_s": len(sim.done) / cpu,
            "requests_per_wall_s": len(sim.done) / wall, "output_tokens": tokens, "loadavg_1m_before": load,
            **_simulated(sim.done)}


def write_trace(path: str, requests: int, isl: str, osl: str, rate: float, seed: int = 7) -> None:
    """A Mooncake-format trace (timestamp in ms, input_length, output_length, hash_ids of 512-token
    blocks): Poisson arrivals at `rate` per second, lengths drawn as the synthetic workload draws
    them, every request's blocks its own."""
    rng = random.Random(seed)
    isl_d, osl_d = LengthDist.parse(isl, "--isl"), LengthDist.parse(osl, "--osl")
    t, next_id = 0.0, 1
    with open(path, "w") as f:
        for _ in range(requests):
            t += rng.expovariate(rate)
            n_in, n_out = isl_d.draw(rng), osl_d.draw(rng)
            blocks = -(-n_in // MOONCAKE_BLOCK)
            f.write(json.dumps({"timestamp": round(t * 1000), "input_length": n_in, "output_length": n_out,
                                "hash_ids": list(range(next_id, next_id + blocks))}) + "\n")
            next_id += blocks


def _ours_trace(args: EngineArgs, path: str, label: str, timing_only: bool,
                disagg: Disaggregation | None = None) -> dict:
    r0 = time.process_time()
    wl = TraceWorkload.from_path(path)  # (read before the clock starts, timed apart)
    read = time.process_time() - r0
    gc.collect()
    load = os.getloadavg()[0]
    w0, c0 = time.perf_counter(), time.process_time()
    sim = simulate(args, wl, concurrency=0, timing_only=timing_only, disagg=disagg)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    return {"path": "timing_only" if timing_only else "plain", "shape": label, "n": wl.num_requests,
            "cpu_s": cpu, "wall_s": wall, "read_cpu_s": read, "requests_per_cpu_s": len(sim.done) / cpu,
            "requests_per_wall_s": len(sim.done) / wall, "output_tokens": sum(r.num_out for r in sim.done),
            "loadavg_1m_before": load, **_simulated(sim.done)}


def _child_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


SRC = Path(__file__).resolve().parent.parent / "src"


def _cli(argv: list[str], env: dict[str, str] | None = None, src: Path = SRC) -> dict:
    """One `python -m vllm_vcr` process: its CPU seconds (user + system) and wall seconds."""
    env = {**os.environ, "PYTHONPATH": str(src), **(env or {})}
    c0, w0 = _child_cpu(), time.perf_counter()
    subprocess.run([sys.executable, "-m", "vllm_vcr", *argv], env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=600)
    return {"cpu_s": _child_cpu() - c0, "wall_s": time.perf_counter() - w0}


_AIC = ["simulate", "meta-llama/Llama-3.1-8B-Instruct", "--perf-model", "aic", "--gpu", "h100_sxm"]
_TEN = ["--num-requests", "10", "--concurrency", "2", "--no-progress", "--no-figures"]
_THOUSAND = ["--num-requests", "1000", "--concurrency", "64", "--isl", "1024", "--osl", "256", "--no-progress",
             "--no-figures"]
# name -> argv (a repeat's index is given to a callable); the perf model's cases share one cache
# directory, made before the timed runs by one untimed run of each kept case (which compiles the
# estimator and keeps its spec, KV estimate, cut kernel tables and price answers)
STARTUP_CASES = {
    "simulate --help": ["simulate", "--help"],
    "10 requests, latency knobs": ["simulate", "--num-requests", "10", "--concurrency", "2",
                                   "--inter-token-latency", "10", "--no-progress", "--no-figures"],
    "10 requests, --perf-model aic, nothing kept (VLLM_VCR_PERF_CACHE=0)": _AIC + _TEN,
    "10 requests, --perf-model aic, step compositions no earlier run priced": lambda i: _AIC + _TEN + [
        "--isl", str(700 + 97 * i), "--osl", str(90 + 7 * i)],
    "10 requests, --perf-model aic, its step prices kept": _AIC + _TEN,
    "1,000 requests, --perf-model aic, its step prices kept": _AIC + _THOUSAND,
}
_WARM = ("10 requests, --perf-model aic, its step prices kept", "1,000 requests, --perf-model aic, its step prices kept")


def _trees(tmp: str) -> dict[str, tuple[Path, dict[str, str]]]:
    """The package as the timed processes import it: a copy of src/ compiled to bytecode (as an
    installed package is: pip compiles it at install; a source checkout writes it at its first
    run), and a copy without bytecode whose every module is compiled by each process
    (PYTHONDONTWRITEBYTECODE=1, as on a box that sets it)."""
    trees = {}
    for kind in ("bytecode", "source"):
        root = Path(tmp) / kind / "src"
        shutil.copytree(SRC, root, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        trees[kind] = (root, {"PYTHONDONTWRITEBYTECODE": "1"})
    compileall.compile_dir(str(trees["bytecode"][0]), quiet=1)
    return trees


def _startup(repeat: int) -> dict:
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = {"VLLM_VCR_CACHE_DIR": os.path.join(tmp, "cache")}
        trees = _trees(tmp)
        for name in _WARM:  # untimed: what an earlier run keeps
            _cli(STARTUP_CASES[name] + ["-o", tmp], cache)
        for i in range(repeat):
            for name, case in STARTUP_CASES.items():
                env = {**cache, "VLLM_VCR_PERF_CACHE": "0"} if "PERF_CACHE=0" in name else cache
                row = out.setdefault(name, {"cpu_s": [], "wall_s": [], "source_cpu_s": [], "source_wall_s": []})
                kinds = ("bytecode", "source") if i % 2 == 0 else ("source", "bytecode")  # alternate A/B
                for kind in kinds:
                    argv = case(2 * i + (kind == "source")) if callable(case) else case  # (new compositions each)
                    argv = argv + (["-o", tmp] if "--help" not in argv else [])
                    src, extra = trees[kind]
                    r = _cli(argv, {**env, **extra}, src)
                    prefix = "" if kind == "bytecode" else "source_"
                    row[prefix + "cpu_s"].append(round(r["cpu_s"], 3))
                    row[prefix + "wall_s"].append(round(r["wall_s"], 3))
    for row in out.values():
        row["median_cpu_s"] = statistics.median(row["cpu_s"])
        row["median_source_cpu_s"] = statistics.median(row["source_cpu_s"])
    return out


def _dynamo_child(python: str, script: str, argv: list[str], engine: dict | None, **fields: str) -> dict:
    """One replay in Dynamo's venv (`script`: DYNAMO_RUN or DYNAMO_TRACE) of the deployment
    `engine` (`dynamo_engine`; `dynamo_defaults`: Dynamo's own), its row."""
    load = os.getloadavg()[0]
    out = subprocess.run([python, "-c", script, *argv, json.dumps(engine or {})], capture_output=True, text=True,
                         timeout=600, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    path = "dynamo_offline_replay" if engine and "num_gpu_blocks" in engine["engine"] else "dynamo_defaults"
    return {"path": path, **fields, **r, "requests_per_cpu_s": r["requests"] / r["cpu_s"],
            "requests_per_wall_s": r["requests"] / r["wall_s"], "loadavg_1m_before": load}


def _dynamo(python: str, requests: int, concurrency: int, engine: dict | None) -> dict:
    return _dynamo_child(python, DYNAMO_RUN, ["1024", "256", str(requests), str(concurrency)], engine,
                         isl="1024", osl="256")


def _dynamo_trace(python: str, path: str, label: str, engine: dict | None) -> dict:
    return _dynamo_child(python, DYNAMO_TRACE, [path], engine, shape=label)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--isl", default="lognormal:1024:512")
    ap.add_argument("--osl", default="lognormal:256:128")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--fixed", action="store_true", help="also run ISL 1024 / OSL 256 exactly (Dynamo's shape)")
    ap.add_argument("--dynamo", metavar="PYTHON", help="the interpreter of a venv with ai-dynamo installed")
    ap.add_argument("--trace", action="store_true",
                    help="also replay one Mooncake-format trace (Poisson arrivals, --isl/--osl lengths) on both sides")
    ap.add_argument("--trace-rate", type=float, default=15.0,
                    help="the trace's arrivals per second (15: about 64 requests in flight on our side)")
    ap.add_argument("--sizes", default="", help="comma list of request counts: cost per request at each size")
    ap.add_argument("--startup", action="store_true", help="time `vllm-vcr simulate` processes (CPU seconds)")
    ap.add_argument("--startup-only", action="store_true", help="only the start-up table (implies --startup)")
    ap.add_argument("--markdown", action="store_true", help="also print the tables of docs/benchmarks.md")
    ap.add_argument("--engine-type", choices=("vllm", "sglang"), default="vllm",
                    help="the engines' scheduler and kernel data on both sides (Dynamo's `backend`)")
    ap.add_argument("--disagg", metavar="P:D", default=None,
                    help="a disaggregated deployment of P prefill and D decode workers on both sides (ours: "
                         "`simulate --num-prefill-workers`; Dynamo: its disaggregated replay), the same engine args")
    a = ap.parse_args()
    if a.startup_only:
        result = {"workload": vars(a), "cpus": os.cpu_count(), "runs": [], "summary": {}, "scaling": [],
                  "startup": _startup(a.repeat)}
        print(json.dumps(result, indent=1))
        if a.markdown:
            print(_markdown(result))
        return 0
    args, compile_s = _engine_args(a.engine_type)
    dynamos = (dynamo_engine(args), dynamo_defaults(args))  # our deployment, then Dynamo's own
    if a.disagg:  # (the same deployment only: Dynamo's defaults are one aggregated worker)
        dynamos = (dynamo_disagg(args, *(int(x) for x in a.disagg.split(":"))),)
    args, disagg = _disaggregation(args, a.disagg)
    shapes = [(a.isl, a.osl)] + ([("1024", "256")] if a.fixed else [])
    runs = []
    for i in range(a.repeat):
        for isl, osl in shapes:
            order = (False, True) if i % 2 == 0 else (True, False)  # alternate A/B on a shared box
            runs += [_ours(args, isl, osl, a.requests, a.concurrency, i, t, disagg) for t in order]
        if a.dynamo:
            runs += [_dynamo(a.dynamo, a.requests, a.concurrency, e) for e in dynamos]
    if a.trace:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.jsonl")
            write_trace(path, a.requests, a.isl, a.osl, a.trace_rate)
            label = (f"{TRACE_SHAPE}: {a.requests:,} requests, Poisson {a.trace_rate:g}/s, ISL {a.isl}, "
                     f"OSL {a.osl}")
            for i in range(a.repeat):
                order = (False, True) if i % 2 == 0 else (True, False)
                runs += [_ours_trace(args, path, label, t, disagg) for t in order]
                if a.dynamo:
                    runs += [_dynamo_trace(a.dynamo, path, label, e) for e in dynamos]
    scaling = []
    for size in [int(x) for x in a.sizes.split(",") if x]:
        for i in range(a.repeat):
            scaling.append(_ours(args, "1024", "256", size, a.concurrency, i, True, disagg))
            if a.dynamo:
                scaling.append(_dynamo(a.dynamo, size, a.concurrency, dynamos[0]))
    startup = _startup(a.repeat) if a.startup else None
    summary: dict[str, dict] = {}
    for r in runs:
        key = f"{r['path']} {r['shape']}" if "shape" in r else f"{r['path']} isl={r['isl']} osl={r['osl']}"
        summary.setdefault(key, {"cpu_s": [], "requests_per_cpu_s": []})
        summary[key]["cpu_s"].append(round(r["cpu_s"], 4))
        summary[key]["requests_per_cpu_s"].append(round(r["requests_per_cpu_s"]))
    for s in summary.values():
        s["median_requests_per_cpu_s"] = statistics.median(s["requests_per_cpu_s"])
    result = {"workload": vars(a), "compile_s": compile_s, "cpus": os.cpu_count(), "runs": runs,
              "summary": summary, "scaling": scaling, "startup": startup}
    print(json.dumps(result, indent=1))
    if a.markdown:
        print(_markdown(result))
    return 0


def _markdown(result: dict) -> str:
    """The tables of docs/benchmarks.md (medians over the repeats)."""
    med = statistics.median
    lines = []
    by_path: dict[tuple[str, str], list[dict]] = {}
    for r in result["runs"]:
        by_path.setdefault((r["path"], r.get("shape") or f"ISL {r['isl']}, OSL {r['osl']}"), []).append(r)
    shapes = list(dict.fromkeys(shape for _, shape in by_path))
    paths = ("plain", "timing_only", "dynamo_offline_replay", "dynamo_defaults")
    if shapes:
        lines += ["| requests per CPU second (median; runs) | plain path | timing-only (default) | "
                  "Dynamo offline replay, the same deployment | Dynamo, its defaults |", "|---|---:|---:|---:|---:|"]
    for shape in shapes:
        cells = []
        for path in paths:
            rs = by_path.get((path, shape))
            if not rs:
                cells.append("-")
                continue
            v = [r["requests_per_cpu_s"] for r in rs]
            cells.append(f"{med(v):,.0f} ({min(v):,.0f}-{max(v):,.0f})")
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    if any((path, shape) in by_path for path in paths[2:] for shape in shapes):
        lines += ["", "| what was simulated: seconds, mean TPOT | timing-only (default) | "
                      "Dynamo, the same deployment | Dynamo, its defaults |", "|---|---:|---:|---:|"]
        for shape in shapes:
            cells = []
            for path in paths[1:]:
                r = (by_path.get((path, shape)) or [{}])[0]
                cells.append(f"{r['simulated_s']:.1f} s, {r['mean_tpot_ms']:.1f} ms" if "simulated_s" in r else "-")
            lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    if result["scaling"]:
        lines += ["", "| requests (ISL 1024, OSL 256, C 64; the same deployment) | simulate µs/request | "
                      "simulate req/CPU-s | "
                      "Dynamo µs/request | Dynamo req/CPU-s |", "|---:|---:|---:|---:|---:|"]
        by_size: dict[tuple[str, int], list[float]] = {}
        for r in result["scaling"]:
            n = r["n"] if "n" in r else r["requests"]
            by_size.setdefault((r["path"], n), []).append(r["cpu_s"] / n)
        for n in sorted({k[1] for k in by_size}):
            row = [f"{n:,}"]
            for path in ("timing_only", "dynamo_offline_replay"):
                v = by_size.get((path, n))
                row += [f"{med(v) * 1e6:.0f}", f"{1 / med(v):,.0f}"] if v else ["-", "-"]
            lines.append("| " + " | ".join(row) + " |")
    if result["startup"]:
        lines += ["", "| `python -m vllm_vcr ...` (one process) | CPU s (median) | runs | source compiled "
                      "each run: CPU s (median) | runs |", "|---|---:|---|---:|---|"]
        for name, row in result["startup"].items():
            runs = ", ".join(f"{x:.2f}" for x in row["cpu_s"])
            source = ", ".join(f"{x:.2f}" for x in row["source_cpu_s"])
            lines.append(f"| {name} | {row['median_cpu_s']:.2f} | {runs} | {row['median_source_cpu_s']:.2f} | "
                         f"{source} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
