"""Check the perf model against measured deployments: `systems/silicon_sample.csv` of
aiconfigurator-core holds real TTFT/TPOT of vLLM, SGLang and TRT-LLM deployments (model, GPU,
precision, TP, ISL, OSL, concurrency).

For one vLLM aggregated row: the estimator for that model/GPU/parallelism/precision, the KV
cache vLLM would get on that GPU, vLLM's default scheduler limits for that GPU, and the row's
closed-loop workload (its concurrency, fixed ISL/OSL, random prompts, `ignore_eos`) simulated
through the same EngineCore as `serve` (attention-DP ranks are separate engines, round robin).
TTFT and TPOT are the means over the requests, as a benchmark client reports them.
"""

from __future__ import annotations

import csv
import math
import zlib
from dataclasses import dataclass
from typing import Any, Iterator

from ..perf.aic import AicTarget, compile_target
from ..perf.catalog import package_root
from ..perf.errors import PerfModelError

GIB = 1 << 30


@dataclass(frozen=True)
class SiliconRow:
    id: str
    model: str
    gpu: str
    backend_version: str
    tp: int
    attention_dp: int
    moe_tp: int | None
    moe_ep: int | None
    gemm_quant: str | None
    moe_quant: str | None
    isl: int
    osl: int
    concurrency: int
    ttft_ms: float
    tpot_ms: float

    @property
    def split(self) -> str:
        """A fixed, declared split: about one row in three trains the global correction."""
        return "train" if zlib.crc32(self.id.encode()) % 3 == 0 else "heldout"

    def target(self, step_overhead_ms: float = 0.0) -> AicTarget:
        return AicTarget(model=self.model, gpu=self.gpu, backend="vllm", tensor_parallel_size=self.tp,
                         attention_dp_size=self.attention_dp, moe_tp_size=self.moe_tp, moe_ep_size=self.moe_ep,
                         gemm_quant=self.gemm_quant, moe_quant=self.moe_quant, step_overhead_ms=step_overhead_ms)


def _int(v: str, default: int | None = None) -> int | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return default
    return default if math.isnan(f) or f <= 0 else int(f)


def _str(v: str) -> str | None:
    return v if v and v.lower() != "nan" else None


def vllm_agg_rows(path: str | None = None) -> Iterator[SiliconRow]:
    """The vLLM aggregated rows of silicon_sample.csv."""
    path = path or str(package_root() / "systems" / "silicon_sample.csv")
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["backend"] != "vllm" or r["mode"] != "agg":
                continue
            yield SiliconRow(
                id=r["id"], model=r["model_path"], gpu=r["system"], backend_version=r["backend_version"],
                tp=_int(r["tp_size"], 1), attention_dp=_int(r["attention_dp_size"], 1),
                moe_tp=_int(r["moe_tp_size"]), moe_ep=_int(r["moe_ep_size"]),
                gemm_quant=_str(r["gemm_quant_mode"]), moe_quant=_str(r["moe_quant_mode"]),
                isl=int(float(r["isl"])), osl=int(float(r["osl"])), concurrency=int(float(r["batch_size"])),
                ttft_ms=float(r["silicon_ttft_ms"]), tpot_ms=float(r["silicon_tpot_ms"]))


def vllm_defaults(gpu_bytes: int) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) vLLM's API server picks for a GPU of this size."""
    if gpu_bytes >= 160 * GIB:
        return 1024, 16384
    if gpu_bytes >= 70 * GIB:
        return 1024, 8192
    return 256, 2048


def static_estimate(row: SiliconRow) -> tuple[float, float]:
    """The estimator's own answer (`run_static`, batch = concurrency): (TTFT ms, TPOT ms)."""
    handle = compile_target(row.target())
    ctx, gen, _ = handle.run_static(batch_size=row.concurrency, isl=row.isl, osl=row.osl)
    return ctx, gen / max(row.osl - 1, 1)


def num_requests_for(row: SiliconRow, max_tokens: int) -> int:
    """The users' first requests (the ramp, not measured) and then as many measured ones again,
    fewer when that would simulate more than `max_tokens` output tokens (at least 8 measured)."""
    c = row.concurrency
    measured = max(c, 16)
    if (c + measured) * row.osl > max_tokens:
        measured = max(int(max_tokens / row.osl) - c, 8)
    return c + measured


def request_lifetime_s(row: SiliconRow) -> float:
    """A request's expected duration at the row's load (the estimator's prefill + decode steps):
    the users' start-up ramp, so the closed loop starts in steady state instead of in waves."""
    h = compile_target(row.target())
    per_engine = max(row.concurrency // max(row.attention_dp, 1), 1)
    decode = h.decode_step_latency(per_engine, row.isl + row.osl // 2, 2)
    return (h.predict_prefill_latency(1, row.isl) + row.osl * decode) / 1e3


def simulate_row(row: SiliconRow, *, step_overhead_ms: float = 0.0, max_tokens: int = 400_000) -> dict[str, Any]:
    """Simulate the row's closed-loop benchmark; TTFT/TPOT means in ms."""
    from ..engine.config import EngineArgs, EngineConfig
    from ..perf.kv_sizing import estimate_kv_capacity
    from .runner import simulate
    from .workload import LengthDist, SyntheticWorkload

    target = row.target(step_overhead_ms).resolved()
    compile_target(target)
    engines = max(row.attention_dp, 1)
    per_engine = max(row.concurrency // engines, 1)
    seqs, budget = 1024, 8192
    cap = estimate_kv_capacity(target, block_size=16, gpu_memory_utilization=0.9,
                               max_num_batched_tokens=budget, max_num_seqs=seqs)
    seqs, budget = vllm_defaults(cap.gpu_bytes)
    args = EngineArgs(config=EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=budget),
                      kv_cache_size=cap.num_blocks, tokens_per_block=16, perf_model=target.to_dict(),
                      advertised_max_model_len=row.isl + row.osl + 16).validate()
    n = num_requests_for(row, max_tokens)
    workload = SyntheticWorkload(num_requests=n, isl=LengthDist("fixed", row.isl), osl=LengthDist("fixed", row.osl),
                                 arrival="closed", concurrency=row.concurrency, ramp_up=request_lifetime_s(row),
                                 seed=zlib.crc32(row.id.encode()))
    sim = simulate(args, workload, engines=engines, router="round_robin", concurrency=row.concurrency)
    measured = [r for r in sim.done if int(r.request_id.rsplit("-", 1)[1]) >= row.concurrency]
    ttft = [(r.first - r.arrival) * 1e3 for r in measured]
    tpot = [(r.end - r.first) * 1e3 / (r.num_out - 1) for r in measured if r.num_out > 1]
    return {"ttft_ms": sum(ttft) / len(ttft), "tpot_ms": sum(tpot) / len(tpot) if tpot else math.nan,
            "requests": n, "kv_blocks": cap.num_blocks, "per_engine_concurrency": per_engine,
            "preemptions": sum(sim.timeline.preemptions), "wall_s": sim.wall_s}


def supported(row: SiliconRow) -> str | None:
    """None when the estimator can price the row, else why not (one line)."""
    try:
        compile_target(row.target())
        static_estimate(row)
    except PerfModelError as e:
        return str(e)
    except Exception as e:  # the estimator's own errors for missing data
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return None
