"""`serve`'s configuration as vLLM's: max_model_len derived from the model's
config.json, `--config file.yaml`, a missing model path, `--help` defaults, uvicorn's logs."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_vcr.frontend.model_config import ModelConfigError, resolve_max_model_len
from vllm_vcr.serve.config_file import ConfigFileError, expand_config_file

LLAMA = {"model_type": "llama", "max_position_embeddings": 2048, "rope_theta": 10000.0}


def test_derived_from_the_smallest_length_key():
    assert resolve_max_model_len(LLAMA, None) == 2048
    assert resolve_max_model_len({"n_positions": 1024, "max_position_embeddings": 4096}, None) == 1024
    assert resolve_max_model_len({"max_position_embeddings": 4096, "model_max_length": 8192}, None) == 8192
    assert resolve_max_model_len({"model_type": "x"}, None) == 2048  # vLLM's default for no key
    assert resolve_max_model_len({"model_type": "x"}, 777) == 777
    assert resolve_max_model_len({"text_config": {"max_position_embeddings": 3000}}, None) == 3000
    assert resolve_max_model_len(LLAMA, -1) == 2048


def test_rope_scaling_and_sliding_window():
    linear = {**LLAMA, "rope_scaling": {"type": "linear", "factor": 4.0}}
    assert resolve_max_model_len(linear, None) == 8192
    # llama3 / yarn leave max_position_embeddings already scaled
    llama3 = {**LLAMA, "max_position_embeddings": 131072,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}}
    assert resolve_max_model_len(llama3, None) == 131072
    longrope = {**LLAMA, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}
    assert resolve_max_model_len(longrope, None) == 4096
    gemma3 = {"model_type": "gemma3_text", "max_position_embeddings": 131072,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert resolve_max_model_len(gemma3, None) == 131072
    windowed = {**LLAMA, "max_position_embeddings": 32768, "sliding_window": 4096}
    assert resolve_max_model_len(windowed, None) == 32768
    assert resolve_max_model_len(windowed, None, disable_sliding_window=True) == 4096


def test_override_above_the_model_is_vllms_error(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    assert resolve_max_model_len(LLAMA, 1024) == 1024
    with pytest.raises(ModelConfigError, match=r"User-specified max_model_len \(4096\) is greater than the derived "
                                               r"max_model_len \(max_position_embeddings=2048.0 or "
                                               r"model_max_length=None in model's config.json\)\. To allow"):
        resolve_max_model_len(LLAMA, 4096)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert resolve_max_model_len(LLAMA, 4096) == 4096


@given(st.integers(1, 1 << 20), st.integers(1, 1 << 20))
def test_requested_never_exceeds_derived_without_the_env(length, requested):
    config = {"max_position_embeddings": length}
    try:
        got = resolve_max_model_len(config, requested)
    except ModelConfigError:
        assert requested > length
    else:
        assert got == requested <= length


def _flags(known=("--no-enable-prefix-caching",)):
    return lambda flag: flag in known


def test_config_file_expands_before_the_command_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("port: 9000\nmax-model-len: 777\nenable-prefix-caching: false\nserved-model-name: [a, b]\n"
                   "kv-events-config: {enable_kv_cache_events: true}\nenforce-eager: true\n")
    out = expand_config_file(["serve", "MODEL", "--config", str(cfg), "--port", "1"], _flags())
    assert out == ["serve", "MODEL", "--port", "9000", "--max-model-len", "777", "--no-enable-prefix-caching",
                   "--served-model-name", "a", "b", "--kv-events-config", '{"enable_kv_cache_events": true}',
                   "--enforce-eager", "--port", "1"]
    assert expand_config_file(["serve", f"--config={cfg}"], _flags())[:3] == ["serve", "--port", "9000"]
    with pytest.raises(ConfigFileError, match="yaml/yml"):
        expand_config_file(["serve", "--config", str(tmp_path / "c.json")], _flags())
    with pytest.raises(ConfigFileError, match="No config file specified"):
        expand_config_file(["serve", "--config"], _flags())


def _run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """`serve` that must fail before it listens (exit 2)."""
    return subprocess.run([sys.executable, "-m", "vllm_vcr", "serve", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "tiny"
    d.mkdir()
    data = resources.files("vllm_vcr") / "data"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).write_text((data / name).read_text())
    (d / "config.json").write_text(json.dumps(LLAMA))
    return d


def test_serve_derives_max_model_len_from_the_model_directory(serve_process, model_dir):
    sp = serve_process(str(model_dir))
    card = httpx.get(sp.url + "/v1/models").json()["data"][0]
    assert card["max_model_len"] == 2048
    tok = httpx.post(sp.url + "/tokenize", json={"prompt": "hi"}).json()
    assert tok["max_model_len"] == 2048
    r = httpx.post(sp.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3000})
    assert r.status_code == 400 and "max_model_len=2048" in r.json()["error"]["message"]


def test_serve_refuses_more_than_the_model_allows(model_dir):
    r = _run(str(model_dir), "--max-model-len", "4k", "--port", "0")
    assert r.returncode == 2
    assert "User-specified max_model_len (4000) is greater than the derived max_model_len" in r.stderr


def test_missing_model_path_is_an_error(tmp_path):
    r = _run(str(tmp_path / "no" / "such" / "model"), "--port", "0")
    assert r.returncode == 2 and "Repo id must be in the form 'repo_name' or 'namespace/repo_name'" in r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _run(str(empty), "--port", "0")
    assert r.returncode == 2 and "Invalid repository ID or local directory specified" in r.stderr


def test_config_file_is_honoured_and_the_command_line_wins(serve_process, tmp_path, model_dir):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {model_dir}\nmax-model-len: 1000\nserved-model-name: [from-config]\n"
                   "enable-request-id-headers: true\n")
    sp = serve_process("--config", str(cfg), "--max-model-len", "512")
    r = httpx.get(sp.url + "/v1/models")
    card = r.json()["data"][0]
    assert card["id"] == "from-config" and card["max_model_len"] == 512
    assert "x-request-id" in r.headers
    bad = tmp_path / "bad.yaml"
    bad.write_text("no-such-flag: 1\n")
    r = _run("--config", str(bad), "--port", "0")
    assert r.returncode == 2 and "unrecognized arguments: --no-such-flag" in r.stderr


def test_help_shows_defaults():
    r = subprocess.run([sys.executable, "-m", "vllm_vcr", "serve", "--help=all"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for shown in ("--port PORT TCP port (default: 8000)", "--stream-interval STREAM_INTERVAL", "(default: 1)",
                  "--scheduling-policy {fcfs,priority} (default: fcfs)", "(default: ['*'])"):
        assert shown in text, shown
    assert "(default: None)" not in text


def test_vllm_vcr_log_governs_uvicorn(serve_process):
    quiet = serve_process(env={"VLLM_VCR_LOG": "warn"})
    loud = serve_process(env={"VLLM_VCR_LOG": "warn,uvicorn=info"})
    assert "Started server process" not in quiet.log()
    assert "Started server process" in loud.log()


def test_unknown_flag_still_an_error():
    r = _run("--no-such-flag", "--port", "0")
    assert r.returncode == 2 and "unrecognized arguments" in r.stderr
