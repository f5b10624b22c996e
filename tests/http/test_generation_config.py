"""The model's generation config: its EOS ids other than the tokenizer's stop every request that
does not ignore EOS, as vLLM adds them (SamplingParams.update_from_generation_config); a Llama-3
instruct model ends its turns this way. Its sampling values fill what a request leaves unset and
its max_new_tokens limits the output (`--generation-config`, `--override-generation-config`).
tests/conformance compares both with the real frontends."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import httpx
import pytest

from vllm_vcr.frontend.model_config import ModelConfigError, generation_defaults, generation_eos_ids
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


def test_the_generation_config_s_sampling_defaults(tmp_path):
    d = _model_dir(tmp_path, {"eos_token_id": 2, "temperature": 0.6, "top_p": 0.9, "top_k": None,
                              "max_new_tokens": 64, "do_sample": True})
    auto = generation_defaults(d)
    assert auto.values == {"temperature": 0.6, "top_p": 0.9}
    assert (auto.max_tokens, auto.max_tokens_cap) == (64, None)  # the model's own: a default, not a cap
    assert auto.limit(10, 1000, None) == 64 and auto.limit(10, 1000, 500) == 500 and auto.limit(990, 1000, None) == 10
    # the override: merged over the file (null removes a value); its max_new_tokens caps every request
    over = generation_defaults(d, "auto", {"temperature": None, "min_p": 0.1, "max_new_tokens": 32})
    assert over.values == {"top_p": 0.9, "min_p": 0.1}
    assert (over.max_tokens, over.max_tokens_cap) == (32, 32) and over.limit(10, 1000, 500) == 32
    # `vllm`: none of the file's; a folder: its own, whose max_new_tokens is a cap too
    assert not generation_defaults(d, "vllm")
    assert generation_defaults(d, "vllm", {"max_new_tokens": 5}).max_tokens_cap == 5
    folder = generation_defaults(d, str(d))
    assert (folder.max_tokens, folder.max_tokens_cap) == (64, 64)
    assert not generation_defaults(None) and not generation_defaults(d, str(tmp_path / "missing"))

    class Req:
        temperature, top_p, top_k = None, 0.5, None
    req = Req()
    auto.fill(req)
    assert (req.temperature, req.top_p, req.top_k) == (0.6, 0.5, None)  # the request's own values stay
    for bad, message in (({"max_new_tokens": 0}, "max_new_tokens must be a positive integer, got 0"),
                         ({"top_k": 1.5}, "top_k must be an integer"), ({"temperature": "hot"}, "must be a number")):
        with pytest.raises(ModelConfigError, match=message):
            generation_defaults(d, "auto", bad)


def test_served_requests_take_the_defaults(tmp_path, serve_process):
    """A greedy generation config and an override cap, through the real CLI and the openai SDK."""
    import openai

    d = _model_dir(tmp_path, {"eos_token_id": TOK.eos_token_id, "temperature": 0.0, "max_new_tokens": 9})
    sp = serve_process(str(d), "--mode", "echo", "--inter-token-latency", "0", "--time-to-first-token", "0",
                       "--override-generation-config", json.dumps({"max_new_tokens": 5}))
    client = openai.OpenAI(base_url=sp.url + "/v1", api_key="x", max_retries=0)
    text = " ".join(["word"] * 40)
    chat = client.chat.completions.create(model=str(d), messages=[{"role": "user", "content": text}],
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"  # the override's cap
    capped = client.completions.create(model=str(d), prompt=text, max_tokens=30, extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == 5
    with pytest.raises(openai.BadRequestError, match="n must be 1 when using greedy sampling"):
        client.chat.completions.create(model=str(d), messages=[{"role": "user", "content": "hi"}], n=2)
    sampled = client.chat.completions.create(model=str(d), messages=[{"role": "user", "content": text}], n=2,
                                             temperature=1.0, extra_body={"ignore_eos": True})
    assert len(sampled.choices) == 2  # the request's own temperature wins


def test_a_bad_value_is_one_line_naming_its_flag(tmp_path):
    d = _model_dir(tmp_path, {"eos_token_id": TOK.eos_token_id, "max_new_tokens": "many"})
    for extra, line in (
            (["--generation-config", "vllm", "--override-generation-config", '{"top_p": "x"}'],
             "--override-generation-config: top_p must be a number, got 'x'"),
            ([], "--generation-config: max_new_tokens must be a positive integer, got 'many'"),
            (["--override-generation-config", "[1]"], "--override-generation-config: must be a JSON object")):
        r = subprocess.run([sys.executable, "-m", "vllm_vcr", "serve", str(d), "--port", "0", *extra],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr
        assert line in r.stderr.strip().splitlines()[-1], r.stderr
