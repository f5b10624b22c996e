"""How InferenceX launched vLLM for a silicon row: the server flags its benchmark scripts passed
at the time the row was measured (github.com/SemiAnalysisAI/InferenceX, `benchmarks/*.sh` and
`.github/configs/nvidia-master.yaml`, read in their git history), and vLLM's own defaults for
the version that ran.

These are facts about the measured deployments, not tuning: a row is simulated with the KV-cache
dtype, the prefill token budget, the sequence limit, the memory fraction and the block size its
server had. Rows of other harnesses (AIConfigurator's gap analyses) get vLLM's defaults.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

GIB = 1 << 30


@dataclass(frozen=True)
class ServerFlags:
    """The vLLM server flags that decide step composition and KV capacity."""

    kv_cache_fp8: bool = False  # --kv-cache-dtype fp8
    max_num_batched_tokens: int | None = None  # None: vLLM's default for the GPU and version
    max_num_seqs: int | None = None  # None: vLLM's default
    max_num_seqs_is_concurrency: bool = False  # --max-num-seqs $CONC
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    async_scheduling: bool | None = None  # --async-scheduling; None: the version's default
    moe_activation: str | None = None  # the MoE kernels' input precision the script asked for (mxfp8)
    cudagraph_mode: str = "FULL_AND_PIECEWISE"  # --compilation-config's cudagraph_mode (vLLM's default)
    max_cudagraph_capture_size: int | None = None  # --max-cudagraph-capture-size (or --cuda-graph-sizes N)


@dataclass(frozen=True)
class _Rule:
    model: str  # a substring of the row's model
    gpus: tuple[str, ...]
    quants: tuple[str, ...]
    since: str  # measured on or after this date (ISO); the latest matching rule wins
    flags: ServerFlags


# 70b_{fp8,fp4}_b200*.sh: `--compilation-config` with `"cudagraph_mode": "FULL_DECODE_ONLY"`
_LLAMA_70B_B200 = ServerFlags(kv_cache_fp8=True, max_num_batched_tokens=8192, max_num_seqs=512,
                              async_scheduling=True, cudagraph_mode="FULL_DECODE_ONLY")
_LLAMA_70B_HOPPER = ServerFlags(kv_cache_fp8=True, max_num_batched_tokens=8192, max_num_seqs_is_concurrency=True,
                                async_scheduling=True)
_MINIMAX_FP8_EARLY = ServerFlags(gpu_memory_utilization=0.95, block_size=32)
_GRAPHS_2048 = dict(max_cudagraph_capture_size=2048)  # `--max-cudagraph-capture-size 2048`
# The scripts' `--max-num-batched-tokens $((ISL * 2))` is left out (vLLM's default budget is
# kept): with a 2048-token budget the simulated TTFT of the C >= 256 bursts is 2.5-6x the
# measured one (512 prompts of ~920 tokens would need >= 230 steps, each reading the expert
# weights), so the rows' servers did not run with that budget.
_MINIMAX_TUNED = ServerFlags(kv_cache_fp8=True, block_size=32)
_MINIMAX_FP4_TUNED = ServerFlags(kv_cache_fp8=True)
# gptoss_fp4_b200*.sh: `VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8=1` (MXFP4 experts on MXFP8 inputs; vLLM
# 0.32: `--quantization-config '{"moe": {"activation": "mxfp8"}}'`) from 2025-09-24, --max-num-seqs
# 512, 8192 batched tokens; kv fp8 from 2025-12-31
# gptoss_fp4_*.sh: `--cuda-graph-sizes 2048` (from 2025-09-17), `--max-cudagraph-capture-size 2048`
# (from 2025-11-19), on B200 and Hopper alike
_GPTOSS_B200 = ServerFlags(max_num_batched_tokens=8192, max_num_seqs=512, moe_activation="mxfp8", **_GRAPHS_2048)
_GPTOSS_HOPPER = ServerFlags(**_GRAPHS_2048)
_GPTOSS_B200_KV_FP8 = replace(_GPTOSS_B200, kv_cache_fp8=True)
_KIMI = ServerFlags(max_num_seqs_is_concurrency=True)
_KIMI_TUNED = ServerFlags(kv_cache_fp8=True, max_num_seqs_is_concurrency=True)

_RULES = (
    # 70b_fp8_{b200,h100,h200}_*.sh (removed 2025-10-29): a config.yaml with kv-cache-dtype fp8,
    # async-scheduling, max-num-batched-tokens 8192; --max-num-seqs 512 (B200) or $CONC
    _Rule("Llama-3.1-70B", ("b200_sxm",), ("fp8", "nvfp4"), "2025-01-01", _LLAMA_70B_B200),
    _Rule("Llama-3.1-70B", ("h100_sxm", "h200_sxm"), ("fp8",), "2025-01-01", _LLAMA_70B_HOPPER),
    # minimaxm2.5_fp8_b200.sh: block size 32, memory 0.95; from 2026-04-03 (#947) kv fp8, memory 0.90
    _Rule("MiniMax-M2.5", ("b200_sxm",), ("fp8",), "2025-01-01", _MINIMAX_FP8_EARLY),
    # ... and from 2026-04-02 --max-cudagraph-capture-size 2048 (B300: from its first version)
    _Rule("MiniMax-M2.5", ("b200_sxm",), ("fp8",), "2026-04-02", replace(_MINIMAX_FP8_EARLY, **_GRAPHS_2048)),
    _Rule("MiniMax-M2.5", ("b200_sxm",), ("fp8",), "2026-04-03", replace(_MINIMAX_TUNED, **_GRAPHS_2048)),
    _Rule("MiniMax-M2.5", ("b300_sxm",), ("fp8",), "2025-01-01", replace(_MINIMAX_TUNED, **_GRAPHS_2048)),
    # minimaxm2.5_fp4_{b200,b300}.sh: kv fp8 from their first version; --max-cudagraph-capture-size
    # 2048 on B300 from its first version, on B200 from 2026-04-07
    _Rule("MiniMax-M2.5", ("b200_sxm",), ("nvfp4",), "2025-01-01", _MINIMAX_FP4_TUNED),
    _Rule("MiniMax-M2.5", ("b200_sxm",), ("nvfp4",), "2026-04-07", replace(_MINIMAX_FP4_TUNED, **_GRAPHS_2048)),
    _Rule("MiniMax-M2.5", ("b300_sxm",), ("nvfp4",), "2025-01-01", replace(_MINIMAX_FP4_TUNED, **_GRAPHS_2048)),
    _Rule("MiniMax-M2.5", ("h100_sxm",), ("fp8",), "2025-01-01", ServerFlags(max_num_seqs=256)),
    _Rule("MiniMax-M2.5", ("h200_sxm",), ("fp8",), "2025-01-01", ServerFlags(gpu_memory_utilization=0.95)),
    _Rule("gpt-oss", ("b200_sxm",), ("bf16", "nvfp4"), "2025-09-24", _GPTOSS_B200),
    _Rule("gpt-oss", ("b200_sxm",), ("bf16", "nvfp4"), "2025-12-31", _GPTOSS_B200_KV_FP8),
    _Rule("gpt-oss", ("h100_sxm", "h200_sxm"), ("bf16", "nvfp4"), "2025-09-17", _GPTOSS_HOPPER),
    # kimik2.5_fp4_{b200,b300}.sh: --max-num-seqs $CONC; B200 from 2026-04-16: --max-cudagraph-capture-size
    # 2048, from 2026-04-20: kv fp8
    _Rule("Kimi-K2.5", ("b200_sxm", "b300_sxm"), ("nvfp4",), "2025-01-01", _KIMI),
    _Rule("Kimi-K2.5", ("b200_sxm",), ("nvfp4",), "2026-04-16", replace(_KIMI, **_GRAPHS_2048)),
    _Rule("Kimi-K2.5", ("b200_sxm",), ("nvfp4",), "2026-04-20", replace(_KIMI_TUNED, **_GRAPHS_2048)),
)

_MEASURED = re.compile(r"measured=(\d{4}-\d{2}-\d{2})")

# gptoss_fp4_h100_docker.sh from 2025-11-21 (#227) until its fix on 2025-12-08 (#310): the client ran
# with `--max-concurrency 512` whatever the run's $CONC, against `--max-num-seqs=$CONC` and 10·$CONC
# prompts (so every prompt was sent at once and waited for one of $CONC slots: TTFTs of 20-460 s
# at a TPOT of a small batch). Every such run is recorded at concurrency 512, and the run's $CONC
# (4-64 in the sweep's config) is not in the row.
_CLIENT_512 = ("gpt-oss", "h100_sxm", 512, "2025-11-21", "2025-12-08")


def inferencex_unknown_deployment(model: str, gpu: str, concurrency: int, source: str) -> str | None:
    """Why the row's deployment cannot be read from the row (None: it can)."""
    m = _MEASURED.search(source)
    name, on, conc, since, until = _CLIENT_512
    if name in model and gpu == on and concurrency == conc and m and since <= m.group(1) <= until:
        return ("measured while the H100 script ran its client at concurrency 512 whatever the run's "
                "--max-num-seqs (4-64, not recorded) and 10x that many prompts")
    return None


def inferencex_flags(model: str, gpu: str, gemm_quant: str | None, source: str) -> ServerFlags:
    """The flags of the InferenceX script that measured the row (vLLM's defaults if none is known)."""
    m = _MEASURED.search(source)
    measured = m.group(1) if m else "9999-12-31"
    match = [r for r in _RULES if r.model in model and gpu in r.gpus and (gemm_quant or "bf16") in r.quants
             and r.since <= measured]
    return max(match, key=lambda r: r.since).flags if match else ServerFlags()


def inferencex_dp_attention(model: str, gemm_quant: str | None, tp: int, concurrency: int, source: str) -> bool:
    """Whether the row ran InferenceX's `{tp: 2, ep: 2, dp-attn: true}` config (minimaxm2.5_fp4
    on B200/B300: `--tensor-parallel-size 1 --data-parallel-size 2 --enable-expert-parallel`):
    from C 512 (from 2026-04-22: C 256) up; below, `{tp: 2, ep: 2}` ran one TP-2 engine."""
    m = _MEASURED.search(source)
    first = 256 if m and m.group(1) >= "2026-04-22" else 512
    return "MiniMax-M2.5" in model and gemm_quant == "nvfp4" and tp == 2 and concurrency >= first


def _version(v: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", v or "")
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def vllm_defaults(gpu_bytes: int, backend_version: str = "") -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) vLLM's API server picks for a GPU of this size:
    16384 tokens at >= 160 GiB (B200, B300) only from vLLM 0.28 (the tier it added; before it,
    and for every row of the sample, measured with 0.10-0.19: 8192), 8192 at >= 70 GiB, else
    2048 tokens and 256 sequences. An unknown version is taken as a current one."""
    current = _version(backend_version) >= (0, 28) or not backend_version[:1].isdigit()
    if gpu_bytes >= 160 * GIB and current:
        return 1024, 16384
    if gpu_bytes >= 70 * GIB:
        return 1024, 8192
    return 256, 2048


def async_scheduling(flags: ServerFlags, backend_version: str) -> bool:
    """Whether the row's engine ran async scheduling: the script's `--async-scheduling`, else
    vLLM's default of the version that ran (on from 0.14, vllm-project/vllm#27614; a nightly
    image of the sample is a 2026 build). An unknown version is taken as a current one."""
    if flags.async_scheduling is not None:
        return flags.async_scheduling
    v = backend_version or ""
    return not v[:1].isdigit() or _version(v) >= (0, 14)


def scheduler_limits(flags: ServerFlags, gpu_bytes: int, backend_version: str,
                     concurrency: int) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) of the row's server."""
    seqs, budget = vllm_defaults(gpu_bytes, backend_version)
    if flags.max_num_batched_tokens:
        budget = flags.max_num_batched_tokens
    if flags.max_num_seqs:
        seqs = flags.max_num_seqs
    elif flags.max_num_seqs_is_concurrency:
        seqs = concurrency
    return seqs, budget
