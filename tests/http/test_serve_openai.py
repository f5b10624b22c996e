"""`vllm-vcr serve` end to end with the official openai SDK."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI

MODEL = "vllm-vcr/sim"


@pytest.fixture(scope="module")
def client(server):
    with OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def echo_client(echo_server):
    with OpenAI(base_url=echo_server.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_models(client):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [MODEL, "alias-model"]
    assert models.data[0].owned_by == "vllm"
    assert models.data[0].model_extra["max_model_len"] == 512


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}],
                                       max_tokens=7)
    assert r.id.startswith("chatcmpl-")
    assert r.object == "chat.completion"
    assert r.model == MODEL
    (choice,) = r.choices
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_alias_name_and_content_parts(client):
    r = client.chat.completions.create(
        model="alias-model", max_completion_tokens=3,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}])
    assert r.model == "alias-model"
    assert r.usage.completion_tokens == 3


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=5, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    content_chunks = [c for c in chunks if c.choices]
    assert content_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert len({c.id for c in chunks}) == 1


def test_completion_non_streaming_and_default_max_tokens(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time")
    assert r.id.startswith("cmpl-")
    assert r.object == "text_completion"
    assert r.usage.completion_tokens == 16  # vLLM's (and OpenAI's) completions default
    assert r.choices[0].finish_reason == "length"


def test_completion_streaming(client):
    stream = client.completions.create(model=MODEL, prompt="Count:", max_tokens=6, stream=True)
    chunks = list(stream)
    assert all(c.object == "text_completion" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in chunks)
    assert isinstance(text, str)


def test_n_and_multiple_prompts(client):
    r = client.completions.create(model=MODEL, prompt=["first prompt", "second prompt"], n=2, max_tokens=4)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 16
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=3,
                                          max_tokens=2)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert chat.usage.completion_tokens == 6


def test_n_streaming_indices(client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2,
                                            max_tokens=3, stream=True)
    chunks = list(stream)
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == [0, 1]


def test_seed_determinism(client):
    def ask(seed):
        return client.completions.create(model=MODEL, prompt="seeded", max_tokens=12, seed=seed).choices[0].text

    assert ask(1234) == ask(1234)
    assert ask(1234) != ask(4321)


def test_token_id_prompt(client):
    r = client.completions.create(model=MODEL, prompt=[10, 20, 30], max_tokens=2)
    assert r.usage.prompt_tokens == 3


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert isinstance(item.token, str)
        assert item.logprob <= 0
        assert len(item.top_logprobs) == 3
        assert all(t.logprob <= 0 for t in item.top_logprobs)
    c = client.completions.create(model=MODEL, prompt="x", max_tokens=3, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(v <= 0 for v in lp.token_logprobs)
    # vLLM: the sampled token and the top 2, so 3 entries when the sampled one is not among the top 2
    assert all(len(t) <= 3 for t in lp.top_logprobs)


def test_echo_mode_round_trips_text(echo_client):
    text = "Grüße, world! 😀 tabs\tand  spaces"
    r = echo_client.completions.create(model=MODEL, prompt=text, max_tokens=200)
    assert r.usage.prompt_tokens_details is None  # only with --enable-prompt-tokens-details, as vLLM
    # the embedded tokenizer adds BOS (a special token, skipped in output): the echo is the text
    assert r.choices[0].text.startswith(text)
    assert r.choices[0].finish_reason == "length"


def test_echo_mode_streaming(echo_client):
    text = "The quick brown fox jumps over the lazy dog."
    stream = echo_client.completions.create(model=MODEL, prompt=text, max_tokens=12, stream=True)
    out = "".join(c.choices[0].text for c in stream)
    assert out == text[: len(out)] and len(out) > 20


def test_stop_string(echo_client):
    r = echo_client.completions.create(model=MODEL, prompt="alpha beta gamma delta", max_tokens=50, stop=[" gamma"])
    c = r.choices[0]
    assert c.text == "alpha beta"
    assert c.finish_reason == "stop"
    assert c.model_extra["stop_reason"] == " gamma"
    stream = echo_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "one two three four"}], max_tokens=80, stop="three",
        stream=True)
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert "three" not in text and text.endswith("one two ")
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_echo_flag(echo_client):
    r = echo_client.completions.create(model=MODEL, prompt="abc", max_tokens=2, echo=True)
    assert r.choices[0].text.startswith("abc")
    # max_tokens 0: the prompt alone; the engine samples one token nobody sees, which usage counts (as vLLM)
    r0 = echo_client.completions.create(model=MODEL, prompt="abc", max_tokens=0, echo=True, n=2)
    assert [c.text for c in r0.choices] == ["abc", "abc"] and r0.usage.completion_tokens == 2
    assert r0.choices[0].finish_reason == "length"


# -- errors ------------------------------------------------------------------------------------


def test_unknown_model_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    body = e.value.body
    assert body["message"] == "The model `nope` does not exist. Valid aliases: vllm-vcr/sim, alias-model."
    assert body["type"] == "NotFoundError" and body["code"] == 404 and body["param"] == "model"


def test_bad_types_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens="lots")  # type: ignore[arg-type]
    assert e.value.body["message"].startswith("1 validation error:")
    assert "'loc': 'body.max_tokens'" in e.value.body["message"]
    assert e.value.body["type"] == "Bad Request" and e.value.body["param"] == "body.max_tokens"
    assert e.value.body["code"] == 400


def test_negative_max_tokens_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert e.value.body["message"] == "max_tokens must be at least 1, got -1. (parameter=max_tokens, value=-1)"
    assert e.value.body["type"] == "BadRequestError" and e.value.body["param"] == "max_tokens"


def test_context_length(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * 600, max_tokens=1)
    msg = e.value.body["message"]
    assert msg.startswith("This model's maximum context length is 512 tokens. However, your prompt contains 600 "
                          "input tokens")
    assert e.value.body["param"] == "input_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=600)
    assert e.value.body["message"].startswith("max_tokens=600 cannot be greater than max_model_len=512.")
    with pytest.raises(openai.BadRequestError) as e:  # a prompt that fills the context leaves no room
        client.completions.create(model=MODEL, prompt=[5] * 512, max_tokens=4)
    assert e.value.body["message"].startswith("max_tokens must be at least 1, got 0.")
    # prompt + max_tokens over the context: vLLM clamps max_tokens to what is left
    r = client.completions.create(model=MODEL, prompt=[5] * 500, max_tokens=100)
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"


def test_value_errors_400(client):
    for kwargs in ({"temperature": -1}, {"top_p": 2}, {"n": 0}, {"stop": [""]}, {"logprobs": 99}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, **kwargs)


def test_cached_tokens_reported(client):
    prompt = "The same long shared prefix for the prefix cache. " * 8
    pin = {"X-data-parallel-rank": "0"}  # two engines here: each has its own prefix cache
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_headers=pin)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_headers=pin)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < r.usage.prompt_tokens and cached % 16 == 0


def test_stop_token_ids_and_include_stop(echo_client):
    r = echo_client.completions.create(model=MODEL, prompt="alpha beta gamma", max_tokens=30,
                                       stop=[" beta"], extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == "alpha beta" and r.choices[0].finish_reason == "stop"
    # the echo engine repeats the prompt ids: stop on the id of the third one
    import httpx

    base = str(echo_client.base_url).removesuffix("/v1/").removesuffix("/v1")
    toks = httpx.post(base + "/tokenize", json={"prompt": "alpha beta gamma"}).json()["tokens"]
    stop_at = toks.index(toks[-1])  # echo emits prompt ids in order: it stops at the first occurrence
    r = echo_client.completions.create(model=MODEL, prompt="alpha beta gamma", max_tokens=30,
                                       extra_body={"stop_token_ids": [toks[stop_at]]})
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == toks[stop_at]
    assert r.usage.completion_tokens == stop_at + 1  # the stop token counts, its text is not shown
    shown = httpx.post(base + "/detokenize", json={"tokens": toks[1:stop_at]}).json()["prompt"]
    assert c.text == shown  # BOS is special (no text), the stop token is left out


def test_chat_continue_final_message_and_echo(echo_client):
    r = echo_client.chat.completions.create(
        model=MODEL, max_tokens=4,
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}],
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "echo": True})
    assert r.choices[0].message.content.startswith("The answer is")
    with pytest.raises(openai.BadRequestError):
        echo_client.chat.completions.create(
            model=MODEL, max_tokens=2, messages=[{"role": "assistant", "content": "x"}],
            extra_body={"continue_final_message": True})  # add_generation_prompt defaults to true
