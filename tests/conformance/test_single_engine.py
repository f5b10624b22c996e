"""One real frontend + one `vllm-vcr play` engine, driven through the OpenAI API.

One stack per vLLM version serves every test of this module (a frontend takes 15-40 s to start);
the last test shuts the engine down, so keep it last.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import msgspec
import openai
import pytest
import zmq

from . import peers
from tests.conftest import scaled

pytestmark = pytest.mark.conformance

ITL_MS = 10
KV_BLOCKS = 512


REPLAY_IDS = [40, 41, 42, 43, 44]


@pytest.fixture(scope="module")
def stack(vllm_version, tmp_path_factory):
    kv_port = peers.free_port()
    kv_config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{kv_port}", "topic": "kv"})
    table = tmp_path_factory.mktemp("replay") / "replay.jsonl"
    table.write_text(json.dumps({"request_id": "greeting", "output_length": len(REPLAY_IDS),
                                 "output_token_ids": REPLAY_IDS}) + "\n")
    st = peers.start_stack(vllm_version, play_args=[
        "--inter-token-latency", str(ITL_MS), "--kv-cache-size", str(KV_BLOCKS),
        "--shutdown-timeout", "10", "--seed", "7", "--kv-events-config", kv_config,
        "--response-replay-trace", str(table)])
    st.extra["kv_port"] = kv_port
    yield st
    st.stop()


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def control_stats(stack) -> dict:
    return httpx.get(f"{stack.control_url}/stats", timeout=10).json()


def wait_for(pred, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + scaled(timeout)
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def test_models_and_ready_payload(stack, client):
    assert [m.id for m in client.models.list().data] == [stack.model]
    m = peers.metrics(stack.base_url)
    info = [lab for (name, lab) in m if name == "vllm:cache_config_info"]
    assert info, "vllm:cache_config_info missing"
    labels = dict(info[0])
    assert labels["num_gpu_blocks"] == str(KV_BLOCKS)
    assert labels["block_size"] == "16"


def test_response_replay_row_through_vllm_xargs(stack, client):
    # the real frontend passes vllm_xargs to the engine as sampling extra_args
    r = client.completions.create(model=stack.model, prompt="hello", max_tokens=50,
                                  extra_body={"vllm_xargs": {"output_replay_id": "greeting"},
                                              "return_token_ids": True})
    choice = r.choices[0]
    assert choice.token_ids == REPLAY_IDS and choice.finish_reason == "length"
    assert r.usage.completion_tokens == len(REPLAY_IDS)


def test_completion(stack, client):
    r = client.completions.create(model=stack.model, prompt="def main():", max_tokens=8)
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.finish_reason == "length"
    assert isinstance(c.text, str)
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_completion_stream(stack, client):
    chunks = list(client.completions.create(model=stack.model, prompt="import os", max_tokens=30, stream=True,
                                            stream_options={"include_usage": True}))
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["length"]
    assert len(texts) >= 2, "a paced engine must stream more than one chunk"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 30


def test_chat(stack, client):
    r = client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "hello"}],
                                       max_tokens=6)
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6


def test_chat_stream(stack, client):
    stream = client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "hello"}], max_tokens=30, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert deltas[0].role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 30
    assert sum(1 for d in deltas if d.content) >= 2  # 300 ms of paced tokens: several chunks


def test_n_greater_than_one(stack, client):
    r = client.completions.create(model=stack.model, prompt="class A:", max_tokens=5, n=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 15


def test_stop_string_aborts_engine_request(stack, client):
    before = control_stats(stack)
    # Random tokens from a code tokenizer: one containing "e" comes within a few tokens.
    r = client.completions.create(model=stack.model, prompt="x", max_tokens=400, stop=["e"])
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.stop_reason == "e"
    assert "e" not in c.text
    # The frontend matched the stop string and sent ABORT; the engine must let the request go.
    after = wait_for(lambda: (s := control_stats(stack))["running"] == 0 and s, what="engine idle")
    assert after["requests_aborted"] == before["requests_aborted"] + 1


def test_client_disconnect_aborts(stack, client):
    before = control_stats(stack)
    stream = client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "go"}],
                                            max_tokens=900, stream=True)  # ~9 s if never aborted
    got = 0
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            got += 1
            if got >= 2:
                break
    stream.close()
    after = wait_for(lambda: (s := control_stats(stack))["running"] == 0 and s, timeout=5,
                     what="the frontend's ABORT after the client went away")
    assert after["requests_aborted"] == before["requests_aborted"] + 1


def test_injected_error_is_http_500(stack, client):
    patch = lambda body: httpx.patch(f"{stack.control_url}/config", json=body, timeout=10)
    assert patch({"failure_injection_rate": 1.0, "failure_types": ["error"]}).status_code == 200
    try:
        with pytest.raises(openai.InternalServerError) as ei:
            client.completions.create(model=stack.model, prompt="boom", max_tokens=4)
        assert ei.value.status_code == 500
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "x"}],
                                           max_tokens=4)
        # streaming: headers are already sent, so the error arrives as an SSE error event
        with httpx.stream("POST", f"{stack.base_url}/v1/completions", timeout=30,
                          json={"model": stack.model, "prompt": "x", "max_tokens": 4, "stream": True}) as resp:
            body = resp.read().decode()
        assert '"error"' in body and "500" in body, body
    finally:
        assert patch({"failure_injection_rate": 0.0}).status_code == 200
    r = client.completions.create(model=stack.model, prompt="ok", max_tokens=2)
    assert r.choices[0].finish_reason == "length"


def test_metrics_follow_engine_outputs(stack, client):
    before = peers.metrics(stack.base_url)
    prompt = "def f(x):\n    return x + 1\n" * 6  # several full KV blocks: the repeats hit the prefix cache
    n_req, n_tok = 3, 7
    prompt_tokens = 0
    for _ in range(n_req):
        r = client.completions.create(model=stack.model, prompt=prompt, max_tokens=n_tok)
        prompt_tokens += r.usage.prompt_tokens
    time.sleep(0.3)  # the frontend records stats after answering
    after = peers.metrics(stack.base_url)
    d = lambda name, **lab: peers.metric_sum(after, name, **lab) - peers.metric_sum(before, name, **lab)
    assert d("vllm:generation_tokens_total") == n_req * n_tok
    assert d("vllm:prompt_tokens_total") == prompt_tokens
    assert d("vllm:request_success_total", finished_reason="length") == n_req
    assert d("vllm:request_queue_time_seconds_count") == n_req
    # QUEUED/SCHEDULED events on the engine's monotonic clock: times are small, not "since boot"
    assert 0 <= d("vllm:request_queue_time_seconds_sum") < 1.0
    assert 0 < d("vllm:request_inference_time_seconds_sum") < 5.0
    assert peers.metric_sum(after, "vllm:num_requests_running") == 0
    # same prompt three times: the simulated prefix cache reports hits
    assert d("vllm:prefix_cache_hits_total") > 0


def test_kv_events_reported_and_published(stack, client):
    # the frontend reports each rank's publisher config from the ready payload
    sources = httpx.get(f"{stack.base_url}/kv_event_sources", timeout=10).json()
    assert list(sources) == ["0"], sources
    assert sources["0"]["endpoint"] == f"tcp://127.0.0.1:{stack.extra['kv_port']}"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.bind(f"tcp://127.0.0.1:{stack.extra['kv_port']}")  # play's PUB connects (and reconnects) to it
    try:
        frames = None
        for i in range(30):  # PUB/SUB joins late: make new blocks until a batch arrives
            client.completions.create(model=stack.model, prompt=f"{i} " + "block " * 40, max_tokens=1)
            if sub.poll(300):
                frames = sub.recv_multipart()
                break
        assert frames is not None, "no KV event batch arrived"
        topic, seq, payload = frames
        assert topic == b"kv" and len(seq) == 8
        _ts, events, rank = msgspec.msgpack.decode(payload)[:3]
        assert rank == 0 and any(e.get("type") == "BlockStored" for e in events), events
    finally:
        ctx.destroy(linger=0)


def test_dev_mode_utilities(stack):
    c = httpx.Client(base_url=stack.base_url, timeout=30)
    assert c.post("/reset_prefix_cache").status_code == 200
    assert c.get("/is_sleeping").json() == {"is_sleeping": False}
    assert c.post("/sleep", params={"level": 1}).status_code == 200
    assert c.get("/is_sleeping").json() == {"is_sleeping": True}
    assert c.post("/wake_up").status_code == 200
    assert c.get("/is_sleeping").json() == {"is_sleeping": False}
    # an engine method vllm-vcr does not simulate: the failure string comes back as a 500
    r = c.post("/collective_rpc", json={"method": "no_such_method"})
    assert r.status_code == 500, r.text


def test_pause_abort_and_resume(stack, client, vllm_version):
    c = httpx.Client(base_url=stack.base_url, timeout=30)
    result: dict = {}

    def consume():
        s = client.completions.create(model=stack.model, prompt="p", max_tokens=900, stream=True)
        for ch in s:
            result.setdefault("first", True)
            if ch.choices and ch.choices[0].finish_reason:
                result["finish"] = ch.choices[0].finish_reason

    t = threading.Thread(target=consume)
    t.start()
    wait_for(lambda: "first" in result, what="the first chunk")
    assert c.post("/pause", params={"mode": "abort"}).status_code == 200
    t.join(10)
    assert result.get("finish") == "abort", result  # the engine aborted it and said so
    assert c.get("/is_paused").json() == {"is_paused": True}
    body = {"model": stack.model, "prompt": "later", "max_tokens": 3}
    if vllm_version == "0.32":
        # pause_scheduler: new requests wait for /resume
        held: dict = {}
        t = threading.Thread(target=lambda: held.update(r=c.post("/v1/completions", json=body)))
        t.start()
        time.sleep(1.0)
        assert "r" not in held, "a request was served while paused"
        assert c.post("/resume").status_code == 200
        t.join(10)
        assert held["r"].status_code == 200 and held["r"].json()["choices"][0]["finish_reason"] == "length"
    else:
        # pause_generation: new requests are refused as retryable (503) until /resume
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 503, r.text
        assert c.post("/resume").status_code == 200
        assert c.post("/v1/completions", json=body).status_code == 200
    assert c.get("/is_paused").json() == {"is_paused": False}


def test_shutdown_drains_then_frontend_fails_fast(stack, client):
    """SIGTERM with --shutdown-timeout 10: the in-flight stream completes, then ENGINE_CORE_DEAD."""
    n = 150  # 1.5 s at 10 ms per token
    result: dict = {}

    def consume():
        try:
            s = client.completions.create(model=stack.model, prompt="drain", max_tokens=n, stream=True,
                                          stream_options={"include_usage": True})
            chunks = []
            for ch in s:
                chunks.append(ch)
                if len(chunks) == 1:
                    result["first"] = time.monotonic()
            result["chunks"] = chunks
        except Exception as e:  # noqa: BLE001 - pragma: no cover - reported below
            result["error"] = e

    t = threading.Thread(target=consume)
    t.start()
    wait_for(lambda: "first" in result or "error" in result, what="the first chunk")
    stack.play.send_signal(signal.SIGTERM)
    t.join(30)
    assert "error" not in result, result.get("error")
    chunks = result["chunks"]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == n
    assert stack.play.wait(20) == 0, stack.logs()
    # The frontend got ENGINE_CORE_DEAD: it must fail requests or exit, never hang.
    t0 = time.monotonic()
    try:
        r = httpx.post(f"{stack.base_url}/v1/completions", timeout=20,
                       json={"model": stack.model, "prompt": "x", "max_tokens": 2})
        assert r.status_code >= 500, r.text
    except httpx.TransportError:
        pass  # already gone
    assert time.monotonic() - t0 < 20
    assert stack.frontend.wait(60) is not None, "frontend still running after ENGINE_CORE_DEAD\n" + stack.logs()
