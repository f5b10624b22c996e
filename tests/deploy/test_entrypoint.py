"""The image's entrypoint (MOCK_* environment → flags) and health check, without a container:
every command line it builds is parsed by the real `vllm-vcr` parser."""

from __future__ import annotations

import json

import httpx
import pytest

from vllm_vcr.cli import build_parser
from vllm_vcr.deploy import healthcheck
from vllm_vcr.deploy.entrypoint import ENV_FLAGS, EntrypointError, build_argv
from vllm_vcr.engine_cli import control_address_from_env
from tests.conftest import free_port

# a value each variable accepts, and the parsed attribute it must land in
SAMPLE = {
    "MOCK_TTFT_MS": ("12", "time_to_first_token", 12.0),
    "MOCK_TTFT_STDDEV_MS": ("2", "time_to_first_token_std_dev", 2.0),
    "MOCK_ITL_MS": ("3", "inter_token_latency", 3.0),
    "MOCK_ITL_STDDEV_MS": ("1", "inter_token_latency_std_dev", 1.0),
    "MOCK_PREFILL_OVERHEAD_MS": ("4", "prefill_overhead", 4.0),
    "MOCK_PREFILL_TIME_PER_TOKEN_MS": ("0.5", "prefill_time_per_token", 0.5),
    "MOCK_PREFILL_TIME_STDDEV_MS": ("0.1", "prefill_time_std_dev", 0.1),
    "MOCK_TIME_FACTOR_UNDER_LOAD": ("2.0", "time_factor_under_load", 2.0),
    "MOCK_MAX_NUM_SEQS": ("9", "max_num_seqs", 9),
    "MOCK_MAX_NUM_BATCHED_TOKENS": ("512", "max_num_batched_tokens", 512),
    "MOCK_LONG_PREFILL_TOKEN_THRESHOLD": ("64", "long_prefill_token_threshold", 64),
    "MOCK_SCHEDULING_POLICY": ("priority", "scheduling_policy", "priority"),
    "MOCK_KV_CACHE_SIZE": ("99", "kv_cache_size", 99),
    "MOCK_TOKENS_PER_BLOCK": ("32", "block_size", 32),
    "MOCK_MAX_LORAS": ("2", "max_loras", 2),
    "MOCK_FAILURE_INJECTION_RATE": ("0.25", "failure_injection_rate", 0.25),
    "MOCK_FAILURE_TYPES": ("length,error", "failure_types", "length,error"),
    "MOCK_SIDE_CHANNEL_PORT": ("5700", "side_channel_port", 5700),
    "MOCK_SHUTDOWN_TIMEOUT": ("25", "shutdown_timeout", 25.0),
    "MOCK_ENGINE_COUNT": ("4", "engine_count", 4),
    "MOCK_ENGINE_TYPE": ("sglang", "engine_type", "sglang"),
    "MOCK_SEED": ("7", "seed", 7),
    "MOCK_TIME_SCALE": ("10", "time_scale", 10.0),
    "MOCK_RESPONSE_REPLAY_TRACE": ("/tables/r.jsonl", "response_replay_trace", "/tables/r.jsonl"),
    "MOCK_LATENCY_TRACE": ("/traces/t.jsonl", "latency_trace", "/traces/t.jsonl"),
    "MOCK_REPLAY_TOKENS": ("/traces/t.jsonl", "replay_tokens", "/traces/t.jsonl"),
    "MOCK_REPLAY_STEPS": ("/traces/t.jsonl", "replay_steps", "/traces/t.jsonl"),
    "MOCK_REPLAY_MATCH": ("prefix", "replay_match", "prefix"),
    "MOCK_LOG_REQUESTS": ("1", "log_requests", True),
    "MOCK_ENGINE_ID": ("engine-a", "engine_id", "engine-a"),
    "MOCK_HANDSHAKE_ADDRESS": ("tcp://10.0.0.9:5570", "handshake_address", "tcp://10.0.0.9:5570"),
    "MOCK_FLEET_WORKERS": ("12", "workers", 12),
    "MOCK_FLEET_PROCESSES": ("3", "processes", 3),
    "MOCK_FLEET_CONFIG": ("/etc/fleet/workers.yaml", "workers_config", "/etc/fleet/workers.yaml"),
}


def parse(argv: list[str]):
    parser, _ = build_parser()
    return parser.parse_args(argv)


def test_every_variable_has_a_sample():
    assert {item.env for item in ENV_FLAGS} == set(SAMPLE)


@pytest.mark.parametrize("command", ["serve", "play"])
@pytest.mark.parametrize("item", ENV_FLAGS, ids=lambda item: item.env)
def test_each_variable_lands_in_its_flag(item, command, monkeypatch):
    for name in ("MOCK_CONTROL_ADDRESS", "MOCK_CONTROL_PORT"):
        monkeypatch.delenv(name, raising=False)
    if command not in item.commands:
        assert build_argv([command], {item.env: SAMPLE[item.env][0]}) == build_argv([command], {})
        return
    value, attr, expected = SAMPLE[item.env]
    args = parse(build_argv([command], {item.env: value}))
    assert getattr(args, attr) == expected


def test_serve_defaults_and_derived_flags():
    env = {"MODEL": "acme/m", "VLLM_PORT": "9000", "MOCK_CONTROL_PORT": "8001", "POD_IP": "10.1.2.3",
           "MOCK_PD_ROLE": "prefill", "MOCK_MAX_MODEL_LEN": "8192"}
    args = parse(build_argv([], env))
    assert (args.command, args.model_tag, args.host, args.port) == ("serve", "acme/m", "0.0.0.0", 9000)
    assert args.control_address == "127.0.0.1:8001"  # loopback unless MOCK_CONTROL_HOST says otherwise
    assert args.side_channel_host == "10.1.2.3"
    assert args.worker_type == "prefill"
    assert args.max_model_len == 8192


def test_decode_role_moves_to_8200_and_explicit_flags_win():
    argv = build_argv(["serve", "--port", "8300"], {"MOCK_PD_ROLE": "decode", "MOCK_ITL_MS": "5"})
    assert argv[argv.index("--port") + 1] == "8200"
    args = parse(argv)
    assert args.port == 8300 and args.worker_type == "decode" and args.inter_token_latency == 5.0


def test_play_maps_the_rust_images_identity_and_handshake():
    env = {"MODEL": "acme/m", "POD_NAME": "pod-7", "MOCK_ENGINE_ID": "ignored", "MOCK_HANDSHAKE_PORT": "5570",
           "MOCK_PD_ROLE": "both", "MOCK_MAX_MODEL_LEN": "0"}
    args = parse(build_argv(["play"], env))
    assert args.engine_id == "pod-7"  # POD_NAME wins, as in the Rust entrypoint
    assert args.handshake_address == "tcp://127.0.0.1:5570"
    assert args.model_name == "acme/m" and args.worker_type == "aggregated" and args.max_model_len == 0


def test_kv_events_topic_is_the_one_llm_d_subscribes_to():
    env = {"MOCK_ENABLE_KV_EVENTS": "1", "POD_IP": "10.0.0.5", "MODEL": "acme/m",
           "MOCK_KV_EVENTS_ENDPOINT": "tcp://epp.default.svc:5557"}
    args = parse(build_argv([], env))
    cfg = json.loads(args.kv_events_config)
    assert cfg == {"enable_kv_cache_events": True, "publisher": "zmq",
                   "endpoint": "tcp://epp.default.svc:5557", "topic": "kv@10.0.0.5:8000@acme/m"}
    explicit = json.loads(parse(build_argv([], {**env, "MOCK_KV_EVENTS_TOPIC": "t"})).kv_events_config)
    assert explicit["topic"] == "t"
    assert "--kv-events-config" not in build_argv([], {"MOCK_ENABLE_KV_EVENTS": "0"})


def test_bad_values_name_the_variable():
    with pytest.raises(EntrypointError, match="MOCK_PD_ROLE"):
        build_argv([], {"MOCK_PD_ROLE": "middle"})
    with pytest.raises(EntrypointError, match="MOCK_CONTROL_PORT"):
        build_argv([], {"MOCK_CONTROL_PORT": "eighty"})


def test_unsupported_rust_variables_are_reported_not_fatal():
    warnings: list[str] = []
    argv = build_argv([], {"MOCK_KV_TRANSFER_LATENCY_MS": "10"}, warn=warnings.append)
    assert argv[0] == "serve" and len(warnings) == 1 and "MOCK_KV_TRANSFER_LATENCY_MS" in warnings[0]


def test_extra_args_and_other_commands_pass_through():
    assert build_argv(["serve"], {"MOCK_EXTRA_ARGS": "--seed 3 --mode echo"})[-4:] == ["--seed", "3", "--mode", "echo"]
    assert build_argv(["pd-proxy", "--prefill", "http://p"], {"MOCK_ITL_MS": "3"}) == ["pd-proxy", "--prefill", "http://p"]


@pytest.mark.parametrize("env,expected", [
    ({}, None),
    ({"MOCK_CONTROL_PORT": "8001"}, "127.0.0.1:8001"),
    ({"MOCK_CONTROL_PORT": "8001", "MOCK_CONTROL_HOST": "0.0.0.0"}, "0.0.0.0:8001"),
    ({"MOCK_CONTROL_PORT": "8001", "MOCK_CONTROL_HOST": "::"}, "[::]:8001"),
    ({"MOCK_CONTROL_PORT": "off", "MOCK_CONTROL_HOST": "0.0.0.0"}, None),
    ({"MOCK_CONTROL_PORT": "off"}, None),
    ({"MOCK_CONTROL_ADDRESS": "127.0.0.1:9", "MOCK_CONTROL_PORT": "8001"}, "127.0.0.1:9"),
    ({"MOCK_CONTROL_ADDRESS": "off", "MOCK_CONTROL_PORT": "8001"}, None),
])
def test_control_address_from_env(env, expected):
    assert control_address_from_env(env) == expected


def test_serve_reads_mock_control_port_and_the_health_check_passes(serve_process, monkeypatch):
    control = free_port()
    srv = serve_process("--inter-token-latency", "2", env={"MOCK_CONTROL_PORT": str(control)})
    config = httpx.get(f"http://127.0.0.1:{control}/config", timeout=5).json()
    assert config["inter_token_latency"] == 2.0
    monkeypatch.setenv("VLLM_PORT", str(srv.port))
    monkeypatch.setenv("MOCK_CONTROL_PORT", str(control))
    assert healthcheck.main(["serve"]) == 0
    assert healthcheck.main(["play"]) == 0  # play is asked through its control API
    monkeypatch.setenv("VLLM_PORT", str(free_port()))
    assert healthcheck.main(["serve"]) == 1


def test_the_control_token_stays_out_of_the_command_line_and_the_health_check_sends_it(serve_process, monkeypatch):
    env = {"MOCK_CONTROL_PORT": "8001", "MOCK_CONTROL_TOKEN": "s3cret-token", "VLLM_API_KEY": "api-s3cret"}
    argv = build_argv(["play"], env) + build_argv(["serve"], env)
    assert not any("s3cret" in a for a in argv)  # inherited through the environment, never on argv
    control = free_port()
    serve_process(env={"MOCK_CONTROL_PORT": str(control), "MOCK_CONTROL_TOKEN": "s3cret-token"})
    assert httpx.get(f"http://127.0.0.1:{control}/stats", timeout=5).status_code == 401
    monkeypatch.setenv("MOCK_CONTROL_PORT", str(control))
    monkeypatch.delenv("MOCK_CONTROL_TOKEN", raising=False)
    assert healthcheck.main(["play"]) == 1  # without the token: 401
    monkeypatch.setenv("MOCK_CONTROL_TOKEN", "s3cret-token")
    assert healthcheck.main(["play"]) == 0


def test_fleet_takes_serve_variables_and_numbers_its_ports():
    env = {"MODEL": "acme/m", "VLLM_PORT": "9000", "MOCK_CONTROL_PORT": "8001", "POD_IP": "10.1.2.3",
           "MOCK_PD_ROLE": "both", "MOCK_ITL_MS": "7", "MOCK_FLEET_WORKERS": "50", "MOCK_ENABLE_KV_EVENTS": "1",
           "MOCK_KV_EVENTS_ENDPOINT": "tcp://*:5556", "MOCK_ENGINE_ID": "not-for-a-fleet"}
    args = parse(build_argv(["fleet"], env))
    assert (args.command, args.model_tag, args.host, args.base_port, args.workers) == (
        "fleet", "acme/m", "0.0.0.0", 9000, 50)
    assert (args.control_base_port, args.control_host, args.kv_events_base_port) == (8001, "127.0.0.1", 5556)
    assert args.inter_token_latency == 7.0 and args.port is None and args.control_address is None
    from vllm_vcr.fleet.cli import _check_fleet_flags
    from vllm_vcr.fleet.plan import plan_workers

    _check_fleet_flags(args)
    plans = plan_workers(args, None, env=env)
    assert [p.args.port for p in plans[:2]] == [9000, 9001] and plans[-1].args.control_address == "127.0.0.1:8050"
    assert json.loads(plans[1].args.kv_events_config)["topic"] == "kv@10.1.2.3:9001@acme/m"
    with pytest.raises(EntrypointError, match="MOCK_KV_EVENTS_ENDPOINT"):
        build_argv(["fleet"], {**env, "MOCK_KV_EVENTS_ENDPOINT": "tcp://epp:5557"})
