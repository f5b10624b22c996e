"""Server CPU per streaming chat request: `serve` at zero latency, OSL 1-2, from /proc.

Starts `vllm-vcr serve` on 127.0.0.1, warms it up, then drives N streaming chat completions
(ISL ~128, max_tokens 1) with httpx at a fixed concurrency and reports the server process's
user+system CPU per request. Per-request work (parsing, validation, template, tokenizing,
admission, response start/end) dominates at this shape.

    PYTHONPATH=src python bench/per_request_cpu.py --requests 2000 [--profile out.txt]

Instructions (valgrind; box-independent) at W2's request shape, per request:

    PYTHONPATH=src python bench/per_request_cpu.py --w2-shape --distinct-prompts 512 --requests 1000 \
        --repeat 3 --callgrind /tmp/cg [--server uvicorn-floor]

`--ttft/--itl` with `--max-tokens 101` give a stream's whole count, but at a concurrency valgrind
can keep up with (C 8) how many loop turns and merged outputs a pass takes follows the box's load:
those counts scatter by ~10 %, too much for a per-event difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

from vllm_vcr.testing.waits import free_port

PEERS = Path(os.environ.get("VLLM_VCR_PEERS") or Path.home() / ".cache/vllm-vcr/peers")  # as install-peers-bench.sh




def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompts(model_dir: Path, isl: int, count: int, seed: int) -> list[str]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        ids = [rng.randrange(vocab) for _ in range(isl)]
        text = tok.decode(ids)
        out.append(tok.decode(tok.encode(text, add_special_tokens=False).ids[:isl]))
    return out


async def drive(url: str, bodies: list[bytes], n: int, conc: int) -> int:
    done = 0
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        async def worker(w: int) -> None:
            nonlocal done
            for i in range(w, n, conc):
                async with client.stream("POST", "/v1/chat/completions", content=bodies[i % len(bodies)],
                                         headers={"content-type": "application/json"}) as r:
                    r.raise_for_status()
                    async for _ in r.aiter_bytes():
                        pass
                done += 1
        await asyncio.gather(*(worker(w) for w in range(conc)))
    return done


def dumped_instructions(pid: int, out_dir: Path) -> int:
    """Dump callgrind's counters (zeroed before the run) and read the dump's total Ir."""
    before = set(out_dir.iterdir())
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
    for _ in range(600):
        new = [p for p in set(out_dir.iterdir()) - before if p.stat().st_size > 0]
        if new:
            time.sleep(1.0)  # let the dump finish writing
            for line in new[0].read_text(errors="replace").splitlines():
                if line.startswith(("summary:", "totals:")):
                    return int(line.split()[1])
        time.sleep(0.5)
    raise RuntimeError("callgrind dump not found")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--distinct-prompts", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--model-dir", default=str(PEERS / "bench-tinymodel"))
    ap.add_argument("--ttft", default="0", help="--time-to-first-token (ms)")
    ap.add_argument("--itl", default="0", help="--inter-token-latency (ms)")
    ap.add_argument("--w2-shape", action="store_true",
                    help="as W2's client: continuous_usage_stats on, and the warm-up sends the measured prompts "
                         "first (W2 cycles 512 prompts, so its renders and encodes are cache hits)")
    ap.add_argument("--profile", help="py-spy raw output file (attached during the measured run)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--callgrind", metavar="DIR",
                    help="run the server under valgrind's callgrind and report instructions per request "
                         "(counters zeroed after the warm-up, dumped after each run; box-independent)")
    ap.add_argument("--server", choices=("serve", "uvicorn-floor"), default="serve",
                    help="uvicorn-floor: bench/asgi_floor_server.py (uvicorn's own request path, chunks sent at "
                         "once), the reference a request's count compares with")
    a = ap.parse_args()
    model_dir = Path(a.model_dir)
    port = free_port()
    cmd = [sys.executable, "-m", "vllm_vcr", "serve", str(model_dir), "--served-model-name", "m",
           "--host", "127.0.0.1", "--port", str(port), "--time-to-first-token", a.ttft,
           "--inter-token-latency", a.itl, "--max-num-seqs", "2048", "--kv-cache-size", "65536",
           "--no-log-requests"]
    if a.server == "uvicorn-floor":
        cmd = [sys.executable, str(Path(__file__).with_name("asgi_floor_server.py")), "--port", str(port)]
    if a.callgrind:
        Path(a.callgrind).mkdir(parents=True, exist_ok=True)
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={a.callgrind}/callgrind.out.%p", *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(3000 if a.callgrind else 300):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        ps = prompts(model_dir, 128, a.distinct_prompts + 200, 7)
        mk = lambda p, mt=a.max_tokens: json.dumps({"model": "m",  # noqa: E731
                                   "messages": [{"role": "user", "content": p}], "max_tokens": mt, "stream": True,
                                   **({"ignore_eos": True} if a.w2_shape else {}),
                                   "stream_options": {"include_usage": True,
                                                      **({"continuous_usage_stats": True} if a.w2_shape else {})},
                                   }).encode()
        bodies = [mk(p) for p in ps[: a.distinct_prompts]]
        # (one token each: the warm-up fills the caches, it need not stream)
        warm = [mk(p, 1) for p in (ps[: a.distinct_prompts] if a.w2_shape else ps[a.distinct_prompts:])]
        asyncio.run(drive(url, warm, max(200, len(warm)) if a.w2_shape else 200, a.concurrency))
        spy = None
        if a.profile:
            spy = subprocess.Popen(["py-spy", "record", "--format", "raw", "--rate", "250", "-o", a.profile,
                                    "--pid", str(proc.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        for _ in range(a.repeat):
            if a.callgrind:
                subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
            c0, t0 = cpu_seconds(proc.pid), time.perf_counter()
            n = asyncio.run(drive(url, bodies, a.requests, a.concurrency))
            c1, t1 = cpu_seconds(proc.pid), time.perf_counter()
            row = {"requests": n, "server_cpu_us_per_request": round((c1 - c0) / n * 1e6, 1),
                   "wall_s": round(t1 - t0, 2)}
            if a.callgrind:
                row["instructions_per_request"] = round(dumped_instructions(proc.pid, Path(a.callgrind)) / n)
            print(json.dumps(row), flush=True)
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
