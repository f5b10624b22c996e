"""The simulator's flags reach EngineArgs, and bad values are errors that name the flag."""

import argparse

import pytest

from vllm_vcr.engine.config import ConfigError
from vllm_vcr.engine_cli import add_engine_args, engine_args_from_cli


def parse(*argv: str):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_args_from_cli(p.parse_args(list(argv)))


def test_flags_reach_engine_args(monkeypatch):
    monkeypatch.delenv("MOCK_LOG_REQUESTS", raising=False)
    a = parse("--worker-type", "prefill", "--kv-bytes-per-token", "2048", "--kv-transfer-bandwidth", "3.5",
              "--kv-hold-timeout", "12", "--startup-time", "1.5", "--startup-failure", "oom",
              "--reasoning", "1,2,0.25", "--replay-match", "prefix", "--inter-token-latency", "0.25")
    assert (a.worker_type, a.kv_bytes_per_token, a.kv_transfer_bandwidth, a.kv_hold_timeout) == ("prefill", 2048, 3.5, 12.0)
    assert (a.startup_time, a.startup_failure, a.reasoning, a.replay_match) == (1.5, "oom", "1,2,0.25", "prefix")
    assert a.config.inter_token_latency == 0.25 and a.config.log_requests is False


def test_pythonhashseed_reaches_the_engine_as_its_none_hash_seed(monkeypatch):
    """vLLM seeds NONE_HASH with $PYTHONHASHSEED: the CLI reads it, the engine gets it in EngineArgs."""
    from vllm_vcr.engine.clock import VirtualClock
    from vllm_vcr.engine.core import EngineCore

    from .test_block_hash import VECTORS

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    a = parse()
    assert a.none_hash_seed == "0"
    assert EngineCore(a, clock=VirtualClock(0.0)).kv.hasher.none_hash.hex() == VECTORS[1][6]
    monkeypatch.delenv("PYTHONHASHSEED")
    a = parse()
    assert a.none_hash_seed is None
    assert EngineCore(a, clock=VirtualClock(0.0)).kv.hasher.seed == "vllm-none-hash"


def test_latency_trace_model_flag():
    assert parse().latency_trace_model == "auto"
    assert parse("--latency-trace", "t.jsonl", "--latency-trace-model", "cells").latency_trace_model == "cells"
    with pytest.raises(SystemExit):
        parse("--latency-trace-model", "fit")  # the fitted model (ported from the Rust vllm-vcr) was removed


def test_log_requests_from_the_environment(monkeypatch):
    monkeypatch.setenv("MOCK_LOG_REQUESTS", "1")
    assert parse().config.log_requests is True


@pytest.mark.parametrize("argv,flag", [
    (["--failure-injection-rate", "2"], "--failure-injection-rate"),
    (["--time-factor-under-load", "0.5"], "--time-factor-under-load"),
    (["--failure-types", "error,boom"], "--failure-types"),
    (["--reasoning", "1,2"], "--reasoning"),
    (["--latency-trace", "t.jsonl", "--inter-token-latency", "5"], "--inter-token-latency"),
])
def test_bad_values_name_the_flag(argv, flag):
    with pytest.raises(ConfigError, match=flag):
        parse(*argv)
