#!/usr/bin/env python3
"""Does an endpoint picker's /metrics scrape, every 50 ms per worker, cost anything a user sees?

Starts W `vllm-vcr serve` workers (paced: --time-to-first-token, --inter-token-latency) on
loopback, drives each with C closed-loop streaming completions (OSL tokens, ignore_eos), and for
--duration seconds alternates --segment-long phases with and without a scraper that GETs every
worker's /metrics every --period seconds (the Gateway API Inference Extension picker's default
refresh interval is 50 ms) and parses it as the picker does (Prometheus text). Alternating
phases puts both arms under the same machine load. Reports, per arm, client-side TTFT and ITL
percentiles (ms), requests and tokens served, and the scrapes' own latency.

--in-process measures what one render of /metrics costs, without sockets or other processes: a
worker's metrics built as `serve` builds them (same collectors, same registry), rendered N times
by prometheus_client.generate_latest and by the renderer /metrics uses, CPU seconds per render
(process time, so other jobs on the box barely move it) on a fresh worker, on a worker after
load with nothing new between scrapes, and on a live one: between two renders, 50 ms of traffic
(C streams at --itl-ms, OSL tokens, a new request for each finished one) is fed through the
metrics hooks serve calls, as the engine would feed them.

usage:
  bench/scrape_cost.py [--workers 2] [--concurrency 8] [--osl 64] [--ttft-ms 50] [--itl-ms 20]
                       [--period 0.05] [--duration 240] [--segment 30] [--engine-type vllm]
                       [--no-parse] [--out result.json]
  bench/scrape_cost.py --in-process [--renders 2000] [--engine-type vllm] [--concurrency 8]
  bench/scrape_cost.py --idle-gets 2000   # one idle worker: server CPU per GET /metrics, per GET /health
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q / 100 * len(v)))]


def start_worker(args) -> tuple[subprocess.Popen, str]:
    from vllm_vcr.testing.waits import free_port

    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])))
    p = subprocess.Popen([sys.executable, "-m", "vllm_vcr", "serve", "--host", "127.0.0.1", "--port", str(port),
                          "--engine-type", args.engine_type, "--time-to-first-token", str(args.ttft_ms),
                          "--inter-token-latency", str(args.itl_ms)],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return p, url
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit(f"worker on {url} did not start")


class Arms:
    """Samples of the phase (scrape on / off) that was current when each one was taken."""

    def __init__(self):
        self.scraping = False
        self.data = {arm: {"ttft": [], "itl": [], "requests": 0, "tokens": 0, "seconds": 0.0, "server_cpu_s": 0.0} for arm in ("off", "on")}
        self.scrape_ms: list[float] = []
        self.scrape_errors = 0

    def arm(self) -> dict:
        return self.data["on" if self.scraping else "off"]


async def stream_loop(client: httpx.AsyncClient, url: str, args, arms: Arms, stop: asyncio.Event) -> None:
    body = {"model": "vllm-vcr/sim", "prompt": "benchmark the scrape " * 8, "max_tokens": args.osl,
            "ignore_eos": True, "stream": True}
    while not stop.is_set():
        phase = arms.scraping
        t0 = time.perf_counter()
        last = None
        ttft = None
        gaps: list[float] = []
        tokens = 0
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:
                    gaps.append(now - last)
                last = now
                tokens += 1
        if phase != arms.scraping:
            continue  # straddled a phase switch: counted in neither arm
        a = arms.arm()
        a["ttft"].append(ttft * 1000)
        a["itl"] += [g * 1000 for g in gaps]
        a["requests"] += 1
        a["tokens"] += tokens


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of the worker processes (from /proc)."""
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def scraper_process(urls: list[str], period: float, engine_type: str, parse: bool, scraping, stop,
                    results) -> None:
    """A separate process, as the picker is: every `period` s, while `scraping` is set, GET every
    worker's /metrics and parse it like the picker (Prometheus text). Scrape latencies (ms) and
    errors go to `results` at the end."""
    prefix = "sglang:" if engine_type == "sglang" else "vllm:"
    times: list[float] = []
    errors = 0

    async def one(client: httpx.AsyncClient, url: str) -> None:
        nonlocal errors
        t0 = time.perf_counter()
        try:
            text = (await client.get(url + "/metrics")).text
            if parse and not any(f.name.startswith(prefix) for f in text_string_to_metric_families(text)):
                errors += 1
            elif not parse and prefix not in text:
                errors += 1
        except httpx.HTTPError:
            errors += 1
        times.append((time.perf_counter() - t0) * 1000)

    async def loop() -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            next_tick = time.perf_counter()
            while not stop.is_set():
                next_tick += period
                if scraping.is_set():
                    await asyncio.gather(*(one(client, u) for u in urls))
                await asyncio.sleep(max(0.0, next_tick - time.perf_counter()))

    asyncio.run(loop())
    results.put((times, errors))


async def run(args) -> dict:
    procs, urls = [], []
    try:
        for _ in range(args.workers):
            p, u = start_worker(args)
            procs.append(p)
            urls.append(u)
        arms = Arms()
        stop = asyncio.Event()
        limits = httpx.Limits(max_connections=args.workers * args.concurrency + 4)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            tasks = [asyncio.create_task(stream_loop(client, u, args, arms, stop))
                     for u in urls for _ in range(args.concurrency)]
            ctx = multiprocessing.get_context("spawn")
            scraping, scraper_stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
            scraper = ctx.Process(target=scraper_process, daemon=True,
                                  args=(urls, args.period, args.engine_type, args.parse, scraping, scraper_stop, results))
            scraper.start()
            await asyncio.sleep(args.warmup)
            arms.data = Arms().data  # drop the warm-up
            start = time.perf_counter()
            while time.perf_counter() - start < args.duration:
                seg, cpu0 = time.perf_counter(), cpu_seconds([p.pid for p in procs])
                await asyncio.sleep(min(args.segment, args.duration - (seg - start)))
                arms.arm()["seconds"] += time.perf_counter() - seg
                arms.arm()["server_cpu_s"] += cpu_seconds([p.pid for p in procs]) - cpu0
                arms.scraping = not arms.scraping
                (scraping.set if arms.scraping else scraping.clear)()
            stop.set()
            scraper_stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            arms.scrape_ms, arms.scrape_errors = results.get(timeout=30)
            scraper.join(10)
        out = {"config": vars(args), "arms": {}}
        for name, a in arms.data.items():
            out["arms"][name] = {
                "seconds": round(a["seconds"], 1), "requests": a["requests"], "tokens": a["tokens"],
                "tokens_per_s": round(a["tokens"] / a["seconds"], 1) if a["seconds"] else None,
                **{f"ttft_p{q}_ms": round(pct(a["ttft"], q), 2) for q in (50, 90, 99)},
                **{f"itl_p{q}_ms": round(pct(a["itl"], q), 2) for q in (50, 90, 99)},
                "itl_mean_ms": round(statistics.fmean(a["itl"]), 3) if a["itl"] else None,
                "server_cpu_pct_per_worker": round(100 * a["server_cpu_s"] / a["seconds"] / args.workers, 1)
                if a["seconds"] else None,
            }
        out["scrapes"] = {"count": len(arms.scrape_ms), "errors": arms.scrape_errors,
                          "p50_ms": round(pct(arms.scrape_ms, 50), 2), "p99_ms": round(pct(arms.scrape_ms, 99), 2),
                          "per_worker_per_s": round(len(arms.scrape_ms) / max(arms.data["on"]["seconds"], 1e-9)
                                                    / args.workers, 1)}
        return out
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(p.pid, signal.SIGKILL)


class SyntheticTraffic:
    """C closed-loop requests on a virtual clock, fed to FrontendMetrics/HttpMetrics through the
    hooks serve calls (on_request_arrival, on_engine_outputs, HttpMetrics.observe): one engine step
    per --itl-ms, one token per running request per step, a new request for each finished one."""

    def __init__(self, metrics, args):
        from vllm_vcr.engine.types import (EngineCoreEvent, EngineCoreOutput, EngineCoreOutputs, FinishReason,
                                           PrefillStats, PrefixCacheStats, SchedulerStats)
        self.t = (EngineCoreEvent, EngineCoreOutput, EngineCoreOutputs, FinishReason, PrefillStats,
                  PrefixCacheStats, SchedulerStats)
        self.m, self.args = metrics, args
        self.clock = 1000.0  # virtual monotonic seconds
        self.seq = 0
        self.active: dict[str, int] = {}  # request id -> tokens so far
        self.new: list[str] = []

    def _arrive(self) -> None:
        rid = f"cmpl-{self.seq}"
        self.seq += 1
        self.m.on_request_arrival(rid, time.time(), n=1, max_tokens=self.args.osl, num_prompt_tokens=48)
        self.active[rid] = 0
        self.new.append(rid)

    def step(self) -> None:
        Event, Output, Outputs, Finish, Prefill, PCS, Stats = self.t
        while len(self.active) < self.args.concurrency:
            self._arrive()
        self.clock += self.args.itl_ms / 1000
        outs, finished = [], []
        for rid in list(self.active):
            n = self.active[rid] = self.active[rid] + 1
            done = n >= self.args.osl
            kw = {}
            if rid in self.new:
                kw = {"events": [Event(1, self.clock - 0.05), Event(2, self.clock - 0.04)],
                      "prefill_stats": Prefill(num_prompt_tokens=48, num_computed_tokens=32, num_cached_tokens=16,
                                               num_local_cached_tokens=16)}
            outs.append(Output(request_id=rid, new_token_ids=[7], finish_reason=Finish.LENGTH if done else None, **kw))
            if done:
                finished.append(rid)
        self.new.clear()
        stats = Stats(num_running_reqs=len(self.active), num_waiting_reqs=0, kv_cache_usage=0.01 * len(self.active),
                      prefix_cache_stats=PCS(requests=1, queries=48, hits=16) if finished else PCS())
        self.m.on_engine_outputs(0, Outputs(engine_index=0, outputs=outs, scheduler_stats=stats,
                                            timestamp=self.clock))
        for rid in finished:
            del self.active[rid]
            if self.m.http is not None:
                self.m.http.observe("/v1/completions", "POST", 200, 180, 0, self.args.osl * self.args.itl_ms / 1000)

    def advance(self, seconds: float) -> None:
        for _ in range(max(1, round(seconds / (self.args.itl_ms / 1000)))):
            self.step()


def in_process(args) -> dict:
    """CPU per /metrics render: generate_latest vs serve's renderer, fresh / after load / live."""
    from prometheus_client import generate_latest

    from vllm_vcr.http.serving_base import ServeSettings
    from vllm_vcr.serve.app import _load_metrics

    def worker():
        return _load_metrics(ServeSettings(engine_type=args.engine_type, num_gpu_blocks=4096))

    def cpu_per_render(m, render, between=None) -> tuple[float, int]:
        spent, size = 0.0, 0
        for _ in range(args.renders):
            if between is not None:
                between()
            t0 = time.process_time()
            body = render(m)
            spent += time.process_time() - t0
            size = len(body)
        return spent / args.renders * 1e6, size

    renderers = {"generate_latest": lambda m: generate_latest(m.registry), "serve": lambda m: m.render_text()}
    out: dict = {"config": {k: getattr(args, k) for k in ("engine_type", "renders", "concurrency", "osl", "itl_ms")},
                 "us_per_render": {}}
    for name, render in renderers.items():
        row = out["us_per_render"][name] = {}
        m = worker()
        row["fresh"], row["bytes_fresh"] = cpu_per_render(m, render)
        traffic = SyntheticTraffic(m, args)
        traffic.advance(600)  # ten minutes of traffic
        row["after_load_idle"], row["bytes_loaded"] = cpu_per_render(m, render)
        row["after_load_live"], _ = cpu_per_render(m, render, lambda: traffic.advance(args.period))
        row["requests_served"] = traffic.seq - len(traffic.active)
    base, new = out["us_per_render"]["generate_latest"], out["us_per_render"]["serve"]
    out["speedup"] = {k: round(base[k] / new[k], 1) for k in ("fresh", "after_load_idle", "after_load_live")}
    for row in out["us_per_render"].values():
        for k in ("fresh", "after_load_idle", "after_load_live"):
            row[k] = round(row[k], 1)
    return out


def idle_gets(args) -> dict:
    """One idle worker, `n` sequential GET /metrics then `n` GET /health: its CPU per request."""
    p, url = start_worker(args)
    try:
        out = {"config": {"engine_type": args.engine_type, "gets": args.idle_gets}}
        with httpx.Client(timeout=10) as client:
            for _ in range(50):
                client.get(url + "/metrics")
            for path in ("/metrics", "/health"):
                c0 = cpu_seconds([p.pid])
                for _ in range(args.idle_gets):
                    client.get(url + path)
                out[f"server_cpu_ms_per_get_{path.strip('/')}"] = round(
                    (cpu_seconds([p.pid]) - c0) / args.idle_gets * 1000, 3)
        return out
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8, help="streams per worker")
    ap.add_argument("--osl", type=int, default=64)
    ap.add_argument("--ttft-ms", type=float, default=50)
    ap.add_argument("--itl-ms", type=float, default=20)
    ap.add_argument("--period", type=float, default=0.05, help="scrape period per worker (s)")
    ap.add_argument("--duration", type=float, default=240, help="measured seconds, both arms")
    ap.add_argument("--segment", type=float, default=30, help="seconds per phase before switching")
    ap.add_argument("--warmup", type=float, default=5)
    ap.add_argument("--engine-type", choices=("vllm", "sglang"), default="vllm")
    ap.add_argument("--no-parse", dest="parse", action="store_false",
                    help="fetch /metrics without parsing it: on a small machine the Python parser's CPU "
                         "(~25 ms a scrape) competes with the workers; the picker parses in Go elsewhere")
    ap.add_argument("--in-process", action="store_true",
                    help="measure CPU per render of /metrics in this process (no workers, no sockets)")
    ap.add_argument("--renders", type=int, default=2000, help="--in-process: renders per measurement")
    ap.add_argument("--idle-gets", type=int, default=0,
                    help="measure one idle worker's CPU per GET /metrics and per GET /health over N requests each")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.in_process or args.idle_gets:
        result = in_process(args) if args.in_process else idle_gets(args)
        text = json.dumps(result, indent=2)
        if args.out:
            Path(args.out).write_text(text + "\n")
        print(text)
        return
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    off, on = result["arms"]["off"], result["arms"]["on"]
    print(f"TTFT p50/p99 off {off['ttft_p50_ms']}/{off['ttft_p99_ms']} ms, on {on['ttft_p50_ms']}/{on['ttft_p99_ms']} ms; "
          f"ITL p50/p99 off {off['itl_p50_ms']}/{off['itl_p99_ms']} ms, on {on['itl_p50_ms']}/{on['itl_p99_ms']} ms; "
          f"{result['scrapes']['count']} scrapes, p50 {result['scrapes']['p50_ms']} ms; server CPU/worker "
          f"off {off['server_cpu_pct_per_worker']} %, on {on['server_cpu_pct_per_worker']} %", file=sys.stderr)


if __name__ == "__main__":
    main()
