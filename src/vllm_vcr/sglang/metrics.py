"""`/metrics` of an SGLang engine (`--engine-type sglang`): SGLang's `sglang:` series instead of vLLM's.

The values are the ones `FrontendMetrics` derives from engine outputs; only the exposition differs.
Names, meanings and labels follow SGLang's two collectors:

- `SchedulerMetricsCollector` (the scheduler's gauges, `num_retracted_reqs`, `queue_time_seconds`):
  `model_name`, `engine_type`, `tp_rank`, `pp_rank`, `moe_ep_rank`;
- `TokenizerMetricsCollector` (token and request counters, TTFT / ITL / TPOT / E2E histograms):
  `model_name`, `engine_type`.

`engine_type` is SGLang's name for the disaggregation mode: `prefill`, `decode`, or `unified` for
an aggregated worker (`--worker-type`). One simulated scheduler has tensor, pipeline and expert
parallel rank 0; like Dynamo's mocker, the per-rank values are summed over DP ranks (so there is
no `dp_rank` label).
"""

from __future__ import annotations

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..vllm.exposition import exact
from ..vllm.metrics import FINISH_REASONS, FrontendMetrics

SCHEDULER, TOKENIZER = "scheduler", "tokenizer"  # which SGLang collector exports a series
# (engine-state histogram attribute, sglang name, help, collector)
SGLANG_HISTOGRAMS = (
    ("ttft", "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TOKENIZER),
    ("itl", "sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TOKENIZER),
    ("tpot", "sglang:time_per_output_token_seconds", "Histogram of time per output token in seconds.", TOKENIZER),
    ("e2e", "sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", TOKENIZER),
    ("queue", "sglang:queue_time_seconds", "Histogram of queueing time in seconds.", SCHEDULER),
)
# SGLang's DisaggregationMode.to_engine_type, from --worker-type
ENGINE_TYPE_LABEL = {"prefill": "prefill", "decode": "decode", "aggregated": "unified"}
_ABORT = FINISH_REASONS.index("abort")


def sglang_labels(model_name: str, worker_type: str) -> dict[str, tuple[list[str], list[str]]]:
    """Per collector, (label names, label values) as SGLang sets them."""
    engine_type = ENGINE_TYPE_LABEL.get(worker_type, "unified")
    return {
        SCHEDULER: (["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"],
                    [model_name, engine_type, "0", "0", "0"]),
        TOKENIZER: (["model_name", "engine_type"], [model_name, engine_type]),
    }


class SGLangFrontendMetrics(FrontendMetrics):
    """FrontendMetrics exposed under SGLang's names."""

    def families(self):
        """A family whose values are unchanged since the last scrape is the same object (FamilyMemo)."""
        by_collector = sglang_labels(self.model_name, self.worker_type)
        self.fold()
        engines = self._engines
        memo = self  # self.get: the memo, with the family rewrite (scripted gauges) when one is set
        created = self._created
        shape = (self.model_name, self.worker_type, len(engines), exact(created))  # in every key

        def total(attr: str) -> float:
            return sum(getattr(e, attr) for e in engines)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:  # all the scheduler's
            def build():
                labels, lv = by_collector[SCHEDULER]
                fam = GaugeMetricFamily(name, doc, labels=labels)
                fam.add_metric(lv, value)
                return fam

            return memo.get(name, (shape, exact(value)), build)

        def counter(name: str, doc: str, value: float, collector: str = TOKENIZER) -> CounterMetricFamily:
            def build():
                labels, lv = by_collector[collector]
                fam = CounterMetricFamily(name, doc, labels=labels)
                fam.add_metric(lv, value, created=created)
                return fam

            return memo.get(name, (shape, exact(value)), build)

        queries, hits = total("prefix_queries"), total("prefix_hits")
        yield gauge("sglang:num_running_reqs", "The number of running requests.", total("running"))
        yield gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.",
                    total("waiting") + total("waiting_deferred"))
        yield gauge("sglang:token_usage", "The token usage.",
                    sum(e.kv_usage for e in engines) / max(len(engines), 1))

        # the KV pool's shape, as SGLang's scheduler exports it (an info gauge: value 1, the facts in
        # labels); the Inference Extension's endpoint picker reads page_size / num_pages from it
        def info():
            sched_labels, sched_lv = by_collector[SCHEDULER]
            fam = GaugeMetricFamily("sglang:cache_config_info", "Information of the KV cache configuration.",
                                    labels=[*sched_labels, "page_size", "num_pages"])
            fam.add_metric([*sched_lv, self._cache_info["block_size"], self._cache_info["num_gpu_blocks"]], 1.0)
            return fam

        yield memo.get("sglang:cache_config_info",
                       (shape, self._cache_info["block_size"], self._cache_info["num_gpu_blocks"]), info)
        yield gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", hits / queries if queries else 0.0)
        yield counter("sglang:prompt_tokens", "Number of prefill tokens processed.", total("prompt_tokens"))
        yield counter("sglang:generation_tokens", "Number of generation tokens processed.",
                      total("generation_tokens"))
        yield counter("sglang:cached_tokens", "Number of cached prompt tokens.", hits)
        finished = [sum(e.success[i] for e in engines) for i in range(len(FINISH_REASONS))]
        yield counter("sglang:num_requests", "Number of requests processed.", sum(finished))
        yield counter("sglang:num_aborted_requests", "Number of requests aborted.", finished[_ABORT])
        yield counter("sglang:num_retracted_reqs", "The number of retracted requests.",
                      sum(e.preemptions or e.preemptions_from_stats for e in engines), SCHEDULER)
        for attr, name, doc, collector in SGLANG_HISTOGRAMS:
            labels, lv = by_collector[collector]
            hists = [getattr(e, "h_" + attr) for e in engines]
            yield memo.get(name, (shape, *[(exact(h.total), *h.counts) for h in hists]),
                           lambda name=name, doc=doc, labels=labels, lv=lv, hists=hists:
                           _summed_histogram(name, doc, labels, lv, hists))


def _summed_histogram(name: str, doc: str, labels: list[str], lv: list[str], hists: list) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, doc, labels=labels)
    buckets = None
    for h in hists:
        cum = h.cumulative()
        buckets = cum if buckets is None else [(b, acc + c) for (b, acc), (_, c) in zip(buckets, cum)]
    fam.add_metric(lv, buckets or [("+Inf", 0)], sum(h.total for h in hists))
    return fam
