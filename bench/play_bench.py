"""Through the real vLLM frontend: `vllm-vcr play` at latency 0 next to the real CPU engine.

Same frontend (vLLM 0.32), same tiny model, same workload (W1 shape: ISL 128, OSL 256, streaming
chat, `ignore_eos`); only the engine behind the frontend changes. Reports requests/s, output
tokens/s and the CPU each side spends per output token (process trees, from /proc), which shows
where the bottleneck is: with `play` it should be the frontend.

usage: python bench/play_bench.py [--concurrency 64] [--requests 256] [--out results.json]
Needs the peers of scripts/install-peers.sh. Everything runs on 127.0.0.1 and is stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "fidelity"))
import stack  # noqa: E402  (bench/fidelity/stack.py: frontend + engine bring-up)

TICKS = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """utime+stime of a process and its descendants (live ones), in seconds."""
    total = 0.0
    pids = [pid]
    while pids:
        p = pids.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / TICKS
            for task in Path(f"/proc/{p}/task").iterdir():
                children = (task / "children").read_text().split()
                pids.extend(int(c) for c in children)
        except (OSError, IndexError, ValueError):
            continue
    return total


def run_one(engine: str, args: argparse.Namespace, workdir: Path) -> dict:
    stack.MAX_NUM_SEQS = args.max_num_seqs
    st = stack.start(workdir / engine, engine=engine, trace_out=None,
                     play_args=["--max-num-batched-tokens", "8192"] if engine == "play" else ())
    try:
        fe = next(p for p in st.procs if p.name == "frontend").popen.pid
        en = next(p for p in st.procs if p.name in ("engine", "play")).popen.pid
        before = (tree_cpu_seconds(fe), tree_cpu_seconds(en))
        out = workdir / f"{engine}.json"
        subprocess.run([sys.executable, str(HERE / "stream_bench.py"), "--url", st.url, "--model", st.model,
                        "--tokenizer", str(stack.MODEL_DIR), "--isl", "128", "--osl", str(args.osl),
                        "--concurrency", str(args.concurrency), "--requests", str(args.requests),
                        "--out", str(out)], check=True)
        after = (tree_cpu_seconds(fe), tree_cpu_seconds(en))
        r = json.loads(out.read_text())
        total_tokens = r["output_tokens"]  # the few short warm-up requests are noise next to these
        return {"engine": engine, "req_per_s": r["req_per_s"], "output_tok_per_s": r["output_tok_per_s"],
                "ttft_p50_ms": r["ttft_ms"]["p50"], "tpot_p50_ms": r["tpot_ms"]["p50"],
                "frontend_cpu_us_per_token": (after[0] - before[0]) / total_tokens * 1e6,
                "engine_cpu_us_per_token": (after[1] - before[1]) / total_tokens * 1e6,
                "errors": r.get("errors", 0)}
    finally:
        st.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--osl", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--engines", default="play,real")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if stack.missing_reason():
        print(stack.missing_reason(), file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="vllm-vcr-play-bench-") as tmp:
        for engine in args.engines.split(","):
            rows.append(run_one(engine, args, Path(tmp)))
            print(json.dumps(rows[-1]), file=sys.stderr)
    print("| engine behind the vLLM 0.32 frontend | req/s | output tok/s | TTFT p50 ms | TPOT p50 ms | "
          "frontend CPU µs/token | engine CPU µs/token | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        name = "vllm-vcr play (latency 0)" if r["engine"] == "play" else "real vLLM CPU engine (dummy weights)"
        print(f"| {name} | {r['req_per_s']:.1f} | {r['output_tok_per_s']:,.0f} | {r['ttft_p50_ms']:.0f} | "
              f"{r['tpot_p50_ms']:.2f} | {r['frontend_cpu_us_per_token']:.0f} | {r['engine_cpu_us_per_token']:.0f} | "
              f"{r['errors']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
