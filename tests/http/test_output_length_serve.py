"""`serve`: outputs end like a model's (a modeled EOS at a realistic length), ignore_eos keeps
max_tokens, and logit_bias / allowed_token_ids shape the ids (seen with return_token_ids and
logprobs), through the openai SDK."""

from __future__ import annotations

import statistics
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

MODEL = "vllm-vcr/sim"
EOS = 4100  # the embedded tokenizer's <|eot_id|>
HI = [{"role": "user", "content": "Hello!"}]
FAST = ["--inter-token-latency", "0", "--time-to-first-token", "1"]


@pytest.fixture(scope="module")
def eos_server(serve_harness, tmp_path_factory):
    log = Path(tmp_path_factory.mktemp("eos")) / "serve.log"
    sp = serve_harness.ServeProcess([*FAST, "--output-length-mean", "64",
                                     "--output-length-std-dev", "32", "--seed", "5"], log_path=log).wait_ready()
    yield sp
    sp.stop()


@pytest.fixture(scope="module")
def client(eos_server):
    with OpenAI(base_url=eos_server.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_chat_without_max_tokens_ends_on_eos_at_a_realistic_length(client):
    lengths = []
    for _ in range(40):
        r = client.chat.completions.create(model=MODEL, messages=HI, extra_body={"return_token_ids": True})
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and choice.stop_reason is None
        assert choice.token_ids[-1] == EOS and EOS not in choice.token_ids[:-1]
        assert "<|eot_id|>" not in choice.message.content  # EOS ends the text, as in vLLM
        assert r.usage.completion_tokens == len(choice.token_ids)
        lengths.append(r.usage.completion_tokens)
    assert statistics.fmean(lengths) == pytest.approx(64, rel=0.25)
    assert max(lengths) < 400


def test_ignore_eos_gives_max_tokens_and_max_tokens_caps_with_length(client):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=300, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 300 and r.choices[0].finish_reason == "length"
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_streaming_ends_with_stop_and_min_tokens_holds_it_back(client):
    stream = client.chat.completions.create(model=MODEL, messages=HI, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"min_tokens": 500})
    chunks = list(stream)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"] and chunks[-1].usage.completion_tokens >= 500


def test_seeded_requests_repeat_their_length(client):
    def length(seed):
        return client.completions.create(model=MODEL, prompt="hi", max_tokens=2000, seed=seed).usage.completion_tokens

    assert length(42) == length(42)


def test_allowed_token_ids_restrict_the_output(client):
    allowed = [300, 301, 302]
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=50,
                                  extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    choice = r.choices[0]
    assert set(choice.token_ids) <= set(allowed) and len(choice.token_ids) == 50  # EOS not allowed: length
    assert choice.finish_reason == "length"


def test_logit_bias_makes_a_token_likely_and_minus_100_excludes_it(client):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=40, logit_bias={"65": 100},
                                       logprobs=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert set(r.choices[0].token_ids) == {65}
    lp = r.choices[0].logprobs.content
    assert len(lp) == 40 and len({e.token for e in lp}) == 1 and r.choices[0].message.content == lp[0].token * 40
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=40,
                                  logit_bias={str(t): -100 for t in range(66, 4100)},
                                  extra_body={"allowed_token_ids": [65, 66, 67], "return_token_ids": True})
    assert set(r.choices[0].token_ids) == {65}


def test_a_biased_stop_token_id_ends_the_stream(client):
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=50, logit_bias={"500": 100},
                                  extra_body={"stop_token_ids": [500], "min_tokens": 2, "return_token_ids": True})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == 500
    assert choice.token_ids[-1] == 500 and len(choice.token_ids) == 3


@pytest.mark.parametrize("body,message", [
    ({"logit_bias": {"x": 1}}, "logit_bias contains key(s) that cannot be converted to integer token IDs: ['x']"),
    ({"logit_bias": {"999999": 1}}, "token_id(s) [999999] in logit_bias contain out-of-vocab token ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids is not None and empty!"),
    ({"allowed_token_ids": [1, 999999]}, "allowed_token_ids contains out-of-vocab token id!"),
])
def test_bad_token_choices_are_400(client, body, message):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=5, extra_body=body)
    assert message in str(ei.value)


def test_output_length_flags_are_validated_and_patchable(serve_harness, tmp_path):
    bad = serve_harness.ServeProcess(["--output-length-mean", "0"], log_path=tmp_path / "bad.log")
    assert bad.proc.wait(30) != 0
    bad.stop()
    assert "--output-length-mean: output_length_mean must be a number >= 1" in bad.log()
    port = serve_harness.free_port()
    sp = serve_harness.ServeProcess([*FAST, "--control-address", f"127.0.0.1:{port}", "--output-length-histogram",
                                     "7:1"], log_path=tmp_path / "ok.log").wait_ready()
    try:
        with OpenAI(base_url=sp.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
            assert c.completions.create(model=MODEL, prompt="hi", max_tokens=100).usage.completion_tokens == 7
            r = httpx.patch(f"http://127.0.0.1:{port}/config", json={"output_length_histogram": "9:1"})
            assert r.status_code == 200, r.text
            assert c.completions.create(model=MODEL, prompt="hi", max_tokens=100).usage.completion_tokens == 9
            r = httpx.patch(f"http://127.0.0.1:{port}/config", json={"output_length_distribution": "off"})
            assert c.completions.create(model=MODEL, prompt="hi", max_tokens=100).usage.completion_tokens == 100
            r = httpx.patch(f"http://127.0.0.1:{port}/config", json={"output_length_mean": -3})
            assert r.status_code == 400 and "output_length_mean" in r.json()["error"]
    finally:
        sp.stop()


def test_output_length_distribution_flag_reaches_the_engine():
    from vllm_vcr.cli import build_parser
    from vllm_vcr.engine_cli import engine_args_from_cli

    parser, _ = build_parser()
    for argv, dist in ((["serve", "--output-length-distribution", "normal"], "normal"),
                       (["play", "--output-length-distribution", "off"], "off")):
        assert engine_args_from_cli(parser.parse_args(argv)).config.output_length_distribution == dist
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--output-length-distribution", "zipf"])
