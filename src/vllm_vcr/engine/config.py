"""Engine configuration.

`EngineConfig` holds the fields of the runtime control API: the seed's 14 (its Config section:
same names, types and units, latency in milliseconds) and the output-length distribution, each
mirroring the CLI flag of the same name, patchable at a step boundary. `EngineArgs` holds
everything fixed at start-up.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import msgspec

from .output_length import (
    DEFAULT_DISTRIBUTION,
    DEFAULT_MEAN,
    DEFAULT_STD_DEV,
    LengthError,
    OutputLengthModel,
    build_length_model,
)
from .policy import engine_types

LATENCY_FIELDS = (
    "time_to_first_token",
    "time_to_first_token_std_dev",
    "inter_token_latency",
    "inter_token_latency_std_dev",
    "prefill_overhead",
    "prefill_time_per_token",
    "prefill_time_std_dev",
    "time_factor_under_load",
)
MS_FIELDS = LATENCY_FIELDS[:-1]  # milliseconds (time_factor_under_load is a factor)


class FailureType(str, enum.Enum):
    ERROR = "error"
    LENGTH = "length"
    REPETITION = "repetition"


class ConfigError(ValueError):
    """A value fails validation (the control API answers 400, the CLI names the flag)."""


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    time_to_first_token: float = 0.0
    time_to_first_token_std_dev: float = 0.0
    inter_token_latency: float = 0.0
    inter_token_latency_std_dev: float = 0.0
    prefill_overhead: float = 0.0
    prefill_time_per_token: float = 0.0
    prefill_time_std_dev: float = 0.0
    time_factor_under_load: float = 1.0
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # 0 = the length advertised at start-up bounds requests
    failure_injection_rate: float = 0.0
    failure_types: list[FailureType] = msgspec.field(default_factory=lambda: [FailureType.ERROR])
    log_requests: bool = False  # vLLM has logged requests only on request since 0.10
    # where a random output's EOS falls (output_length.py); drawn per request at arrival
    output_length_distribution: str = DEFAULT_DISTRIBUTION  # lognormal | normal | histogram | off
    output_length_mean: float = DEFAULT_MEAN  # tokens
    output_length_std_dev: float = DEFAULT_STD_DEV  # tokens
    output_length_histogram: str = ""  # LO-HI:WEIGHT,... (output_length_distribution histogram)

    def validate(self) -> "EngineConfig":
        for name in LATENCY_FIELDS + ("failure_injection_rate",):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"{name} must be a finite number, got {getattr(self, name)}")
        for name in LATENCY_FIELDS[:-1]:
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.time_factor_under_load < 1.0:
            raise ConfigError(f"time_factor_under_load must be >= 1.0, got {self.time_factor_under_load}")
        if not 0.0 <= self.failure_injection_rate <= 1.0:
            raise ConfigError(f"failure_injection_rate must be in [0, 1], got {self.failure_injection_rate}")
        if not self.failure_types:
            raise ConfigError("failure_types must not be empty")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 0:
            raise ConfigError(f"max_model_len must be >= 0, got {self.max_model_len}")
        self.output_length_model()
        return self

    def output_length_model(self) -> OutputLengthModel | None:
        """The output-length distribution these fields describe (None: `off`)."""
        try:
            return build_length_model(self.output_length_distribution, self.output_length_mean,
                                      self.output_length_std_dev, self.output_length_histogram)
        except LengthError as e:
            raise ConfigError(str(e)) from None

    def to_dict(self) -> dict[str, Any]:
        """The fields as the control API's /config shows them: the millisecond fields as integers
        when they are whole (`"time_to_first_token": 200`), the factor and the rate as floats."""
        out = msgspec.to_builtins(self)
        for name in MS_FIELDS:
            v = out[name]
            if isinstance(v, float) and v.is_integer():
                out[name] = int(v)
        return out

    def patched(self, patch: dict[str, Any]) -> "EngineConfig":
        """A validated copy with `patch` applied (patch already schema-checked)."""
        merged = {**self.to_dict(), **patch}
        return msgspec.convert(merged, EngineConfig).validate()


def running_limit(config: EngineConfig, max_num_active_seqs: int | None) -> int:
    """How many requests may run at once: max_num_seqs, or vLLM's lower --max-num-active-seqs."""
    return config.max_num_seqs if max_num_active_seqs is None else min(config.max_num_seqs, max_num_active_seqs)


def token_budget(config: EngineConfig, max_num_scheduled_tokens: int | None) -> int:
    """The tokens one step may schedule: vLLM's --max-num-scheduled-tokens, else max_num_batched_tokens."""
    return max_num_scheduled_tokens or config.max_num_batched_tokens


class EngineArgs(msgspec.Struct, kw_only=True):
    """Everything about an engine that is fixed when it starts."""

    config: EngineConfig = msgspec.field(default_factory=EngineConfig)
    kv_cache_size: int = 1024  # blocks
    tokens_per_block: int = 16
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"  # or "priority"
    enable_prefix_caching: bool = True
    time_scale: float = 1.0
    seed: int = 0
    mode: str = "random"  # random | echo
    vocab_size: int = 32000
    eos_token_id: int | None = None  # what the token source may emit to end a request
    shutdown_timeout: float = 0.0
    # zero-latency decode steps that may run as one multi-token output. 1 (the default): one token
    # per request per step, every step's outputs delivered before the next step runs, so what a
    # client sees never depends on internal batching; serve raises it with --stream-interval N,
    # where tokens leave N to an SSE event anyway
    max_burst: int = 1
    # seconds an untimed step takes at least (divided by time_scale): steps start at least this far
    # apart, so zero-latency outputs leave one step at a time at a pace a frontend reads
    # (play --min-step-time); 0: back to back (serve, simulate)
    min_step_time: float = 0.0
    advertised_max_model_len: int = 4096  # what the frontend is told; the arrival check uses config
    model_name: str = "vllm-vcr/sim"
    engine_id: str = "vllm-vcr-engine"
    enable_chunked_prefill: bool = True
    # vLLM's scheduler_reserve_full_isl (its default): a waiting or preempted request is admitted
    # only if its whole sequence (not just its first chunk) fits in the free KV blocks; vLLM engine
    # type only
    scheduler_reserve_full_isl: bool = True
    # vLLM's --watermark: this fraction of the KV blocks stays free when a waiting or preempted
    # request is admitted beside running ones (vLLM engine type only)
    watermark: float = 0.0
    # vLLM's --max-num-active-seqs: how many requests may run at once (admission into RUNNING), at
    # most max_num_seqs (which keeps sizing CUDA-graph capture); None: max_num_seqs
    max_num_active_seqs: int | None = None
    # vLLM's --max-num-scheduled-tokens: the tokens one step may schedule; None: max_num_batched_tokens
    max_num_scheduled_tokens: int | None = None
    prefix_caching_hash_algo: str = "sha256"  # vLLM's default; KV event hashes depend on it
    # the seed of vLLM's NONE_HASH (the parent of every first block): what vLLM reads from
    # $PYTHONHASHSEED, read there by the CLI (the engine reads no environment); None: vLLM's
    # default without it ("vllm-none-hash" for sha256*, a random seed per engine for xxhash*)
    none_hash_seed: str | None = None
    startup_time: float = 0.0  # s of simulated model loading (divided by time_scale)
    startup_failure: str | None = None  # simulate a loading failure with this message
    response_replay_trace: str | None = None  # JSONL of planned output token ids
    # record/replay: recorded traces that pace or script requests instead of the knobs
    latency_trace: str | None = None
    latency_trace_model: str = "auto"  # auto | steps | cells: the model fitted from latency_trace
    perf_model: dict[str, Any] | None = None  # --perf-model: perf/aic.py AicTarget fields
    replay_tokens: str | None = None
    replay_steps: str | None = None
    replay_match: str = "index"  # index | prefix
    reasoning: str | None = None  # "START_ID,END_ID,RATIO"
    # which engine is simulated (policy.py's registry: vllm | sglang): its scheduling policy and
    # P/D handoff order here; its metric names, HTTP routes (and perf data) in the adapters
    engine_type: str = "vllm"
    # SGLang's --scheduler-recv-interval: its scheduler reads new requests once per this many
    # decode steps (at once after a prefill step or when idle); 1 = every step
    scheduler_recv_interval: int = 1
    # prefill/decode disaggregation
    worker_type: str = "aggregated"  # aggregated | prefill | decode
    kv_bytes_per_token: int = 131072
    kv_transfer_bandwidth: float = 25.0  # GB/s shared by concurrent transfers
    kv_hold_timeout: float = 480.0  # s a prefill keeps blocks for a decode that never pulls
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5600
    # LoRA (serve --enable-lora): max_loras > 0 limits the distinct adapters of a batch; an adapter
    # read from disk / copied in from the CPU pool of max_cpu_loras delays its request (seconds)
    max_loras: int = 0
    max_cpu_loras: int = 0
    lora_load_time: float = 0.0
    lora_swap_in_time: float = 0.0

    def check_injected(self, latency: object, planner: object, replay_table: object) -> None:
        """The engine loads no files: a trace flag without its built input is a caller's bug."""
        missing = [flag for flag, needed, given in (
            ("--latency-trace", self.latency_trace, latency),
            ("--replay-tokens/--replay-steps", self.replay_tokens or self.replay_steps, planner),
            ("--response-replay-trace", self.response_replay_trace, replay_table)) if needed and given is None]
        if missing:
            raise ValueError(f"{', '.join(missing)}: build the engine's inputs first (vllm_vcr.engine_inputs)")

    def validate(self) -> "EngineArgs":
        self.config.validate()
        if self.kv_cache_size < 1:
            raise ConfigError(f"--kv-cache-size must be >= 1, got {self.kv_cache_size}")
        if self.tokens_per_block < 1:
            raise ConfigError(f"--tokens-per-block must be >= 1, got {self.tokens_per_block}")
        if self.time_scale <= 0:
            raise ConfigError(f"--time-scale must be > 0, got {self.time_scale}")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"--watermark must be in [0, 1), got {self.watermark}")
        if self.max_num_active_seqs is not None:
            if self.max_num_active_seqs < 1:
                raise ConfigError(f"--max-num-active-seqs must be >= 1, got {self.max_num_active_seqs}")
            if self.max_num_active_seqs > self.config.max_num_seqs:
                raise ConfigError(f"--max-num-active-seqs: max_num_active_seqs ({self.max_num_active_seqs}) cannot "
                                  f"be greater than max_num_seqs ({self.config.max_num_seqs}).")
        if self.max_num_scheduled_tokens is not None and self.max_num_scheduled_tokens < 1:
            raise ConfigError(f"--max-num-scheduled-tokens must be >= 1, got {self.max_num_scheduled_tokens}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"--scheduling-policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.mode not in ("random", "echo"):
            raise ConfigError(f"--mode must be random or echo, got {self.mode!r}")
        if self.engine_type not in engine_types():
            raise ConfigError(f"--engine-type must be one of {', '.join(engine_types())}, got {self.engine_type!r}")
        if self.scheduler_recv_interval < 1:
            raise ConfigError(f"--scheduler-recv-interval must be >= 1, got {self.scheduler_recv_interval}")
        if self.scheduler_recv_interval > 1 and self.engine_type != "sglang":
            raise ConfigError("--scheduler-recv-interval is an SGLang server flag: it needs --engine-type sglang")
        if self.worker_type not in ("aggregated", "prefill", "decode"):
            raise ConfigError(f"--worker-type must be aggregated, prefill or decode, got {self.worker_type!r}")
        if self.kv_transfer_bandwidth <= 0:
            raise ConfigError(f"--kv-transfer-bandwidth must be > 0, got {self.kv_transfer_bandwidth}")
        if self.kv_bytes_per_token < 0:
            raise ConfigError(f"--kv-bytes-per-token must be >= 0, got {self.kv_bytes_per_token}")
        if self.reasoning is not None:
            from .tokens import ReasoningConfig

            try:
                ReasoningConfig.parse(self.reasoning)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        from .block_hash import HASH_ALGOS

        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ConfigError(f"--prefix-caching-hash-algo must be one of {', '.join(HASH_ALGOS)}, "
                              f"got {self.prefix_caching_hash_algo!r}")
        if self.replay_match not in ("index", "prefix"):
            raise ConfigError(f"--replay-match must be index or prefix, got {self.replay_match!r}")
        if self.latency_trace_model not in ("auto", "steps", "cells"):
            raise ConfigError(f"--latency-trace-model must be auto, steps or cells, got {self.latency_trace_model!r}")
        if self.latency_trace:
            knobs = [f for f in LATENCY_FIELDS[:-1] if getattr(self.config, f)]
            if knobs:
                flags = ", ".join("--" + f.replace("_", "-") for f in knobs)
                raise ConfigError(f"--latency-trace paces requests from a recording; it cannot be combined "
                                  f"with {flags}")
        if self.startup_time < 0:
            raise ConfigError(f"--startup-time must be >= 0, got {self.startup_time}")
        if self.min_step_time < 0:
            raise ConfigError(f"--min-step-time must be >= 0, got {self.min_step_time * 1000:g} ms")
        if self.max_burst < 1:
            raise ConfigError(f"max_burst must be >= 1, got {self.max_burst}")
        if self.shutdown_timeout < 0:
            raise ConfigError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        return self
