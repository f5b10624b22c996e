"""Engine-only cost per token at W2's shape, on the virtual clock (no HTTP): a closed loop of C=1000
requests, TTFT 100 ms, ITL 20 ms, prompt 142 tokens, OSL 100 (about ten requests due per step, as
`serve` sees them at W2 C=1000).

  PYTHONPATH=src python bench/engine_w2.py [--requests N] [--osl OSL] [--repeat R]

Prints CPU µs per token (process time; min and median of R runs). On a shared box the times
drift with other load; instruction counts do not. Per token without per-request work, from two
runs that admit the same requests with different output lengths:

  for osl in 100 200; do PYTHONPATH=src valgrind --tool=cachegrind --cache-sim=no \\
      --cachegrind-out-file=/dev/null "$(python -c 'import sys; print(sys.executable)')" \\
      bench/engine_w2.py --requests 1000 --osl $osl --repeat 1; done
  # (I refs at OSL 200 - I refs at OSL 100) / (tokens at OSL 200 - tokens at OSL 100)
"""

from __future__ import annotations

import argparse
import statistics
import time

from vllm_vcr.engine.clock import VirtualClock
from vllm_vcr.engine.config import EngineArgs
from vllm_vcr.engine.core import EngineCore
from vllm_vcr.engine.types import EngineCoreRequest, SamplingParams
from vllm_vcr.gc_tuning import tune_for_serving

CONCURRENCY = 1000
ARRIVAL_GAP = 0.00002  # the opening requests arrive 20 µs apart: deadlines spread over one ITL


def run(requests: int, osl: int) -> tuple[float, int]:
    """CPU seconds of the measured phase and the tokens it emitted."""
    args = EngineArgs(vocab_size=4096, kv_cache_size=65536).validate()
    args.config.time_to_first_token, args.config.inter_token_latency = 100, 20
    args.config.max_num_seqs = 2048
    clock = VirtualClock(0.0)
    counts = {"tokens": 0, "finished": 0}

    def sink(_client: int, outs) -> None:
        for o in outs.outputs:
            counts["tokens"] += len(o.new_token_ids)
            if o.finish_reason is not None:
                counts["finished"] += 1

    core = EngineCore(args, clock=clock, output_sink=sink)
    sent = 0

    def add() -> None:
        nonlocal sent
        prompt = list(range(1 + sent % 50, 143 + sent % 50))
        core.add_request(EngineCoreRequest(request_id=f"r{sent}", prompt_token_ids=prompt, arrival_time=clock.now(),
                                           sampling_params=SamplingParams(max_tokens=osl, ignore_eos=True)))
        sent += 1

    for i in range(CONCURRENCY):
        clock.advance_to(i * ARRIVAL_GAP)
        add()
        core._turn()
    t0 = time.process_time()
    replaced = 0
    while counts["finished"] < requests:
        wake = core._turn()
        for _ in range(counts["finished"] - replaced):  # closed loop: each finish brings a new request
            add()
        replaced = counts["finished"]
        if isinstance(wake, float):
            clock.advance_to(max(wake, clock.now()))
        elif wake is None and not core._inbox:
            break
    return time.process_time() - t0, counts["tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="finished requests to measure")
    ap.add_argument("--osl", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    tune_for_serving()  # the collector settings `serve` runs with
    runs = [run(a.requests, a.osl) for _ in range(a.repeat)]
    per_token = sorted(cpu / tokens * 1e6 for cpu, tokens in runs)
    print(f"engine CPU µs per token, W2 shape: min {per_token[0]:.3f}, median {statistics.median(per_token):.3f} "
          f"({runs[0][1]} tokens per run)")


if __name__ == "__main__":
    main()
