"""`serve --engine-type sglang`: SGLang's HTTP routes and `sglang:` metric names, beside the OpenAI routes."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest

from vllm_vcr.testing.waits import free_port, scaled, wait_until


@pytest.fixture
def sglang(serve_process):
    return serve_process("--engine-type", "sglang", "--inter-token-latency", "1")


def test_generate_and_metrics(sglang):
    with httpx.Client(base_url=sglang.url, timeout=30) as c:
        r = c.post("/generate", json={"text": "Hello there", "sampling_params": {"max_new_tokens": 4,
                                                                                  "ignore_eos": True}})
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["output_ids"]) == 4 and isinstance(body["text"], str)
        meta = body["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 4}
        assert meta["completion_tokens"] == 4 and meta["prompt_tokens"] > 0
        # streamed: every event carries the output so far, then [DONE]
        events = []
        with c.stream("POST", "/generate", json={"input_ids": [5, 6, 7], "stream": True,
                                                  "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}) as s:
            for line in s.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert len(last["output_ids"]) == 3 and last["meta_info"]["prompt_tokens"] == 3
        assert [len(json.loads(e)["output_ids"]) for e in events[:-1]] == sorted(
            len(json.loads(e)["output_ids"]) for e in events[:-1])
        bad = c.post("/generate", json={"sampling_params": {"max_new_tokens": 1}})
        assert bad.status_code == 400 and "text or input_ids" in bad.json()["error"]["message"]
        stop = c.post("/generate", json={"text": "x", "sampling_params": {"stop": ["."]}})
        assert stop.status_code == 400 and "stop_token_ids" in stop.json()["error"]["message"]
        metrics = c.get("/metrics").text
    assert "sglang:num_running_reqs{" in metrics and "sglang:prompt_tokens_total{" in metrics
    assert "sglang:generation_tokens_total" in metrics and "vllm:" not in metrics
    assert 'sglang:num_requests_total{engine_type="unified",model_name="vllm-vcr/sim"} 2.0' in metrics


SCHEDULER_SERIES = {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
                    "sglang:num_retracted_reqs", "sglang:queue_time_seconds"}


@pytest.mark.parametrize("worker_type,engine_type", [("aggregated", "unified"), ("prefill", "prefill"),
                                                     ("decode", "decode")])
def test_metric_labels_are_sglangs(serve_process, serve_harness, worker_type, engine_type):
    """SGLang's label sets: the scheduler's series carry model_name, engine_type (its name for the
    disaggregation mode), tp_rank, pp_rank and moe_ep_rank; the tokenizer's model_name and
    engine_type."""
    from prometheus_client.parser import text_string_to_metric_families

    sp = serve_process("--engine-type", "sglang", "--worker-type", worker_type,
                       "--side-channel-port", str(serve_harness.free_port()))
    r = httpx.post(sp.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(sp.url + "/metrics").text)}
    sglang = {name: f for name, f in families.items() if name.startswith("sglang:")}
    assert SCHEDULER_SERIES <= set(sglang)
    scheduler = {"model_name": "vllm-vcr/sim", "engine_type": engine_type, "tp_rank": "0", "pp_rank": "0",
                 "moe_ep_rank": "0"}
    tokenizer = {"model_name": "vllm-vcr/sim", "engine_type": engine_type}
    for name, fam in sglang.items():
        want = scheduler if name.removesuffix("_created") in SCHEDULER_SERIES else tokenizer
        if name == "sglang:cache_config_info":  # the scheduler's KV pool: its shape in labels
            want = {**scheduler, "page_size": "16", "num_pages": "1024"}
        for sample in fam.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "le"}
            assert labels == want, (name, sample)
    assert families["sglang:num_requests"].samples[0].value == 1.0


def test_router_routes_and_openai(sglang):
    with httpx.Client(base_url=sglang.url, timeout=30) as c:
        info = c.get("/get_model_info").json()
        assert info["is_generation"] is True and info["model_path"]
        assert c.get("/health_generate").status_code == 200
        assert c.post("/flush_cache").status_code == 200
    client = openai.OpenAI(base_url=sglang.url + "/v1", api_key="x")
    out = client.completions.create(model="vllm-vcr/sim", prompt="hi", max_tokens=2)
    assert out.usage.completion_tokens <= 2


@pytest.mark.parametrize("shape", [("--engine-count", "2"), ("--data-parallel-size", "2", "--api-server-count", "2")],
                         ids=["one-process", "engine-core-processes"])
def test_server_info_reports_the_engine_config(serve_process, shape):
    """SGLang's /get_server_info (and the newer /model_info that SMG asks first):
    the running window and KV capacity come from the engine's flags, as SGLang's server args and
    scheduler info report them; SMG's P/D admission reads max_running_requests. The same answer
    whether the engines run in the HTTP process or in engine-core processes."""
    sp = serve_process("--engine-type", "sglang", "--worker-type", "decode", "--max-num-seqs", "7",
                       "--kv-cache-size", "300", "--block-size", "32", "--max-model-len", "2048",
                       "--max-num-batched-tokens", "512", *shape)
    with httpx.Client(base_url=sp.url, timeout=30) as c:
        info = c.get("/get_server_info").json()
        assert c.get("/model_info").json() == c.get("/get_model_info").json()
    assert info["max_running_requests"] == 7
    assert info["max_total_num_tokens"] == info["max_total_tokens"] == 300 * 32
    assert info["page_size"] == 32 and info["context_length"] == 2048 and info["max_req_input_len"] == 2047
    assert info["max_prefill_tokens"] == 512 and info["dp_size"] == 2
    assert info["disaggregation_mode"] == "decode" and info["served_model_name"] == "vllm-vcr/sim"
    states = info["internal_states"]
    assert [s["dp_rank"] for s in states] == [0, 1]
    assert all(s["memory_usage"]["token_capacity"] == 300 * 32 and s["num_running_reqs"] == 0 for s in states)


def test_vllm_engine_has_no_sglang_routes(serve_process):
    sp = serve_process("--inter-token-latency", "0")
    assert httpx.post(sp.url + "/generate", json={"text": "x"}).status_code == 404
    assert httpx.get(sp.url + "/get_server_info").status_code == 404
    assert "vllm:num_requests_running" in httpx.get(sp.url + "/metrics").text


def test_models_are_owned_by_sglang(sglang):
    """Routers (smg) tell an SGLang worker from a vLLM one by the model cards' owner."""
    cards = httpx.get(sglang.url + "/v1/models", timeout=10).json()["data"]
    assert {c["owned_by"] for c in cards} == {"sglang"}


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_sglang_bootstrap_fields_run_the_handoff(serve_process, route):
    """SGLang's P/D: the router sends one request to the prefill and the decode worker at once with
    top-level bootstrap_host/port/room; the decode side joins the prefill's bootstrap room, pulls,
    and the prefill side frees the blocks it held. Without the fields the request is a plain one."""
    boot = free_port()
    common = ("--engine-type", "sglang", "--time-to-first-token", "0", "--inter-token-latency", "0")
    prefill = serve_process(*common, "--worker-type", "prefill", "--bootstrap-port", str(boot),
                            "--side-channel-port", str(free_port()))
    decode = serve_process(*common, "--worker-type", "decode")
    text = " ".join(["omega"] * 60)
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": 2**63 - 7}
    if route == "/generate":
        body = {"text": text, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}, **fields}
    elif route == "/v1/completions":
        body = {"model": "vllm-vcr/sim", "prompt": text, "max_tokens": 4, "ignore_eos": True, **fields}
    else:
        body = {"model": "vllm-vcr/sim", "messages": [{"role": "user", "content": text}], "max_tokens": 4,
                "ignore_eos": True, **fields}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        d = pool.submit(httpx.post, decode.url + route, json=body, timeout=scaled(30))
        p = pool.submit(httpx.post, prefill.url + route, json=body, timeout=scaled(30))
        assert p.result().status_code == 200, p.result().text
        assert d.result().status_code == 200, d.result().text

    def kv_free() -> bool:
        m = httpx.get(prefill.url + "/metrics", timeout=10).text
        return "sglang:token_usage{" in m and any(
            line.startswith("sglang:token_usage{") and float(line.rsplit(" ", 1)[1]) == 0.0 for line in m.splitlines())

    wait_until(kv_free, 10, "the prefill worker to free its held blocks after the decode side's pull")
    # a decode-side request that names a room nobody prefills waits for it: the fields are honoured
    lonely = {**body, "bootstrap_room": 99}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(decode.url + route, json=lonely, timeout=1.5)


def test_scheduler_recv_interval_is_an_sglang_flag(serve_process):
    """`--scheduler-recv-interval N` serves with `--engine-type sglang` (a stream gets every token);
    without it the CLI refuses in one line naming the flag, before anything starts."""
    import subprocess
    import sys

    from tests.conftest import subprocess_env

    r = subprocess.run([sys.executable, "-m", "vllm_vcr", "serve", "--port", str(free_port()),
                        "--scheduler-recv-interval", "4"],
                       capture_output=True, text=True, env=subprocess_env(), timeout=scaled(60))
    assert r.returncode == 2, r.stderr
    assert "--scheduler-recv-interval" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr

    sp = serve_process("--engine-type", "sglang", "--scheduler-recv-interval", "4", "--inter-token-latency", "1")
    with httpx.Client(base_url=sp.url, timeout=30) as c:
        r = c.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 6
