"""MockServerConfig: the `vllm-vcr serve` command line as a typed object."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Sequence


@dataclass
class MockServerConfig:
    """Flags of `vllm-vcr serve`; a field left None keeps the command's default. Latencies are
    milliseconds, as on the command line and in the control API. Anything else goes in
    `extra_args`, verbatim (e.g. `["--response-replay-trace", "table.jsonl"]`)."""

    model: str | None = None  # served name (or a local tokenizer directory); default vllm-vcr/sim
    served_model_name: Sequence[str] | None = None
    time_to_first_token: float | None = None
    time_to_first_token_std_dev: float | None = None
    inter_token_latency: float | None = None
    inter_token_latency_std_dev: float | None = None
    prefill_overhead: float | None = None
    prefill_time_per_token: float | None = None
    time_factor_under_load: float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    kv_cache_size: int | None = None
    block_size: int | None = None
    failure_injection_rate: float | None = None
    failure_types: Sequence[Literal["error", "length", "repetition"]] | None = None
    mode: Literal["random", "echo"] | None = None
    seed: int | None = None
    time_scale: float | None = None
    engine_count: int | None = None
    api_key: str | None = None
    shutdown_timeout: float | None = None
    log_requests: bool | None = None
    extra_args: Sequence[str] = field(default_factory=tuple)

    def replace(self, **changes: object) -> "MockServerConfig":
        return dataclasses.replace(self, **changes)

    def to_argv(self) -> list[str]:
        """The flags, in `vllm-vcr serve` syntax (without host, port and control address)."""
        argv: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or f.name == "extra_args":
                continue
            flag = "--" + f.name.replace("_", "-")
            if f.name == "model":
                argv.insert(0, value)
            elif isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            elif f.name == "served_model_name":
                argv += [flag, *value]
            elif f.name == "failure_types":
                argv += [flag, ",".join(value)]
            else:
                argv += [flag, str(value)]
        return argv + list(self.extra_args)
