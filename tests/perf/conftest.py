"""The perf-model tests need the optional extra (aiconfigurator-core); .ci/run installs it."""

from __future__ import annotations

import importlib.util

import pytest

HAVE_AIC = importlib.util.find_spec("aiconfigurator_core") is not None
needs_aic = pytest.mark.skipif(not HAVE_AIC, reason="the aic extra is not installed: pip install 'vllm-vcr[aic]'")

LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
