"""The pooling runner (`--runner pooling`) through `vllm-vcr serve`: embeddings with the openai SDK,
/pooling, /score and /rerank with httpx."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from vllm_vcr.frontend.tokenizer import load_tokenizer
from vllm_vcr.openai.pooling import embed_tokens

MODEL = "vllm-vcr/sim"


@pytest.fixture(scope="module")
def pooling_server(serve_harness, tmp_path_factory):
    control = serve_harness.free_port()
    log = tmp_path_factory.mktemp("pooling") / "serve.log"
    sp = serve_harness.ServeProcess(["--runner", "pooling", "--embedding-size", "256", "--is-matryoshka",
                                     "--max-model-len", "64", "--time-to-first-token", "1",
                                     "--control-address", f"127.0.0.1:{control}"], log_path=log).wait_ready()
    sp.control = f"http://127.0.0.1:{control}"
    yield sp
    sp.stop()


@pytest.fixture(scope="module")
def client(pooling_server):
    return OpenAI(base_url=pooling_server.url + "/v1", api_key="none")


def test_embeddings_are_deterministic_unit_vectors(client):
    r = client.embeddings.create(model=MODEL, input=["the cat sat", "the cat sat", "stock markets fell"])
    vecs = [np.array(d.embedding) for d in r.data]  # the SDK asked for base64 and decoded it
    assert [d.index for d in r.data] == [0, 1, 2] and all(len(v) == 256 for v in vecs)
    assert all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in vecs)
    assert np.array_equal(vecs[0], vecs[1])
    again = client.embeddings.create(model=MODEL, input="the cat sat", encoding_format="float")
    assert np.allclose(again.data[0].embedding, vecs[0], atol=1e-6)
    tok = load_tokenizer()
    counts = [len(tok.encode(t, add_special_tokens=True)) for t in ("the cat sat", "the cat sat", "stock markets fell")]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(counts)
    assert r.model == MODEL and r.object == "list"


def test_token_ids_dimensions_and_base64(pooling_server, client):
    r = client.embeddings.create(model=MODEL, input=[[5, 6, 7], [8, 9]], dimensions=32, encoding_format="float")
    assert [len(d.embedding) for d in r.data] == [32, 32] and r.usage.prompt_tokens == 5
    expected = embed_tokens([5, 6, 7], 256, 32)
    assert np.allclose(r.data[0].embedding, expected, atol=1e-6)
    raw = httpx.post(pooling_server.url + "/v1/embeddings",
                     json={"input": [5, 6, 7], "encoding_format": "base64", "embed_dtype": "float16",
                           "endianness": "big", "dimensions": 32}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype=">f2")
    assert np.allclose(decoded, expected, atol=1e-3)
    assert raw["id"].startswith("embd-") and raw["usage"] == {"prompt_tokens": 3, "total_tokens": 3,
                                                               "completion_tokens": 0, "prompt_tokens_details": None}


def test_embedding_errors(pooling_server, client):
    with pytest.raises(BadRequestError, match="only supports dimensions in range"):
        client.embeddings.create(model=MODEL, input="x", dimensions=1000)
    with pytest.raises(NotFoundError):
        client.embeddings.create(model="other", input="x")
    with pytest.raises(BadRequestError, match="maximum context length is 64 tokens"):
        client.embeddings.create(model=MODEL, input=[list(range(1, 100))])
    r = httpx.post(pooling_server.url + "/v1/embeddings", json={"input": "word " * 100, "truncate_prompt_tokens": 10})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10
    # token ids: the last ones by default (vLLM's tokenizer side), -1 the whole context (no room kept for output)
    ids = list(range(1, 100))
    for trunc, side, want in ((3, None, ids[-3:]), (3, "right", ids[:3]), (-1, None, ids[-64:])):
        body = {"input": [ids], "truncate_prompt_tokens": trunc, "encoding_format": "float"}
        if side:
            body["truncation_side"] = side
        r = httpx.post(pooling_server.url + "/v1/embeddings", json=body)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want)
        one = httpx.post(pooling_server.url + "/v1/embeddings", json={"input": [want], "encoding_format": "float"})
        assert one.json()["data"][0]["embedding"] == r.json()["data"][0]["embedding"]
    bad = httpx.post(pooling_server.url + "/v1/embeddings", json={"input": "x", "normalize": True})
    assert bad.status_code == 400 and "use_activation" in bad.json()["error"]["message"]
    # a pooling model serves no generation
    assert httpx.post(pooling_server.url + "/v1/completions", json={"prompt": "x"}).status_code == 404
    assert httpx.post(pooling_server.url + "/v1/chat/completions", json={"messages": []}).status_code == 404


def test_chat_input_embeds_rendered_prompt(pooling_server):
    msgs = [{"role": "user", "content": "hello there"}]
    r = httpx.post(pooling_server.url + "/v1/embeddings", json={"messages": msgs, "encoding_format": "float"}).json()
    tok = httpx.post(pooling_server.url + "/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()
    assert r["usage"]["prompt_tokens"] == tok["count"]


def test_pooling_score_rerank(pooling_server):
    url = pooling_server.url
    pooled = httpx.post(url + "/pooling", json={"input": "the cat sat"}).json()
    assert pooled["id"].startswith("pooling-") and pooled["data"][0]["object"] == "pooling"
    assert len(pooled["data"][0]["data"]) == 256
    bad_task = httpx.post(url + "/pooling", json={"input": "x", "task": "classify"}).json()["error"]
    assert bad_task["message"] == ("Unsupported task: 'classify' Supported tasks: ('embed', 'token_embed') "
                                   "(parameter=task)") and bad_task["param"] == "task"
    assert httpx.post(url + "/pooling", json={"input": "x", "dimensions": 8}).status_code == 400
    for path in ("/score", "/v1/score"):
        s = httpx.post(url + path, json={"text_1": "the cat sat", "text_2": ["the cat sat down", "bond yields rose"]})
        data = s.json()["data"]
        assert [d["object"] for d in data] == ["score", "score"] and data[0]["score"] > data[1]["score"]
    same = httpx.post(url + "/score", json={"queries": ["a b", "c d"], "documents": ["a b", "c d"]}).json()
    assert all(abs(d["score"] - 1) < 1e-5 for d in same["data"])
    bad = httpx.post(url + "/score", json={"data_1": ["a", "b"], "data_2": ["a", "b", "c"]})
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "Input lengths must be either 1:1, 1:N or N:N"
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        rr = httpx.post(url + path, json={"query": "the cat sat", "top_n": 2,
                                          "documents": ["bond yields rose", "the cat sat down", "a cat"]}).json()
        assert [x["index"] for x in rr["results"]][0] == 1 and len(rr["results"]) == 2
        assert rr["results"][0]["document"] == {"text": "the cat sat down", "multi_modal": None}
        assert rr["usage"]["prompt_tokens"] == rr["usage"]["total_tokens"] > 0


async def test_pooling_runs_through_the_engine(pooling_server):
    before = httpx.get(pooling_server.control + "/stats").json()["requests_completed"]
    async with httpx.AsyncClient(timeout=30) as c:
        rs = await asyncio.gather(*(c.post(pooling_server.url + "/v1/embeddings",
                                           json={"input": [f"text {i}", "more"], "encoding_format": "float"})
                                    for i in range(5)))
    assert all(r.status_code == 200 for r in rs)
    stats = httpx.get(pooling_server.control + "/stats").json()
    assert stats["requests_completed"] - before == 10  # one prefill-only engine request per input
    metrics = httpx.get(pooling_server.url + "/metrics").text
    assert "vllm:request_success_total" in metrics and json.loads(json.dumps(stats))["running"] == 0


def test_pooling_is_prefill_only(pooling_server):
    """A pooling request ends after its prefill: no generated token, finished_reason stop."""
    from prometheus_client.parser import text_string_to_metric_families

    def samples() -> dict:
        text = httpx.get(pooling_server.url + "/metrics").text
        return {(s.name, s.labels.get("finished_reason")): s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.name in ("vllm:generation_tokens_total", "vllm:request_success_total")}

    before = samples()
    r = httpx.post(pooling_server.url + "/v1/embeddings", json={"input": ["a b", "c d e"]})
    assert r.status_code == 200
    after = samples()
    assert after[("vllm:generation_tokens_total", None)] == before[("vllm:generation_tokens_total", None)]
    assert after[("vllm:request_success_total", "stop")] - before[("vllm:request_success_total", "stop")] == 2
