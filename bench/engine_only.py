"""Engine-only cost per token on the virtual clock (no HTTP): 64 requests x 256 tokens, 40 rounds.

  PYTHONPATH=src python bench/engine_only.py [MAX_BURST]   (1: one token per step, the default)
"""
import time, sys
from vllm_vcr.engine.config import EngineArgs
from vllm_vcr.engine.core import EngineCore
from vllm_vcr.engine.clock import VirtualClock
from vllm_vcr.engine.types import EngineCoreRequest, SamplingParams
import inspect
def run(n_req=64, osl=256, rounds=40, **kw):
    args = EngineArgs(vocab_size=32000, kv_cache_size=65536, **kw).validate()
    args.config.max_num_seqs = 256
    core = EngineCore(args, clock=VirtualClock(0.0))
    t0 = time.perf_counter(); toks = 0
    for r in range(rounds):
        for i in range(n_req):
            core.add_request(EngineCoreRequest(request_id=f"r{r}-{i}", prompt_token_ids=list(range(1+i, 129+i)),
                             sampling_params=SamplingParams(max_tokens=osl, ignore_eos=True)))
        core.run_until_idle()
        toks += n_req * osl
    dt = time.perf_counter() - t0
    return dt / toks * 1e6
kw = {}
if "max_burst" in inspect.signature(EngineArgs).parameters or hasattr(EngineArgs, "max_burst"):
    kw["max_burst"] = int(sys.argv[1]) if len(sys.argv) > 1 else 8
res = sorted(run(**kw) for _ in range(5))
print("us/token engine-only (median of 5):", round(res[2], 3), [round(x, 3) for x in res], kw)
