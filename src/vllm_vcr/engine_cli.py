"""The simulator's own command-line flags, shared by `serve` and `play`.

Names are the Config fields of the control API, dash-separated (`--time-to-first-token`), so a
flag, its control-API field and its `MOCK_*` environment variable always say the same thing.
"""

from __future__ import annotations

import argparse
import os

from .engine.config import LATENCY_FIELDS, ConfigError, EngineArgs, EngineConfig, FailureType
from .engine.output_length import DEFAULT_DISTRIBUTION, DEFAULT_MEAN, DEFAULT_STD_DEV, DISTRIBUTIONS
from .engine.policy import engine_types


def _env(name: str, default):
    return os.environ.get(name, default)


# The latency knobs' defaults, for every command that takes them (`serve`, `play`, `simulate`):
# EngineConfig's own field defaults, so there is one place for them.
_DEFAULTS = EngineConfig()

# flag -> (EngineConfig field, MOCK_* environment variable)
LATENCY_FLAGS = {
    "--time-to-first-token": ("time_to_first_token", "MOCK_TTFT_MS"),
    "--time-to-first-token-std-dev": ("time_to_first_token_std_dev", "MOCK_TTFT_STDDEV_MS"),
    "--inter-token-latency": ("inter_token_latency", "MOCK_ITL_MS"),
    "--inter-token-latency-std-dev": ("inter_token_latency_std_dev", "MOCK_ITL_STDDEV_MS"),
    "--prefill-overhead": ("prefill_overhead", "MOCK_PREFILL_OVERHEAD_MS"),
    "--prefill-time-per-token": ("prefill_time_per_token", "MOCK_PREFILL_TIME_PER_TOKEN_MS"),
    "--prefill-time-std-dev": ("prefill_time_std_dev", "MOCK_PREFILL_TIME_STDDEV_MS"),
    "--time-factor-under-load": ("time_factor_under_load", "MOCK_TIME_FACTOR_UNDER_LOAD"),
}


def latency_default(flag: str) -> float:
    """The default of a latency flag: its MOCK_* variable when set, else EngineConfig's default."""
    field, env = LATENCY_FLAGS[flag]
    return _env(env, getattr(_DEFAULTS, field))


def latency_knobs_line(config: EngineConfig) -> str:
    """The knob latency model in one line, naming the knobs left at their (serve's) defaults."""
    parts, defaults = [], []
    for flag, (field, _env_name) in LATENCY_FLAGS.items():
        value = getattr(config, field)
        (defaults if value == getattr(_DEFAULTS, field) else parts).append(f"{flag} {value:g}")
    text = ", ".join(parts) if parts else "none given"
    return f"{text}; at serve's defaults: {', '.join(defaults)}" if defaults else text


def none_hash_seed_from_env() -> str | None:
    """vLLM's NONE_HASH seed: $PYTHONHASHSEED when set (vLLM's `init_none_hash`), else None (the
    engine's default: vLLM's without it). The engine reads no environment: it gets this in
    `EngineArgs.none_hash_seed`."""
    return os.environ.get("PYTHONHASHSEED")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("simulated engine")
    ms = "milliseconds"
    g.add_argument("--time-to-first-token", type=float, default=latency_default("--time-to-first-token"),
                   help=f"TTFT mean ({ms}); 0 with its std dev 0 selects the prefill model")
    g.add_argument("--time-to-first-token-std-dev", type=float, default=latency_default("--time-to-first-token-std-dev"))
    g.add_argument("--inter-token-latency", type=float, default=latency_default("--inter-token-latency"),
                   help=f"inter-token latency mean ({ms})")
    g.add_argument("--inter-token-latency-std-dev", type=float, default=latency_default("--inter-token-latency-std-dev"))
    g.add_argument("--prefill-overhead", type=float, default=latency_default("--prefill-overhead"),
                   help=f"fixed prefill cost ({ms}) when TTFT is 0")
    g.add_argument("--prefill-time-per-token", type=float, default=latency_default("--prefill-time-per-token"),
                   help=f"prefill cost per uncached prompt token ({ms})")
    g.add_argument("--prefill-time-std-dev", type=float, default=latency_default("--prefill-time-std-dev"))
    g.add_argument("--time-factor-under-load", type=float, default=latency_default("--time-factor-under-load"),
                   help="latency multiplier reached at max-num-seqs running requests (>= 1.0)")
    g.add_argument("--kv-cache-size", type=int, default=_env("MOCK_KV_CACHE_SIZE", 1024),
                   help="KV cache capacity in blocks")
    g.add_argument("--tokens-per-block", type=int, default=None,
                   help="tokens per KV block (alias of --block-size)")
    g.add_argument("--long-prefill-token-threshold", type=int,
                   default=_env("MOCK_LONG_PREFILL_TOKEN_THRESHOLD", 0),
                   help="cap on one prefill's chunk per step; 0 = off")
    g.add_argument("--scheduler-reserve-full-isl", action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM's admission gate (on by default, as in vLLM): a waiting request starts only when "
                        "its whole sequence, not just its first chunk, fits in the free KV blocks (--engine-type "
                        "vllm)")
    g.add_argument("--watermark", type=float, default=0.0,
                   help="fraction of the KV blocks an admission beside running requests leaves free, as vLLM's "
                        "(0 to < 1; --engine-type vllm)")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"],
                   default=_env("MOCK_SCHEDULING_POLICY", "fcfs"))
    g.add_argument("--failure-injection-rate", type=float, default=_env("MOCK_FAILURE_INJECTION_RATE", 0.0),
                   help="probability in [0, 1] that a request fails on arrival")
    g.add_argument("--failure-types", default=_env("MOCK_FAILURE_TYPES", "error"),
                   help="comma list of error,length,repetition")
    g.add_argument("--time-scale", type=float, default=1.0, help="divide every delay by this")
    g.add_argument("--mode", choices=["random", "echo"], default="random",
                   help="output tokens: random ids, or echo the prompt")
    add_output_length_args(g)
    g.add_argument("--seed", type=int, default=0, help="base seed for token, output-length and failure draws")
    g.add_argument("--vocab-size", type=int, default=None, help="random tokens are drawn from [0, vocab)")
    g.add_argument("--shutdown-timeout", type=float, default=0.0,
                   help="seconds to drain on SIGTERM/SIGINT; 0 aborts everything at once")
    g.add_argument("--engine-count", type=int, default=1, help="engines (DP ranks) in this process")
    g.add_argument("--log-requests", dest="log_requests", action=argparse.BooleanOptionalAction,
                   default=os.environ.get("MOCK_LOG_REQUESTS", "0") == "1",
                   help="log each request's arrival and finish (off by default, as in vLLM)")
    g.add_argument("--response-replay-trace", default=None, metavar="FILE",
                   help="JSONL of planned output token ids, selected per request by an output-replay id")
    g.add_argument("--reasoning", default=None, metavar="START_ID,END_ID,RATIO",
                   help="make the first RATIO of each output a thinking span between two token ids")
    r = parser.add_argument_group("record / replay")
    r.add_argument("--latency-trace", default=None, metavar="TRACE",
                   help="pace requests with a latency model fitted from a recorded trace (excludes the latency knobs)")
    r.add_argument("--latency-trace-model", choices=["auto", "steps", "cells"], default="auto",
                   help="the model --latency-trace fits: auto = the step-time model for an engine tap trace, "
                        "the cell model otherwise")
    r.add_argument("--replay-steps", default=None, metavar="TRACE",
                   help="replay each matched request's recorded TTFT, gaps and chunk sizes verbatim")
    r.add_argument("--replay-tokens", default=None, metavar="TRACE",
                   help="replay each matched request's recorded output token ids and finish reason")
    r.add_argument("--replay-match", choices=["index", "prefix"], default="index",
                   help="match requests to records by the trailing -<i> of the request id, or by prompt prefix")
    g.add_argument("--startup-time", type=float, default=0.0,
                   help="seconds of simulated model loading before the engine serves")
    g.add_argument("--startup-failure", default=None, metavar="MESSAGE",
                   help="after --startup-time, fail model loading with MESSAGE (for orchestration tests)")
    g.add_argument("--engine-type", choices=engine_types(), default="vllm",
                   help="the engine simulated: sglang serves SGLang's metric names (sglang:*), its HTTP routes "
                        "(/generate, /get_model_info, /health_generate, /flush_cache) and P/D handoff order")
    g.add_argument("--scheduler-recv-interval", type=int, default=1, metavar="N",
                   help="(--engine-type sglang) SGLang's flag: the scheduler reads new requests once per N decode "
                        "steps (at once after a prefill step or when idle)")
    g.add_argument("--forward-pass-metrics-port", type=int, default=None, metavar="PORT",
                   help="publish one forward-pass-metrics record per engine step on a ZMQ PUB socket, "
                        "engine (DP rank) i on PORT+i (Dynamo's FPM schema); off unless given")
    g.add_argument("--forward-pass-metrics-trace", default=None, metavar="PATH",
                   help="also write every forward-pass-metrics record to a trace (`{\"fpm\": ...}` lines)")
    pd = parser.add_argument_group("prefill/decode disaggregation")
    pd.add_argument("--worker-type", choices=["aggregated", "prefill", "decode"], default="aggregated",
                    help="prefill workers finish after the first token and hold KV for the decode side")
    pd.add_argument("--kv-bytes-per-token", type=int, default=None,
                    help="KV bytes one token occupies (default: with --perf-model, the model's per GPU; else 131072)")
    pd.add_argument("--kv-transfer-bandwidth", type=float, default=25.0,
                    help="GB/s of the KV link, shared by concurrent transfers")
    pd.add_argument("--kv-hold-timeout", type=float, default=480.0,
                    help="seconds a prefill holds KV blocks for a decode side that never pulls them "
                         "(vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT)")
    pd.add_argument("--side-channel-host", default=_env("MOCK_SIDE_CHANNEL_HOST", "127.0.0.1"),
                    help="host of the KV side channel: advertised as remote_host, bound by the release "
                         "listener and the bootstrap server")
    pd.add_argument("--side-channel-port", type=int, default=_env("MOCK_SIDE_CHANNEL_PORT", None),
                    help="base port of the release listener (engine i listens on port+i; advertised as "
                         "remote_port); default 5600, listened on by prefill workers, and by aggregated "
                         "workers only when given")
    pd.add_argument("--bootstrap-port", type=int, default=None,
                    help="prefill worker: serve Dynamo-style bootstrap handoffs on this port")
    pd.add_argument("--handoff-session-timeout-ms", type=float, default=300000.0,
                    help="bootstrap handoff: longest wait for the other side (divided by --time-scale)")
    add_control_args(g)


def add_control_args(g) -> None:
    """Where the runtime control API listens and the token it asks for (docs/control-api.md)."""
    g.add_argument("--control-address", default=control_address_from_env(os.environ),
                   help="HOST:PORT of the runtime control API (env MOCK_CONTROL_ADDRESS, or MOCK_CONTROL_PORT "
                        "for 127.0.0.1:PORT, MOCK_CONTROL_HOST:PORT when that is set); off unless set")
    g.add_argument("--control-token", default=os.environ.get("MOCK_CONTROL_TOKEN") or None, metavar="TOKEN",
                   help="require `Authorization: Bearer TOKEN` on every control API request (prefer the env "
                        "MOCK_CONTROL_TOKEN: a flag's value is visible to every local user in the process list)")


def add_output_length_args(g) -> None:
    """Where a random output's EOS falls (engine/output_length.py; docs/serve.md#output-length)."""
    g.add_argument("--output-length-distribution", choices=DISTRIBUTIONS,
                   default=_env("MOCK_OUTPUT_LENGTH_DISTRIBUTION", None),
                   help=f"the length at which a random output ends on EOS, drawn per request unless it sets "
                        f"ignore_eos (max_tokens still caps it with finish_reason length); default "
                        f"{DEFAULT_DISTRIBUTION}, or histogram when --output-length-histogram is given; off: only "
                        f"max_tokens and the context end an output")
    g.add_argument("--output-length-mean", type=float, default=_env("MOCK_OUTPUT_LENGTH_MEAN", DEFAULT_MEAN),
                   help="mean output length in tokens (lognormal, normal)")
    g.add_argument("--output-length-std-dev", type=float,
                   default=_env("MOCK_OUTPUT_LENGTH_STD_DEV", DEFAULT_STD_DEV),
                   help="standard deviation of the output length in tokens (lognormal, normal)")
    g.add_argument("--output-length-histogram", default=_env("MOCK_OUTPUT_LENGTH_HISTOGRAM", ""),
                   metavar="LO-HI:WEIGHT,...",
                   help="output lengths from weighted buckets (N:WEIGHT is one length), "
                        "e.g. 1-64:2,65-512:7,513-2048:1")


def output_length_fields(ns: argparse.Namespace) -> dict:
    """The config's output_length_* fields from the flags (a histogram alone selects itself)."""
    histogram = str(getattr(ns, "output_length_histogram", "") or "")
    distribution = getattr(ns, "output_length_distribution", None) or ("histogram" if histogram else
                                                                      DEFAULT_DISTRIBUTION)
    return {"output_length_distribution": distribution, "output_length_histogram": histogram,
            "output_length_mean": float(getattr(ns, "output_length_mean", DEFAULT_MEAN)),
            "output_length_std_dev": float(getattr(ns, "output_length_std_dev", DEFAULT_STD_DEV))}


DEFAULT_CONTROL_HOST = "127.0.0.1"  # the control API changes the engine: reachable from this machine only


def control_address_from_env(env) -> str | None:
    """MOCK_CONTROL_ADDRESS, else MOCK_CONTROL_PORT (how the container image turns the API on, at
    8001) on loopback, or on MOCK_CONTROL_HOST when that is set (`0.0.0.0` to reach it from outside
    the container); `off` in either disables it. The control server validates the value."""
    address = env.get("MOCK_CONTROL_ADDRESS") or None
    if address is None and (env.get("MOCK_CONTROL_PORT") or "off").lower() != "off":
        host = (env.get("MOCK_CONTROL_HOST") or "").strip() or DEFAULT_CONTROL_HOST
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        address = f"{host}:{env['MOCK_CONTROL_PORT']}"
    return None if address is None or address.lower() == "off" else address


def parse_failure_types(value: str | list[str]) -> list[FailureType]:
    items = value if isinstance(value, list) else [v.strip() for v in value.split(",") if v.strip()]
    try:
        return [FailureType(v) for v in items]
    except ValueError:
        raise ConfigError(f"--failure-types: unknown value in {value!r}; choose from error, length, repetition") from None


def add_running_limit_args(group: argparse._ActionsContainer) -> None:
    """vLLM's --max-num-active-seqs and --max-num-scheduled-tokens, beside a command's own
    --max-num-seqs and --max-num-batched-tokens (serve takes them from vLLM's option table)."""
    group.add_argument("--max-num-active-seqs", type=int, default=None,
                       help="requests running at once, at most --max-num-seqs (vLLM's; default: --max-num-seqs)")
    group.add_argument("--max-num-scheduled-tokens", type=int, default=None,
                       help="tokens one step may schedule (vLLM's; default: --max-num-batched-tokens)")


def engine_args_from_cli(ns: argparse.Namespace, **overrides) -> EngineArgs:
    """Build validated EngineArgs; raises ConfigError whose message names the flag."""
    cfg_fields = {f: float(getattr(ns, f)) for f in LATENCY_FIELDS}
    try:
        config = EngineConfig(
            **cfg_fields,
            max_num_seqs=int(getattr(ns, "max_num_seqs", 128) or 128),
            max_num_batched_tokens=int(getattr(ns, "max_num_batched_tokens", None) or 2048),
            max_model_len=int(getattr(ns, "max_model_len", 0) or 0),
            failure_injection_rate=float(ns.failure_injection_rate),
            failure_types=parse_failure_types(ns.failure_types),
            log_requests=bool(ns.log_requests),
            **output_length_fields(ns),
        )
        config.validate()
    except ConfigError as e:
        field = str(e).split(" ", 1)[0]
        raise ConfigError(f"--{field.replace('_', '-')}: {e}") from None
    tokens_per_block = ns.tokens_per_block or getattr(ns, "block_size", None) or int(_env("MOCK_TOKENS_PER_BLOCK", 16))
    args = EngineArgs(
        config=config,
        kv_cache_size=int(ns.kv_cache_size),
        tokens_per_block=int(tokens_per_block),
        long_prefill_token_threshold=int(ns.long_prefill_token_threshold),
        scheduler_reserve_full_isl=bool(getattr(ns, "scheduler_reserve_full_isl", True)),
        watermark=float(getattr(ns, "watermark", 0.0) or 0.0),
        max_num_active_seqs=getattr(ns, "max_num_active_seqs", None),
        max_num_scheduled_tokens=getattr(ns, "max_num_scheduled_tokens", None),
        scheduling_policy=ns.scheduling_policy,
        time_scale=float(ns.time_scale),
        seed=int(ns.seed),
        mode=ns.mode,
        shutdown_timeout=float(ns.shutdown_timeout),
        response_replay_trace=ns.response_replay_trace,
        reasoning=ns.reasoning,
        worker_type=ns.worker_type,
        engine_type=getattr(ns, "engine_type", None) or "vllm",
        scheduler_recv_interval=int(getattr(ns, "scheduler_recv_interval", None) or 1),
        kv_hold_timeout=float(ns.kv_hold_timeout),
        side_channel_host=str(getattr(ns, "side_channel_host", None) or "127.0.0.1"),
        side_channel_port=int(getattr(ns, "side_channel_port", None) or 5600),
        startup_time=float(ns.startup_time),
        latency_trace=ns.latency_trace,
        latency_trace_model=getattr(ns, "latency_trace_model", None) or "auto",
        replay_tokens=ns.replay_tokens,
        replay_steps=ns.replay_steps,
        replay_match=ns.replay_match,
        startup_failure=ns.startup_failure,
        # (None unless given: the engine's defaults, or what the perf model and `simulate` derive)
        **{dest: kind(getattr(ns, dest))
           for dest, kind in (("kv_bytes_per_token", int), ("kv_transfer_bandwidth", float))
           if getattr(ns, dest, None) is not None},
        **{"none_hash_seed": none_hash_seed_from_env(), **overrides},
    )
    if ns.vocab_size is not None:
        args.vocab_size = int(ns.vocab_size)
    if hasattr(ns, "perf_model"):  # --perf-model / --num-gpu-blocks-override (perf/cli.py)
        from .perf.cli import apply_perf_args

        args = apply_perf_args(ns, args)
    return args.validate()
