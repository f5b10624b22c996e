"""The perf model's one error type: a start-up configuration error that names the flag."""

from __future__ import annotations

from ..engine.config import ConfigError

AIC_EXTRA_HINT = "pip install 'vllm-vcr[aic]'  (aiconfigurator-core)"


class PerfModelError(ConfigError):
    """An unsupported model/GPU/backend, or the optional extra is missing (the CLI exits 2)."""
