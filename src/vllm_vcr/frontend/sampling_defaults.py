"""The server's default sampling values: what a request leaves unset takes them, as vLLM's
frontends do with `ModelConfig.get_diff_sampling_param()` (`--generation-config`,
`--override-generation-config`; read by model_config.generation_defaults).

vLLM's priority is the request's value, then the server's default, then the OpenAI default. A
default `max_tokens` (the generation config's `max_new_tokens`) is the output limit of a request
that sets none; a cap (`max_new_tokens` of a `--generation-config` folder, or of
`--override-generation-config` with `auto`/`vllm`) limits every request (`get_max_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# the sampling fields a generation config can set (vLLM's `available_params`, max_new_tokens apart)
SAMPLING_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
                   "min_p")


@dataclass(frozen=True)
class SamplingDefaults:
    values: dict[str, Any] = field(default_factory=dict)  # SAMPLING_FIELDS the server sets
    max_tokens: int | None = None  # the output limit of a request that sets none
    max_tokens_cap: int | None = None  # the output limit of every request

    def __bool__(self) -> bool:
        return bool(self.values) or self.max_tokens is not None or self.max_tokens_cap is not None

    def fill(self, req: Any) -> None:
        """Give the request's unset (None) sampling fields the server's values."""
        for name, value in self.values.items():
            if getattr(req, name, 0) is None:
                setattr(req, name, value)

    def limit(self, prompt_len: int, max_model_len: int, max_tokens: int | None) -> int:
        """vLLM's get_max_tokens: the request's limit (else the server's default), within the room
        the prompt leaves and the server's cap."""
        wanted = self.max_tokens if max_tokens is None else max_tokens
        limit = max_model_len - prompt_len if wanted is None else min(max_model_len - prompt_len, wanted)
        cap = self.max_tokens_cap
        return limit if cap is None else min(limit, cap)

    def describe(self) -> dict[str, Any]:
        """What vLLM logs as its overridden defaults (max_new_tokens as max_tokens)."""
        out = dict(self.values)
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        return out


NO_DEFAULTS = SamplingDefaults()
