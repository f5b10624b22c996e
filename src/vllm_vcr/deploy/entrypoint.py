"""The container image's entrypoint: the Rust vllm-vcr image's environment, mapped to flags.

    vllm-vcr-entrypoint [serve|play|pd-proxy|COMMAND] [EXTRA FLAGS...]

The first argument picks the subcommand (default `serve`); the environment below becomes its
flags, then the extra flags follow (so an explicit flag wins over the environment: argparse keeps
the last value). The process then *becomes* `vllm-vcr` (exec), so it is PID 1 and gets the
pod's SIGTERM itself. Names and defaults follow the Rust image's `entrypoint.sh`; the variables
marked "ours" are vllm-vcr additions. Unset or empty variables add no flag (the CLI default
applies). `MOCK_KV_TRANSFER_*` has no equivalent here (the KV link is a bandwidth model): those
are reported on stderr and ignored, so a manifest written for the Rust image still starts.

The control API listens on 127.0.0.1:MOCK_CONTROL_PORT unless MOCK_CONTROL_HOST (or
MOCK_CONTROL_ADDRESS) says otherwise. MOCK_CONTROL_TOKEN and VLLM_API_KEY never become flags:
`vllm-vcr` reads them from the environment it inherits, so they stay out of the process list and
out of the command line this entrypoint logs.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Callable, Mapping

from ..engine_cli import control_address_from_env

SERVE, PLAY, FLEET = "serve", "play", "fleet"
BOTH = (SERVE, PLAY)
DEFAULT_KV_EVENTS_ENDPOINT = "tcp://*:5556"  # the Rust image's default (its binary says 5557)
DEFAULT_HANDSHAKE_PORT = 29550


@dataclass(frozen=True)
class EnvFlag:
    """One environment variable that becomes one flag of the listed subcommands."""

    env: str
    flag: str
    commands: tuple[str, ...] = BOTH
    meaning: str = ""
    switch: bool = False  # "1"/"true" adds the bare flag, anything else adds nothing

    def argv(self, value: str) -> list[str]:
        if self.switch:
            return [self.flag] if _truthy(value) else []
        return [self.flag, value]


# The variables that map one to one; the ones needing logic are in `_derived_flags`.
ENV_FLAGS: tuple[EnvFlag, ...] = (
    EnvFlag("MOCK_TTFT_MS", "--time-to-first-token", meaning="TTFT mean (ms)"),
    EnvFlag("MOCK_TTFT_STDDEV_MS", "--time-to-first-token-std-dev", meaning="TTFT std dev (ms)"),
    EnvFlag("MOCK_ITL_MS", "--inter-token-latency", meaning="inter-token latency mean (ms)"),
    EnvFlag("MOCK_ITL_STDDEV_MS", "--inter-token-latency-std-dev", meaning="ITL std dev (ms)"),
    EnvFlag("MOCK_PREFILL_OVERHEAD_MS", "--prefill-overhead", meaning="fixed prefill cost (ms)"),
    EnvFlag("MOCK_PREFILL_TIME_PER_TOKEN_MS", "--prefill-time-per-token", meaning="prefill ms per uncached token"),
    EnvFlag("MOCK_PREFILL_TIME_STDDEV_MS", "--prefill-time-std-dev", meaning="prefill std dev (ms)"),
    EnvFlag("MOCK_TIME_FACTOR_UNDER_LOAD", "--time-factor-under-load", meaning="latency factor at max-num-seqs"),
    EnvFlag("MOCK_MAX_NUM_SEQS", "--max-num-seqs", meaning="running-batch cap (default 128)"),
    EnvFlag("MOCK_MAX_NUM_BATCHED_TOKENS", "--max-num-batched-tokens", meaning="token budget per step"),
    EnvFlag("MOCK_LONG_PREFILL_TOKEN_THRESHOLD", "--long-prefill-token-threshold", meaning="per-step prefill cap"),
    EnvFlag("MOCK_SCHEDULING_POLICY", "--scheduling-policy", meaning="fcfs or priority"),
    EnvFlag("MOCK_KV_CACHE_SIZE", "--kv-cache-size", meaning="KV capacity in blocks"),
    EnvFlag("MOCK_TOKENS_PER_BLOCK", "--block-size", meaning="tokens per KV block (KV events too)"),
    EnvFlag("MOCK_MAX_LORAS", "--max-loras", (PLAY,), meaning="max_loras reported to the frontend"),
    EnvFlag("MOCK_FAILURE_INJECTION_RATE", "--failure-injection-rate", meaning="probability a request fails"),
    EnvFlag("MOCK_FAILURE_TYPES", "--failure-types", meaning="comma list: error,length,repetition"),
    EnvFlag("MOCK_SIDE_CHANNEL_PORT", "--side-channel-port", meaning="KV side-channel base port"),
    EnvFlag("MOCK_SHUTDOWN_TIMEOUT", "--shutdown-timeout", meaning="seconds to drain on SIGTERM (ours)"),
    EnvFlag("MOCK_ENGINE_COUNT", "--engine-count", meaning="DP ranks in this process (ours)"),
    EnvFlag("MOCK_ENGINE_TYPE", "--engine-type", meaning="vllm or sglang: metric names, routes (ours)"),
    EnvFlag("MOCK_SEED", "--seed", meaning="base seed (ours)"),
    EnvFlag("MOCK_TIME_SCALE", "--time-scale", meaning="divide every delay by this (ours)"),
    EnvFlag("MOCK_RESPONSE_REPLAY_TRACE", "--response-replay-trace", meaning="replay table JSONL (ours)"),
    EnvFlag("MOCK_LATENCY_TRACE", "--latency-trace", meaning="pace requests like this trace (ours)"),
    EnvFlag("MOCK_REPLAY_TOKENS", "--replay-tokens", meaning="replay output tokens of this trace (ours)"),
    EnvFlag("MOCK_REPLAY_STEPS", "--replay-steps", meaning="replay timing of this trace (ours)"),
    EnvFlag("MOCK_REPLAY_MATCH", "--replay-match", meaning="index or prefix (ours)"),
    EnvFlag("MOCK_LOG_REQUESTS", "--log-requests", switch=True, meaning="1: log every request"),
    EnvFlag("MOCK_ENGINE_ID", "--engine-id", (PLAY,), meaning="instance id (POD_NAME wins)"),
    EnvFlag("MOCK_HANDSHAKE_ADDRESS", "--handshake-address", (PLAY,), meaning="frontend handshake (ours)"),
    EnvFlag("MOCK_FLEET_WORKERS", "--workers", (FLEET,), meaning="fleet: workers in the pod (ours)"),
    EnvFlag("MOCK_FLEET_PROCESSES", "--processes", (FLEET,), meaning="fleet: host processes (ours)"),
    EnvFlag("MOCK_FLEET_CONFIG", "--workers-config", (FLEET,), meaning="fleet: YAML file of workers (ours)"),
)

# The Rust image's KV-transfer knobs: no counterpart in this engine's KV link model.
UNSUPPORTED = {
    name: "the KV link is modelled by --kv-transfer-bandwidth and --kv-bytes-per-token; pass them as flags"
    for name in ("MOCK_KV_TRANSFER_LATENCY_MS", "MOCK_KV_TRANSFER_LATENCY_STDDEV_MS",
                 "MOCK_KV_TRANSFER_TIME_PER_TOKEN_MS", "MOCK_KV_TRANSFER_TIME_STDDEV_MS")
}
_PD_ROLES = {"both": "aggregated", "aggregated": "aggregated", "prefill": "prefill", "decode": "decode"}


class EntrypointError(ValueError):
    """A variable with a value the entrypoint cannot map (the message names it)."""


def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def _get(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    return value if value not in (None, "") else None


def control_address(env: Mapping[str, str]) -> str | None:
    """The CLI's own reading of MOCK_CONTROL_ADDRESS / MOCK_CONTROL_PORT, with the port checked here
    so that a typo stops the container with the variable's name."""
    port = _get(env, "MOCK_CONTROL_PORT")
    if _get(env, "MOCK_CONTROL_ADDRESS") is None and port is not None and port.lower() != "off" \
            and not (port.isdigit() and 0 < int(port) < 65536):
        raise EntrypointError(f"MOCK_CONTROL_PORT must be a port number or 'off', got {port!r}")
    return control_address_from_env(env)


def _pd_role(env: Mapping[str, str]) -> str | None:
    role = _get(env, "MOCK_PD_ROLE")
    if role is None:
        return None
    if role.lower() not in _PD_ROLES:
        raise EntrypointError(f"MOCK_PD_ROLE must be both, prefill or decode, got {role!r}")
    return _PD_ROLES[role.lower()]


def default_port(env: Mapping[str, str]) -> str:
    """VLLM_PORT; else 8000, or 8200 for a decode worker (the Rust image: a routing sidecar owns 8000)."""
    return _get(env, "VLLM_PORT") or ("8200" if _pd_role(env) == "decode" else "8000")


def kv_events_config(env: Mapping[str, str]) -> str | None:
    """MOCK_ENABLE_KV_EVENTS=1 → vLLM's --kv-events-config JSON. The default topic is the one
    llm-d's KV-cache-aware router subscribes to: kv@<pod ip>:<port>@<model>."""
    if not _truthy(env.get("MOCK_ENABLE_KV_EVENTS", "0")):
        return None
    topic = _get(env, "MOCK_KV_EVENTS_TOPIC")
    if topic is None:
        pod = _get(env, "POD_IP")
        pod = f"{pod}:{default_port(env)}" if pod else (_get(env, "POD_NAME") or "mock-engine-0")
        topic = f"kv@{pod}@{_get(env, 'MODEL') or ''}"
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": _get(env, "MOCK_KV_EVENTS_ENDPOINT") or DEFAULT_KV_EVENTS_ENDPOINT,
                       "topic": topic})


def _fleet_flags(env: Mapping[str, str]) -> list[str]:
    """A fleet in the pod: worker i on VLLM_PORT + i, its control API on MOCK_CONTROL_PORT + i, its
    KV events on the endpoint's port + i (each worker publishes its own topic)."""
    out = ["--base-port", default_port(env)]
    port = _get(env, "MOCK_CONTROL_PORT")
    if port is not None and port.lower() != "off":
        if not (port.isdigit() and 0 < int(port) < 65536):
            raise EntrypointError(f"MOCK_CONTROL_PORT must be a port number or 'off', got {port!r}")
        out += ["--control-base-port", port, "--control-host", _get(env, "MOCK_CONTROL_HOST") or "127.0.0.1"]
    if _truthy(env.get("MOCK_ENABLE_KV_EVENTS", "0")):
        endpoint = _get(env, "MOCK_KV_EVENTS_ENDPOINT") or DEFAULT_KV_EVENTS_ENDPOINT
        host, _, kv_port = endpoint.rpartition(":")
        if not (host.endswith("*") and kv_port.isdigit()):
            raise EntrypointError(f"MOCK_KV_EVENTS_ENDPOINT: a fleet binds one port per worker, so it must be "
                                  f"tcp://*:PORT, got {endpoint!r}")
        out += ["--kv-events-base-port", kv_port]
    return out


def _derived_flags(command: str, env: Mapping[str, str]) -> list[str]:
    out: list[str] = []
    model = _get(env, "MODEL")
    if command == FLEET:
        if model:
            out.append(model)
        out += ["--host", _get(env, "VLLM_HOST") or "0.0.0.0", *_fleet_flags(env)]
        max_len = _get(env, "MOCK_MAX_MODEL_LEN")
        if max_len and max_len != "0":
            out += ["--max-model-len", max_len]
        return out
    if command == SERVE:
        if model:
            out.append(model)
        out += ["--host", _get(env, "VLLM_HOST") or "0.0.0.0", "--port", default_port(env)]
        max_len = _get(env, "MOCK_MAX_MODEL_LEN")
        if max_len and max_len != "0":  # 0 means "no check" in the Rust image; serve's default applies
            out += ["--max-model-len", max_len]
    else:
        if model:
            out += ["--model-name", model]
        if _get(env, "POD_NAME"):
            out += ["--engine-id", env["POD_NAME"]]
        port = _get(env, "MOCK_HANDSHAKE_PORT")
        if port and not _get(env, "MOCK_HANDSHAKE_ADDRESS"):
            out += ["--handshake-address", f"tcp://127.0.0.1:{port}"]
        if _get(env, "MOCK_MAX_MODEL_LEN"):
            out += ["--max-model-len", env["MOCK_MAX_MODEL_LEN"]]
    role = _pd_role(env)
    if role:
        out += ["--worker-type", role]
    if _get(env, "POD_IP"):
        out += ["--side-channel-host", env["POD_IP"]]
    address = control_address(env)
    if address:
        out += ["--control-address", address]
    kv = kv_events_config(env)
    if kv:
        out += ["--kv-events-config", kv]
    return out


def build_argv(args: list[str], env: Mapping[str, str], warn: Callable[[str], None] = lambda m: None) -> list[str]:
    """The `vllm-vcr` command line for the entrypoint's arguments and environment."""
    command = args[0] if args and not args[0].startswith("-") else SERVE
    rest = args[1:] if args and not args[0].startswith("-") else list(args)
    argv = [command]
    if command in BOTH or command == FLEET:
        argv += _derived_flags(command, env)
        overridden = {"MOCK_ENGINE_ID"} if _get(env, "POD_NAME") else set()  # POD_NAME is the engine id
        # a fleet's workers take serve's flags
        takes = (SERVE, FLEET) if command == FLEET else (command,)
        for item in ENV_FLAGS:
            value = _get(env, item.env)
            if value is not None and any(c in item.commands for c in takes) and item.env not in overridden:
                argv += item.argv(value)
        for name, why in UNSUPPORTED.items():
            if _get(env, name) is not None:
                warn(f"vllm-vcr-entrypoint: {name} is ignored: {why}")
        extra = _get(env, "MOCK_EXTRA_ARGS")
        if extra:
            argv += shlex.split(extra)
    return argv + rest


def main(args: list[str] | None = None) -> int:
    args = sys.argv[1:] if args is None else args
    try:
        argv = build_argv(args, os.environ, warn=lambda m: print(m, file=sys.stderr, flush=True))
    except EntrypointError as e:
        print(f"vllm-vcr-entrypoint: error: {e}", file=sys.stderr)
        return 2
    print("vllm-vcr-entrypoint: vllm-vcr " + shlex.join(argv), file=sys.stderr, flush=True)
    exe = os.path.join(os.path.dirname(sys.executable), "vllm-vcr")
    if os.path.exists(exe):
        os.execv(exe, [exe, *argv])
    os.execv(sys.executable, [sys.executable, "-m", "vllm_vcr", *argv])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
