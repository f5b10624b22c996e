"""`vllm-vcr serve` takes `vllm serve`'s command line: every option of vLLM 0.32/0.33 (from the
table serve/vllm_args.py loads), vLLM's argument forms, a help that fits a screen, one-line
argument errors, and the options with an effect here (KV size from bytes, the queue limit, the
data-parallel rank, the log level)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from vllm_vcr.cli import build_parser
from vllm_vcr.serve.vllm_args import IGNORED_MARK, load_table, option_key, sample_args, spec_problems

TINY = Path.home() / ".cache" / "vllm-vcr" / "peers" / "tinymodel"


@pytest.fixture(scope="module")
def parser():
    p, loaded = build_parser()
    return p, loaded["serve"]


def _parse(parser, *argv: str) -> argparse.Namespace:
    p, serve = parser
    args, rest = p.parse_known_args(serve.expand_argv(["serve", *argv]))
    assert not rest, rest
    return args


def _options():
    return [o for o in load_table()["options"] if o["option_strings"]]


def test_the_table_covers_both_releases():
    table = load_table()
    assert table["vllm_versions"] == ["0.32", "0.33"]
    assert len(_options()) >= 317  # 0.32 has 317 options, 0.33 four more
    assert spec_problems(table, table) == []


def test_every_option_string_of_every_release_parses(parser, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("{}\n")
    for opt in _options():
        args = sample_args(opt, {"--config": [str(config)]})
        for spelling in opt["option_strings"]:  # -tp, --disable-prefix-caching, --no-enable-lora, ...
            _parse(parser, spelling, *args[1:])


def test_vllms_defaults_types_and_negative_forms(parser):
    a = _parse(parser)
    assert a.port == 8000 and a.host is None and a.max_num_queued_reqs is None and a.data_parallel_size == 1
    a = _parse(parser, "--max-model-len", "4k", "--disable-prefix-caching", "--kv-cache-memory-bytes", "1G",
               "--no-enable-chunked-prefill", "--data-parallel-rank", "3")
    assert (a.max_model_len, a.enable_prefix_caching, a.kv_cache_memory_bytes, a.enable_chunked_prefill,
            a.data_parallel_rank) == (4000, False, 1 << 30, False, 3)
    assert _parse(parser, "--max-model-len", "auto").max_model_len == -1
    assert _parse(parser, "--max-num-queued-reqs", "None").max_num_queued_reqs is None


def test_ignored_options_are_kept_apart_with_their_values(parser):
    from vllm_vcr.serve.ignored_flags import ignored_flags

    a = _parse(parser, "-tp", "4", "--enforce-eager", "--no-trust-remote-code", "--compilation-config.mode", "3",
               "-O3", "--dtype", "half")
    assert ignored_flags(a) == ['--compilation-config={"mode":3}', "--dtype=half", "--enforce-eager",
                                "--optimization-level=3", "--tensor-parallel-size=4", "--no-trust-remote-code"]


def test_vllms_argument_forms(parser):
    a = _parse(parser, "--max_num_seqs=7", "--served_model_name", "m", "--kv-transfer-config.kv_role", "kv_both",
               "--kv-transfer-config.kv_connector", "X")
    assert a.max_num_seqs == 7 and a.served_model_name == ["m"]
    assert a.ignored__kv_transfer_config == {"kv_role": "kv_both", "kv_connector": "X"}


def test_the_simulators_own_definitions_accept_what_vllm_does(parser):
    """A vLLM option the simulator defines itself (engine, perf, LoRA flags) takes vLLM's values."""
    p, _ = parser
    serve = p._subparsers._group_actions[0].choices["serve"]
    for opt in _options():
        action = serve._option_string_actions[opt["option_strings"][0]]
        if hasattr(action, "vllm_option"):
            continue
        takes_value = action.nargs != 0
        assert takes_value == (opt["kind"] in ("value", "append")), opt["option_strings"]
        if action.choices is not None and opt["choices"] is not None:
            missing = [c for c in opt["choices"] if c is not None and c not in action.choices]
            assert not missing, (opt["option_strings"], missing)


def _serve(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_vcr", "serve", *argv], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("argv, names", [
    (["--max-num-seqs", "x"], "argument --max-num-seqs: invalid int value: 'x'"),
    (["--max-num-queued-reqs", "x"], "argument --max-num-queued-reqs: Value x cannot be converted to <class 'int'>."),
    (["--prefix-caching-hash-algo", "md5"], "argument --prefix-caching-hash-algo: invalid choice: 'md5'"),
    (["--max-model-len", "1.5K"], "Did you mean to use 1.5k instead?"),
    (["--max-num-seqz"], "unrecognized arguments: --max-num-seqz (did you mean --max-num-seqs?"),
    (["--max-num-seqs", "0", "--port", "0"], "--max-num-seqs: must be >= 1, got 0"),
    (["--tool-call-parser", "nope", "--port", "0"], "--tool-call-parser: invalid tool call parser: nope"),
    (["--watermark", "1.5", "--port", "0"], "--watermark must be in [0, 1), got 1.5"),
    (["--max-num-queued-tokens", "-1", "--port", "0"], "--max-num-queued-tokens: must be >= 0, got -1"),
    (["--sse-keep-alive-interval", "-1", "--port", "0"], "--sse-keep-alive-interval: must be >= 0, got -1"),
    (["--max-num-seqs", "8", "--max-num-active-seqs", "9", "--port", "0"],
     "--max-num-active-seqs: max_num_active_seqs (9) cannot be greater than max_num_seqs (8)."),
    (["--max-num-scheduled-tokens", "1.5K", "--port", "0"], "Did you mean to use 1.5k instead?"),
    (["--chat-template-content-format", "parts", "--port", "0"],
     "argument --chat-template-content-format: invalid choice: 'parts'"),
])
def test_an_argument_error_is_one_line_naming_the_flag(argv, names):
    r = _serve(*argv)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("vllm-vcr serve: error: ") and names in lines[0]


def test_help_first_screen_groups_and_search():
    first = _serve("--help").stdout
    lines = first.splitlines()
    assert len(lines) < 90
    head = "\n".join(lines[:30])
    for flag in ("--host", "--port", "--model", "--time-to-first-token"):
        assert flag in head
    assert "CacheConfig" in first and "--help=all" in first
    everything = _serve("--help=all").stdout
    for opt in _options():
        assert opt["option_strings"][0] in everything
    group = _serve("--help=CacheConfig").stdout
    assert "--block-size" in group and "--kv-cache-memory-bytes" in group and "--port" not in group
    found = _serve("--help=max_model").stdout
    assert "Arguments matching 'max-model'" in found and "--max-model-len" in found
    ignored = _serve("--help=ignored").stdout
    assert "--enforce-eager" in ignored and "--max-num-seqs" not in ignored
    assert IGNORED_MARK.format(reason="used only by --perf-model aic with --perf-eager-layer-us (steps above it run without CUDA graphs)") \
        in " ".join(ignored.split())
    assert "No group or arguments matching 'zzz'" in _serve("--help=zzz").stdout


def test_ignored_options_are_reported_once_at_start_up(serve_process):
    sp = serve_process("-tp", "2", "--enforce-eager", "--gpu-memory-utilization", "0.5", "--kv-cache-dtype", "fp8")
    lines = [line for line in sp.log().splitlines() if "ignoring vLLM flags" in line]
    assert len(lines) == 1
    assert "--enforce-eager" in lines[0] and "--tensor-parallel-size=2" in lines[0]
    assert "--kv-cache-dtype=fp8" in lines[0]


@pytest.mark.skipif(not (TINY / "config.json").is_file(), reason="the peers' tiny model is not installed")
def test_kv_cache_memory_bytes_sizes_the_cache_from_the_models_bytes_per_block(serve_process):
    # tiny model: 2 layers x 1 KV head x 32 dims x 2 (K, V) x 2 bytes = 256 bytes per token
    sp = serve_process(str(TINY), "--kv-cache-memory-bytes", "1M", "--block-size", "32")
    text = httpx.get(sp.url + "/metrics").text
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert f'num_gpu_blocks="{(1 << 20) // (256 * 32)}"' in info and 'block_size="32"' in info


def test_max_num_queued_reqs_refuses_with_vllms_503(serve_process):
    sp = serve_process("--max-num-queued-reqs", "1", "--inter-token-latency", "500")
    client = openai.OpenAI(base_url=sp.url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    slow = client.completions.create(model=model, prompt="hi", max_tokens=200, stream=True,
                                     extra_body={"ignore_eos": True})
    next(iter(slow))  # admitted and running: 200 tokens 0.5 s apart
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=model, prompt="hi", max_tokens=2)
    assert e.value.status_code == 503
    assert e.value.body["message"].startswith("The engine is currently busy and cannot accept new requests.")
    assert e.value.body["type"] == "Service Unavailable"
    slow.close()
    text = httpx.get(sp.url + "/metrics").text
    assert re.search(r'vllm:admission_rejections_total\{[^}]*reason="max_num_queued_reqs"[^}]*\} [1-9]', text)


def test_data_parallel_rank_labels_the_engine(serve_process):
    sp = serve_process("--data-parallel-rank", "3")
    text = httpx.get(sp.url + "/metrics").text
    assert 'engine="3"' in text and 'engine="0"' not in text


def test_log_level_sets_every_loggers_level(serve_process):
    quiet = serve_process("--log-level", "ERROR")
    assert "listening on" not in quiet.log()
    assert "listening on" in serve_process("--log-level", "INFO").log()


def test_option_key_names_positional_and_flags():
    assert option_key({"option_strings": [], "dest": "model_tag"}) == "model_tag"
    assert option_key({"option_strings": ["--a", "-a"], "dest": "a"}) == "--a"


def test_docs_list_the_accepted_and_ignored_options():
    from vllm_vcr.serve import flag_docs

    page = (Path(__file__).resolve().parents[2] / "docs" / "serve.md").read_text(encoding="utf-8")
    assert flag_docs.generated_section(page) == flag_docs.render(), \
        "docs/serve.md is stale: python -m vllm_vcr.serve.flag_docs docs/serve.md"


def test_a_config_file_takes_vllms_spellings_too(parser, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("max_num_seqs: 5\nenable_prefix_caching: false\ntensor-parallel-size: 2\n")
    a = _parse(parser, "--config", str(config), "--max_num_batched_tokens", "99")
    assert (a.max_num_seqs, a.enable_prefix_caching, a.max_num_batched_tokens, a.ignored__tensor_parallel_size) \
        == (5, False, 99, 2)
