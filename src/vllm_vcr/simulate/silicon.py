"""Check the perf model against measured deployments: `systems/silicon_sample.csv` of
aiconfigurator-core holds real TTFT/TPOT of vLLM, SGLang and TRT-LLM deployments (model, GPU,
precision, TP, ISL, OSL, concurrency).

For one vLLM aggregated row: the estimator for that model/GPU/parallelism/precision, the KV
cache vLLM would get on that GPU, vLLM's default scheduler limits for that GPU, and the row's
closed-loop workload (its concurrency, fixed ISL/OSL, random prompts, `ignore_eos`) simulated
through the same EngineCore as `serve` (attention-DP ranks are separate engines, round robin).

The workload is the benchmark that measured the row, not an idealised steady state: vLLM's
`benchmark_serving.py` as InferenceX runs it (`--request-rate inf --max-concurrency C
--num-prompts 10*C --random-range-ratio 0.8 --ignore-eos`): all C users send at once (the first
wave's prompts queue behind each other in chunked prefill), lengths uniform in [0.8 L, L] for
the rows measured with the `vllm/vllm-openai` images (fixed lengths for the other sources), and
TTFT and TPOT are the means over all 10*C requests, the first wave included.
"""

from __future__ import annotations

import csv
import math
import re
import zlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

from ..perf.aic import AicTarget, compile_target, with_capture_size
from ..perf.catalog import bundled_models, package_root, resolve_model
from ..perf.checkpoint import checkpoint_kernels, kv_cache_directive
from ..perf.errors import PerfModelError
from .silicon_harness import (ServerFlags, async_scheduling, inferencex_dp_attention, inferencex_flags,
                              inferencex_unknown_deployment, scheduler_limits)


@dataclass(frozen=True)
class HostTime:
    """The perf model's fitted terms (perf/aic.py), all zero here (the estimator's kernels alone,
    what the fit starts from): the engine's host time per step, `step_ms + per_seq_ms x running
    sequences`, added to the GPU time, or overlapped with it under async scheduling, which
    leaves `async_exposed_ms` per step exposed; the GPU time of the attention's QK norm the
    kernel data lacks (perf/qk_norm.py): `qk_norm_us` per QK-normed layer, plus
    `qk_norm_allreduce_us` per layer where that norm spans the TP ranks; and the API server's
    time before the engine sees a request, `frontend_ms + frontend_ms_per_1k_tokens x prompt
    tokens / 1000 + frontend_ms_per_request x requests in flight`; and the host time of a step
    vLLM runs without CUDA graphs (perf/cuda_graphs.py), `eager_layer_us` per layer plus
    `eager_layer_tp_us` per layer when TP > 1."""

    step_ms: float = 0.0
    per_seq_ms: float = 0.0
    async_exposed_ms: float = 0.0
    qk_norm_us: float = 0.0
    qk_norm_allreduce_us: float = 0.0
    frontend_ms: float = 0.0
    frontend_ms_per_1k_tokens: float = 0.0
    frontend_ms_per_request: float = 0.0
    eager_layer_us: float = 0.0
    eager_layer_tp_us: float = 0.0

    @classmethod
    def fitted(cls) -> "HostTime":
        """The perf model's defaults (perf/aic.py): what `serve`, `play` and `simulate` run."""
        t = AicTarget(model="")
        return cls(t.step_overhead_ms, t.per_seq_overhead_ms, t.async_exposed_ms, t.qk_norm_us,
                   t.qk_norm_allreduce_us, t.frontend_ms, t.frontend_ms_per_1k_tokens, t.frontend_ms_per_request,
                   t.eager_layer_us, t.eager_layer_tp_us)


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
    source: str = ""
    precision_label: str = ""  # the sample's GEMM precision label, before the checkpoint's own replaces it
    recorded_group: str = ""  # the group of the sample's columns, where the deployment run differs from them

    @property
    def inferencex(self) -> bool:
        """Measured with InferenceX's harness (its database dump and CSV exports: the
        `vllm/vllm-openai` images on its ISL/OSL grid); the other sources (AIConfigurator's gap
        analyses) are taken as steady-state measurements of fixed-length requests. The SGLang
        Qwen3.5-397B "gap analysis" file is InferenceX's runs again: each of its 76 rows is an
        InferenceX row of the same configuration, rounded to two decimals."""
        return self.source.startswith(("db-dump", "source_file=2026-", "source_file=qwen3.5-397b-gap-analysis.csv"))

    @property
    def burst(self) -> bool:
        """Whether the benchmark's users keep starting together: InferenceX's harness (10·C prompts,
        all measured). The gap-analysis harness also starts its C users at once, but under vLLM its
        waves dissolve (vLLM mixes prefills into the decodes, so requests finish at different steps;
        the measured TTFT follows a steady state): those rows run as a steady state (SGLang's keep
        their waves: SGLangRow)."""
        return self.inferencex

    @property
    def range_ratio(self) -> float:
        """`--random-range-ratio` of the row's benchmark: lengths uniform in [r L, L]."""
        return 0.8 if self.inferencex else 1.0

    @property
    def group(self) -> str:
        """The row's configuration (model x GPU x precision x parallelism, with the sample's own
        precision label): every repeat of one configuration shares it, and the validation's splits
        are made of whole groups. A row whose deployment was read from more than its columns keeps
        the group of its columns (the split is made of recorded groups)."""
        return self.recorded_group or self.columns_group()

    def columns_group(self) -> str:
        """The group the sample's columns give."""
        dp = f"-dp{self.attention_dp}" if self.attention_dp > 1 else ""
        return f"{self.model}|{self.gpu}|{self.precision_label}|tp{self.tp}{dp}"

    @property
    def family(self) -> str:
        """The model family, for the report (`Llama-3.1-70B` and `Llama-3.1-8B` are two)."""
        return self.model.rsplit("/", 1)[-1]

    @property
    def server(self) -> ServerFlags:
        """The server flags of the row's deployment (silicon_harness.py)."""
        if not self.inferencex:
            return ServerFlags()
        return inferencex_flags(self.model, self.gpu, self.gemm_quant, self.source)

    @property
    def unknown_deployment(self) -> str | None:
        """Why the deployment that measured the row is not known (silicon_harness.py), or None."""
        if not self.inferencex:
            return None
        return inferencex_unknown_deployment(self.model, self.gpu, self.concurrency, self.source)

    @property
    def async_scheduling(self) -> bool:
        """Whether the row's engine overlapped its host work with the GPU (silicon_harness.py)."""
        return async_scheduling(self.server, self.backend_version)

    @property
    def checkpoint(self) -> str:
        """The checkpoint the row's server loaded, where the estimator bundles its config: an
        `nvfp4` row of a model whose own checkpoint is not NVFP4 served NVIDIA's ModelOpt
        checkpoint (`nvidia/<name>-NVFP4`; InferenceX's `*_fp4` scripts name it)."""
        if self.precision_label == "nvfp4":
            nvidia = f"nvidia/{self.family}-NVFP4"
            if nvidia in bundled_models():
                return nvidia
        return self.model

    @property
    def kv_cache_quant(self) -> str:
        """The KV cache dtype the row's server ran: `--kv-cache-dtype fp8` when its script passed it,
        else vLLM's `auto`: the checkpoint's own directive (perf/checkpoint.py) from vLLM 0.13 on
        (an unknown version is taken as a current one), the model's dtype before."""
        if self.server.kv_cache_fp8:
            return "fp8"
        v = re.match(r"(\d+)\.(\d+)", self.backend_version or "")
        if v is None or (int(v.group(1)), int(v.group(2))) >= (0, 13):
            return kv_cache_directive(self.checkpoint) or "bfloat16"
        return "bfloat16"

    def target(self, host: HostTime | None = None) -> AicTarget:
        h = host or HostTime()
        kv = self.kv_cache_quant  # None where it is what `auto` resolves to (one estimator spec per identity)
        if kv == "bfloat16" and not kv_cache_directive(resolve_model(self.model)[0]):
            kv = None
        return AicTarget(model=self.model, gpu=self.gpu, backend="vllm", tensor_parallel_size=self.tp,
                         attention_dp_size=self.attention_dp, moe_tp_size=self.moe_tp, moe_ep_size=self.moe_ep,
                         gemm_quant=self.gemm_quant, moe_quant=self.moe_quant,
                         kv_cache_quant=kv, moe_activation=self.server.moe_activation,
                         step_overhead_ms=h.step_ms, per_seq_overhead_ms=h.per_seq_ms,
                         async_scheduling=self.async_scheduling, async_exposed_ms=h.async_exposed_ms,
                         qk_norm_us=h.qk_norm_us, qk_norm_allreduce_us=h.qk_norm_allreduce_us,
                         frontend_ms=h.frontend_ms, frontend_ms_per_1k_tokens=h.frontend_ms_per_1k_tokens,
                         frontend_ms_per_request=h.frontend_ms_per_request, cudagraph_mode=self.server.cudagraph_mode,
                         eager_layer_us=h.eager_layer_us, eager_layer_tp_us=h.eager_layer_tp_us)


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
            row = SiliconRow(
                id=r["id"], model=r["model_path"], gpu=r["system"], backend_version=r["backend_version"],
                tp=_int(r["tp_size"], 1), attention_dp=_int(r["attention_dp_size"], 1),
                moe_tp=_int(r["moe_tp_size"]), moe_ep=_int(r["moe_ep_size"]),
                gemm_quant=_str(r["gemm_quant_mode"]), moe_quant=_str(r["moe_quant_mode"]),
                isl=int(float(r["isl"])), osl=int(float(r["osl"])), concurrency=int(float(r["batch_size"])),
                ttft_ms=float(r["silicon_ttft_ms"]), tpot_ms=float(r["silicon_tpot_ms"]),
                source=r["silicon_data_source"], precision_label=_str(r["gemm_quant_mode"]) or "bf16")
            yield _checkpoint_precision(_as_deployed(row))


_BENCH_CONCURRENCY = re.compile(r"silicon_concurrency=(\d+)")


def _checkpoint_precision(row: SiliconRow) -> SiliconRow:
    """The kernels of the checkpoint the row served, where the sample's label says otherwise
    (perf/checkpoint.py `checkpoint_kernels`, the same `serve`, `play` and `simulate` price a
    checkpoint with when no quantisation is given).

    MXFP4 checkpoints (gpt-oss) and int4 experts-only ones (Kimi-K2.5) run what their config
    says, whatever precision label the sample gives. The sample says `fp8` for every FP8
    deployment, but Qwen3-235B-A22B-FP8 and MiniMax-M2.5 are block-scaled FP8 checkpoints, which
    vLLM runs through block-scaled GEMM and MoE kernels: the estimator's `fp8_block` tables where
    vLLM can shard the experts that way (on Blackwell its `fp8_block` GEMM tables price
    MiniMax-M2.5 3-4x slower than it was measured: there the per-tensor GEMM tables stand in)."""
    kernels = checkpoint_kernels(row.checkpoint, row.gpu, row.moe_tp or row.tp)
    if kernels is not None and kernels[1] in ("w4a16_mxfp4", "int4_wo"):
        return replace(row, gemm_quant=kernels[0], moe_quant=kernels[1])
    if row.gemm_quant != "fp8":
        return row
    kernels = checkpoint_kernels(row.model, row.gpu, row.moe_tp or row.tp)
    if kernels is None or kernels[1] != "fp8_block":
        return row
    return replace(row, gemm_quant=kernels[0], moe_quant="fp8_block" if row.moe_quant == "fp8" else row.moe_quant)


def _as_deployed(row: SiliconRow) -> SiliconRow:
    """The deployment InferenceX ran, where the sample's conversion recorded another.

    InferenceX's `{tp: N, ep: N}` configs launch `vllm serve --tensor-parallel-size N
    --enable-expert-parallel`: N GPUs, attention TP N, MoE experts spread over the same N GPUs
    (EP N, MoE TP 1), one engine. Part of the sample records them as attention DP N with EP N*N
    and a per-rank batch of C/N (the same measurements appear under both spellings, with the
    same TTFT/TPOT): taken literally, that prices 16 GPUs with cross-node all-to-all for a
    4-GPU run. The benchmark's concurrency is `silicon_concurrency` in the row's source. Only
    the configs marked `dp-attn` ran attention DP: N engines of TP 1, EP N over all of them."""
    m = _BENCH_CONCURRENCY.search(row.source)
    if not row.inferencex:
        return _data_parallel(row)
    if row.attention_dp <= 1 or m is None:
        return row
    c = int(m.group(1))
    if inferencex_dp_attention(row.model, row.gemm_quant, row.tp, c, row.source):
        return replace(row, tp=1, attention_dp=row.tp, moe_tp=1, moe_ep=row.tp, concurrency=c)
    return replace(row, attention_dp=1, moe_tp=1, moe_ep=row.tp, concurrency=c)


def _data_parallel(row: SiliconRow) -> SiliconRow:
    """A gap-analysis row whose MoE spans more GPUs than its attention TP (`moe_tp` 2 at TP 1)
    leaves its attention DP blank: vLLM's `--data-parallel-size D` without expert parallelism
    runs the experts tensor-parallel over all D x TP GPUs, so D = MoE width / TP engines."""
    width = (row.moe_tp or 1) * (row.moe_ep or 1)
    if row.attention_dp > 1 or width <= row.tp or width % row.tp:
        return row
    return replace(row, attention_dp=width // row.tp)


def static_estimate(row: SiliconRow) -> tuple[float, float]:
    """The estimator's own answer (`run_static`, batch = concurrency): (TTFT ms, TPOT ms)."""
    handle = compile_target(row.target())
    ctx, gen, _ = handle.run_static(batch_size=row.concurrency, isl=row.isl, osl=row.osl)
    return ctx, gen / max(row.osl - 1, 1)


BENCH_WAVES = 10  # InferenceX: --num-prompts 10 * concurrency


@dataclass(frozen=True)
class SimPlan:
    """How much of the row's benchmark to simulate: `requests` of the 10*C, each with at most
    `osl` output tokens (the row's OSL, or fewer when the benchmark is too costly)."""

    requests: int
    osl: int


def plan_for(row: SiliconRow, max_tokens: int) -> SimPlan:
    """The whole benchmark when it fits in `max_tokens` simulated output tokens; else fewer
    requests, down to two waves (the burst and one wave in steady state: the rest of the
    benchmark repeats the second wave, see `benchmark_means`); when even two waves do not fit,
    two waves of shorter requests (at least 256 tokens and 4x the steps of the first wave's
    prefill burst, so the burst stays a small part of a request's life)."""
    c = row.concurrency
    full = BENCH_WAVES * c if row.burst else 2 * max(c, 8)
    n = min(full, max(max_tokens // max(row.osl, 1), 2 * c))
    if n * row.osl <= max_tokens:
        return SimPlan(n, row.osl)
    burst_steps = math.ceil(c // max(row.attention_dp, 1) * row.isl / 8192)
    return SimPlan(n, min(row.osl, max(max_tokens // n, 256, 4 * burst_steps)))


def benchmark_means(values_in_order: list[float], concurrency: int, total: int) -> float:
    """The benchmark's mean over `total` requests from the simulated ones (in request order):
    the simulated requests count as themselves and each request not simulated as the mean of
    the requests after the first wave (the closed loop's steady state)."""
    vals = values_in_order
    if not vals:
        return math.nan
    steady = vals[concurrency:] or vals
    missing = max(total - len(vals), 0)
    return (sum(vals) + missing * sum(steady) / len(steady)) / (len(vals) + missing)


def request_lifetime_s(row: SiliconRow) -> float:
    """A request's expected duration at the row's load (the estimator's prefill + decode steps):
    for a steady-state row, the users start spread over it, so the loop starts without waves."""
    h = compile_target(row.target())
    per_engine = max(row.concurrency // max(row.attention_dp, 1), 1)
    decode = h.decode_step_latency(per_engine, row.isl + row.osl // 2, 2)
    return (h.predict_prefill_latency(1, row.isl) + row.osl * decode) / 1e3


def _context_correction_ms(row: SiliconRow, plan: SimPlan) -> float:
    """A shortened run decodes at shorter contexts: the estimator's decode step at the row's mean
    context minus at the simulated one (0 when the run is not shortened)."""
    if plan.osl >= row.osl:
        return 0.0
    h = compile_target(row.target())
    b = max(row.concurrency // max(row.attention_dp, 1), 1)
    return h.decode_step_latency(b, row.isl + row.osl // 2, 2) - h.decode_step_latency(b, row.isl + plan.osl // 2, 2)


def row_workload(row: SiliconRow, plan: SimPlan) -> Any:
    """The row's benchmark as a closed-loop workload: its lengths (uniform below the range ratio),
    its concurrency, the users ramping up over a request's lifetime unless they start together (`burst`)."""
    from .workload import LengthDist, SyntheticWorkload

    r = row.range_ratio
    isl = LengthDist("uniform", int(row.isl * r), row.isl) if r < 1 else LengthDist("fixed", row.isl)
    osl = LengthDist("uniform", int(plan.osl * r), plan.osl) if r < 1 else LengthDist("fixed", plan.osl)
    return SyntheticWorkload(num_requests=plan.requests, isl=isl, osl=osl, arrival="closed",
                             concurrency=row.concurrency, seed=zlib.crc32(row.id.encode()),
                             ramp_up=0.0 if row.burst else request_lifetime_s(row))


def row_latencies(row: SiliconRow, done: list) -> tuple[float, float]:
    """(TTFT, TPOT) means in ms over the finished requests the benchmark measures: InferenceX's
    waves, or the steady state after the users' first requests."""
    done = sorted(done, key=lambda rec: int(rec.request_id.rsplit("-", 1)[1]))
    if row.burst:
        total = BENCH_WAVES * row.concurrency
    else:  # steady state: the users' first requests (the ramp) are not measured
        done, total = done[row.concurrency:], len(done) - row.concurrency
    ttft = [(d.first - d.arrival) * 1e3 for d in done]
    tpot = [(d.end - d.first) * 1e3 / (d.num_out - 1) for d in done if d.num_out > 1]
    return benchmark_means(ttft, row.concurrency, total), benchmark_means(tpot, row.concurrency, total)


def simulate_row(row: SiliconRow, *, host: HostTime | None = None, max_tokens: int = 40_000) -> dict[str, Any]:
    """Simulate the row's benchmark (see the module doc); TTFT/TPOT means in ms."""
    from ..engine.config import EngineArgs, EngineConfig
    from ..perf.kv_sizing import estimate_kv_capacity
    from .runner import simulate

    target = row.target(host).resolved()
    compile_target(target)
    engines = max(row.attention_dp, 1)
    server = row.server
    seqs, budget = 1024, 8192
    for _ in range(2):  # the activations of a budget-sized pass come off the KV cache
        cap = estimate_kv_capacity(target, block_size=server.block_size,
                                   gpu_memory_utilization=server.gpu_memory_utilization,
                                   max_num_batched_tokens=budget, max_num_seqs=seqs)
        seqs, budget = scheduler_limits(server, cap.gpu_bytes, row.backend_version, row.concurrency)
    # the rows' releases (0.10-0.19) predate the 1024 default capture size on Blackwell
    perf = with_capture_size(target.to_dict(), seqs, budget, given=server.max_cudagraph_capture_size,
                             blackwell_1024=False)
    # (and vLLM's full-sequence admission gate, scheduler_reserve_full_isl, which came after them:
    # a row's request starts once its first chunk fits, as in those releases)
    args = EngineArgs(config=EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=budget),
                      kv_cache_size=cap.num_blocks, tokens_per_block=server.block_size, perf_model=perf,
                      advertised_max_model_len=row.isl + row.osl + 16, scheduler_reserve_full_isl=False).validate()
    plan = plan_for(row, max_tokens)
    sim = simulate(args, row_workload(row, plan), engines=engines, router="round_robin", concurrency=row.concurrency)
    ttft, tpot = row_latencies(row, sim.done)
    return {"ttft_ms": ttft, "tpot_ms": tpot + _context_correction_ms(row, plan),
            "requests": plan.requests, "sim_osl": plan.osl, "kv_blocks": cap.num_blocks,
            "per_engine_concurrency": max(row.concurrency // engines, 1), "max_num_batched_tokens": budget,
            "max_num_seqs": seqs, "cudagraph_capture_size": perf["cudagraph_capture_size"],
            "cudagraph_mode": perf["cudagraph_mode"], "kv_cache_fp8": row.kv_cache_quant == "fp8", "async_scheduling": row.async_scheduling,
            "preemptions": sum(sim.timeline.preemptions), "wall_s": sim.wall_s}


def unpriceable(check: Callable[[], Any]) -> str | None:
    """None when `check` (compiling and pricing a row) runs, else why not, in one line."""
    try:
        check()
    except PerfModelError as e:
        return str(e)
    except Exception as e:  # the estimator's own errors for missing data
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return None


def supported(row: SiliconRow) -> str | None:
    """None when the estimator can price the row, else why not (one line)."""
    return unpriceable(lambda: (compile_target(row.target()), static_estimate(row)))
