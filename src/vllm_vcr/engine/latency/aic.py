"""The GPU perf model's step times: a step priced from its composition by a compiled estimator
of NVIDIA AIConfigurator (aiconfigurator-core; compiled and handed in by vllm_vcr.perf.aic, so
nothing here imports it or reads a file).

A step's time is composed the way the estimator composes a mixed chunked-prefill iteration, but
from the step's actual contents rather than one static batch:

- the shared non-attention work (GEMMs, norms, communication) over every token of the step
  (prefill chunk tokens + one per decode);
- context attention of each prefill chunk over its own context (the chunk plus the tokens
  already computed: earlier chunks and prefix-cache hits), for the step's mean chunk;
- decode attention of the decodes over their mean context length.

A decode-only step is the estimator's own generation step, plus the GPU work its kernel data
leaves out (`unpriced_gpu_ms` per step, worked out from the model by vllm_vcr.perf: e.g. the
QK norm of Qwen3 and MiniMax-M2 attention, which the estimator's op list has no entry for).
On top of the GPU time, every step
has the engine's host time (`step_overhead_ms`; a per-sequence share can be set too): scheduling,
input preparation, sampling, output processing. Without async scheduling the host and the GPU
take turns, so a step lasts their sum. With vLLM's async scheduling (`--async-scheduling`, on
by default from vLLM 0.14) the host schedules and prepares step n+1 while step n runs on the
GPU, so a step lasts max(GPU time, host time) plus the part that cannot overlap
(`async_exposed_ms`: handing step n's sampled tokens back to step n+1's inputs); and since step
n+1 is scheduled before step n's outputs are processed (and new requests read: vLLM's
`step_with_batch_queue`), a request reaching the engine core during step n waits for step n+1
to end and is prefilled in step n+2 (`schedules_ahead`, engine/step.py).

A step vLLM runs without CUDA graphs (more tokens than the deployment's capture size, a step
with a prefill under `FULL_DECODE_ONLY`, every step under `NONE`; vllm_vcr.perf.cuda_graphs)
launches every kernel from the CPU: `eager_step_ms` more, on the GPU's critical path (the GPU
waits for the launches), so async scheduling does not hide it.
"""

from __future__ import annotations

import random
from typing import Any

from .base import LatencyModel, RequestPacing, StepBatch, zero_pacing

_CTX_QUANTUM = 16  # contexts are priced to this many tokens (memoised lookups)


def _q(n: float) -> int:
    """A context length rounded to the memo quantum (at least 1)."""
    return max(int(n + _CTX_QUANTUM / 2) // _CTX_QUANTUM * _CTX_QUANTUM, 1)


class StepPricer:
    """Milliseconds of GPU time for one step's composition (memoised: steps repeat a lot)."""

    def __init__(self, handle: Any) -> None:
        self._h = handle
        self._memo: dict[tuple, float] = {}

    def gpu_ms(self, num_decodes: int, decode_context: int, num_prefills: int, prefill_tokens: int,
               prefill_context: int) -> float:
        """`decode_context`: the decodes' summed lengths; `prefill_context`: tokens computed before
        this step's chunks (earlier chunks and prefix hits), summed over the prefills."""
        dec_ctx = _q(decode_context / num_decodes) if num_decodes else 0
        key: tuple[int, ...]
        if not prefill_tokens:
            if not num_decodes:
                return 0.0
            key = (num_decodes, dec_ctx)
        else:
            p = max(num_prefills, 1)
            key = (num_decodes, dec_ctx, p, prefill_tokens, _q(prefill_context / p))
        ms = self._memo.get(key)
        if ms is None:
            ms = self._memo[key] = self._price(*key)
        return ms

    def _price(self, num_decodes: int, dec_ctx: int, prefills: int = 0, tokens: int = 0, prefix: int = 0) -> float:
        h = self._h
        if not tokens:
            return h.decode_step_latency(num_decodes, dec_ctx, 2)
        # shared non-attention work over all the step's tokens, and the decodes' attention
        _, shared, _, dec_attn = h.mixed_step_breakdown(tokens, num_decodes, max(dec_ctx, 1), 2, 0)
        # one chunk's attention over its context: chunk tokens = isl - prefix, priced unchunked
        chunk = max(tokens // prefills, 1)
        isl = prefix + chunk
        _, _, ctx_attn, _ = h.mixed_step_breakdown(isl, 0, isl, 2, prefix)
        return shared + dec_attn + prefills * ctx_attn


def overlapped_step_ms(gpu_ms: float, host_ms: float, exposed_ms: float) -> float:
    """A step under async scheduling: the host's work for the next step hides behind the GPU's
    (or the GPU waits for the host), plus the part that cannot overlap."""
    return max(gpu_ms, host_ms) + exposed_ms


class AicStepLatency(LatencyModel):
    """`--perf-model aic`: every step timed from what it computes (the timing interface's step
    durations; requests have no pacing of their own)."""

    times_steps = True

    def __init__(self, pricer: StepPricer, *, step_overhead_ms: float = 0.0, per_seq_overhead_ms: float = 0.0,
                 async_scheduling: bool = False, async_exposed_ms: float = 0.0, unpriced_gpu_ms: float = 0.0,
                 frontend_ms: float = 0.0, frontend_ms_per_1k_tokens: float = 0.0,
                 frontend_ms_per_request: float = 0.0, time_scale: float = 1.0, moe: bool = False,
                 eager_step_ms: float = 0.0, graph_capture_size: int | None = None,
                 graph_mode: str = "FULL_AND_PIECEWISE") -> None:
        self.pricer = pricer
        self.eager_step_ms = eager_step_ms
        self.graph_capture_size = graph_capture_size  # None: not known, every step as if graphed
        self.graph_mode = graph_mode
        self.data_parallel_lockstep = moe
        self.frontend_ms = frontend_ms
        self.frontend_ms_per_1k_tokens = frontend_ms_per_1k_tokens
        self.frontend_ms_per_request = frontend_ms_per_request
        self.unpriced_gpu_ms = unpriced_gpu_ms
        self.step_overhead_ms = step_overhead_ms
        self.per_seq_overhead_ms = per_seq_overhead_ms
        self.async_scheduling = async_scheduling
        self.async_exposed_ms = async_exposed_ms
        self.schedules_ahead = async_scheduling
        self._scale = 1e-3 / time_scale

    def step_ms(self, batch: StepBatch) -> float:
        gpu = self.pricer.gpu_ms(batch.num_decodes, batch.decode_context, batch.num_prefills,
                                 batch.num_prefill_tokens, batch.prefill_context)
        if gpu:
            gpu += self.unpriced_gpu_ms
            if self.eager_step_ms and self.runs_eager(batch):
                gpu += self.eager_step_ms
        host = self.step_overhead_ms + self.per_seq_overhead_ms * (batch.num_decodes + batch.num_prefills)
        return overlapped_step_ms(gpu, host, self.async_exposed_ms) if self.async_scheduling else gpu + host

    def runs_eager(self, batch: StepBatch) -> bool:
        """Whether vLLM runs this step without CUDA graphs (vllm_vcr.perf.cuda_graphs)."""
        if self.graph_capture_size is None:
            return False
        mode = self.graph_mode
        if mode == "NONE":
            return True
        if mode == "FULL_DECODE_ONLY" and batch.num_prefill_tokens:
            return True
        return batch.num_prefill_tokens + batch.num_decodes > self.graph_capture_size

    def step_duration(self, batch: StepBatch, rng: random.Random) -> float:
        return self.step_ms(batch) * self._scale

    def frontend_delay(self, num_prompt_tokens: int, num_in_flight: int) -> float:
        ms = (self.frontend_ms + self.frontend_ms_per_1k_tokens * num_prompt_tokens / 1000
              + self.frontend_ms_per_request * num_in_flight)
        return ms * self._scale

    def pacing(self, num_prompt_tokens: int, num_cached_tokens: int, num_running: int,
               rng: random.Random) -> RequestPacing:
        return zero_pacing(rng)


