"""The PATCH /config and PUT /log body checks that need no engine."""

from __future__ import annotations

import json

import pytest

from vllm_vcr.control.schema import CONFIG_FIELDS, ControlError, parse_config_patch, parse_log_request
from vllm_vcr.engine.config import EngineConfig


def body(obj) -> bytes:
    return json.dumps(obj).encode()


def status_of(raw: bytes) -> int:
    with pytest.raises(ControlError) as ei:
        parse_config_patch(raw)
    return ei.value.status


def test_config_fields_are_the_14_of_the_seed_and_the_output_length():
    assert CONFIG_FIELDS == (
        "time_to_first_token", "time_to_first_token_std_dev", "inter_token_latency",
        "inter_token_latency_std_dev", "prefill_overhead", "prefill_time_per_token",
        "prefill_time_std_dev", "time_factor_under_load", "max_num_seqs", "max_num_batched_tokens",
        "max_model_len", "failure_injection_rate", "failure_types", "log_requests",
        "output_length_distribution", "output_length_mean", "output_length_std_dev", "output_length_histogram",
    )


def test_valid_patch_keeps_only_named_fields():
    patch = parse_config_patch(body({"time_to_first_token": 1000, "inter_token_latency": 50}))
    assert patch == {"time_to_first_token": 1000.0, "inter_token_latency": 50.0}
    patch = parse_config_patch(body({"failure_injection_rate": 1.0, "failure_types": ["error", "length"]}))
    assert patch == {"failure_injection_rate": 1.0, "failure_types": ["error", "length"]}
    assert parse_config_patch(b"{}") == {}
    # the result applies cleanly to a config
    assert EngineConfig().patched(patch).failure_injection_rate == 1.0


@pytest.mark.parametrize(
    "raw",
    [b"", b"not json", b"[1, 2]", b'"x"', b"null", b'{"max_num_seqs": 1,}'],
)
def test_not_json_object_is_422(raw):
    assert status_of(raw) == 422


@pytest.mark.parametrize(
    "obj",
    [
        {"failure_types": ["timeout"]},
        {"failure_types": "error"},
        {"max_num_seqs": "8"},
        {"max_num_seqs": 1.5},
        {"max_num_seqs": True},
        {"time_to_first_token": "fast"},
        {"time_to_first_token": None},
        {"log_requests": "yes"},
        {"output_length_mean": "long"},
        {"output_length_histogram": [1, 64]},
        {"bogus": 1},
        {"max_num_seqs": 4, "time_to_first_tokens": 1},
    ],
)
def test_schema_mismatch_is_422(obj):
    assert status_of(body(obj)) == 422


@pytest.mark.parametrize(
    "obj",
    [
        {"failure_injection_rate": 1.5},
        {"failure_injection_rate": -0.1},
        {"time_factor_under_load": 0.5},
        {"failure_types": []},
        {"time_to_first_token": -1},
        {"inter_token_latency_std_dev": -0.5},
        {"prefill_time_per_token": -3},
        {"max_num_seqs": 0},
        {"max_model_len": -1},
        {"output_length_distribution": "zipf"},
        {"output_length_mean": 0},
        {"output_length_std_dev": -1},
        {"output_length_distribution": "histogram"},
        {"output_length_histogram": "1-64"},
        {"output_length_histogram": "64-1:1"},
    ],
)
def test_bad_value_is_400(obj):
    assert status_of(body(obj)) == 400


def test_out_of_range_number_is_not_json():
    assert status_of(b'{"time_to_first_token": 1e999}') == 422


@pytest.mark.parametrize(
    "name",
    ["time_scale", "shutdown_timeout", "kv_cache_size", "tokens_per_block", "engine_id",
     "latency_trace", "replay_tokens", "replay_steps", "seed", "mode"],
)
def test_not_patchable_is_400_saying_so(name):
    with pytest.raises(ControlError) as ei:
        parse_config_patch(body({name: 1, "max_num_seqs": 4}))
    assert ei.value.status == 400
    assert "cannot change at run time" in ei.value.message
    assert name in ei.value.message


def test_log_request():
    assert parse_log_request(body({"filter": "vllm_vcr::engine=trace,info"})) == "vllm_vcr::engine=trace,info"
    for raw in [b"nope", body({}), body({"filter": 3}), body({"filter": "info", "x": 1}), body(["info"])]:
        with pytest.raises(ControlError) as ei:
            parse_log_request(raw)
        assert ei.value.status == 422
