#!/usr/bin/env python3
"""Run the W1 / W2 benchmark against `vllm-vcr serve` and its peers, one server at a time.

  W1 max speed      no simulated latency, ISL 128, OSL 256, concurrency 64
                    -> streamed output tok/s and server CPU us per output token
                    (every server sends one token per SSE event; vllm-vcr-si16 shows --stream-interval 16)
                    -> also SSE events/s and server CPU us per SSE event
  W2 timing         TTFT 100 ms, ITL 20 ms, ISL 128, OSL 100, concurrency 32 / 256 / 1000
                    -> measured TTFT, ITL (per chunk), TPOT p50/p99; vllm-vcr against null at each C
  burst (TTFT)      TTFT 100 ms, ITL 20 ms, ISL 128, OSL 100: C streams opened at once (one wave,
                    N = C, default C 256), `--burst-rounds` times -> TTFT p50/p99 against the
                    configured 100 ms, with null as the floor
  requests          TTFT 100 ms, ITL 20 ms, ISL 128, OSL 2, concurrency 300: almost all of a
                    request's work is per request -> server CPU us per request
  aiperf            optional cross-check of one W1 and one W2 point (`--aiperf`)

Servers (all on 127.0.0.1, each started in its own process group and killed with it):
  vllm-vcr          `python -m vllm_vcr serve ...` from this checkout
  vllm-vcr-api2     the same with `--api-server-count 2`: two API server processes and an
                    engine-core process (CPU counted over the whole process tree)
  dynamo            ai-dynamo frontend + mocker (file discovery, tcp request plane, no etcd/NATS)
  guidellm          `guidellm mock-server`
  null              bench/null_sse_server.py: pre-built chunks on deadlines, nothing else: the
                    floor this machine and client put under any server's timing and CPU per event
  uvicorn-floor     bench/asgi_floor_server.py: null's chunks and timing behind uvicorn's request
                    path (httptools, uvloop, an ASGI task per request; serve's GC settings): what
                    the HTTP framework `serve` runs on costs before any of serve's own work
  null+cpuN         null spending N us of CPU on each request as it parses it (e.g. null+cpu50):
                    what W2's ITL tail makes of per-request work alone, on the same client and box
Peers come from bench/install-peers-bench.sh (venvs under $VLLM_VCR_PEERS).

usage:
  python bench/run_bench.py [--servers vllm-vcr,vllm-vcr-si16,dynamo,guidellm,null]
                            [--workloads w1,w2,burst,requests] [--w2-concurrency 32,256,1000]
                            [--burst-concurrency 256] [--burst-rounds 3] [--aiperf] [--out-dir DIR]
Writes DIR/results.json and DIR/results.md (markdown tables) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PEERS = Path(os.environ.get("VLLM_VCR_PEERS", Path.home() / ".cache/vllm-vcr/peers"))
MODEL_NAME = "tiny"


# ------------------------------------------------------------------ process handling


class Server:
    """A set of processes (each its own process group) that serve one OpenAI endpoint."""

    def __init__(self, name: str, port: int, run_dir: Path):
        self.name = name
        self.port = port
        self.run_dir = run_dir
        self.procs: list[subprocess.Popen] = []
        self.desc: list[str] = []  # the commands, for the doc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spawn(self, tag: str, cmd: list[str], env: dict | None = None) -> None:
        log = open(self.run_dir / f"{self.name}-{tag}.log", "wb")
        full_env = dict(os.environ, **(env or {}))
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                             start_new_session=True, cwd=self.run_dir)
        self.procs.append(p)
        envs = " ".join(f"{k}={v}" for k, v in (env or {}).items())
        self.desc.append((envs + " " if envs else "") + " ".join(cmd))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait_ready(self, timeout: float = 90.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{self.name}: pid {p.pid} exited rc={p.returncode}; see {self.run_dir}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                    if MODEL_NAME.encode() in r.read():
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name}: not ready after {timeout}s")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 8
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:  # whatever is left of the group (workers, stragglers)
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()


# `serve` as the peers stream (one token per SSE event), with 16 tokens per event, and in vLLM's
# process shape with two API server processes in front of an engine-core process
VCR_VARIANTS = {"vllm-vcr": [], "vllm-vcr-si16": ["--stream-interval", "16"],
                "vllm-vcr-api2": ["--api-server-count", "2"]}


def start_vllm_vcr(port: int, run_dir: Path, *, ttft_ms: float, itl_ms: float, model_dir: Path,
                   extra: list[str], name: str = "vllm-vcr") -> Server:
    s = Server(name, port, run_dir)
    py = os.environ.get("VLLM_VCR_PYTHON", sys.executable)
    cmd = [py, "-m", "vllm_vcr", "serve", str(model_dir), "--served-model-name", MODEL_NAME,
           "--host", "127.0.0.1", "--port", str(port),
           "--time-to-first-token", str(ttft_ms), "--inter-token-latency", str(itl_ms),
           # enough sequences and KV blocks that nothing queues or gets preempted at c=1000
           "--max-num-seqs", "2048", "--kv-cache-size", "65536", "--no-log-requests", *extra]
    env = {"PYTHONPATH": str(REPO / "src")}
    s.spawn("serve", cmd, env)
    return s


def start_dynamo(port: int, run_dir: Path, *, ttft_ms: float, itl_ms: float, model_dir: Path,
                 speedup: float) -> Server:
    s = Server("dynamo", port, run_dir)
    py = str(PEERS / "dynamo/bin/python")
    kv = run_dir / f"dynamo-kv-{port}"
    shutil.rmtree(kv, ignore_errors=True)
    kv.mkdir(parents=True)
    # file discovery + tcp request plane + zmq events: no etcd or NATS, everything on loopback
    env = {"DYN_FILE_KV": str(kv), "DYN_DISCOVERY_BACKEND": "file", "DYN_REQUEST_PLANE": "tcp",
           "DYN_EVENT_PLANE": "zmq", "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_EVENT_PLANE_HOST": "127.0.0.1",
           "DYN_SYSTEM_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1", "HF_HUB_OFFLINE": "1"}
    common = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
    s.spawn("frontend", [py, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port),
                         *common], env)
    mock = [py, "-m", "dynamo.mocker", "--model-path", str(model_dir), "--model-name", MODEL_NAME,
            *common, "--num-workers", "1"]
    if ttft_ms == 0 and itl_ms == 0:
        mock += ["--speedup-ratio", str(speedup), "--max-num-seqs", "2048"]
    else:
        # The fixed timing model (charged per engine pass) only exists in the engine-args file,
        # which replaces the individual flags, so max_num_seqs goes in there too.
        args_file = run_dir / f"dynamo-engine-args-{port}.json"
        args_file.write_text(json.dumps({
            "engine": {"speedup_ratio": 1.0, "max_num_seqs": 2048,
                       "timing_model": {"type": "fixed", "prefill_ms": ttft_ms, "decode_ms": itl_ms}},
            "dynamo": {"enable_local_indexer": True}}))
        mock += ["--extra-engine-args", str(args_file)]
    s.spawn("mocker", mock, env)
    return s


def start_guidellm(port: int, run_dir: Path, *, ttft_ms: float, itl_ms: float, model_dir: Path) -> Server:
    s = Server("guidellm", port, run_dir)
    # --output-tokens is a cap: the request's max_tokens decides the length below it
    s.spawn("mock", [str(PEERS / "guidellm/bin/guidellm"), "mock-server", "--host", "127.0.0.1",
                     "--port", str(port), "--model", MODEL_NAME, "--ttft-ms", str(ttft_ms),
                     "--itl-ms", str(itl_ms), "--output-tokens", "100000"])
    return s


def start_null(port: int, run_dir: Path, *, ttft_ms: float, itl_ms: float, request_cpu_us: int = 0) -> Server:
    s = Server(f"null+cpu{request_cpu_us}" if request_cpu_us else "null", port, run_dir)
    s.spawn("null", [sys.executable, str(HERE / "null_sse_server.py"), "--port", str(port),
                     "--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms),
                     *(["--request-cpu-us", str(request_cpu_us)] if request_cpu_us else [])])
    return s


def null_cpu_us(name: str) -> int | None:
    """N of a `null+cpuN` server name, else None."""
    head, sep, n = name.partition("+cpu")
    return int(n) if head == "null" and sep and n.isdigit() and int(n) > 0 else None


def start_uvicorn_floor(port: int, run_dir: Path, *, ttft_ms: float, itl_ms: float) -> Server:
    s = Server("uvicorn-floor", port, run_dir)
    s.spawn("floor", [sys.executable, str(HERE / "asgi_floor_server.py"), "--host", "127.0.0.1",
                      "--port", str(port), "--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms)],
            {"PYTHONPATH": str(REPO / "src")})
    return s


# ------------------------------------------------------------------ clients


def box_busy_pct(window: float = 2.0) -> float:
    def busy():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v[:8]) - v[3] - v[4], sum(v[:8])
    b0, t0 = busy()
    time.sleep(window)
    b1, t1 = busy()
    return 100.0 * (os.cpu_count() or 1) * (b1 - b0) / max(1, t1 - t0)


QUIET = {"threshold": 0.0, "max_wait": 0.0}


def wait_quiet() -> float:
    """Block until other work on the shared machine is below QUIET['threshold'] % CPU (or give up)."""
    if QUIET["threshold"] <= 0:
        return 0.0
    t0 = time.monotonic()
    busy = box_busy_pct()
    while busy > QUIET["threshold"] and time.monotonic() - t0 < QUIET["max_wait"]:
        busy = box_busy_pct()
    waited = time.monotonic() - t0
    if waited > 3:
        print(f"  (waited {waited:.0f}s for a quiet machine; busy {busy:.0f}%)", flush=True)
    return busy


def scrape(server: Server) -> dict[str, float] | None:
    """Sum of the `vllm:` histogram _sum/_count series on the server's /metrics (None if it has none)."""
    try:
        with urllib.request.urlopen(server.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and ("_sum{" in line or "_count{" in line or "_total{" in line):
            name = line.split("{", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return out or None


def server_side(before: dict | None, after: dict | None) -> dict | None:
    """Means over the run from the server's own histograms: what its /metrics says it did."""
    if not before or not after:
        return None

    def mean(h):
        n = after.get(h + "_count", 0) - before.get(h + "_count", 0)
        return None if n <= 0 else round(1e3 * (after.get(h + "_sum", 0) - before.get(h + "_sum", 0)) / n, 3)

    steps = after.get("vllm:iteration_tokens_total_count", 0) - before.get("vllm:iteration_tokens_total_count", 0)
    stepped = after.get("vllm:iteration_tokens_total_sum", 0) - before.get("vllm:iteration_tokens_total_sum", 0)
    return {"ttft_mean_ms": mean("vllm:time_to_first_token_seconds"),
            "itl_mean_ms": mean("vllm:inter_token_latency_seconds"),
            "tpot_mean_ms": mean("vllm:request_time_per_output_token_seconds"),
            "queue_mean_ms": mean("vllm:request_queue_time_seconds"),
            "e2e_mean_ms": mean("vllm:e2e_request_latency_seconds"),
            "generation_tokens": after.get("vllm:generation_tokens_total", 0)
            - before.get("vllm:generation_tokens_total", 0),
            # how many tokens an engine step carried on average (its batching under this load)
            "tokens_per_step": round(stepped / steps, 1) if steps > 0 else None}


def run_client(server: Server, *, label: str, osl: int, conc: int, n: int, model_dir: Path,
               out: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, str(HERE / "stream_bench.py"), "--url", server.url, "--model", MODEL_NAME,
           "--tokenizer", str(model_dir), "--isl", "128", "--osl", str(osl), "--concurrency", str(conc),
           "--requests", str(n), "--pids", ",".join(map(str, server.pids)), "--label", label,
           "--timeout", "300", "--out", str(out), *extra]
    busy_before = wait_quiet()
    m0 = scrape(server) if server.name in VCR_VARIANTS else None
    t0 = time.monotonic()
    p = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    srv_metrics = server_side(m0, scrape(server) if m0 else None)
    line = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
    print(f"  {line}  ({time.monotonic() - t0:.0f}s)", flush=True)
    if not out.exists():
        return {"label": label, "failed": p.stderr[-2000:]}
    r = json.loads(out.read_text())
    r["command"] = " ".join(cmd)
    r["box_busy_before_pct"] = round(busy_before, 1)
    if srv_metrics:
        r["server_metrics"] = srv_metrics
        print(f"    server /metrics over the run: {srv_metrics}", flush=True)
    by_role = cpu_by_role(server, r)
    if by_role:
        r["server_cpu_us_per_event_by_role"] = by_role
        print(f"    server CPU us per event, by process: {by_role}", flush=True)
    return r


_READY_PIDS = re.compile(r"API server\(s\) \(pids ([\d ]+)\), \d+ engine core process\(es\) \(pids ([\d ]+)\)")


def cpu_by_role(server: Server, r: dict) -> dict[str, float] | None:
    """`serve --api-server-count N`'s CPU per SSE event split by process (its ready line names the
    API servers' and engine cores' pids; the rest is the parent's): None for one process."""
    log = server.run_dir / f"{server.name}-serve.log"
    m = _READY_PIDS.search(log.read_text(errors="replace")) if log.exists() else None
    by_pid, events = r.get("server_cpu_s_by_pid"), r.get("content_events")
    if m is None or not by_pid or not events:
        return None
    roles = {**{p: "API servers" for p in m.group(1).split()}, **{p: "engine cores" for p in m.group(2).split()}}
    out: dict[str, float] = {}
    for pid, cpu in by_pid.items():
        role = roles.get(pid, "parent and the rest")
        out[role] = out.get(role, 0.0) + cpu
    return {k: round(v / events * 1e6, 2) for k, v in sorted(out.items())}


def run_profiled(server: Server, *, label: str, osl: int, conc: int, n: int, model_dir: Path, out_dir: Path,
                 extra: list[str], duration: float = 12.0) -> dict:
    """An extra, unmeasured client run with `py-spy record` attached to the server's first process."""
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        print("  (py-spy not installed: pip install py-spy)")
        return {"label": label, "failed": "py-spy not installed"}
    raw = out_dir / f"profile-{label}.txt"
    wait_quiet()  # before py-spy starts its clock, not inside run_client
    saved, QUIET["threshold"] = QUIET["threshold"], 0.0
    spy = subprocess.Popen([pyspy, "record", "--pid", str(server.pids[0]), "--rate", "200", "--format", "raw",
                            "--full-filenames", "--duration", str(int(duration)), "--nonblocking",
                            "--output", str(raw)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    time.sleep(1.0)  # let py-spy attach
    r = run_client(server, label=f"{label} (under py-spy)", osl=osl, conc=conc, n=n, model_dir=model_dir,
                   out=out_dir / f"profiled-{label}.json", extra=extra)
    QUIET["threshold"] = saved
    try:
        spy.wait(timeout=duration + 20)
    except subprocess.TimeoutExpired:
        os.killpg(spy.pid, signal.SIGINT)
        spy.wait(timeout=10)
    summary = subprocess.run([sys.executable, str(HERE / "profile_summary.py"), str(raw), "--top", "25"],
                             capture_output=True, text=True).stdout
    (out_dir / f"profile-{label}-summary.txt").write_text(summary)
    print(summary[:4000])
    return {"label": label, "raw": str(raw), "summary": summary, "client": r}


def run_aiperf(server: Server, *, label: str, osl: int, conc: int, n: int, model_dir: Path,
               art: Path) -> dict:
    """aiperf profile against a running server; returns its headline numbers."""
    aiperf = PEERS / "aiperf/bin/aiperf"
    cmd = [str(aiperf), "profile", "--model", MODEL_NAME, "--tokenizer", str(model_dir), "--url", server.url,
           "--endpoint-type", "chat", "--streaming", "--concurrency", str(conc), "--request-count", str(n),
           "--isl", "128", "--osl", str(osl), "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
           "--ui", "simple", "--artifact-dir", str(art)]
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # aiperf breaks with it set
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    res: dict = {"label": label, "client": "aiperf", "concurrency": conc, "requests": n, "osl": osl,
                 "command": " ".join(cmd), "rc": p.returncode, "elapsed_s": round(time.monotonic() - t0, 1)}
    js = next(iter(sorted(art.rglob("profile_export_aiperf.json"))), None)
    if js is None:
        res["failed"] = (p.stdout + p.stderr)[-2000:]
        return res
    data = json.loads(js.read_text())
    recs = data.get("records", data)

    def metric(name):
        m = recs.get(name) if isinstance(recs, dict) else None
        if not isinstance(m, dict):
            return None
        return {k: m.get(k) for k in ("avg", "p50", "p99") if k in m}

    for key in ("time_to_first_token", "inter_token_latency", "request_throughput",
                "output_token_throughput", "request_latency", "error_request_count", "request_count"):
        res[key] = metric(key)
    print(f"  [aiperf {label}] rc={p.returncode} ttft={res['time_to_first_token']} "
          f"itl={res['inter_token_latency']} tok/s={res['output_token_throughput']}", flush=True)
    return res


# ------------------------------------------------------------------ tables


def fmt(v, nd=1):
    return "-" if v is None else f"{v:,.{nd}f}"


def table_w1(rows: list[dict]) -> str:
    out = ["| server | req/s | output tok/s | SSE events/s | TTFT p50 / p99 ms | ITL chunk p50 / p99 ms "
           "| TPOT p50 ms | tokens per SSE chunk | server CPU % | server CPU µs/event | server CPU µs/token "
           "| client CPU % | others CPU % | server peak RSS MB | errors |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            out.append(f"| {r['label']} | failed | | | | | | | | | | | | | |")
            continue
        out.append(
            f"| {r['label']} | {fmt(r['req_per_s'])} | {fmt(r['output_tok_per_s'], 0)} "
            f"| {fmt(r.get('events_per_s'), 0)} "
            f"| {fmt(r['ttft_ms']['p50'])} / {fmt(r['ttft_ms']['p99'])} "
            f"| {fmt(r['itl_chunk_ms']['p50'], 2)} / {fmt(r['itl_chunk_ms']['p99'], 2)} "
            f"| {fmt(r['tpot_ms']['p50'], 3)} | {r['output_tokens'] / max(1, r['content_events']):.2f} "
            f"| {fmt(r.get('server_cpu_pct'))} | {fmt(r.get('server_cpu_us_per_event'))} "
            f"| {fmt(r.get('server_cpu_us_per_token'))} | {fmt(r['client_cpu_pct'])} "
            f"| {fmt(r.get('other_cpu_pct'))} | {fmt(r.get('server_peak_rss_mb'), 0)} | {r['errors']} |")
    return "\n".join(out)


def table_w2(rows: list[dict]) -> str:
    out = ["| server | C | N | tok/s | TTFT p50 / p99 ms (cfg 100) | TTFT p50 / p99 after the first C "
           "| ITL chunk p50 / p99 ms (cfg 20) | ITL 1-token chunks p50 / p99 | the same p99 away from arrivals "
           "| TPOT p50 / p99 ms "
           "| tokens per chunk | tokens per engine step (its /metrics) | errors | server CPU % "
           "| server µs/event (of it, system) | server µs/token | client CPU % | others CPU % |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            out.append(f"| {r['label']} | | | failed | | | | | | | | | | | | | | |")
            continue
        t1 = r.get("itl_1tok_ms") or {}
        calm = r.get("itl_1tok_calm_ms") or {}
        ts = r.get("ttft_steady_ms") or {}
        out.append(
            f"| {r['label']} | {r['concurrency']} | {r['requests']} | {fmt(r['output_tok_per_s'], 0)} "
            f"| {fmt(r['ttft_ms']['p50'])} / {fmt(r['ttft_ms']['p99'])} | {fmt(ts.get('p50'))} / {fmt(ts.get('p99'))} "
            f"| {fmt(r['itl_chunk_ms']['p50'], 2)} / {fmt(r['itl_chunk_ms']['p99'], 2)} "
            f"| {fmt(t1.get('p50'), 2)} / {fmt(t1.get('p99'), 2)} | {fmt(calm.get('p99'), 2)} "
            f"| {fmt(r['tpot_ms']['p50'], 2)} / {fmt(r['tpot_ms']['p99'], 2)} "
            f"| {r['output_tokens'] / max(1, r['content_events']):.2f} "
            f"| {fmt((r.get('server_metrics') or {}).get('tokens_per_step'))} | {r['errors']} "
            f"| {fmt(r.get('server_cpu_pct'))} | {fmt(r.get('server_cpu_us_per_event'))} "
            f"({fmt(r.get('server_sys_us_per_event'))}) "
            f"| {fmt(r.get('server_cpu_us_per_token'))} "
            f"| {fmt(r['client_cpu_pct'])} | {fmt(r.get('other_cpu_pct'))} |")
    return "\n".join(out)


def table_requests(rows: list[dict]) -> str:
    """The `requests` workload: two tokens per request, so the server's CPU is nearly all per-request work."""
    out = ["| server | C | N | req/s | server CPU µs per request (of it, system) | server CPU % "
           "| TTFT p50 / p99 ms (cfg 100) | errors | client CPU % | others CPU % |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            out.append(f"| {r['label']} | | | failed | | | | | | |")
            continue
        per_req = r["server_cpu_s"] / max(1, r["ok"]) * 1e6
        sys_ = r["server_sys_us_per_event"] * r["content_events"] / max(1, r["ok"])
        out.append(f"| {r['label']} | {r['concurrency']} | {r['requests']} | {fmt(r['req_per_s'], 0)} "
                   f"| {per_req:.0f} ({sys_:.0f}) | {fmt(r.get('server_cpu_pct'))} "
                   f"| {fmt(r['ttft_ms']['p50'])} / {fmt(r['ttft_ms']['p99'])} | {r['errors']} "
                   f"| {fmt(r['client_cpu_pct'])} | {fmt(r.get('other_cpu_pct'))} |")
    return "\n".join(out)


def table_burst(rows: list[dict]) -> str:
    # the server's own TTFT (its /metrics, from the arrival stamp) beside the client's: the difference
    # is what happens before the stamp (the loop not reading yet) and after the write (the client)
    out = ["| server | round | C = N | TTFT p50 ms (cfg 100) | TTFT p90 | TTFT p99 | TTFT max | p50 / cfg | p99 / cfg "
           "| server's own TTFT mean | errors | server CPU % | client CPU % | others CPU % |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            out.append(f"| {r['label']} | {r.get('round', '')} | | failed | | | | | | | | | | |")
            continue
        t = r["ttft_ms"]
        cfg = r.get("ttft_cfg_ms", 100.0)
        own = (r.get("server_metrics") or {}).get("ttft_mean_ms")
        out.append(
            f"| {r['label']} | {r.get('round', '')} | {r['concurrency']} | {fmt(t['p50'])} | {fmt(t['p90'])} "
            f"| {fmt(t['p99'])} | {fmt(t['max'])} | {t['p50'] / cfg:.3f} | {t['p99'] / cfg:.3f} | {fmt(own)} | {r['errors']} "
            f"| {fmt(r.get('server_cpu_pct'))} | {fmt(r['client_cpu_pct'])} | {fmt(r.get('other_cpu_pct'))} |")
    return "\n".join(out)


def _median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return None if not xs else xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def verdict_w2(rows: list[dict], server: str = "vllm-vcr") -> list[str]:
    """The W2 target, per C: one-token ITL p99 within 2 ms of null's, CPU per event <= 1.2x null's."""
    out = []
    for c in sorted({r["concurrency"] for r in rows if "failed" not in r}):
        at = {r["label"]: r for r in rows if "failed" not in r and r["concurrency"] == c}
        ours, null = at.get(server), at.get("null")
        if ours is None or null is None:
            continue
        p99, p99n = (ours.get("itl_1tok_ms") or {}).get("p99"), (null.get("itl_1tok_ms") or {}).get("p99")
        cpu, cpun = ours.get("server_cpu_us_per_event"), null.get("server_cpu_us_per_event")
        if None in (p99, p99n, cpu, cpun) or not cpun:
            continue
        d, ratio = p99 - p99n, cpu / cpun
        calm, calmn = (ours.get("itl_1tok_calm_ms") or {}).get("p99"), (null.get("itl_1tok_calm_ms") or {}).get("p99")
        away = f"; away from arrivals {calm:.2f} vs {calmn:.2f} ms" if None not in (calm, calmn) else ""
        sys_, sysn = ours.get("server_sys_us_per_event"), null.get("server_sys_us_per_event")
        split = f"; user {cpu - sys_:.1f} vs {cpun - sysn:.1f}, system {sys_:.1f} vs {sysn:.1f}" \
            if None not in (sys_, sysn) else ""
        out.append(f"* {server} vs null, C={c}: one-token ITL p99 {p99:.2f} vs {p99n:.2f} ms (+{d:.2f}; target <= +2: "
                   f"{'met' if d <= 2 else 'NOT met'}{away}); server CPU {cpu:.1f} vs {cpun:.1f} us/event "
                   f"({ratio:.2f}x; target <= 1.2x: {'met' if ratio <= 1.2 else 'NOT met'}{split})")
    return out


def verdict_burst(rows: list[dict]) -> list[str]:
    """The burst TTFT target: p50 within 5 %, p99 within 20 % of the configured TTFT (medians of the rounds)."""
    out = []
    for label in dict.fromkeys(r["label"] for r in rows if "failed" not in r):
        mine = [r for r in rows if r["label"] == label and "failed" not in r]
        cfg = mine[0].get("ttft_cfg_ms", 100.0)
        p50 = _median([r["ttft_ms"]["p50"] for r in mine])
        p99 = _median([r["ttft_ms"]["p99"] for r in mine])
        out.append(f"* {label}: TTFT p50 {p50:.1f} ms ({p50 / cfg - 1:+.1%}; target within 5 %: "
                   f"{'met' if abs(p50 / cfg - 1) <= 0.05 else 'NOT met'}), p99 {p99:.1f} ms ({p99 / cfg - 1:+.1%}; "
                   f"target within 20 %: {'met' if abs(p99 / cfg - 1) <= 0.20 else 'NOT met'}); "
                   f"median of {len(mine)} round(s)")
    return out


def table_aiperf(rows: list[dict]) -> str:
    out = ["| run | C | N | req/s | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms (per-request mean) |",
           "|---|---|---|---|---|---|---|"]

    def g(m, k):
        return None if not m else m.get(k)

    for r in rows:
        if "failed" in r:
            out.append(f"| {r['label']} | {r['concurrency']} | {r['requests']} | failed | | | |")
            continue
        out.append(
            f"| {r['label']} | {r['concurrency']} | {r['requests']} | {fmt(g(r['request_throughput'], 'avg'))} "
            f"| {fmt(g(r['output_token_throughput'], 'avg'), 0)} "
            f"| {fmt(g(r['time_to_first_token'], 'p50'))} / {fmt(g(r['time_to_first_token'], 'p99'))} "
            f"| {fmt(g(r['inter_token_latency'], 'p50'), 2)} / {fmt(g(r['inter_token_latency'], 'p99'), 2)} |")
    return "\n".join(out)


def machine_info() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    mem = next((ln.split()[1] for ln in open("/proc/meminfo") if ln.startswith("MemTotal")), "0")
    return {"nproc": os.cpu_count(), "cpu": cpu, "mem_gib": round(int(mem) / 2**20, 1),
            "python": platform.python_version(), "kernel": platform.release(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "loadavg_at_start": open("/proc/loadavg").read().split()[:3]}


# ------------------------------------------------------------------ main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="vllm-vcr,vllm-vcr-si16,dynamo,guidellm,null",
                    help="vllm-vcr-si16: vllm-vcr with --stream-interval 16 (what batching tokens per event buys); "
                         "vllm-vcr-api2: vllm-vcr with --api-server-count 2; "
                         "null: bench/null_sse_server.py, the floor; uvicorn-floor: bench/asgi_floor_server.py, "
                         "the floor behind uvicorn's request path")
    ap.add_argument("--workloads", default="w1,w2",
                    help="w1, w2, burst (the opening-burst TTFT), requests (server CPU per request)")
    ap.add_argument("--w1-requests", type=int, default=3000)
    ap.add_argument("--w2-concurrency", default="32,256,1000")
    ap.add_argument("--w2-rounds", type=int, default=4, help="W2 requests = rounds x concurrency (min 320)")
    ap.add_argument("--requests-concurrency", type=int, default=300, help="requests workload: C")
    ap.add_argument("--requests-n", type=int, default=6000, help="requests workload: N")
    ap.add_argument("--burst-concurrency", type=int, default=256, help="streams opened at once (burst workload)")
    ap.add_argument("--burst-rounds", type=int, default=3,
                    help="burst workload: separate client runs, each one opening burst of C requests")
    ap.add_argument("--dynamo-speedup", type=float, default=1000.0,
                    help="W1 mocker --speedup-ratio (its polynomial model; 1000 => a few us per step)")
    ap.add_argument("--vcr-args", default="", help="extra args for vllm-vcr serve (split on spaces)")
    ap.add_argument("--client-args", default="", help="extra args for stream_bench.py")
    ap.add_argument("--no-continuous-usage", action="store_true", help="W2 without continuous_usage_stats")
    ap.add_argument("--aiperf", action="store_true", help="cross-check W1 and W2 c=256 with aiperf")
    ap.add_argument("--profile", action="store_true",
                    help="after the measured runs, profile vllm-vcr with py-spy during an extra W1 / W2 c=max run")
    ap.add_argument("--quiet-threshold", type=float, default=0.0,
                    help="before each run wait until the machine (server idle) is below this CPU %% busy")
    ap.add_argument("--quiet-max-wait", type=float, default=180.0)
    ap.add_argument("--model-dir", default=str(PEERS / "bench-tinymodel"))
    ap.add_argument("--base-port", type=int, default=18300)
    ap.add_argument("--out-dir", default="")
    a = ap.parse_args()

    QUIET.update(threshold=a.quiet_threshold, max_wait=a.quiet_max_wait)
    model_dir = Path(a.model_dir)
    if not (model_dir / "tokenizer.json").exists():
        subprocess.run([sys.executable, str(REPO / "scripts/make_tiny_model.py"), str(model_dir)], check=True)
    out_dir = Path(a.out_dir or tempfile.mkdtemp(prefix="vllm-vcr-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    servers = [s for s in a.servers.split(",") if s]
    workloads = [w for w in a.workloads.split(",") if w]
    if unknown := set(workloads) - {"w1", "w2", "burst", "requests"}:
        raise SystemExit(f"unknown workload(s) {sorted(unknown)}: w1, w2, burst, requests")
    w2_conc = [int(c) for c in a.w2_concurrency.split(",") if c]
    client_extra = a.client_args.split()
    # W2 asks for usage on every chunk (vLLM's continuous_usage_stats) so a chunk's token count is
    # exact; servers that ignore it make every content chunk count as one token
    w2_extra = client_extra + ([] if a.no_continuous_usage else ["--continuous-usage"])
    results: dict = {"machine": machine_info(), "w1": [], "w2": [], "burst": [], "requests": [], "aiperf": [],
                     "servers": {}, "profiles": []}
    port = a.base_port

    def start(name: str, ttft: float, itl: float) -> Server:
        nonlocal port
        port += 1
        if name in VCR_VARIANTS:
            return start_vllm_vcr(port, out_dir, ttft_ms=ttft, itl_ms=itl, model_dir=model_dir,
                                  extra=VCR_VARIANTS[name] + a.vcr_args.split(), name=name)
        if name == "dynamo":
            return start_dynamo(port, out_dir, ttft_ms=ttft, itl_ms=itl, model_dir=model_dir,
                                speedup=a.dynamo_speedup)
        if name == "guidellm":
            return start_guidellm(port, out_dir, ttft_ms=ttft, itl_ms=itl, model_dir=model_dir)
        cpu_us = null_cpu_us(name)
        if name == "null" or cpu_us:
            return start_null(port, out_dir, ttft_ms=ttft, itl_ms=itl, request_cpu_us=cpu_us or 0)
        if name == "uvicorn-floor":
            return start_uvicorn_floor(port, out_dir, ttft_ms=ttft, itl_ms=itl)
        raise SystemExit(f"unknown server {name}")

    for name in servers:
        for wl in workloads:
            ttft, itl = (0.0, 0.0) if wl == "w1" else (100.0, 20.0)
            srv = start(name, ttft, itl)
            try:
                ready = srv.wait_ready()
                print(f"{name} {wl}: ready in {ready:.1f}s on {srv.url} pids {srv.pids}", flush=True)
                results["servers"][f"{name}-{wl}"] = srv.desc
                if wl == "w1":
                    r = run_client(srv, label=name, osl=256, conc=64, n=a.w1_requests, model_dir=model_dir,
                                   out=out_dir / f"{name}-w1.json", extra=client_extra)
                    results["w1"].append(r)
                    if a.aiperf:
                        results["aiperf"].append(run_aiperf(srv, label=f"{name} W1", osl=256, conc=64, n=512,
                                                            model_dir=model_dir, art=out_dir / f"aiperf-{name}-w1"))
                    if a.profile and name == "vllm-vcr":
                        results["profiles"].append(run_profiled(
                            srv, label="vllm-vcr-w1", osl=256, conc=64, n=a.w1_requests * 3, model_dir=model_dir,
                            out_dir=out_dir, extra=client_extra))
                elif wl == "requests":
                    c, n = a.requests_concurrency, a.requests_n
                    results["requests"].append(run_client(srv, label=name, osl=2, conc=c, n=n, model_dir=model_dir,
                                                          out=out_dir / f"{name}-requests-c{c}.json",
                                                          extra=w2_extra))
                elif wl == "burst":
                    c = a.burst_concurrency
                    for k in range(1, a.burst_rounds + 1):
                        r = run_client(srv, label=name, osl=100, conc=c, n=c, model_dir=model_dir,
                                       out=out_dir / f"{name}-burst-c{c}-r{k}.json", extra=client_extra)
                        r.update(round=k, ttft_cfg_ms=ttft)
                        results["burst"].append(r)
                else:
                    for c in w2_conc:
                        n = max(320, a.w2_rounds * c)
                        r = run_client(srv, label=name, osl=100, conc=c, n=n, model_dir=model_dir,
                                       out=out_dir / f"{name}-w2-c{c}.json", extra=w2_extra)
                        results["w2"].append(r)
                    if a.aiperf:
                        results["aiperf"].append(run_aiperf(srv, label=f"{name} W2", osl=100, conc=256, n=1024,
                                                            model_dir=model_dir, art=out_dir / f"aiperf-{name}-w2"))
                    if a.profile and name == "vllm-vcr":
                        c = max(w2_conc)
                        results["profiles"].append(run_profiled(
                            srv, label=f"vllm-vcr-w2-c{c}", osl=100, conc=c, n=max(320, a.w2_rounds * c),
                            model_dir=model_dir, out_dir=out_dir, extra=w2_extra))
            except Exception as e:  # noqa: BLE001 - record and go on with the next server
                print(f"{name} {wl}: FAILED {e}", flush=True)
                results.setdefault("failures", []).append(f"{name} {wl}: {e}")
            finally:
                srv.stop()
            time.sleep(1)

    md = [f"Machine: {results['machine']}", ""]
    if results["w1"]:
        md += ["### W1 (ISL 128, OSL 256, C 64, no simulated latency; one token per SSE event, "
               "vllm-vcr-si16 up to 16)", "", table_w1(results["w1"]), ""]
    if results["w2"]:
        md += ["### W2 (TTFT 100 ms, ITL 20 ms, ISL 128, OSL 100)", "", table_w2(results["w2"]), "",
               *verdict_w2(results["w2"]), *verdict_w2(results["w2"], "uvicorn-floor"),
               *(line for s in servers if null_cpu_us(s) for line in verdict_w2(results["w2"], s)), ""]
    if results["requests"]:
        md += [f"### Per-request work (TTFT 100 ms, ITL 20 ms, ISL 128, OSL 2, C {a.requests_concurrency})", "",
               table_requests(results["requests"]), ""]
    if results["burst"]:
        md += [f"### Opening burst (C = N = {a.burst_concurrency} at once; TTFT 100 ms, ITL 20 ms, ISL 128, OSL 100)",
               "", table_burst(results["burst"]), "", *verdict_burst(results["burst"]), ""]
    if results["aiperf"]:
        md += ["### aiperf cross-check", "", table_aiperf(results["aiperf"]), ""]
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"results in {out_dir}")
    return 0 if not results.get("failures") else 1


if __name__ == "__main__":
    sys.exit(main())
