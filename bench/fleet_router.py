"""A router in front of a fleet: `vllm-router` (round robin) before M `vllm-vcr fleet` workers at an
open-loop request rate, measured from the client.

    PYTHONPATH=src python bench/fleet_router.py                          # M = 100, 500 req/s, 30 s
    PYTHONPATH=src python bench/fleet_router.py --workers 10 100 --json load.json
    PYTHONPATH=src python bench/fleet_router.py --from-json load.json --idle-json idle.json --plot docs/fleet-growth.png

For each M: start `vllm-vcr fleet --workers M` (every worker `--time-to-first-token TTFT
--inter-token-latency ITL`, a control API each), then for each arm:

* `router`: start the real `vllm-router --policy round_robin` (scripts/install-routers.sh) with the
  M workers' URLs; the client sends every request to the router.
* `direct`: no router; the client sends request i to worker i mod M itself (the reference: what
  the router adds is the difference between the two arms).

The client (bench/stream_bench.py's aiohttp request and SSE scanner, one event loop) sends
streaming completions (`max_tokens` OSL, `ignore_eos`, continuous usage) at constant or Poisson
arrivals for DURATION seconds (or `--requests` in all), without waiting for answers (open loop),
after a warm-up that opens connections. Measured:

* per worker, from its control API: requests received in the phase (min / max against the
  expected share), and the largest `running` and `waiting` seen by polling every worker's
  /stats (every second, or every M/100 s: ~100 polls a second on the fleet);
* from every worker's /metrics before and after the phase: the mean queue time, TTFT and ITL
  the workers saw themselves, and their share of inter-token gaps over the first bucket bound
  above the configured ITL (the client's share over the same bound beside it);
* client side: TTFT and ITL p50/p90/p99 against the configured values, how late the client sent
  (lag behind the arrival schedule), errors by kind (HTTP status or transport);
* CPU (utime + stime from /proc) of the router, the fleet's processes and the client over the
  phase, per request; the machine's load average before and after.

The fleet is started by `fleet_command()` with `serve_flags()`, the flags every worker gets;
`run_m()` takes those flags, and each row records them. A dimension that changes how one worker
is served (serve's `--api-server-count N`, say) is one more entry of `variants()`; `--serve-args`
passes extra flags now.

Prints a Markdown table (docs/benchmarks.md) and writes JSON with --json; --plot draws how the
figures grow with M, with the idle figures of bench/fleet_idle.py's --json if given.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import stream_bench as sb  # noqa: E402  the one streaming client: Rec, one_request, TreeCPU, summary

PEERS = Path(os.environ.get("VLLM_VCR_PEERS") or Path.home() / ".cache" / "vllm-vcr" / "peers")
ROUTER = PEERS / "routers" / "bin" / "vllm-router"
MODEL = "vllm-vcr/sim"
PROMPT = "Tell me a short story about a fleet of engines that answer every request on time."
SAMPLE = re.compile(r"^(vllm:[a-z_]+)(?:\{([^}]*)\})? (\S+)$")
LE = re.compile(r'le="([^"]+)"')
TTFT, ITL, QUEUE = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                    "vllm:request_queue_time_seconds")


def router_missing() -> str | None:
    """Why the router arm cannot run here (None: it can)."""
    if not ROUTER.is_file():
        return f"vllm-router not installed at {ROUTER}; run scripts/install-routers.sh"
    return None


# ------------------------------------------------------------------ processes


def serve_flags(a: argparse.Namespace) -> list[str]:
    """The serve flags every worker of the fleet gets."""
    return ["--time-to-first-token", str(a.ttft), "--inter-token-latency", str(a.itl),
            "--max-num-seqs", str(a.max_num_seqs), "--no-log-requests", *shlex.split(a.serve_args)]


def variants(a: argparse.Namespace) -> list[list[str]]:
    """The ways of serving a worker to measure, each a list of serve flags (one today)."""
    return [serve_flags(a)]


def fleet_command(m: int, flags: list[str], ports_file: Path) -> list[str]:
    return [sys.executable, "-m", "vllm_vcr", "fleet", "--workers", str(m), "--host", "127.0.0.1",
            "--base-port", "0", "--control-base-port", "0", "--ports-file", str(ports_file), *flags]


def _spawn(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", NO_COLOR="1"), start_new_session=True)


def _stop(proc: subprocess.Popen, timeout: float = 30.0) -> int | None:
    """SIGTERM the process group, then SIGKILL what is left."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    return proc.returncode


def _tail(log: Path) -> str:
    with contextlib.suppress(OSError):
        return log.read_text(errors="replace")[-3000:]
    return ""


def start_fleet(argv: list[str], ports_file: Path, log: Path, timeout: float) -> tuple[subprocess.Popen, list[dict]]:
    proc = _spawn(argv, log)
    deadline = time.monotonic() + timeout
    while not ports_file.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the fleet exited with {proc.returncode}:\n{_tail(log)}")
        if time.monotonic() > deadline:
            _stop(proc)
            raise RuntimeError(f"the fleet did not write {ports_file} in {timeout:.0f} s:\n{_tail(log)}")
        time.sleep(0.05)
    return proc, json.loads(ports_file.read_text())["workers"]


def start_router(urls: list[str], log: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    from vllm_vcr.testing.waits import free_port, wait_http_ok

    port, prom = free_port(), free_port()
    proc = _spawn([str(ROUTER), "--worker-urls", *urls, "--policy", "round_robin", "--host", "127.0.0.1",
                   "--port", str(port), "--prometheus-port", str(prom), "--log-level", "warning"], log)
    url = f"http://127.0.0.1:{port}"

    def exited() -> str | None:
        return None if proc.poll() is None else f"vllm-router exited with {proc.returncode}:\n{_tail(log)}"

    try:
        wait_http_ok(url + "/health", timeout, exited)
    except BaseException:
        _stop(proc)
        raise
    return proc, url


# ------------------------------------------------------------------ per-worker figures


async def _get(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url) as r:
        r.raise_for_status()
        return await r.text()


async def worker_stats(session: aiohttp.ClientSession, workers: list[dict]) -> list[dict]:
    texts = await asyncio.gather(*(_get(session, f"http://127.0.0.1:{w['control_port']}/stats") for w in workers))
    return [json.loads(t) for t in texts]


def _histograms(text: str) -> dict[tuple[str, str], float]:
    """(sample name, le) -> value, summed over engines, of the TTFT, ITL and queue-time histograms."""
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m is None or not m.group(1).startswith((TTFT, ITL, QUEUE)) or m.group(3) == "NaN":
            continue
        le = LE.search(m.group(2) or "")
        key = (m.group(1), le.group(1) if le else "")
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


async def fleet_histograms(session: aiohttp.ClientSession, workers: list[dict]) -> list[dict]:
    texts = await asyncio.gather(*(_get(session, f"http://127.0.0.1:{w['port']}/metrics") for w in workers))
    return [_histograms(t) for t in texts]


def server_view(before: list[dict], after: list[dict], itl_ms: float) -> dict:
    """What the workers' own /metrics saw in the phase: mean TTFT, ITL and queue time, and the
    share of inter-token gaps over the first ITL bucket bound at or above 1.05 x the configured ITL."""
    d: dict[tuple[str, str], float] = {}
    for b, a in zip(before, after):
        for k, v in a.items():
            d[k] = d.get(k, 0.0) + v - b.get(k, 0.0)
    out: dict = {}
    for name, key in ((TTFT, "ttft"), (ITL, "itl"), (QUEUE, "queue_time")):
        n = d.get((name + "_count", ""), 0.0)
        out[f"{key}_mean_ms"] = round(1e3 * d.get((name + "_sum", ""), 0.0) / n, 3) if n else None
    bounds = sorted(float(le) for (k, le) in d if k == ITL + "_bucket" and le != "+Inf")
    bound = next((x for x in bounds if x * 1e3 >= 1.05 * itl_ms), None)
    n = d.get((ITL + "_count", ""), 0.0)
    if bound is not None and n:
        le = next(le for (k, le) in d if k == ITL + "_bucket" and le != "+Inf" and float(le) == bound)
        out["itl_over_ms"] = round(bound * 1e3, 3)
        out["itl_over_share_pct"] = round(100 * (n - d[(ITL + "_bucket", le)]) / n, 2)
    return out


class Poller:
    """Every `interval` s, every worker's /stats: the largest running and waiting seen per worker."""

    def __init__(self, session: aiohttp.ClientSession, workers: list[dict], interval: float):
        self.session, self.workers, self.interval = session, workers, interval
        self.max_running = [0] * len(workers)
        self.max_waiting = [0] * len(workers)
        self.polls = 0
        self.failed = 0

    async def run(self) -> None:
        while True:
            t = time.perf_counter()
            try:
                for i, s in enumerate(await worker_stats(self.session, self.workers)):
                    self.max_running[i] = max(self.max_running[i], s["running"])
                    self.max_waiting[i] = max(self.max_waiting[i], s["waiting"])
                self.polls += 1
            except (aiohttp.ClientError, asyncio.TimeoutError):
                self.failed += 1
            await asyncio.sleep(max(0.0, self.interval - (time.perf_counter() - t)))


# ------------------------------------------------------------------ the load


def arrivals(n: int, rate: float, kind: str, seed: int) -> list[float]:
    if kind == "constant":
        return [i / rate for i in range(n)]
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def request_body(a: argparse.Namespace) -> bytes:
    return json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": a.osl, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).encode()


def _pct(value: float | None, target: float) -> float | None:
    return None if value is None or not target else round(100 * (value - target) / target, 1)


async def drive(a: argparse.Namespace, workers: list[dict], urls: list[str], pids: dict[str, int]) -> dict:
    """One measured phase: open-loop requests spread over `urls` in turn."""
    body = request_body(a)
    paths = [u.rstrip("/") + "/v1/completions" for u in urls]
    n = a.requests or int(a.rate * a.duration)
    sched = arrivals(n, a.rate, a.arrivals, a.seed)
    warm_body = json.loads(body)
    warm_body["max_tokens"] = 1
    wb = json.dumps(warm_body).encode()
    session = raws = None
    if a.transport == "raw":  # stream_bench's minimal HTTP/1.1 client: about half aiohttp's CPU per event
        raws = [sb.RawClient(p, a.timeout) for p in paths]
        payloads = [(c.payload(body), c.payload(wb)) for c in raws]

        def send(i: int, r: sb.Rec, warm: bool = False):
            return raws[i % len(raws)].one(payloads[i % len(raws)][warm], r)
    else:
        conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
        session = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=a.timeout))

        def send(i: int, r: sb.Rec, warm: bool = False):
            return sb.one_request(session, paths[i % len(paths)], wb if warm else body, r)
    ctl = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32), timeout=aiohttp.ClientTimeout(total=60))
    try:
        # warm-up, not measured: a few requests per URL open the connections (and the router's)
        warm = [sb.Rec(time.perf_counter()) for _ in range(max(a.warmup, len(paths)))]
        for k in range(0, len(warm), 50):
            await asyncio.gather(*(send(i, warm[i], True) for i in range(k, min(k + 50, len(warm)))))
        bad = [r.err for r in warm if r.err]
        if bad:
            raise RuntimeError(f"{len(bad)} of {len(warm)} warm-up requests failed: {bad[0]}")

        before = await worker_stats(ctl, workers)
        hist0 = await fleet_histograms(ctl, workers)
        poller = Poller(ctl, workers, a.poll_interval or max(1.0, len(workers) / 100))
        mons = {k: sb.TreeCPU([p]) for k, p in pids.items()}
        load0 = os.getloadavg()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        box0 = sb.box_cpu_seconds()
        for mon in mons.values():
            mon.start()
        poll_task = asyncio.create_task(poller.run())
        recs: list[sb.Rec] = []
        lags: list[float] = []
        tasks = []
        t_start = time.perf_counter() + 0.05
        i = 0
        while i < n:
            now = time.perf_counter()
            while i < n and t_start + sched[i] <= now:
                lags.append((now - t_start - sched[i]) * 1e3)
                r = sb.Rec(now)
                recs.append(r)
                tasks.append(asyncio.create_task(send(i, r)))
                i += 1
            if i < n:
                await asyncio.sleep(max(0.0, t_start + sched[i] - time.perf_counter()))
        send_s = time.perf_counter() - t_start
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t_start
        cpu = {k: mon.stop()[0] for k, mon in mons.items()}
        box1 = sb.box_cpu_seconds()
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        load1 = os.getloadavg()
        poll_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poll_task
        after = await worker_stats(ctl, workers)
        hist1 = await fleet_histograms(ctl, workers)
    finally:
        if session is not None:
            await session.close()
        for c in raws or ():
            c.close()
        await ctl.close()

    res = sb.analyse(recs)
    errs: dict[str, int] = {}
    for r in recs:
        if r.err is not None:
            kind = r.err.split(":", 1)[0] if r.err.startswith("HTTP ") else r.err.split(":", 1)[0][:60]
            errs[kind] = errs.get(kind, 0) + 1
    served = [b["requests_received"] - f["requests_received"] for f, b in zip(before, after)]
    failed = sum(b["requests_failed"] - f["requests_failed"] for f, b in zip(before, after))
    client_cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    other = max(0.0, (box1 - box0) - client_cpu - sum(cpu.values()))
    expected = n / len(workers)
    server = server_view(hist0, hist1, a.itl)
    gaps = [1e3 * (y - x) for r in recs if r.err is None for x, y in zip(r.stamps, r.stamps[1:])]
    if "itl_over_ms" in server and gaps:
        server["client_itl_over_share_pct"] = round(
            100 * sum(1 for g in gaps if g > server["itl_over_ms"]) / len(gaps), 2)
    lags.sort()
    out = {
        "requests": n, "ok": res["ok"], "errors": sum(errs.values()), "errors_by_kind": errs,
        "send_s": round(send_s, 2), "wall_s": round(wall, 2), "offered_rps": a.rate,
        "sent_rps": round(n / send_s, 1) if send_s > 0 else None,
        "send_lag_ms": {"p50": round(sb.percentile(lags, 50), 2), "p99": round(sb.percentile(lags, 99), 2),
                        "max": round(lags[-1], 2)},
        "per_worker": {"expected": round(expected, 1), "min": min(served), "max": max(served),
                       "total": sum(served), "unserved": sum(1 for s in served if s == 0),
                       "spread_pct": [_pct(min(served), expected), _pct(max(served), expected)]},
        "worker_failed": failed,
        "max_running": max(poller.max_running), "max_waiting": max(poller.max_waiting),
        "workers_ever_waiting": sum(1 for w in poller.max_waiting if w > 0), "polls": poller.polls,
        "poll_failures": poller.failed,
        "server": server,
        "ttft_ms": res["ttft_ms"], "itl_ms": res["itl_chunk_ms"], "itl_1tok_ms": res["itl_1tok_ms"],
        "tpot_ms": res["tpot_ms"], "e2e_ms": res["e2e_ms"],
        "ttft_off_pct": {p: _pct(res["ttft_ms"][p], a.ttft) for p in ("p50", "p90", "p99")},
        "itl_off_pct": {p: _pct(res["itl_chunk_ms"][p], a.itl) for p in ("p50", "p90", "p99")},
        "output_tokens": res["output_tokens"], "prompt_tokens_mean": res["prompt_tokens_mean"],
        "cpu_pct": {k: round(100 * v / wall, 1) for k, v in cpu.items()},
        "cpu_us_per_request": {k: round(1e6 * v / max(1, res["ok"]), 1) for k, v in cpu.items()},
        "client_cpu_pct": round(100 * client_cpu / wall, 1),
        "client_cpu_us_per_request": round(1e6 * client_cpu / max(1, res["ok"]), 1),
        "other_cpu_pct": round(100 * other / wall, 1),
        "loadavg_before": [round(x, 2) for x in load0], "loadavg_after": [round(x, 2) for x in load1],
    }
    return out


def run_m(a: argparse.Namespace, m: int, flags: list[str], tmp: Path) -> list[dict]:
    """Start a fleet of m workers, each served with `flags`, run each arm against it, stop it."""
    ports_file = tmp / f"ports-{m}.json"
    argv = fleet_command(m, flags, ports_file)
    t0 = time.perf_counter()
    fleet, workers = start_fleet(argv, ports_file, tmp / f"fleet-{m}.log", a.start_timeout)
    rows = []
    try:
        startup = time.perf_counter() - t0
        worker_urls = [f"http://127.0.0.1:{w['port']}" for w in workers]
        for arm in a.arms:
            router = None
            if arm == "router":
                router, url = start_router(worker_urls, tmp / f"router-{m}.log", a.start_timeout)
                urls, pids = [url], {"router": router.pid, "fleet": fleet.pid}
            else:
                urls, pids = worker_urls, {"fleet": fleet.pid}
            row = {"arm": arm, "workers": m, "serve_flags": flags, "transport": a.transport, "ttft_cfg_ms": a.ttft,
                   "itl_cfg_ms": a.itl, "osl": a.osl, "arrivals": a.arrivals, "fleet_startup_s": round(startup, 2)}
            try:
                time.sleep(a.settle)
                row.update(asyncio.run(drive(a, workers, urls, pids)))
            finally:
                if router is not None:
                    row["router_exit"] = _stop(router)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        code = _stop(fleet, 60)
    for r in rows:
        r["fleet_exit"] = code
    return rows


# ------------------------------------------------------------------ report


def _f(x) -> str:
    return "-" if x is None else f"{x:g}" if isinstance(x, float) else str(x)


def report(rows: list[dict]) -> None:
    print("| arm | M | sent req/s | ok / errors | per worker: expected, min-max | max running / waiting | "
          "TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) | send lag p99 (ms) | "
          "CPU µs per request: router / fleet / client | CPU % of a core: router / fleet / client / other | load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pw, t, i = r["per_worker"], r["ttft_ms"], r["itl_ms"]
        cu, cp = r["cpu_us_per_request"], r["cpu_pct"]
        print(f"| {r['arm']} | {r['workers']} | {_f(r['sent_rps'])} | {r['ok']} / {r['errors']} | "
              f"{_f(pw['expected'])}, {pw['min']}-{pw['max']} | {r['max_running']} / {r['max_waiting']} | "
              f"{_f(t['p50'])} / {_f(t['p90'])} / {_f(t['p99'])} | {_f(i['p50'])} / {_f(i['p90'])} / {_f(i['p99'])} | "
              f"{_f(r['send_lag_ms']['p99'])} | {_f(cu.get('router'))} / {_f(cu['fleet'])} / "
              f"{_f(r['client_cpu_us_per_request'])} | {_f(cp.get('router'))} / {_f(cp['fleet'])} / "
              f"{_f(r['client_cpu_pct'])} / {_f(r['other_cpu_pct'])} | {r['loadavg_before'][0]} |")
    print()
    for r in rows:
        off_t, off_i = r["ttft_off_pct"], r["itl_off_pct"]
        verdict = all(v is not None and abs(v) <= 5 for v in (*off_t.values(), *off_i.values()))
        print(f"{r['arm']} M={r['workers']}: TTFT off by {off_t['p50']}/{off_t['p90']}/{off_t['p99']} %, "
              f"ITL by {off_i['p50']}/{off_i['p90']}/{off_i['p99']} % (p50/p90/p99; target within 5 %: "
              f"{'met' if verdict else 'NOT met'}); unserved workers {r['per_worker']['unserved']}, "
              f"errors {r['errors_by_kind'] or 0}; the workers' /metrics: {r['server']}")


def growth(rows: list[dict], idle: list[dict] | None) -> None:
    """One line per M: the idle figures (bench/fleet_idle.py) beside the figures under load."""
    idle_by_m = {r["workers"]: r for r in idle or () if r["what"].startswith("fleet")}
    load = {(r["arm"], r["workers"]): r for r in rows}
    ms = sorted(set(idle_by_m) | {m for _, m in load})
    print("| M | idle: start-up (s) | idle: PSS per worker (MB) | idle: CPU of all (% of a core) | "
          "load: fleet CPU µs per request (router / direct arm) | load: vllm-router CPU µs per request | "
          "load: max running per worker | load: TTFT p99 (ms, router / direct) | load: ITL p99 (ms, router / direct) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in ms:
        i, r, d = idle_by_m.get(m, {}), load.get(("router", m), {}), load.get(("direct", m), {})

        def g(row: dict, *keys):
            for k in keys:
                row = row.get(k, {}) if isinstance(row, dict) else {}
            return None if row == {} else row

        print(f"| {m} | {_f(i.get('startup_s'))} | {_f(i.get('pss_per_worker_mb'))} | {_f(i.get('idle_cpu_pct'))} | "
              f"{_f(g(r, 'cpu_us_per_request', 'fleet'))} / {_f(g(d, 'cpu_us_per_request', 'fleet'))} | "
              f"{_f(g(r, 'cpu_us_per_request', 'router'))} | "
              f"{_f(max(g(r, 'max_running') or 0, g(d, 'max_running') or 0) if r or d else None)} | "
              f"{_f(g(r, 'ttft_ms', 'p99'))} / {_f(g(d, 'ttft_ms', 'p99'))} | "
              f"{_f(g(r, 'itl_ms', 'p99'))} / {_f(g(d, 'itl_ms', 'p99'))} |")


def plot(rows: list[dict], idle: list[dict] | None, path: str) -> None:
    """How the figures grow with M: idle memory and CPU (bench/fleet_idle.py), CPU per request under
    load and the client's TTFT/ITL p99 against the configured values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if idle else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    ax = list(axes)
    if idle:
        fleets = [r for r in idle if r["what"].startswith("fleet")]
        ms = [r["workers"] for r in fleets]
        a0 = ax.pop(0)
        a0.plot(ms, [r["pss_per_worker_mb"] for r in fleets], "o-", label="PSS per worker, MB")
        a0.plot(ms, [r["idle_cpu_pct"] for r in fleets], "s-", label="idle CPU of all, % of a core")
        a0.plot(ms, [r["startup_s"] for r in fleets], "^-", label="start-up, s")
        a0.set(xscale="log", yscale="log", xlabel="workers M", title="idle fleet")
        a0.legend(fontsize=8)
    a1, a2 = ax
    for arm, style in (("router", "-"), ("direct", "--")):
        rs = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["workers"])
        if not rs:
            continue
        ms = [r["workers"] for r in rs]
        a1.plot(ms, [r["cpu_us_per_request"]["fleet"] for r in rs], "o" + style, label=f"fleet ({arm})")
        if arm == "router":
            a1.plot(ms, [r["cpu_us_per_request"]["router"] for r in rs], "s" + style, label="vllm-router")
        a1.plot(ms, [r["client_cpu_us_per_request"] for r in rs], "x" + style, label=f"client ({arm})")
        a2.plot(ms, [r["ttft_off_pct"]["p99"] for r in rs], "o" + style, label=f"TTFT p99 ({arm})")
        a2.plot(ms, [r["itl_off_pct"]["p99"] for r in rs], "s" + style, label=f"ITL p99 ({arm})")
    rate = rows[0]["sent_rps"] if rows else 0
    a1.set(xscale="log", xlabel="workers M", ylabel="CPU µs per request", title=f"under load (~{rate:.0f} req/s)")
    a1.set_ylim(bottom=0)
    a1.legend(fontsize=8)
    a2.axhline(5, color="grey", lw=0.8, ls=":")
    a2.set(xscale="log", yscale="symlog", xlabel="workers M", ylabel="% over the configured value",
           title="client TTFT / ITL p99 (dotted: 5 %)")
    a2.set_ylim(bottom=0)
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[100], metavar="M")
    ap.add_argument("--arms", nargs="+", choices=("router", "direct"), default=["router", "direct"])
    ap.add_argument("--direct", action="store_true", help="only the direct arm (no router)")
    ap.add_argument("--rate", type=float, default=500.0, help="requests per second (open loop)")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    ap.add_argument("--requests", type=int, default=None, help="requests in all (instead of --duration)")
    ap.add_argument("--arrivals", choices=("poisson", "constant"), default="poisson")
    ap.add_argument("--ttft", type=float, default=100.0, help="every worker's --time-to-first-token (ms)")
    ap.add_argument("--itl", type=float, default=20.0, help="every worker's --inter-token-latency (ms)")
    ap.add_argument("--osl", type=int, default=8, help="output tokens per request")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--transport", choices=("aiohttp", "raw"), default="aiohttp",
                    help="the client's HTTP: aiohttp, or stream_bench's minimal HTTP/1.1 (less CPU per event)")
    ap.add_argument("--serve-args", default="", help="more serve flags for every worker (one string)")
    ap.add_argument("--warmup", type=int, default=200, help="unmeasured requests first (at least one per URL)")
    ap.add_argument("--poll-interval", type=float, default=None,
                    help="s between polls of every worker's /stats (default: 1 s per 100 workers, at least 1 s)")
    ap.add_argument("--settle", type=float, default=2.0, help="s between start-up and the warm-up")
    ap.add_argument("--timeout", type=float, default=120.0, help="per request (s)")
    ap.add_argument("--start-timeout", type=float, default=180.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--from-json", default=None, help="no run: the table (and --plot) of an earlier --json")
    ap.add_argument("--idle-json", default=None, help="bench/fleet_idle.py --json output, for --plot")
    ap.add_argument("--plot", default=None, metavar="FILE.png", help="the figures against M (matplotlib)")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.direct:
        a.arms = ["direct"]
    if a.from_json:
        rows = json.loads(Path(a.from_json).read_text())
    else:
        if "router" in a.arms and (why := router_missing()):
            print(f"fleet_router: {why}", file=sys.stderr)
            return 2
        # SIGTERM unwinds like an exception, so every fleet and router started here is stopped
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for flags in variants(a):
                for m in a.workers:
                    rows += run_m(a, m, flags, Path(tmp))
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1))
    report(rows)
    idle = json.loads(Path(a.idle_json).read_text()) if a.idle_json else None
    if idle or len({r["workers"] for r in rows}) > 1:
        print()
        growth(rows, idle)
    if a.plot:
        plot(rows, idle, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
