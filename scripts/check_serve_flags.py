"""Start `vllm-vcr serve` once per `vllm serve` option (vLLM 0.32 and 0.33) and check that it
comes up healthy.

    PYTHONPATH=src python scripts/check_serve_flags.py                 # every option
    PYTHONPATH=src python scripts/check_serve_flags.py --sample 20     # a random 20 (seeded)
    PYTHONPATH=src python scripts/check_serve_flags.py --only=--max-num-seqs --only=--enforce-eager

Each server gets the peers' tiny model (else the embedded tokenizer), a free loopback port and the
option with a value vLLM accepts (serve/vllm_args.py sample_args); it passes when GET /health
answers 200, and is stopped with SIGTERM. Prints one line per failure and a count line; exits 1
when any option failed.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from vllm_vcr.serve.vllm_args import load_table, sample_args  # noqa: E402
from vllm_vcr.testing.waits import free_port, scaled  # noqa: E402

MODEL = Path(os.environ.get("VLLM_VCR_PEERS") or Path.home() / ".cache" / "vllm-vcr" / "peers") / "tinymodel"


def start_with(option_args: list[str], timeout: float) -> str | None:
    """None when serve started healthy with the option, else why not."""
    port = free_port()
    model = [str(MODEL)] if (MODEL / "config.json").is_file() else []
    argv = [sys.executable, "-m", "vllm_vcr", "serve", *model, "--host", "127.0.0.1", "--port", str(port),
            *option_args]
    if option_args[0] in ("--port", "--host"):
        argv = [sys.executable, "-m", "vllm_vcr", "serve", *model, "--host", "127.0.0.1", "--port", str(port)]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), VLLM_VCR_LOG="warn")
    env = {k: v for k, v in env.items() if not k.startswith("MOCK_")}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + scaled(timeout)
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    log.seek(0)
                    return f"exited {proc.returncode}: {log.read().decode(errors='replace').strip()[-300:]}"
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        return None
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            return "not healthy in time"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(scaled(20))
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sample", type=int, default=None, help="check N options drawn at random (seeded)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", action="append", default=None, metavar="FLAG", help="check this option (repeat)")
    ap.add_argument("--jobs", type=int, default=2, help="servers started at once")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds for one server to get healthy")
    args = ap.parse_args()
    options = [o for o in load_table()["options"] if o["option_strings"]]
    if args.only:
        options = [o for o in options if set(o["option_strings"]) & set(args.only)]
    if args.sample is not None:
        options = random.Random(args.seed).sample(options, min(args.sample, len(options)))
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write("max-num-seqs: 8\n")
    adapter = tempfile.mkdtemp(prefix="check-serve-lora-")
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_adapter.py"), adapter], check=True,
                   capture_output=True)
    overrides = {"--config": [f.name], "--lora-modules": [f"sample-lora={adapter}"]}
    if (MODEL / "config.json").is_file():  # --model must agree with MODEL; --tokenizer must exist
        overrides.update({"--model": [str(MODEL)], "--tokenizer": [str(MODEL)]})
    failed = 0
    try:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            runs = [(o, pool.submit(start_with, sample_args(o, overrides), args.timeout)) for o in options]
            for opt, fut in runs:
                why = fut.result()
                if why is not None:
                    failed += 1
                    print(f"FAIL {' '.join(sample_args(opt, overrides))}: {why}", flush=True)
    finally:
        os.unlink(f.name)
        shutil.rmtree(adapter, ignore_errors=True)
    print(f"{len(options) - failed} of {len(options)} `vllm serve` options started vllm-vcr serve "
          f"(vLLM {', '.join(load_table()['vllm_versions'])})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
