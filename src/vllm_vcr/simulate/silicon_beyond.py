"""The measured rows beyond aggregated vLLM: SGLang's aggregated deployments and the
disaggregated (prefill/decode) deployments of vLLM and SGLang in aiconfigurator-core's
`systems/silicon_sample.csv`, simulated like the vLLM rows (silicon.py): the benchmark that
measured the row, through the engine with the perf model's defaults.

**SGLang, aggregated** (`--engine-type sglang`): the estimator's SGLang kernel data
(`backend="sglang"`) and SGLang's scheduler (engine/policy.py `SGLangPolicy`: a step with any
prefill runs no decodes, `enable_mixed_chunk` being off by default; page-aligned chunks; admission
with the new-token-ratio reserve; retraction instead of LIFO preemption). SGLang's server defaults
for the GPU (sgl-project/sglang `python/sglang/srt/server_args.py`, `_handle_gpu_memory_settings`):
`chunked_prefill_size` 8192 below 160 GB of GPU memory (H100, H200), 16384 above (B200, B300,
GB200); `cuda_graph_max_bs` 256 (TP < 4) or 512; `mem_fraction_static` = (memory − reserved) /
memory with reserved = 512 MB + 1.5 MB per chunk token + 2 MB per CUDA-graph batch + TP/8 GB, at
least 10 GB on GPUs above 60 GB. The overlap scheduler (`disable_overlap_schedule` False by default)
prepares the next batch while the GPU runs this one: priced like vLLM's async scheduling. The radix
cache changes nothing for these benchmarks' random prompts; SGLang's page size 1 against the
simulation's 16-token blocks changes only rounding of the KV pool.

**Disaggregated**: prefill workers and decode workers (disagg.py), each priced with its own
parallelism (the row's `prefill_*` and `decode_*` columns; attention-DP ranks are separate engines
of one worker, stepping together for an MoE model), the decode side's concurrency its `decode_batch_size` per rank. The KV of a
prompt moves from the prefill rank to the decode rank at the GPU's link bandwidth from the
estimator's system file (`systems/<gpu>.yaml`): `intra_node_bw` when the prefill and decode GPUs
fit in one node (or one NVLink domain: GB200/GB300 racks, `inter_node_bw` there is NVLink),
else `inter_node_bw` (one 400/800 Gb/s NIC per GPU), shared by the pulls in flight on a decode
rank; the bytes are the prefill rank's KV per token (its shard, or the whole latent of an MLA
model) x prompt tokens.
"""

from __future__ import annotations

import csv
import functools
import re
from dataclasses import dataclass, replace
from typing import Any, Iterator

from ..perf.aic import AicTarget, compile_target
from ..perf.errors import PerfModelError
from ..perf.catalog import kv_link as catalog_kv_link, package_root, pull_bytes_per_token, resolve_model
from ..perf.checkpoint import FP8_BLOCK
from ..perf.qk_norm import bundled_config
from .silicon import (HostTime, SiliconRow, _checkpoint_precision, _data_parallel, _int, _str, plan_for,
                      row_latencies, row_workload, simulate_row, static_estimate, unpriceable)

MIB = 1 << 20
_CONC = re.compile(r"silicon_concurrency=(\d+)")


def _sample_path(path: str | None) -> str:
    return path or str(package_root() / "systems" / "silicon_sample.csv")


# --- SGLang, aggregated ----------------------------------------------------------------------------
def sglang_server_defaults(gpu_bytes: int, tp: int) -> tuple[int, int, float]:
    """(chunked_prefill_size, cuda_graph_max_bs, mem_fraction_static) SGLang's server picks for a
    GPU of this size (server_args.py `_handle_gpu_memory_settings`, the CUDA branches)."""
    mem = gpu_bytes / MIB
    if mem < 20 * 1024:
        chunk, graph = 2048, 8
    elif mem < 35 * 1024:
        chunk, graph = 2048, 24 if tp < 4 else 80
    elif mem < 60 * 1024:
        chunk, graph = 4096, 32 if tp < 4 else 160
    elif mem < 160 * 1024:
        chunk, graph = 8192, 256 if tp < 4 else 512
    else:
        chunk, graph = 16384, 512
    reserved = 512 + max(chunk, 2048) * 1.5 + graph * 2 + tp / 8 * 1024
    if mem > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return chunk, graph, round((mem - reserved) / mem, 3)


def _checkpoint_config(model: str) -> dict:
    return bundled_config(resolve_model(model)[0])


def _sglang_kernels(row: SiliconRow) -> SiliconRow:
    """The kernels SGLang runs for the row's checkpoint, as the estimator's SGLang data has them: a
    block-scaled FP8 checkpoint (`weight_block_size` [128, 128]: DeepSeek-V3/R1, Qwen3-235B-A22B-FP8)
    through block-scaled GEMM and MoE kernels on every GPU (the estimator has no per-tensor FP8 MoE
    tables for SGLang), where each rank's expert width stays a multiple of the block."""
    cfg = _checkpoint_config(row.model)
    if row.gemm_quant != "fp8" or "weight_block_size" not in (cfg.get("quantization_config") or {}):
        return row
    width = cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0
    sides = [row.moe_tp or row.tp] + ([row.prefill_moe_tp or row.prefill_tp] if isinstance(row, DisaggRow) else [])
    if any(width // s % FP8_BLOCK for s in sides):
        return row
    return replace(row, gemm_quant="fp8_block", moe_quant="fp8_block" if row.moe_quant == "fp8" else row.moe_quant)


def _mla_fmha(model: str) -> str | None:
    """SGLang's MLA prefill attention runs in BF16 (the estimator's SGLang MLA tables are BF16 only;
    left to itself it asks for FP8 attention next to FP8 GEMMs): 'bfloat16' for an MLA model."""
    cfg = _checkpoint_config(model)
    return "bfloat16" if (cfg.get("text_config") or cfg).get("kv_lora_rank") else None


@dataclass(frozen=True)
class SGLangFlags:
    """The SGLang server flags that decide step composition, KV capacity and input reads (None: SGLang's
    default for the GPU)."""

    chunked_prefill_size: int | None = None  # --chunked-prefill-size
    max_running_requests: int | None = None  # --max-running-requests
    mem_fraction_static: float | None = None  # --mem-fraction-static
    kv_cache_fp8: bool = False  # --kv-cache-dtype fp8_e4m3
    recv_interval: int = 1  # --scheduler-recv-interval


def inferencex_sglang_flags(row: SiliconRow) -> SGLangFlags:
    """The flags of the InferenceX script that measured an SGLang row (github.com/SemiAnalysisAI/InferenceX
    `benchmarks/single_node/{dsr1,qwen3.5,glm5}_*_{b200,b300,h200}.sh`, read at the rows' measurement
    dates, February to April 2026). `--scheduler-recv-interval` is 10 below 16 users and 30 from 16
    (DeepSeek FP4, DeepSeek FP8 at TP 8, Qwen3.5 on B200), 10 flat (DeepSeek FP8 at TP 4, Qwen3.5 FP8
    on B300), absent on H200 and for GLM-5 FP8; an attention-DP server cannot take one (SGLang's
    skipper refuses it). Rows of other harnesses (AIConfigurator's gap analyses) and of deployments
    beyond one 8-GPU node (not these single-node scripts' servers): SGLang's defaults."""
    if not row.inferencex or row.tp * max(row.attention_dp, 1) > 8:
        return SGLangFlags()
    conc, label = row.concurrency, row.precision_label
    paced = 30 if conc >= 16 else 10
    if "DeepSeek-" in row.model and row.gpu in ("b200_sxm", "b300_sxm"):
        if label == "nvfp4":  # dsr1_fp4_{b200,b300}.sh
            flags = SGLangFlags(16384, 256, 0.85, True, paced)
        elif row.tp == 4:  # dsr1_fp8_{b200,b300}.sh, TP 4
            flags = SGLangFlags(8192, 32, 0.95, True, 10)
        else:
            flags = SGLangFlags(32768, 128, 0.82, True, paced)
    elif "DeepSeek-" in row.model and row.gpu == "h200_sxm":  # dsr1_fp8_h200.sh
        flags = SGLangFlags(32768, 512 if (row.isl, row.osl) == (1024, 1024) else 256, 0.82)
    elif "Qwen3.5" in row.model and row.gpu == "b200_sxm":  # qwen3.5_{bf16,fp8,fp4}_b200.sh
        flags = SGLangFlags(32768, 128, 0.85 if label == "nvfp4" else 0.82, label != "bf16", paced)
    elif "Qwen3.5" in row.model and row.gpu == "b300_sxm" and label == "fp8":  # qwen3.5_fp8_b300.sh
        flags = SGLangFlags(16384, max(conc, 1), 0.8, True, 10)
    elif "Qwen3.5" in row.model and row.gpu == "h200_sxm":  # qwen3.5_fp8_h200.sh
        flags = SGLangFlags(16384, 128, 0.8, True)
    elif "GLM-5" in row.model and label == "fp8" and row.gpu in ("b200_sxm", "b300_sxm"):  # glm5_fp8_*.sh
        flags = SGLangFlags(32768, max(conc, 1), 0.85, True)
    else:
        return SGLangFlags()
    return replace(flags, recv_interval=1) if row.attention_dp > 1 else flags


SGLANG_MAX_RUNNING = 4096  # the scheduler's running-request limit is never below the rows' per-rank load


@dataclass(frozen=True)
class SGLangRow(SiliconRow):
    """An SGLang aggregated row: one SGLang server (`--tp N`, attention DP ranks as engines)."""

    engine_type: str = "sglang"

    def columns_group(self) -> str:
        return "sglang|" + super().columns_group()

    @property
    def async_scheduling(self) -> bool:
        return True  # the overlap scheduler, on by default

    @property
    def burst(self) -> bool:
        """Every SGLang row's users keep starting together, the gap-analysis harness's too: SGLang
        runs a prefill batch whenever requests wait and mixes none into the decodes (no
        `--enable-mixed-chunk`), so a wave's requests start decoding in one step, end in one step
        (fixed lengths) and the next wave arrives together again. Its measured TTFT shows it: at one
        prompt length and load it does not change with the output length, as a steady state's would."""
        return True

    @property
    def flags(self) -> SGLangFlags:
        return inferencex_sglang_flags(self)

    @property
    def kv_cache_quant(self) -> str:
        """`--kv-cache-dtype fp8_e4m3` where the row's script passed it (and the estimator has SGLang
        data for it), else `auto`: the model's dtype (the estimator would pick FP8 next to FP8 GEMMs)."""
        return "fp8" if self.flags.kv_cache_fp8 and _sglang_fp8_kv_priced(self) else "bfloat16"

    def target(self, host: HostTime | None = None) -> AicTarget:
        return replace(super().target(host), backend="sglang", async_scheduling=True,
                       kv_cache_quant=self.kv_cache_quant, fmha_quant=_mla_fmha(self.model))


def _sglang_fp8_kv_priced(row: SiliconRow) -> bool:
    """Whether the estimator's SGLang data prices the row with an FP8 KV cache (it has none for
    Qwen3.5 on H200, whose script asks for one: that row keeps a BF16 cache)."""
    return _fp8_kv_priced(row.model, row.gpu, row.tp, row.attention_dp, row.moe_tp, row.moe_ep, row.gemm_quant,
                          row.moe_quant)


@functools.lru_cache(maxsize=256)
def _fp8_kv_priced(model: str, gpu: str, tp: int, dp: int, moe_tp: int | None, moe_ep: int | None,
                   gemm: str | None, moe: str | None) -> bool:
    try:
        compile_target(AicTarget(model=model, gpu=gpu, backend="sglang", tensor_parallel_size=tp, attention_dp_size=dp,
                                 moe_tp_size=moe_tp, moe_ep_size=moe_ep, gemm_quant=gemm, moe_quant=moe,
                                 kv_cache_quant="fp8", fmha_quant=_mla_fmha(model)))
    except PerfModelError:
        return False
    return True


def _row_common(r: dict[str, str]) -> dict[str, Any]:
    m = _CONC.search(r["silicon_data_source"])
    conc = int(m.group(1)) if m else int(float(r["batch_size"] or r.get("decode_batch_size") or 1))
    return dict(id=r["id"], model=r["model_path"], gpu=r["system"], backend_version=r["backend_version"],
                gemm_quant=_str(r["gemm_quant_mode"]), moe_quant=_str(r["moe_quant_mode"]),
                isl=int(float(r["isl"])), osl=int(float(r["osl"])), concurrency=conc,
                ttft_ms=float(r["silicon_ttft_ms"]), tpot_ms=float(r["silicon_tpot_ms"]),
                source=r["silicon_data_source"], precision_label=_str(r["gemm_quant_mode"]) or "bf16")


def sglang_agg_rows(path: str | None = None) -> Iterator[SGLangRow]:
    """The SGLang aggregated rows of silicon_sample.csv."""
    with open(_sample_path(path), newline="") as f:
        for r in csv.DictReader(f):
            if r["backend"] != "sglang" or r["mode"] != "agg":
                continue
            row = SGLangRow(**_row_common(r), tp=_int(r["tp_size"], 1), attention_dp=_int(r["attention_dp_size"], 1),
                            moe_tp=_int(r["moe_tp_size"]), moe_ep=_int(r["moe_ep_size"]))
            yield _sglang_kernels(_checkpoint_precision(_data_parallel(_expert_parallel(row))))


def _expert_parallel(row: SGLangRow) -> SGLangRow:
    """The deployment of a row whose columns spell expert parallelism as InferenceX's database dump
    and its dashboard export of 2026-04-06 do: `tp_size` = TP x EP, `moe_tp_size` = TP,
    `moe_ep_size` = EP. SGLang's `--tp 4 --ep 4` (attention TP 4, experts spread over the same 4
    GPUs, MoE TP = TP / EP = 1) is `16 / 4 / 4` there and `4 / 1 / 4` in the sample's other rows,
    which carry the same measurements (tests/perf/test_silicon_beyond.py), and the rows' InferenceX
    search spaces list exactly these points (`{ tp: 4, ep: 4 }`, `{ tp: 8, ep: 8 }` for DeepSeek-R1,
    `{ tp: 2, ep: 2 }` for Qwen3.5 NVFP4 on B300, in `.github/configs/nvidia-master.yaml`); read as
    written they were 16 and 64 GPUs of attention TP. The row keeps its recorded group."""
    tp, ep = row.moe_tp or 1, row.moe_ep or 1
    if tp > 1 and ep > 1 and row.tp == tp * ep and row.attention_dp == 1 and tp % ep == 0:
        return replace(row, recorded_group=row.group, tp=tp, moe_tp=tp // ep, moe_ep=ep)
    return row


def _engine_args(target: AicTarget, *, gpu_util: float, budget: int, seqs: int, block_size: int,
                 max_len: int, engine_type: str, **extra: Any):
    from ..engine.config import EngineArgs, EngineConfig
    from ..perf.kv_sizing import estimate_kv_capacity

    cap = estimate_kv_capacity(target, block_size=block_size, gpu_memory_utilization=gpu_util,
                               max_num_batched_tokens=budget, max_num_seqs=seqs)
    # (the rows' vLLM releases admit a request once its first chunk fits: no scheduler_reserve_full_isl)
    args = EngineArgs(config=EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=budget), kv_cache_size=cap.num_blocks,
                      tokens_per_block=block_size, perf_model=target.to_dict(), engine_type=engine_type,
                      advertised_max_model_len=max_len, scheduler_reserve_full_isl=False, **extra).validate()
    return args, cap


def _server_limits(row: SiliconRow, target: AicTarget) -> tuple[int, int, float]:
    """(token budget per step, sequences, memory fraction) of the row's server."""
    from ..perf.kv_sizing import estimate_kv_capacity

    gpu = estimate_kv_capacity(target, block_size=16, gpu_memory_utilization=0.9, max_num_batched_tokens=8192,
                               max_num_seqs=256).gpu_bytes
    if getattr(row, "engine_type", "vllm") == "sglang":
        chunk, _, frac = sglang_server_defaults(gpu, target.tensor_parallel_size * target.attention_dp_size)
        flags = row.flags if isinstance(row, SGLangRow) else SGLangFlags()
        seqs = max(flags.max_running_requests // max(row.attention_dp, 1), 1) if flags.max_running_requests \
            else SGLANG_MAX_RUNNING
        return flags.chunked_prefill_size or chunk, seqs, flags.mem_fraction_static or frac
    from .silicon_harness import scheduler_limits

    seqs, budget = scheduler_limits(row.server, gpu, row.backend_version, row.concurrency)
    return budget, seqs, row.server.gpu_memory_utilization


def _means(row: SiliconRow, done: list, plan, extra: dict[str, Any]) -> dict[str, Any]:
    ttft, tpot = row_latencies(row, done)
    return {"ttft_ms": ttft, "tpot_ms": tpot, "requests": plan.requests, "sim_osl": plan.osl, **extra}


def simulate_sglang_row(row: SGLangRow, *, host: HostTime | None = None, max_tokens: int = 40_000) -> dict[str, Any]:
    """An SGLang row's benchmark through SGLang-policy engines priced with SGLang's kernel data."""
    from .runner import simulate

    target = row.target(host).resolved()
    compile_target(target)
    budget, seqs, frac = _server_limits(row, target)
    recv = row.flags.recv_interval
    args, cap = _engine_args(target, gpu_util=frac, budget=budget, seqs=seqs, block_size=16,
                             max_len=row.isl + row.osl + 16, engine_type="sglang", scheduler_recv_interval=recv)
    plan = plan_for(row, max_tokens)
    engines = max(row.attention_dp, 1)
    sim = simulate(args, row_workload(row, plan), engines=engines, router="round_robin", concurrency=row.concurrency)
    return _means(row, sim.done, plan, {
        "kv_blocks": cap.num_blocks, "per_engine_concurrency": max(row.concurrency // engines, 1),
        "max_num_batched_tokens": budget, "max_num_seqs": seqs, "mem_fraction": frac, "async_scheduling": True,
        "scheduler_recv_interval": recv, "preemptions": sum(sim.timeline.preemptions), "wall_s": sim.wall_s,
        "engine_type": "sglang"})


# --- disaggregated -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DisaggRow(SiliconRow):
    """A disaggregated row: `prefill_workers` workers of TP `prefill_tp` x attention DP `prefill_dp`
    and `decode_workers` of the decode side's parallelism (the base fields: tp, attention_dp,
    moe_tp, moe_ep), served by `engine_type`."""

    engine_type: str = "vllm"
    prefill_workers: int = 1
    prefill_tp: int = 1
    prefill_dp: int = 1
    prefill_moe_tp: int | None = None
    prefill_moe_ep: int | None = None
    decode_workers: int = 1

    def columns_group(self) -> str:
        return (f"disagg-{self.engine_type}|{self.model}|{self.gpu}|{self.precision_label}|"
                f"p{self.prefill_workers}x(tp{self.prefill_tp}-dp{self.prefill_dp})|"
                f"d{self.decode_workers}x(tp{self.tp}-dp{self.attention_dp})")

    @property
    def async_scheduling(self) -> bool:
        return True if self.engine_type == "sglang" else super().async_scheduling

    @property
    def kv_cache_quant(self) -> str:
        return "bfloat16" if self.engine_type == "sglang" else super().kv_cache_quant

    @property
    def server(self):
        from .silicon_harness import ServerFlags

        return ServerFlags()  # no InferenceX script flags are known for the disaggregated recipes

    def target(self, host: HostTime | None = None) -> AicTarget:
        t = super().target(host)
        if self.engine_type == "sglang":
            t = replace(t, kv_cache_quant="bfloat16", fmha_quant=_mla_fmha(self.model))
        return replace(t, backend=self.engine_type, async_scheduling=self.async_scheduling)

    def prefill_target(self, host: HostTime | None = None) -> AicTarget:
        return replace(self.target(host), tensor_parallel_size=self.prefill_tp, attention_dp_size=self.prefill_dp,
                       moe_tp_size=self.prefill_moe_tp, moe_ep_size=self.prefill_moe_ep)

    @property
    def gpus(self) -> int:
        return (self.prefill_workers * self.prefill_tp * self.prefill_dp
                + self.decode_workers * self.tp * self.attention_dp)


def disagg_rows(path: str | None = None, backends: tuple[str, ...] = ("vllm", "sglang")) -> Iterator[DisaggRow]:
    """The disaggregated rows of silicon_sample.csv served by `backends` (the engine types)."""
    with open(_sample_path(path), newline="") as f:
        for r in csv.DictReader(f):
            if r["backend"] not in backends or r["mode"] != "disagg":
                continue
            row = DisaggRow(**_row_common(r), engine_type=r["backend"],
                            tp=_int(r["decode_tp_size"], 1), attention_dp=_int(r["decode_attention_dp_size"], 1),
                            moe_tp=_int(r["decode_moe_tp_size"]), moe_ep=_int(r["decode_moe_ep_size"]),
                            prefill_workers=_int(r["prefill_num_workers"], 1), prefill_tp=_int(r["prefill_tp_size"], 1),
                            prefill_dp=_int(r["prefill_attention_dp_size"], 1),
                            prefill_moe_tp=_int(r["prefill_moe_tp_size"]), prefill_moe_ep=_int(r["prefill_moe_ep_size"]),
                            decode_workers=_int(r["decode_num_workers"], 1))
            row = _checkpoint_precision(_recipe_deployment(row))
            yield _sglang_kernels(row) if row.engine_type == "sglang" else row


def _recipe_deployment(row: DisaggRow) -> DisaggRow:
    """The deployment InferenceX's recipe ran for a dashboard row whose columns give one GPU count
    per worker and no worker counts or DP attention (inferencex_disagg.py); the row keeps its
    recorded group (the split is made of recorded groups)."""
    from .inferencex_disagg import recipe_point

    pt = recipe_point(row.source, row.model, row.gpu, row.precision_label, row.isl, row.osl, row.concurrency,
                      row.prefill_tp, row.prefill_moe_ep or 1, row.tp)
    if pt is None:
        return row
    p, d = pt.prefill, pt.decode
    return replace(row, recorded_group=row.group, prefill_workers=p.workers, prefill_tp=p.tp,
                   prefill_dp=p.attention_dp, prefill_moe_tp=p.moe_tp, prefill_moe_ep=p.ep, decode_workers=d.workers,
                   tp=d.tp, attention_dp=d.attention_dp, moe_tp=d.moe_tp, moe_ep=d.ep)


def kv_link(row: DisaggRow) -> tuple[float, str]:
    """(bytes per second per GPU, which link) the KV of a prompt crosses from prefill to decode."""
    return catalog_kv_link(row.gpu, row.gpus)


def disagg_static(row: DisaggRow) -> tuple[float, float]:
    """The estimator's static answer for a disaggregated row: the prefill side's context latency of
    one request plus the KV transfer, and the decode side's generation step at its per-rank batch."""
    from ..perf.kv_sizing import estimate_kv_capacity

    p = compile_target(row.prefill_target())
    d = compile_target(row.target())
    ctx, _, _ = p.run_static(batch_size=1, isl=row.isl, osl=2)
    per_rank = max(row.concurrency // max(row.decode_workers * row.attention_dp, 1), 1)
    _, gen, _ = d.run_static(batch_size=per_rank, isl=row.isl, osl=row.osl)
    bpt = pull_bytes_per_token(*(estimate_kv_capacity(t, block_size=16, gpu_memory_utilization=0.9,
                                                      max_num_batched_tokens=8192, max_num_seqs=256).bytes_per_token
                                 for t in (row.prefill_target(), row.target())))
    bw, _ = kv_link(row)
    return ctx + bpt * row.isl / bw * 1e3, gen / max(row.osl - 1, 1)


def simulate_disagg_row(row: DisaggRow, *, host: HostTime | None = None, max_tokens: int = 40_000) -> dict[str, Any]:
    """A disaggregated row's benchmark: its prefill and decode workers on one virtual clock (what
    `simulate --num-prefill-workers` runs)."""
    from .disagg import Disaggregation
    from .runner import simulate

    pt, dt = row.prefill_target(host).resolved(), row.target(host).resolved()
    compile_target(pt)
    compile_target(dt)
    max_len = row.isl + row.osl + 16
    p_budget, p_seqs, p_frac = _server_limits(row, pt)
    d_budget, d_seqs, d_frac = _server_limits(row, dt)
    d_seqs = max(d_seqs, row.concurrency)
    bw, link = kv_link(row)
    p_args, p_cap = _engine_args(pt, gpu_util=p_frac, budget=p_budget, seqs=p_seqs, block_size=16, max_len=max_len,
                                 engine_type=row.engine_type, worker_type="prefill")
    d_args, d_cap = _engine_args(dt, gpu_util=d_frac, budget=d_budget, seqs=d_seqs, block_size=16, max_len=max_len,
                                 engine_type=row.engine_type, worker_type="decode", kv_transfer_bandwidth=bw / 1e9)
    d_args.kv_bytes_per_token = bpt = pull_bytes_per_token(p_cap.bytes_per_token, d_cap.bytes_per_token)
    plan = plan_for(row, max_tokens)
    sim = simulate(d_args, row_workload(row, plan), engines=max(row.attention_dp, 1), concurrency=row.concurrency,
                   disagg=Disaggregation(p_args, row.prefill_workers, max(row.prefill_dp, 1), row.decode_workers))
    transfer = bpt * row.isl / bw * 1e3
    return _means(row, sim.done, plan, {
        "kv_blocks": d_cap.num_blocks, "prefill_kv_blocks": p_cap.num_blocks,
        "per_engine_concurrency": max(row.concurrency // max(row.decode_workers * row.attention_dp, 1), 1),
        "max_num_batched_tokens": p_budget, "max_num_seqs": d_seqs, "async_scheduling": row.async_scheduling,
        "kv_bytes_per_token": bpt, "kv_link": link, "kv_link_gb_s": bw / 1e9,
        "kv_transfer_ms_one_prompt": transfer, "preemptions": sum(sim.timeline.preemptions), "wall_s": sim.wall_s,
        "engine_type": row.engine_type, "disaggregated": True})


# --- the dispatch the validation uses ------------------------------------------------------------------
ROW_KINDS = ("vllm-agg", "sglang-agg", "disagg")


def rows_of_kind(kind: str, path: str | None = None) -> list[SiliconRow]:
    from .silicon import vllm_agg_rows

    if kind == "vllm-agg":
        return list(vllm_agg_rows(path))
    if kind == "sglang-agg":
        return list(sglang_agg_rows(path))
    if kind == "disagg":
        return list(disagg_rows(path))
    raise ValueError(f"unknown row kind {kind!r} (known: {', '.join(ROW_KINDS)})")


def row_from_dict(d: dict[str, Any]) -> SiliconRow:
    """A row from its fields (`row.__dict__`), of the class the fields name."""
    if "prefill_tp" in d:
        return DisaggRow(**d)
    if d.get("engine_type") == "sglang":
        return SGLangRow(**d)
    return SiliconRow(**d)


def simulate_any(row: SiliconRow, *, host: HostTime | None = None, max_tokens: int = 40_000) -> dict[str, Any]:
    if isinstance(row, DisaggRow):
        return simulate_disagg_row(row, host=host, max_tokens=max_tokens)
    if isinstance(row, SGLangRow):
        return simulate_sglang_row(row, host=host, max_tokens=max_tokens)
    return simulate_row(row, host=host, max_tokens=max_tokens)


def static_any(row: SiliconRow) -> tuple[float, float]:
    return disagg_static(row) if isinstance(row, DisaggRow) else static_estimate(row)


def supported_any(row: SiliconRow) -> str | None:
    """None when the estimator can price the row (both sides of a disaggregated one), else why not."""
    from ..perf.kv_sizing import estimate_kv_capacity

    def check() -> None:
        sides = [row.prefill_target(), row.target()] if isinstance(row, DisaggRow) else [row.target()]
        for t in sides:
            compile_target(t)
            if type(row) is not SiliconRow:  # the KV cache the row's server gets (may leave none)
                budget, seqs, frac = _server_limits(row, t.resolved())
                estimate_kv_capacity(t, block_size=16, gpu_memory_utilization=frac, max_num_batched_tokens=budget,
                                     max_num_seqs=seqs)
        static_any(row)

    return unpriceable(check)


def kind_label(row: SiliconRow) -> str:
    """engine type x aggregated/disaggregated, for the report."""
    if isinstance(row, DisaggRow):
        return f"{row.engine_type}, disaggregated"
    return f"{getattr(row, 'engine_type', 'vllm')}, aggregated"
