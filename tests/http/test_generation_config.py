"""The model's generation config: its EOS ids other than the tokenizer's stop every request that
does not ignore EOS, as vLLM adds them (SamplingParams.update_from_generation_config); a Llama-3
instruct model ends its turns this way. tests/conformance compares an echo chat with the real
frontends (a generation config with two EOS ids)."""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path

import httpx
import pytest

from vllm_vcr.frontend.model_config import ModelConfigError, generation_eos_ids
from vllm_vcr.frontend.tokenizer import load_tokenizer

EMBEDDED = Path(str(resources.files("vllm_vcr") / "data"))
TOK = load_tokenizer()
WORD = "server"


def _model_dir(root: Path, generation: dict | None, config: dict | None = None) -> Path:
    d = root / "model"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED / name, d / name)
    (d / "config.json").write_text(json.dumps(config or {"architectures": ["LlamaForCausalLM"],
                                                         "max_position_embeddings": 2048}))
    if generation is not None:
        (d / "generation_config.json").write_text(json.dumps(generation))
    return d


def _word_id() -> int:
    ids = TOK.encode(" " + WORD, add_special_tokens=False)
    assert len(ids) == 1
    return ids[0]


def test_the_generation_config_s_eos_ids(tmp_path):
    d = _model_dir(tmp_path, {"eos_token_id": [9, 3, 9]})
    assert generation_eos_ids(d) == generation_eos_ids(d, "vllm") == (3, 9)  # (vllm: still the model's EOS ids)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": 7}}))
    assert generation_eos_ids(d, str(other)) == (7,)  # a folder without generation_config.json: its config.json
    assert generation_eos_ids(d, str(tmp_path / "missing")) == ()
    assert generation_eos_ids(None) == ()
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ModelConfigError, match="eos_token_id must be an integer"):
        generation_eos_ids(d)


def test_an_echoed_generation_eos_ends_the_answer_with_its_id(tmp_path, serve_process):
    word = _word_id()
    d = _model_dir(tmp_path, {"eos_token_id": [TOK.eos_token_id, word]})
    sp = serve_process(str(d), "--mode", "echo", "--inter-token-latency", "0",
                       "--time-to-first-token", "0")
    body = {"model": str(d), "messages": [{"role": "user", "content": f"one {WORD} two"}]}
    r = httpx.post(sp.url + "/v1/chat/completions", json=body, timeout=60).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == word
    assert choice["message"]["content"].endswith("one")  # (a stop token's text is not shown)
    ignored = httpx.post(sp.url + "/v1/chat/completions", json={**body, "ignore_eos": True, "max_tokens": 40},
                         timeout=60).json()["choices"][0]
    assert ignored["finish_reason"] == "length" and WORD in ignored["message"]["content"]
    vllm = serve_process(str(d), "--mode", "echo", "--generation-config", "vllm",
                         "--inter-token-latency", "0", "--time-to-first-token", "0")
    r = httpx.post(vllm.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert r["choices"][0]["stop_reason"] == word  # `vllm` drops the default sampling values, not the EOS ids
