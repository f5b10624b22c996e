"""Prometheus `/metrics` of the built-in frontend: the `vllm:` series of vLLM's own frontend.

Names, HELP texts, label sets (`model_name`, `engine`, plus `finished_reason` / `reason` /
`source` / `sleep_state` where vLLM has them) and histogram buckets follow vLLM 0.32's
`PrometheusStatLogger`, and the values are derived from engine outputs the way vLLM's
`OutputProcessor` / `IterationStats` derive them (see docs/metrics.md for the table).

Integration (all calls are synchronous, cheap and never raise for unknown request ids)::

    metrics = FrontendMetrics("tiny", engine_count=2, block_size=16, num_gpu_blocks=1024,
                              max_model_len=4096)          # registry=None: a private registry
    engine.add_output_listener(metrics.on_engine_outputs)  # once per engine step

    # per HTTP request, before the engine sees it (arrival_time: time.time() at arrival)
    metrics.on_request_arrival(req_id, arrival_time, n=1, max_tokens=256, num_prompt_tokens=128)
    # optional: a request the frontend finished itself (stop string found by the detokenizer)
    metrics.on_request_finished(req_id, "stop")
    # optional: the client went away (vLLM records nothing for client aborts)
    metrics.on_request_aborted(req_id)

    body = metrics.render_text()                           # GET /metrics: always the text format
    body, content_type = metrics.render(accept_header)     # POST / HEAD /metrics: as Accept asks

* A request's end is detected from its output with `finish_reason` set, as in vLLM; the serve
  layer does not have to report it. `on_request_finished` only matters when the frontend ends a
  request the engine did not (it is a no-op for a request already finished).
* `on_request_arrival` is what gives TTFT and e2e latency their frontend start time and what
  feeds `request_params_n` / `request_params_max_tokens`. A request that shows up in
  outputs without it is still tracked: its arrival is taken from its QUEUED event, its prompt
  length from `prefill_stats`, and its max_tokens is unknown.
* With `n > 1`, pass each child's id with `parent_id=<the parent's id>` and the same `n`;
  `request_params_n` and `request_max_num_generation_tokens` are observed once, when the last
  child finishes (vLLM's ParentRequest rule).
* Engine-side preemptions are counted from PREEMPTED events; an engine that sends none but
  fills `SchedulerStats.num_preemptions` is counted from that instead (never both).
* `set_sleep_state(engine_index, level)` drives `vllm:engine_sleep_state` (0 = awake).

Cost: one pass over `outputs.outputs` per engine message with a handful of attribute updates
per output; histograms are plain Python lists turned into prometheus families only in
`render()`, so no prometheus_client locks or objects sit on the per-token path. A finished
request's dozen observations are one kept row, folded into the histograms in bulk (`fold`) before
any read and every `FOLD_AT` rows: the same counts and sums as observing each on its own. A scrape rebuilds
only the families whose values changed since the last one (exposition.FamilyMemo) and renders
the text with exposition.TextExposition: generate_latest's bytes, at a tenth of its cost.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from functools import partial, reduce
from itertools import repeat
from operator import add, is_not
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.openmetrics.exposition import UNDERSCORES
from prometheus_client.samples import Sample

from ..engine.types import EngineCoreEventType, EngineCoreOutputs, FinishReason
from ..http.serving_base import REQUEST_METRICS_FIELDS
from .exposition import FamilyMemo, TextExposition, exact

__all__ = ["FrontendMetrics", "build_1_2_5_buckets"]

# ------------------------------------------------------------------ bucket families (vLLM 0.32)

REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to and including max_value (vLLM's request-token buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # FinishReason order, str() form
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
WAITING_REASONS = ("capacity", "deferred")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")  # vllm:admission_rejections
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


class Histogram:
    """A histogram as two plain lists: observe() is one bisect and two additions (`created`: the
    time its family's `_created` sample reports, where it has one)."""

    __slots__ = ("bounds", "counts", "total", "created")

    def __init__(self, bounds: Iterable[float], created: float = 0.0):
        self.bounds = [float(b) for b in bounds]
        self.counts = [0] * (len(self.bounds) + 1)  # last slot: above every bound (+Inf only)
        self.total = 0.0
        self.created = created

    def observe(self, v: float) -> None:
        # bisect_left finds the first bound >= v, i.e. the `le` bucket Prometheus puts v in
        self.counts[bisect_left(self.bounds, v)] += 1
        self.total += v

    def observe_all(self, values: Sequence[float]) -> None:
        """observe(v) for each of `values` in order, its loops in C: the same bisect per value and
        the same additions in the same order, so the same counts and total."""
        counts = self.counts
        for i, c in Counter(map(bisect_left, repeat(self.bounds), values)).items():
            counts[i] += c
        self.total = reduce(add, values, self.total)

    def cumulative(self) -> list[tuple[str, float]]:
        out, acc = [], 0
        for b, c in zip(self.bounds, self.counts):
            acc += c
            out.append((_fmt_bound(b), acc))
        out.append(("+Inf", acc + self.counts[-1]))
        return out


def _fmt_bound(b: float) -> str:
    # prometheus_client renders bucket bounds with repr(float(b)): "1.0", "0.005", "2560.0"
    return repr(float(b))


# (attribute, metric name, help, bucket family); bucket family "tokens" = 1-2-5 up to max_model_len
_HISTOGRAMS = (
    ("prompt_tokens", "vllm:request_prompt_tokens", "Number of prefill tokens processed.", "tokens"),
    ("generation_tokens", "vllm:request_generation_tokens", "Number of generation tokens processed.", "tokens"),
    ("iteration_tokens", "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
     ITERATION_TOKENS_BUCKETS),
    ("max_num_generation_tokens", "vllm:request_max_num_generation_tokens",
     "Histogram of maximum number of requested generation tokens.", "tokens"),
    ("params_n", "vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS),
    ("params_max_tokens", "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
     "tokens"),
    ("ttft", "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    ("itl", "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    ("tpot", "vllm:request_time_per_output_token_seconds",
     "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS),
    ("e2e", "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
     REQUEST_LATENCY_BUCKETS),
    ("queue", "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
     REQUEST_LATENCY_BUCKETS),
    ("inference", "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
     REQUEST_LATENCY_BUCKETS),
    ("prefill", "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
     REQUEST_LATENCY_BUCKETS),
    ("decode", "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
     REQUEST_LATENCY_BUCKETS),
    ("num_preemptions", "vllm:request_num_preemptions",
     "Histogram of the number of times a request was preempted.", NUM_PREEMPTIONS_BUCKETS),
    ("prefill_kv_computed", "vllm:request_prefill_kv_computed_tokens",
     "Histogram of new KV tokens computed during prefill (excluding cached tokens).", "tokens"),
)

# plain per-engine counters: (attribute, metric name without _total, help)
_COUNTERS = (
    ("prefix_queries", "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    ("prefix_hits", "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    ("ext_prefix_queries", "vllm:external_prefix_cache_queries",
     "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
     "queried tokens."),
    ("ext_prefix_hits", "vllm:external_prefix_cache_hits",
     "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
     "cached tokens."),
    ("mm_queries", "vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items."),
    ("mm_hits", "vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items."),
    ("preemptions", "vllm:num_preemptions", "Cumulative number of preemption from the engine."),
    ("prompt_tokens", "vllm:prompt_tokens", "Number of prefill tokens processed."),
)


class _Engine:
    """Everything one engine index contributes; plain attributes, no locks (one event loop)."""

    def __init__(self, token_buckets: list[int]):
        self.running = 0
        self.waiting = 0
        self.waiting_deferred = 0
        self.kv_usage = 0.0
        self.sleep_state = (1, 0, 0)  # awake, weights_offloaded, discard_all
        for attr, _, _ in _COUNTERS:
            setattr(self, attr, 0)
        self.preemptions_from_stats = 0
        self.by_source = [0, 0, 0]  # PROMPT_SOURCES order
        self.prompt_cached = 0
        self.cached_by_source = dict.fromkeys(CACHE_HIT_SOURCES, 0)
        self.generation_tokens = 0
        self.tokens_taken = 0  # since the last batch (FrontendMetrics.token_observer)
        self.success = [0] * len(FINISH_REASONS)
        for attr, _, _, fam in _HISTOGRAMS:
            setattr(self, "h_" + attr, Histogram(token_buckets if fam == "tokens" else fam))
        # what finished requests observe, one row each (FrontendMetrics._finish), folded into the
        # histograms in bulk before a scrape reads them and whenever FOLD_AT rows wait
        self.finished: list[tuple] = []
        self.finish_hists = tuple(getattr(self, "h_" + attr) for attr in _FINISH_COLUMNS)


# the histograms a finished request observes, in the order of its row (FrontendMetrics._finish);
# the last three only with a value (not None)
_FINISH_COLUMNS = ("e2e", "queue", "prefill", "inference", "decode", "num_preemptions", "prefill_kv_computed",
                   "prompt_tokens", "generation_tokens", "tpot", "params_max_tokens", "params_n",
                   "max_num_generation_tokens")
_OPTIONAL_FROM = 10
_is_value = partial(is_not, None)


def fold_finished(eng: _Engine) -> None:
    """Observe the waiting finished-request rows into `eng`'s histograms (row by row, as each
    request's own observations would have been)."""
    rows = eng.finished
    if not rows:
        return
    eng.finished = []
    for i, (h, col) in enumerate(zip(eng.finish_hists, zip(*rows))):
        h.observe_all(col if i < _OPTIONAL_FROM else list(filter(_is_value, col)))


class TakenTokens:
    """What `token_observer` counts, for the members of one steady batch at once (the engine's
    steady_batch.py): each step of the batch is one token for each member whose reader took it,
    and its inter-token latency is the same for every member that was in the batch's previous
    step, so a step costs one histogram observation (plus one per member new since then). A
    member's own record (last token time, token count) is brought up to date when it leaves."""

    __slots__ = ("eng", "records", "gen0", "fresh", "steps", "last_ts")

    def __init__(self, eng: _Engine) -> None:
        self.eng = eng
        self.records: list[_Req | None] = []  # None: brought up to date already (its token was declined)
        self.gen0: list[int] = []  # a member's token count is gen0 + steps
        self.fresh: list[_Req] = []  # members added since the last step (their last token was their own)
        self.steps = 0
        self.last_ts = 0.0

    def add(self, observer: Any) -> None:
        r = observer.record
        self.records.append(r)
        self.gen0.append(r.num_gen - self.steps)
        self.fresh.append(r)

    def _settle(self, i: int) -> None:
        r = self.records[i]
        if r is None:
            return
        self.records[i] = None
        if r in self.fresh:
            self.fresh.remove(r)  # it has had no step here: its record is current
        else:
            r.num_gen = self.gen0[i] + self.steps
            r.last_ts = self.last_ts

    def drop(self, index: int) -> None:
        self._settle(index)
        del self.records[index], self.gen0[index]

    def observe(self, ts: float, declined: list[int] | None) -> None:
        taken = len(self.records)
        if declined:  # (their token goes out as an output, which on_engine_outputs counts)
            for i in declined:
                self._settle(i)
            taken -= len(declined)
        h = self.eng.h_itl
        counts, bounds = h.counts, h.bounds
        stable = taken - len(self.fresh)
        if stable:
            d = ts - self.last_ts
            counts[bisect_left(bounds, d)] += stable
            h.total += d * stable
        for r in self.fresh:
            d = ts - r.last_ts
            counts[bisect_left(bounds, d)] += 1
            h.total += d
        self.fresh.clear()
        self.steps += 1
        self.last_ts = ts
        self.eng.tokens_taken += taken


class _Req:
    """Per-request state between arrival and finish (vLLM's RequestStateStats + a bit of RequestState)."""

    __slots__ = ("arrival", "n", "max_tokens", "prompt_len", "parent", "prefilling", "num_gen",
                 "num_preempt", "num_cached", "queued_ts", "scheduled_ts", "first_ts", "last_ts", "engine",
                 "frontend_finishes")

    def __init__(self, arrival: float, n: int, max_tokens: int | None, prompt_len: int | None,
                 parent: str | None, frontend_finishes: bool = False):
        # stop strings: the frontend's detokenizer decides how the request ended, not the engine
        self.frontend_finishes = frontend_finishes
        self.arrival = arrival
        self.n = n
        self.max_tokens = max_tokens
        self.prompt_len = prompt_len
        self.parent = parent
        self.prefilling = True
        self.num_gen = 0
        self.num_preempt = 0
        self.num_cached = 0
        self.queued_ts = 0.0
        self.scheduled_ts = 0.0
        self.first_ts = 0.0
        self.last_ts = 0.0
        self.engine = 0


class _Parent:
    __slots__ = ("n", "remaining", "max_gen")

    def __init__(self, n: int):
        self.n = n
        self.remaining = n
        self.max_gen = 0


_QUEUED = int(EngineCoreEventType.QUEUED)
_SCHEDULED = int(EngineCoreEventType.SCHEDULED)
_PREEMPTED = int(EngineCoreEventType.PREEMPTED)
_REASON_INDEX = {r: i for i, r in enumerate(FINISH_REASONS)}


TOOL_PARSER_MODES = ("streaming", "non_streaming")
TOOL_PARSER_OUTCOMES = ("tool_call", "no_tool_call")
TOOL_PARSER_REQUEST_TYPES = ("chat_completions", "responses", "other")


class FrontendMetrics:
    """vLLM-compatible frontend metrics fed from EngineCoreOutputs. See the module docstring."""

    # vLLM's GET /metrics is the instrumentator's route: the text format whatever Accept says
    GET_IGNORES_ACCEPT = True
    http: Any = None  # the http_* series (http_metrics.HttpMetrics), when serve counts them
    tool_parser_invocations: dict[tuple[str, str, str], int] | None = None
    first_engine = 0  # the `engine` label of engine 0 (serve --data-parallel-rank R: R, R+1, ...)

    def __init__(self, model_name: str, engine_count: int = 1, registry: CollectorRegistry | None = None, *,
                 block_size: int = 16, num_gpu_blocks: int | None = None, max_model_len: int = 4096,
                 enable_prefix_caching: bool = True, gpu_memory_utilization: float = 0.92,
                 cache_info_extra: dict[str, Any] | None = None, worker_type: str = "aggregated"):
        self.model_name = str(model_name)
        self.worker_type = worker_type  # --worker-type (SGLang's series name it: engine_type)
        self.max_model_len = int(max_model_len)
        self._token_buckets = build_1_2_5_buckets(self.max_model_len)
        self._engines: list[_Engine] = []
        self._ensure_engine(max(1, int(engine_count)) - 1)
        self._reqs: dict[str, _Req] = {}
        # --enable-per-request-metrics: finished requests' timings, until their response takes them
        self.keep_request_timings = False
        self._timings: dict[str, _Req] = {}
        self._parents: dict[str, _Parent] = {}
        self.admission_rejections = dict.fromkeys(ADMISSION_REASONS, 0)
        self._created = time.time()
        # gauges vLLM sets on an event (not on each stats interval): family -> wall time of the last
        # set, even of an unchanged value; `on_gauge_set` is told at once (metrics_multiproc.py:
        # behind several API servers the one that set it last is the one shown)
        self.gauge_set_at: dict[str, float] = {}
        self.on_gauge_set: Callable[[], None] | None = None
        # monotonic -> wall clock, for requests whose arrival only the engine's QUEUED event knows
        self._mono_to_wall = time.time() - time.monotonic()
        self._cache_info = self._make_cache_info(block_size, num_gpu_blocks, enable_prefix_caching,
                                                 gpu_memory_utilization, cache_info_extra)
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        self._memo = FamilyMemo()  # families unchanged since the last scrape (families())
        self._exposition = TextExposition(self.registry)

    # ------------------------------------------------------------------ configuration

    def _make_cache_info(self, block_size: int, num_gpu_blocks: int | None, prefix: bool, gpu_util: float,
                         extra: dict[str, Any] | None) -> dict[str, str]:
        # vLLM exports str() of every CacheConfig field; the ones with meaning here get real values
        tokens = num_gpu_blocks * block_size if num_gpu_blocks else None
        info: dict[str, Any] = {
            "block_size": block_size, "user_specified_block_size": True, "kv_cache_layout": None,
            "prefix_match_unit": None, "gpu_memory_utilization": gpu_util, "cache_dtype": "auto",
            "is_attention_free": False, "num_gpu_blocks_override": None, "sliding_window": None,
            "enable_prefix_caching": prefix, "prefix_caching_hash_algo": "sha256",
            "prefix_cache_retention_interval": 0, "kv_cache_dtype_skip_layers": [],
            "mamba_page_size_padded": None, "skip_page_size_padded": None, "mamba_block_size": None,
            "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto", "mamba_cache_mode": "none",
            "enable_mamba_shared_prefix_checkpoint": False, "replayssm_buffer_len": 16, "use_replayssm": False,
            "use_kda_recoverssm": False, "num_gpu_blocks": num_gpu_blocks, "num_cpu_blocks": None,
            "effective_attention_block_size": None, "kv_cache_size_tokens": tokens,
            "kv_cache_max_concurrency": (tokens / self.max_model_len) if tokens else None,
            "hash_block_size": None, "cache_hit_alignment_tokens": None, "kv_sharing_fast_prefill": False,
            "swa_bounded_replay": True, "kv_cache_memory_bytes": None, "kv_offloading_size": None,
            "kv_offloading_backend": "native", "_block_size_resolved": True,
        }
        info.update(extra or {})
        return {k: str(v) for k, v in info.items()}

    def _ensure_engine(self, index: int) -> _Engine:
        while len(self._engines) <= index:
            self._engines.append(_Engine(self._token_buckets))
        return self._engines[index]

    @property
    def engine_count(self) -> int:
        return len(self._engines)

    # ------------------------------------------------------------------ request lifecycle

    def on_request_arrival(self, request_id: str, arrival_time: float | None = None, n: int = 1,
                           max_tokens: int | None = None, *, num_prompt_tokens: int | None = None,
                           parent_id: str | None = None, frontend_finishes: bool = False) -> None:
        """A request entered the frontend. arrival_time is wall-clock (time.time()), default now.
        frontend_finishes: the frontend will report the end (stop strings), whatever the engine says."""
        self._reqs[request_id] = _Req(time.time() if arrival_time is None else float(arrival_time),
                                      max(1, int(n or 1)), max_tokens, num_prompt_tokens, parent_id,
                                      frontend_finishes)
        if parent_id is not None and parent_id not in self._parents:
            self._parents[parent_id] = _Parent(max(1, int(n or 1)))

    def num_prefill_tokens(self) -> int:
        """The prompt tokens of the requests whose first token has not come yet (vLLM's
        get_num_queued_tokens: whole prompts, whatever chunks or cache hits they have had)."""
        return sum(r.prompt_len or 0 for r in self._reqs.values() if r.prefilling)

    def on_request_aborted(self, request_id: str) -> None:
        """The client went away: forget the request and record nothing (vLLM's abort path)."""
        self._reqs.pop(request_id, None)

    def on_request_finished(self, request_id: str, finish_reason: str | int | FinishReason = "stop",
                            num_prompt_tokens: int | None = None, num_generation_tokens: int | None = None,
                            engine_index: int | None = None) -> None:
        """The frontend ended a request itself. No-op if outputs already finished it."""
        r = self._reqs.pop(request_id, None)
        if r is None:
            return
        if num_prompt_tokens is not None:
            r.prompt_len = num_prompt_tokens
        if num_generation_tokens is not None:
            r.num_gen = num_generation_tokens
        eng = self._ensure_engine(r.engine if engine_index is None else engine_index)
        self._finish(eng, r, _reason_index(finish_reason), time.time())
        if self.keep_request_timings:
            self._timings[request_id] = r

    def enable_tool_parser_series(self) -> None:
        """`vllm:tool_call_parser_invocations_total`, which vLLM registers when `--tool-call-parser`
        is set, with every (mode, outcome, request_type) at 0."""
        if self.tool_parser_invocations is None:
            self.tool_parser_invocations = {(m, o, t): 0 for m in TOOL_PARSER_MODES for o in TOOL_PARSER_OUTCOMES
                                            for t in TOOL_PARSER_REQUEST_TYPES}

    def record_tool_parser_invocation(self, tool_called: bool, streaming: bool,
                                      request_type: str = "chat_completions", count: int = 1) -> None:
        """A tool parser ran: once per choice of a whole response, once per delta of a stream (vLLM's
        `record_tool_parser_invocation`). A no-op unless the series is enabled."""
        table = self.tool_parser_invocations
        if table is not None:
            table[("streaming" if streaming else "non_streaming", "tool_call" if tool_called else "no_tool_call",
                   request_type)] += count

    def record_admission_rejection(self, reason: str) -> None:
        """A request refused by a queue limit (max_num_queued_reqs / max_num_queued_tokens)."""
        self.admission_rejections[reason] += 1

    def set_sleep_state(self, engine_index: int | None = None, level: int = 0, *,
                        sleeping: bool | None = None) -> None:
        """level 0 = awake, 1 = weights offloaded, 2 = discard all; None = every engine.
        `sleeping=True` with level 0 is vLLM's level-0 sleep (scheduling paused): awake = 0 only."""
        if sleeping is None:
            sleeping = level > 0
        state = (1, 0, 0) if not sleeping else ((0, 1, 0) if level == 1 else (0, 0, 1) if level == 2 else (0, 0, 0))
        targets = self._engines if engine_index is None else [self._ensure_engine(engine_index)]
        for e in targets:
            e.sleep_state = state
        self.gauge_set_at["vllm:engine_sleep_state"] = time.time()
        if self.on_gauge_set is not None:
            self.on_gauge_set()

    # ------------------------------------------------------------------ the per-step hook

    def on_engine_outputs(self, engine_index: int, outputs: EngineCoreOutputs) -> None:
        """Fold one engine message into the metrics (AsyncEngine output listener)."""
        eng = self._engines[engine_index] if engine_index < len(self._engines) else self._ensure_engine(engine_index)
        ss = outputs.scheduler_stats
        if ss is not None:
            eng.running = ss.num_running_reqs
            eng.waiting = ss.num_waiting_reqs
            eng.waiting_deferred = ss.num_skipped_waiting_reqs
            eng.kv_usage = ss.kv_cache_usage
            pcs = ss.prefix_cache_stats
            if pcs is not None:
                eng.prefix_queries += pcs.queries
                eng.prefix_hits += pcs.hits
                eng.cached_by_source["device"] += pcs.hits
            eng.preemptions_from_stats += getattr(ss, "num_preemptions", 0) or 0

        taken = eng.tokens_taken  # the step's tokens that streams took directly (token_observer)
        if taken:
            eng.tokens_taken = 0
            eng.generation_tokens += taken
        outs = outputs.outputs
        if not outs:
            if taken:
                eng.h_iteration_tokens.observe(taken)
            self._forget(outputs.finished_requests)
            return
        now = time.time()
        ts = outputs.timestamp or time.monotonic()
        reqs = self._reqs
        gen_total = 0
        computed = 0
        ttft_h = eng.h_ttft
        # the ITL histogram is the one touched per output: update its lists inline
        itl_h = eng.h_itl
        itl_bounds = itl_h.bounds
        itl_counts = itl_h.counts
        itl_sum = 0.0
        for o in outs:
            r = reqs.get(o.request_id)
            if r is None:
                r = self._adopt(o)
                if r is None:
                    continue
            k = len(o.new_token_ids)
            gen_total += k
            r.num_gen += k
            if o.events:
                for ev in o.events:
                    t = ev.type
                    if t == _QUEUED:
                        r.queued_ts = ev.timestamp
                    elif t == _SCHEDULED:
                        if r.scheduled_ts == 0.0:  # later SCHEDULED events follow preemptions
                            r.scheduled_ts = ev.timestamp
                    elif t == _PREEMPTED:
                        eng.preemptions += 1
                        r.num_preempt += 1
            if r.prefilling:
                ps = o.prefill_stats
                if ps is not None:
                    computed += ps.num_computed_tokens
                    eng.prompt_tokens += ps.num_prompt_tokens
                    eng.by_source[0] += ps.num_computed_tokens
                    eng.by_source[1] += ps.num_local_cached_tokens
                    eng.by_source[2] += ps.num_external_cached_tokens
                    eng.prompt_cached += ps.num_cached_tokens
                    r.num_cached = ps.num_cached_tokens
                    if r.prompt_len is None:
                        r.prompt_len = ps.num_prompt_tokens
                ttft_h.observe(now - r.arrival)
                r.first_ts = ts
                r.prefilling = False
                r.engine = engine_index
            else:
                d = ts - r.last_ts
                itl_counts[bisect_left(itl_bounds, d)] += 1
                itl_sum += d
            r.last_ts = ts
            if o.finish_reason is not None and not r.frontend_finishes:
                del reqs[o.request_id]
                self._finish(eng, r, int(o.finish_reason), now)
                if self.keep_request_timings:
                    self._timings[o.request_id] = r
        itl_h.total += itl_sum
        eng.generation_tokens += gen_total
        eng.h_iteration_tokens.observe(computed + gen_total + taken)
        if outputs.finished_requests:
            self._forget(outputs.finished_requests)

    def request_timings(self, request_id: str, num_generation_tokens: int) -> dict[str, float | None]:
        """vLLM's PerRequestMetrics of a request whose last token was sent (its finish taken or
        still ahead: a stop string's), from the timestamps these metrics keep: TTFT and the queue
        from the engine's scheduling, the decode between the first and the last token."""
        r = self._timings.pop(request_id, None) or self._reqs.get(request_id)
        out: dict[str, float | None] = dict.fromkeys(REQUEST_METRICS_FIELDS)
        if r is None:
            return out
        queued, scheduled, first, last = r.queued_ts, r.scheduled_ts, r.first_ts, r.last_ts
        if scheduled > 0 and first > 0:
            out["time_to_first_token_ms"] = (first - scheduled) * 1000
        if first > 0 and last > 0:
            out["generation_time_ms"] = (last - first) * 1000
            if num_generation_tokens > 1:
                out["mean_itl_ms"] = (last - first) / (num_generation_tokens - 1) * 1000
        if queued > 0 and scheduled > 0:
            out["queue_time_ms"] = (scheduled - queued) * 1000
        if scheduled > 0 and last > scheduled:
            out["tokens_per_second"] = num_generation_tokens / ((last - scheduled) * 1000) * 1000
        return out

    def forget_timings(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._timings.pop(rid, None)

    def token_observer(self, engine_index: int, request_id: str) -> Callable[[float], None] | None:
        """For AsyncEngine.add_output_listener: what `on_engine_outputs` does for a plain decode
        token (one more token, its inter-token latency), for the tokens of `request_id` that its
        stream takes straight from the engine's step, so in no output; called with the step's
        clock time. The step's count goes into the iteration and generation totals with the
        step's batch, which follows."""
        r = self._reqs.get(request_id)
        if r is None:
            return None  # announced nowhere: its outputs alone can track it
        eng = self._ensure_engine(engine_index)
        itl_h = eng.h_itl
        bounds, counts = itl_h.bounds, itl_h.counts

        def observe(ts: float) -> None:
            d = ts - r.last_ts
            counts[bisect_left(bounds, d)] += 1
            itl_h.total += d
            r.last_ts = ts
            r.num_gen += 1
            eng.tokens_taken += 1
        observe.record = r  # (for a steady batch's TakenTokens)
        observe.new_group = lambda: TakenTokens(eng)
        return observe

    # ------------------------------------------------------------------ internals

    def _adopt(self, o: Any) -> _Req | None:
        """Track a request nobody announced, if this is its first output (QUEUED event present)."""
        if not o.events:
            return None  # a late output of a request we already finished or forgot
        arrival = None
        for ev in o.events:
            if ev.type == _QUEUED:
                arrival = ev.timestamp + self._mono_to_wall
        if arrival is None:
            return None
        r = _Req(arrival, 1, None, None, None)
        self._reqs[o.request_id] = r
        return r

    def _forget(self, ids: Iterable[str] | None) -> None:
        # ids the engine finished without a final output for us (client aborts): drop their state
        if ids:
            reqs = self._reqs
            for rid in ids:
                r = reqs.get(rid)
                if r is not None and not r.frontend_finishes:  # those the frontend ends itself
                    del reqs[rid]

    FOLD_AT = 512  # finished requests' rows kept before they are observed (fold_finished)

    def _finish(self, eng: _Engine, r: _Req, reason: int, now: float) -> None:
        if 0 <= reason < len(eng.success):
            eng.success[reason] += 1
        decode = r.last_ts - r.first_ts
        num_gen = r.num_gen
        prompt_len = r.prompt_len or 0
        # n and the longest child's length are observed once per parent request
        if r.parent is None:
            n, max_gen = r.n, num_gen
        else:
            n = max_gen = None
            p = self._parents.get(r.parent)
            if p is not None:
                p.max_gen = max(p.max_gen, num_gen)
                p.remaining -= 1
                if p.remaining <= 0:
                    del self._parents[r.parent]
                    n, max_gen = p.n, p.max_gen
        rows = eng.finished
        # _FINISH_COLUMNS' order
        rows.append((now - r.arrival, r.scheduled_ts - r.queued_ts, r.first_ts - r.scheduled_ts,
                     r.last_ts - r.scheduled_ts, decode, r.num_preempt, prompt_len - max(r.num_cached, 0),
                     prompt_len, num_gen, decode / (num_gen - 1) if num_gen > 1 else 0, r.max_tokens or None,
                     n, max_gen))
        if len(rows) >= self.FOLD_AT:
            fold_finished(eng)

    # ------------------------------------------------------------------ exposition

    def fold(self) -> None:
        """Bring the histograms up to date (the finished requests' waiting rows): before any read."""
        for e in self._engines:
            if e.finished:
                fold_finished(e)

    def render_text(self) -> bytes:
        """The Prometheus text format (vLLM's GET /metrics; its content type is text/plain 1.0.0):
        generate_latest(self.registry)'s bytes, rendered by exposition.TextExposition."""
        return self._exposition.render()

    def render(self, accept_header: str | None = None) -> tuple[bytes, str]:
        """(body, content type) as prometheus_client's ASGI app answers (vLLM's POST / HEAD /metrics):
        the format Accept asks for; OpenMetrics escapes the `vllm:` names to `vllm_`."""
        encoder, content_type = choose_encoder(accept_header or "")
        if encoder is generate_latest or (isinstance(encoder, partial) and encoder.func is generate_latest
                                          and not encoder.args and encoder.keywords == {"escaping": UNDERSCORES}):
            return self._exposition.render(), content_type
        return encoder(self.registry), content_type

    # (faults: scripted gauges) a rewrite of each family after it is built, and what the rewrite of
    # the family of a given name depends on (part of its memo key); see http/faults_adapter.py
    family_rewrite: Callable[[Any], Any] | None = None
    family_rewrite_key: Callable[[str], Any] | None = None
    # (faults shared by several API servers) the scripted gauges' epoch, changed by every set or
    # clear in any process (vllm/metrics_multiproc.py re-stamps the gauges when it changes)
    gauges_epoch: Callable[[], int] | None = None

    def get(self, name: str, key: Any, build: Callable[[], Any]) -> Any:
        """The family `name` through the memo (exposition.FamilyMemo.get), rewritten if a rewrite is set."""
        rewrite = self.family_rewrite
        if rewrite is None:
            return self._memo.get(name, key, build)
        return self._memo.get(name, (key, self.family_rewrite_key(name)), lambda: rewrite(build()))

    def families(self):
        """Yield the prometheus metric families (used by the registered collector). A family whose
        values are the same as at the last scrape is the same object (FamilyMemo), so its text is
        rendered once."""
        name = self.model_name
        created = self._created
        self.fold()
        memo = self  # self.get: the memo, with the family rewrite (scripted gauges) when one is set
        eng_labels = [(name, str(self.first_engine + i)) for i in range(len(self._engines))]
        engines = list(zip(eng_labels, self._engines))
        shape = (name, self.first_engine, len(engines), exact(created))  # in every key

        def scalar(kind, metric, doc, getter, extra_label=None, extra_values=()):
            labels = ["model_name", "engine"] + ([extra_label] if extra_label else [])
            if extra_label:
                children = [([*lv, x], getter(e, i)) for lv, e in engines for i, x in enumerate(extra_values)]
            else:
                children = [(list(lv), getter(e)) for lv, e in engines]

            def build():
                if kind == "gauge":
                    fam = GaugeMetricFamily(metric, doc, labels=labels)
                    for lv, v in children:
                        fam.add_metric(lv, v)
                else:
                    fam = CounterMetricFamily(metric, doc, labels=labels)
                    for lv, v in children:
                        fam.add_metric(lv, v, created=created)
                return fam

            return memo.get(metric, (shape, tuple(exact(v) for _, v in children)), build)

        def gauge(metric, doc, getter, extra_label=None, extra_values=()):
            return scalar("gauge", metric, doc, getter, extra_label, extra_values)

        def counter(metric, doc, getter, extra_label=None, extra_values=()):
            return scalar("counter", metric, doc, getter, extra_label, extra_values)

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    lambda e: e.running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    lambda e: e.waiting + e.waiting_deferred)
        yield gauge("vllm:num_requests_waiting_by_reason",
                    "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
                    "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
                    "status). Sum of all reasons equals vllm:num_requests_waiting.",
                    lambda e, i: e.waiting if i == 0 else e.waiting_deferred, "reason", WAITING_REASONS)
        yield gauge("vllm:engine_sleep_state",
                    "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
                    "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
                    lambda e, i: e.sleep_state[i], "sleep_state", SLEEP_STATES)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    lambda e: e.kv_usage)
        for attr, metric, doc in _COUNTERS:
            if attr == "preemptions":
                yield counter(metric, doc, lambda e: e.preemptions or e.preemptions_from_stats)
            else:
                yield counter(metric, doc, lambda e, a=attr: getattr(e, a))
        yield counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                      lambda e, i: e.by_source[i], "source", PROMPT_SOURCES)
        yield counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
                      lambda e: e.prompt_cached)
        yield counter("vllm:prompt_tokens_cached_by_source",
                      "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host "
                      "(offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
                      "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
                      "vllm:external_prefix_cache_hits.",
                      lambda e, i: e.cached_by_source[CACHE_HIT_SOURCES[i]], "source", CACHE_HIT_SOURCES)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      lambda e: e.generation_tokens)
        yield counter("vllm:request_success", "Count of successfully processed requests.",
                      lambda e, i: e.success[i], "finished_reason", FINISH_REASONS)

        def rejections():
            fam = CounterMetricFamily("vllm:admission_rejections",
                                      "Number of admission attempts rejected by a queue limit, by reason.",
                                      labels=["model_name", "reason"])
            for reason in ADMISSION_REASONS:
                fam.add_metric([name, reason], self.admission_rejections[reason], created=created)
            return fam

        yield memo.get("vllm:admission_rejections",
                       (shape, tuple(exact(v) for v in self.admission_rejections.values())), rejections)
        # vLLM's MFU estimates: the simulator moves no bytes and runs no FLOPs, so they stay 0
        for metric, what in (("flops", "floating point operations"), ("read_bytes", "bytes read from memory"),
                             ("write_bytes", "bytes written to memory")):
            yield counter(f"vllm:estimated_{metric}_per_gpu", f"Estimated number of {what} per GPU (for Model "
                          "Flops Utilization calculations).", lambda e: 0.0)
        for attr, metric, doc, _ in _HISTOGRAMS:
            hists = [(lv, getattr(e, "h_" + attr)) for lv, e in engines]

            def histogram(metric=metric, doc=doc, hists=hists):
                fam = HistogramMetricFamily(metric, doc, labels=["model_name", "engine"])
                for lv, h in hists:
                    fam.add_metric(list(lv), h.cumulative(), h.total)
                    # prometheus_client's own Histogram exports a _created sample; so does vLLM
                    fam.samples.append(Sample(metric + "_created", {"model_name": lv[0], "engine": lv[1]}, created))
                return fam

            yield memo.get(metric, (shape, *[(exact(h.total), *h.counts) for _, h in hists]), histogram)
        table = self.tool_parser_invocations
        if table is not None:
            def tools():
                fam = CounterMetricFamily("vllm:tool_call_parser_invocations",
                                          "Total number of ToolParser invocations. Non-streaming increments once "
                                          "per choice; streaming increments once per delta.",
                                          labels=["model_name", "mode", "outcome", "request_type"])
                for (mode, outcome, kind), n in table.items():
                    fam.add_metric([name, mode, outcome, kind], n, created=created)
                return fam

            yield memo.get("vllm:tool_call_parser_invocations",
                           (shape, tuple((k, exact(v)) for k, v in table.items())), tools)

        def info():
            fam = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                    labels=[*self._cache_info.keys(), "engine"])
            for i in range(len(self._engines)):
                fam.add_metric([*self._cache_info.values(), str(self.first_engine + i)], 1.0)
            return fam

        yield memo.get("vllm:cache_config_info", (shape, tuple(self._cache_info.items())), info)


def _reason_index(reason: str | int | FinishReason) -> int:
    if isinstance(reason, str):
        return _REASON_INDEX.get(reason.lower(), int(FinishReason.STOP))
    return int(reason)


class _Collector:
    """Adapter so a CollectorRegistry can scrape a FrontendMetrics."""

    def __init__(self, metrics: FrontendMetrics):
        self._m = metrics

    def collect(self):
        return self._m.families()
