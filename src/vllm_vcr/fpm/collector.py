"""Turn an engine step (a `StepRecord` from `EngineCore.add_step_observer`) into an FPM record."""

from __future__ import annotations

from typing import Any, Callable

from .record import ForwardPassMetrics, QueuedRequestMetrics, ScheduledRequestMetrics, count_sum_var


def scheduled_metrics(batch: Any) -> ScheduledRequestMetrics:
    chunks = getattr(batch, "prefill_chunk_lens", ())
    _, _, prefill_var = count_sum_var(chunks)
    n_dec, sum_dec, var_dec = count_sum_var(batch.decode_context_lens)
    return ScheduledRequestMetrics(
        num_prefill_requests=batch.num_prefills, sum_prefill_tokens=batch.num_prefill_tokens,
        var_prefill_length=prefill_var, sum_prefill_kv_tokens=batch.prefill_context,
        num_decode_requests=batch.num_decodes,
        sum_decode_kv_tokens=batch.decode_context if n_dec == 0 else sum_dec, var_decode_kv_tokens=var_dec)


def queued_metrics(waiting: Any) -> QueuedRequestMetrics:
    """Waiting requests: fresh ones are queued prefills, preempted ones (with output) queued decodes."""
    prompts = [r.num_prompt_tokens for r in waiting if not r.output_token_ids]
    contexts = [r.num_tokens for r in waiting if r.output_token_ids]
    n_p, sum_p, var_p = count_sum_var(prompts)
    n_d, sum_d, var_d = count_sum_var(contexts)
    return QueuedRequestMetrics(num_prefill_requests=n_p, sum_prefill_tokens=sum_p, var_prefill_length=var_p,
                                num_decode_requests=n_d, sum_decode_kv_tokens=sum_d, var_decode_kv_tokens=var_d)


class FpmCollector:
    """A step observer for one engine (DP rank): builds the record and hands it to `sinks`."""

    def __init__(self, core: Any, worker_id: str, engine_type: str,
                 sinks: list[Callable[[ForwardPassMetrics], None]]) -> None:
        self.core = core
        self.worker_id = worker_id
        self.engine_type = engine_type
        self.sinks = sinks
        self.counter = 0

    def __call__(self, record: Any) -> None:
        core = self.core
        self.counter += 1
        fpm = ForwardPassMetrics(
            worker_id=self.worker_id, dp_rank=core.engine_index, counter_id=self.counter,
            wall_time=record.duration, scheduled_requests=scheduled_metrics(record.batch),
            queued_requests=queued_metrics(core.scheduler.waiting), step=record.step, start=record.start,
            sim_duration=record.duration, kv_usage=core.block_pool.usage(), engine_type=self.engine_type)
        for sink in self.sinks:
            sink(fpm)
