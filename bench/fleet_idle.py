"""What an idle fleet worker costs: RSS, PSS and CPU per worker of `vllm-vcr fleet` at M workers,
and how long M workers take to start and to stop.

    PYTHONPATH=src python bench/fleet_idle.py                 # M = 10, 100, 1000; 30 s idle windows
    PYTHONPATH=src python bench/fleet_idle.py --workers 10 100 --idle 10 --kv-events
    PYTHONPATH=src python bench/fleet_idle.py --json out.json --plot docs/fleet-idle.png

For each M: start `vllm-vcr fleet --workers M --base-port 0 --control-base-port 0` (one host
process per core), time until its ports file appears (every worker listens), check that every
worker answers /health and its control API /stats, let it settle, then read the CPU time
(utime + stime) and memory (RSS, and PSS, which counts a shared page once) of the whole process
tree over an idle window; SIGTERM and time the exit. A single `vllm-vcr serve` process, measured
the same way, is the baseline (a fleet of processes would cost M times that). Prints a Markdown
table (docs/benchmarks.md) and writes JSON with --json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TICKS = os.sysconf("SC_CLK_TCK")


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            children = []
        todo += [int(c) for c in children]
    return out


def _cpu_s(pids: list[int]) -> float:
    total = 0
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / TICKS


def _memory_mb(pids: list[int]) -> tuple[float, float]:
    rss = pss = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
        except OSError:
            continue
    return rss / 1024, pss / 1024


async def _all_answer(workers: list[dict]) -> None:
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        sem = asyncio.Semaphore(64)

        async def one(w: dict) -> None:
            async with sem:
                r = await client.get(f"http://127.0.0.1:{w['port']}/health")
                assert r.status_code == 200, (w, r.status_code)
                if "control_port" in w:
                    s = await client.get(f"http://127.0.0.1:{w['control_port']}/stats")
                    assert s.status_code == 200, (w, s.status_code)

        await asyncio.gather(*(one(w) for w in workers))


def measure(argv: list[str], ports_file: Path | None, idle_s: float, settle_s: float) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        workers: list[dict] = []
        if ports_file is not None:
            while not ports_file.exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"{argv} exited with {proc.returncode}")
                time.sleep(0.05)
            startup = time.perf_counter() - t0
            workers = json.loads(ports_file.read_text())["workers"]
        else:  # a serve process: ready when /health answers
            port = int(argv[argv.index("--port") + 1])
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if proc.poll() is not None:
                    raise RuntimeError(f"{argv} exited with {proc.returncode}")
                time.sleep(0.05)
            startup = time.perf_counter() - t0
            workers = [{"port": port}]
        asyncio.run(_all_answer(workers))
        time.sleep(settle_s)
        pids = _tree(proc.pid)
        cpu0, w0 = _cpu_s(pids), time.perf_counter()
        time.sleep(idle_s)
        cpu1, w1 = _cpu_s(pids), time.perf_counter()
        rss, pss = _memory_mb(pids)
        t_stop = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
        stop = time.perf_counter() - t_stop
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    m = len(workers)
    cpu_pct = 100 * (cpu1 - cpu0) / (w1 - w0)
    return {"workers": m, "processes": len(pids), "startup_s": round(startup, 2), "stop_s": round(stop, 2),
            "exit": code, "rss_mb": round(rss, 1), "pss_mb": round(pss, 1),
            "rss_per_worker_mb": round(rss / m, 2), "pss_per_worker_mb": round(pss / m, 2),
            "idle_cpu_pct": round(cpu_pct, 3), "idle_cpu_pct_per_worker": round(cpu_pct / m, 5)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--idle", type=float, default=30.0, help="idle window (s)")
    ap.add_argument("--settle", type=float, default=5.0, help="wait after start-up before the window (s)")
    ap.add_argument("--processes", type=int, default=None, help="fleet --processes (default: one per core)")
    ap.add_argument("--kv-events", action="store_true", help="every worker also publishes KV events (ZMQ)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--from-json", default=None, help="no run: the table (and --plot) of an earlier --json")
    ap.add_argument("--plot", default=None, metavar="FILE.png", help="PSS and idle CPU against M (matplotlib)")
    args = ap.parse_args()
    rows = json.loads(Path(args.from_json).read_text()) if args.from_json else run(args)
    report(rows)
    if args.json and not args.from_json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot)
    return 0


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        from vllm_vcr.testing.waits import free_port

        port = free_port()
        rows.append({"what": "serve (1 process)", **measure(
            [sys.executable, "-m", "vllm_vcr", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--control-address", f"127.0.0.1:{free_port()}"], None, args.idle, args.settle)})
        for m in args.workers:
            ports_file = Path(tmp) / f"ports-{m}.json"
            argv = [sys.executable, "-m", "vllm_vcr", "fleet", "--workers", str(m), "--base-port", "0",
                    "--host", "127.0.0.1", "--control-base-port", "0", "--ports-file", str(ports_file)]
            if args.processes:
                argv += ["--processes", str(args.processes)]
            if args.kv_events:
                kv = free_port()
                if kv + m > 65535:
                    kv = 20000
                argv += ["--kv-events-base-port", str(kv)]
            rows.append({"what": f"fleet M={m}", **measure(argv, ports_file, args.idle, args.settle)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def report(rows: list[dict]) -> None:
    print("| run | processes | start-up (s) | SIGTERM to exit (s) | RSS total (MB) | PSS total (MB) | "
          "PSS per worker (MB) | idle CPU (% of a core) | idle CPU per worker (% of a core) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['what']} | {r['processes']} | {r['startup_s']} | {r['stop_s']} | {r['rss_mb']} | {r['pss_mb']} | "
              f"{r['pss_per_worker_mb']} | {r['idle_cpu_pct']} | {r['idle_cpu_pct_per_worker']} |")
    fleets = [r for r in rows if r["what"].startswith("fleet")]
    for a, b in zip(fleets, fleets[1:]):
        slope = (b["pss_mb"] - a["pss_mb"]) / (b["workers"] - a["workers"])
        print(f"\nmarginal PSS per worker from M={a['workers']} to M={b['workers']}: {slope:.2f} MB")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fleets = [r for r in rows if r["what"].startswith("fleet")]
    serve = next((r for r in rows if r["what"].startswith("serve")), None)
    ms = [r["workers"] for r in fleets]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(ms, [r["pss_mb"] for r in fleets], "o-", label="fleet: PSS of all processes")
    if serve is not None:
        left.plot(ms, [serve["pss_mb"] * m for m in ms], "x--", label="M serve processes (PSS x M)")
    left.set(xscale="log", yscale="log", xlabel="workers M", ylabel="MB", title="memory, idle")
    left.legend()
    right.plot(ms, [r["idle_cpu_pct"] for r in fleets], "o-", label="idle CPU, % of a core")
    right.plot(ms, [r["startup_s"] for r in fleets], "s-", label="start-up, s")
    right.set(xscale="log", xlabel="workers M", title="idle CPU and start-up")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
