"""`--perf-model aic` prices the simulated engine's own kernels: SGLang's perf data for
`--engine-type sglang` unless `--perf-backend` says otherwise."""

from __future__ import annotations

import argparse

import pytest

from vllm_vcr.perf.cli import add_perf_args, perf_target


@pytest.mark.parametrize("extra,expected", [([], "vllm"), (["--engine-type", "sglang"], "sglang"),
                                            (["--engine-type", "sglang", "--perf-backend", "vllm"], "vllm")])
def test_perf_backend_follows_the_engine_type(extra, expected):
    pytest.importorskip("aiconfigurator_core", reason="the aic extra is not installed: pip install 'vllm-vcr[aic]'")
    parser = argparse.ArgumentParser()
    add_perf_args(parser)
    parser.add_argument("--engine-type", default="vllm")
    parser.add_argument("--served-model-name", nargs="*", default=["Qwen/Qwen3-8B"])
    ns = parser.parse_args(["--perf-model", "aic", *extra])
    assert perf_target(ns)["backend"] == expected
