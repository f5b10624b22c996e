"""The perf model's one error type: a start-up configuration error that names the flag."""

from __future__ import annotations

import json
from typing import Any

from ..engine.config import ConfigError

AIC_EXTRA_HINT = "pip install 'vllm-vcr[aic]'  (aiconfigurator-core)"


class PerfModelError(ConfigError):
    """An unsupported model/GPU/backend, or the optional extra is missing (the CLI exits 2)."""


def json_flag(value: Any, flag: str) -> Any:
    """A flag's JSON value (vLLM's config flags: `--compilation-config`, `--quantization-config`):
    a string parsed, anything else as given; PerfModelError naming the flag when it is not JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        raise PerfModelError(f"{flag}: invalid JSON {value!r}") from None
