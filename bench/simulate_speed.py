#!/usr/bin/env python
"""Speed of `vllm-vcr simulate`: simulated requests per wall second on one core.

The workload of the issue: a 1,000-request trace at concurrency 64 with the GPU perf model
(Llama-3.1-8B on one H100, vLLM): closed loop, ISL/OSL drawn per request. Reports wall and CPU
seconds of the simulation alone (the estimator's one-off compile is timed apart) and the load
average, since the box may be shared: numbers are only comparable on a quiet machine.

usage: python bench/simulate_speed.py [--requests 1000] [--concurrency 64] [--isl lognormal:1024:512]
                                      [--osl lognormal:256:128] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from vllm_vcr.engine.config import EngineArgs, EngineConfig  # noqa: E402
from vllm_vcr.perf.aic import AicTarget, compile_target  # noqa: E402
from vllm_vcr.perf.kv_sizing import estimate_kv_capacity  # noqa: E402
from vllm_vcr.simulate.runner import simulate  # noqa: E402
from vllm_vcr.simulate.workload import LengthDist, SyntheticWorkload  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--isl", default="lognormal:1024:512")
    ap.add_argument("--osl", default="lognormal:256:128")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    t0 = time.perf_counter()
    target = AicTarget("meta-llama/Llama-3.1-8B-Instruct", "h100_sxm").resolved()
    compile_target(target)
    compile_s = time.perf_counter() - t0
    cap = estimate_kv_capacity(target, block_size=16, gpu_memory_utilization=0.9, max_num_batched_tokens=8192,
                               max_num_seqs=1024)
    args = EngineArgs(config=EngineConfig(max_num_seqs=1024, max_num_batched_tokens=8192),
                      kv_cache_size=cap.num_blocks, perf_model=target.to_dict(),
                      advertised_max_model_len=1 << 20).validate()
    runs = []
    for i in range(a.repeat):
        wl = SyntheticWorkload(num_requests=a.requests, isl=LengthDist.parse(a.isl, "--isl"),
                               osl=LengthDist.parse(a.osl, "--osl"), arrival="closed", concurrency=a.concurrency,
                               seed=i)
        load = os.getloadavg()[0]
        w0, c0 = time.perf_counter(), time.process_time()
        sim = simulate(args, wl, concurrency=a.concurrency)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        tokens = sum(r.num_out for r in sim.done)
        runs.append({"wall_s": wall, "cpu_s": cpu, "requests_per_wall_s": len(sim.done) / wall,
                     "requests_per_cpu_s": len(sim.done) / cpu, "output_tokens": tokens,
                     "tokens_per_cpu_s": tokens / cpu, "loadavg_1m_before": load})
    print(json.dumps({"workload": vars(a), "compile_s": compile_s, "cpus": os.cpu_count(), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
