"""The deployments InferenceX's multi-node disaggregated SGLang recipes ran, for the sample's rows
whose columns do not describe them.

InferenceX's dashboard exports in aiconfigurator-core's `silicon_sample.csv`
(`source_file=2026-03-25.csv`, `source_file=2026-04-06.csv`) record, per side, the GPUs of one
worker as `tp` and the prefill side's expert parallelism as `ep` (the decode side's `ep` repeats it),
and neither the number of workers nor attention data parallelism: a decode worker of 32 GPUs
running DP attention with 32-way expert parallelism ("DEP32") behind five prefill workers of DEP8
reads as one TP-32 decode worker behind one TP-8 prefill worker, and four TP-4 decode workers as
one. The same measurements in the sample's database dump (`db-dump/...`, worker counts and
attention DP given) confirm that reading.

The table is InferenceX's `.github/configs/nvidia-master.yaml` (github.com/SemiAnalysisAI/InferenceX)
at the rows' measurement dates, February 2026, its DeepSeek-R1 `dynamo-sglang` entries without
speculative decoding: for each ISL/OSL a list of search-space points, each a list of
concurrencies and the two sides' worker count, GPUs per worker, DP attention and expert
parallelism. A row takes a recipe's deployment when every point that matches its GPU, precision,
lengths, prefill GPUs and EP, decode GPUs and concurrency agrees on it; otherwise (no point, or
points that differ: a configuration benchmarked in two shapes at one concurrency) the row keeps
its columns.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Side:
    workers: int
    gpus: int  # per worker
    dp_attention: bool
    ep: int

    @property
    def tp(self) -> int:
        return 1 if self.dp_attention else self.gpus

    @property
    def attention_dp(self) -> int:
        return self.gpus if self.dp_attention else 1

    @property
    def moe_tp(self) -> int:
        return max(self.gpus // self.ep, 1)


@dataclass(frozen=True)
class Point:
    concurrencies: tuple[int, ...]
    prefill: Side
    decode: Side


def _p(conc, pw, pg, pdp, pep, dw, dg, ddp, dep) -> Point:
    return Point(tuple(conc), Side(pw, pg, bool(pdp), pep), Side(dw, dg, bool(ddp), dep))


# (gpu, precision label, isl, osl) -> search-space points (DeepSeek-R1, dynamo-sglang, no MTP)
RECIPES: dict[tuple[str, str, int, int], tuple[Point, ...]] = {
    # dsr1-fp8-gb300-dynamo-sglang (lmsysorg/sglang:v0.5.8.post1-cu130)
    ("gb300", "fp8", 1024, 1024): (
        _p((4, 8, 16, 32), 1, 4, 0, 1, 4, 4, 0, 1),
        _p((1024, 2048, 4096, 6144), 2, 8, 1, 8, 1, 32, 1, 32),
        _p((4096, 7168, 7680), 1, 8, 1, 8, 1, 8, 1, 8)),
    ("gb300", "fp8", 8192, 1024): (
        _p((4, 8), 1, 4, 0, 1, 1, 4, 0, 1),
        _p((128, 256, 512, 1024), 5, 8, 1, 8, 1, 32, 1, 32),
        _p((2048, 4096), 6, 8, 1, 8, 1, 24, 1, 24)),
    # dsr1-fp8-gb200-dynamo-sglang (v0.5.8.post1-cu130)
    ("gb200", "fp8", 1024, 1024): (
        _p((4, 8), 1, 4, 0, 1, 1, 4, 0, 1),
        _p((1024, 2048, 4096), 3, 8, 1, 8, 1, 48, 1, 48),
        _p((1024, 2048, 4096, 6144), 2, 8, 1, 8, 1, 32, 1, 32),
        _p((4096,), 1, 8, 1, 8, 1, 8, 1, 8)),
    ("gb200", "fp8", 8192, 1024): (
        _p((4, 8, 16), 1, 8, 0, 1, 1, 8, 0, 1),
        _p((512, 1024, 2048, 6144), 5, 8, 1, 8, 1, 32, 1, 32),
        _p((2048, 4096, 6144), 6, 8, 1, 8, 1, 24, 1, 24)),
    # dsr1-fp4-gb200-dynamo-sglang (v0.5.8-cu130)
    ("gb200", "nvfp4", 1024, 1024): (
        _p((4, 8, 32), 1, 4, 0, 1, 2, 4, 0, 1),
        _p((512, 2048, 4096, 8192), 4, 4, 1, 4, 1, 32, 1, 32),
        _p((2048, 4096), 4, 4, 1, 4, 1, 48, 1, 48)),
    ("gb200", "nvfp4", 8192, 1024): (
        _p((4, 8), 1, 4, 0, 1, 4, 4, 0, 1),
        _p((512, 2048, 4096), 6, 4, 0, 1, 1, 48, 1, 48),
        _p((2048,), 10, 4, 0, 1, 1, 32, 1, 32)),
    # dsr1-fp4-gb300-dynamo-sglang (v0.5.8.post1-cu130-runtime)
    ("gb300", "nvfp4", 1024, 1024): (
        _p((4, 8, 32), 1, 4, 0, 1, 2, 4, 0, 1),
        _p((512, 2048, 4096, 8192), 4, 4, 1, 4, 1, 32, 1, 32),
        _p((512, 2048, 4096, 8192), 4, 4, 1, 4, 1, 48, 1, 48)),
    ("gb300", "nvfp4", 8192, 1024): (
        _p((4, 8, 32, 64), 1, 4, 0, 1, 4, 4, 0, 1),
        _p((512, 2048, 4096), 6, 4, 0, 1, 1, 48, 1, 48),
        _p((2048,), 10, 4, 0, 1, 1, 32, 1, 32)),
    # dsr1-fp8-b200-dynamo-sglang (v0.5.8.post1-cu130-amd64): February's points (prefill EP 8),
    # and March's 8k/1k points (prefill DP attention without expert parallelism: EP 1)
    ("b200_sxm", "fp8", 1024, 1024): (
        _p((4,), 1, 8, 0, 8, 1, 8, 0, 8),
        _p((16, 32, 64, 128, 256), 1, 8, 0, 8, 3, 8, 0, 8),
        _p((1024, 2048, 4096), 1, 8, 1, 8, 5, 8, 1, 8),
        _p((2048, 4096), 2, 8, 1, 8, 5, 8, 1, 8)),
    ("b200_sxm", "fp8", 8192, 1024): (
        _p((4, 32, 64, 512), 1, 8, 0, 8, 1, 8, 0, 8),
        _p((64, 512), 1, 8, 0, 8, 4, 8, 0, 8),
        _p((32,), 1, 8, 0, 8, 6, 8, 0, 8),
        _p((128, 512, 1024), 1, 8, 1, 8, 1, 8, 1, 8),
        _p((256, 512, 1024), 2, 8, 1, 8, 1, 8, 1, 8),
        _p((128,), 1, 8, 1, 1, 3, 8, 0, 1),
        _p((128,), 1, 8, 1, 1, 4, 8, 0, 1),
        _p((8, 16, 32, 64, 128), 1, 8, 1, 1, 6, 8, 0, 1),
        _p((288,), 1, 8, 1, 1, 2, 8, 1, 8),
        _p((160, 288), 1, 8, 1, 1, 1, 8, 1, 8),
        _p((512,), 2, 8, 1, 1, 1, 8, 1, 8),
        _p((1024,), 3, 8, 1, 1, 1, 8, 1, 8)),
    # dsr1-fp8-h200-dynamo-sglang (v0.5.8.post1-cu130)
    ("h200_sxm", "fp8", 1024, 1024): (
        _p((1, 4, 8, 16, 32, 64, 128, 256), 1, 8, 0, 1, 9, 8, 0, 1),
        _p((512, 1024, 2048), 1, 8, 0, 1, 6, 8, 0, 1),
        _p((128, 256, 512, 1024, 2048), 1, 8, 1, 8, 6, 8, 1, 8)),
    ("h200_sxm", "fp8", 8192, 1024): (
        _p((1, 4, 8), 1, 8, 0, 1, 7, 8, 0, 1),
        _p((4, 8, 16), 1, 8, 0, 1, 6, 8, 0, 1),
        _p((8, 16, 32), 1, 8, 0, 1, 3, 8, 0, 1),
        _p((32, 64, 128), 2, 8, 0, 1, 3, 8, 0, 1),
        _p((64, 128, 256), 1, 8, 0, 1, 1, 8, 1, 8)),
    # dsr1-fp4-b200-dynamo-sglang (v0.5.8.post1-cu130-runtime)
    ("b200_sxm", "nvfp4", 1024, 1024): (
        _p((16, 128), 1, 4, 1, 4, 5, 8, 0, 8),
        _p((32, 64, 256), 1, 4, 1, 4, 6, 8, 0, 8),
        _p((512,), 1, 4, 1, 4, 1, 8, 1, 8),
        _p((512,), 1, 4, 1, 4, 2, 8, 1, 8)),
    ("b200_sxm", "nvfp4", 8192, 1024): (
        _p((64, 128), 1, 4, 1, 4, 1, 8, 0, 8),
        _p((8,), 1, 4, 1, 4, 5, 8, 0, 8),
        _p((4, 128), 2, 4, 1, 4, 5, 8, 0, 8),
        _p((4, 8, 16, 64), 1, 4, 0, 1, 1, 8, 0, 1),
        _p((1024, 2048), 7, 4, 1, 4, 2, 8, 1, 8)),
}

DASHBOARD_SOURCES = ("source_file=2026-03-25.csv", "source_file=2026-04-06.csv")


def recipe_point(source: str, model: str, gpu: str, label: str, isl: int, osl: int, concurrency: int,
                 prefill_gpus: int, prefill_ep: int, decode_gpus: int) -> Point | None:
    """The recipe point a dashboard row of DeepSeek-R1/V3 ran (one GPU count per worker per side and
    the prefill side's EP, as the export records them), or None when the recipes do not say which."""
    if not source.startswith(DASHBOARD_SOURCES) or "DeepSeek-" not in model:
        return None
    found = {p for p in RECIPES.get((gpu, label, isl, osl), ())
             if concurrency in p.concurrencies and p.prefill.gpus == prefill_gpus and p.prefill.ep == prefill_ep
             and p.decode.gpus == decode_gpus}
    shapes = {(p.prefill, p.decode) for p in found}
    if len(shapes) != 1:
        return None
    return next(iter(found))
