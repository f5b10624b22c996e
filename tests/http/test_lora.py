"""LoRA adapters through `vllm-vcr serve`'s HTTP interface (vLLM 0.32's routes, bodies and errors)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from vllm_vcr.serve.extension_args import parse_lora_modules

FAST = ["--inter-token-latency", "1", "--time-to-first-token", "2"]
RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_SERVER_DEV_MODE": "0"}


def make_adapter(root: Path, name: str, rank: int = 8, **extra) -> str:
    """A PEFT adapter directory as `peft` writes it (the config is what vLLM checks first)."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"],
              "bias": "none", "task_type": "CAUSAL_LM", **extra}
    (d / "adapter_config.json").write_text(json.dumps(config))
    return str(d)


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url, json=body, timeout=10)


@pytest.fixture
def adapters(tmp_path):
    return {"sql": make_adapter(tmp_path, "sql"), "chat": make_adapter(tmp_path, "chat"),
            "wide": make_adapter(tmp_path, "wide", rank=32), "dora": make_adapter(tmp_path, "dora", use_dora=True)}


def test_lora_modules_forms():
    mods = parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "base"}', ""])
    assert [(m.name, m.path, m.base_model_name) for m in mods] == [("a", "/x", None), ("b", "/y", "base")]
    with pytest.raises(ValueError, match="Invalid JSON format for --lora-modules"):
        parse_lora_modules(["{not json"])
    with pytest.raises(ValueError, match="Invalid fields for --lora-modules"):
        parse_lora_modules(['{"name": "a", "path": "/x", "rank": 3}'])


def test_static_adapters_listed_and_served(serve_process, adapters):
    sp = serve_process(*FAST, "--enable-lora", "--lora-modules", f"sql={adapters['sql']}",
                       json.dumps({"name": "chat", "path": adapters["chat"], "base_model_name": "vllm-vcr/sim"}),
                       "--max-loras", "2", env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"})
    cards = {m["id"]: m for m in httpx.get(sp.url + "/v1/models").json()["data"]}
    assert cards["sql"]["parent"] == "vllm-vcr/sim" and cards["sql"]["root"] == adapters["sql"]
    assert cards["sql"]["max_model_len"] is None and cards["vllm-vcr/sim"]["parent"] is None
    assert cards["chat"]["root"] == adapters["chat"]
    client = OpenAI(base_url=sp.url + "/v1", api_key="none")
    out = client.completions.create(model="sql", prompt="select", max_tokens=3)
    assert out.model == "sql" and out.usage.completion_tokens == 3
    chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.model == "chat"
    # runtime updating is off: the routes do not exist, as in vLLM
    assert post(sp.url + "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": adapters["sql"]}).status_code == 404
    metrics = {s.labels["running_lora_adapters"]: s for f in text_string_to_metric_families(
        httpx.get(sp.url + "/metrics").text) if f.name == "vllm:lora_requests_info" for s in f.samples}
    assert "sql" in metrics and metrics["sql"].labels["max_lora"] == "2"
    assert metrics["sql"].labels["waiting_lora_adapters"] == "sql"


def test_runtime_load_unload_and_errors(serve_process, adapters):
    sp = serve_process(*FAST, "--enable-lora", env=RUNTIME)
    url = sp.url
    r = post(url + "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": adapters["sql"]})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
    dup = post(url + "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": adapters["sql"]})
    assert dup.status_code == 400 and dup.json()["error"] == {
        "message": "The lora adapter 'sql' has already been loaded. If you want to load the adapter in place, "
                   "set 'load_inplace' to True.", "type": "InvalidUserInput", "param": None, "code": 400}
    inplace = post(url + "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": adapters["chat"],
                                                   "load_inplace": True})
    assert inplace.status_code == 200
    missing = post(url + "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": "/nonexistent/adapter"})
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "Loading lora gone failed: No adapter found for /nonexistent/adapter"
    hidden = post(url + "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": adapters["sql"] + "-no"})
    assert hidden.json()["error"]["message"] == "Loading lora gone failed: No adapter found for <path>"  # /tmp/...
    wide = post(url + "/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": adapters["wide"]})
    assert wide.status_code == 500 and wide.json()["error"]["message"] == (
        "Call to add_lora method failed: LoRA rank 32 is greater than max_lora_rank 16.")
    dora = post(url + "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": adapters["dora"]})
    assert "vLLM does not yet support DoRA." in dora.json()["error"]["message"]
    base = post(url + "/v1/load_lora_adapter", {"lora_name": "vllm-vcr/sim", "lora_path": adapters["sql"]})
    assert base.json()["error"]["message"] == "The lora adapter 'vllm-vcr/sim' conflicts with a served base model."
    empty = post(url + "/v1/load_lora_adapter", {"lora_name": "", "lora_path": adapters["sql"]})
    assert empty.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
    not_json = httpx.post(url + "/v1/load_lora_adapter", content=b'{"lora_name": "a", "lora_path": "b"}')
    assert not_json.status_code == 400 and "Unsupported Media Type" in not_json.json()["error"]["message"]
    ids = {m["id"]: m["root"] for m in httpx.get(url + "/v1/models").json()["data"]}
    assert ids["sql"] == adapters["chat"]  # reloaded in place from the new path
    gen = post(url + "/v1/completions", {"model": "sql", "prompt": "x", "max_tokens": 2})
    assert gen.status_code == 200 and gen.json()["model"] == "sql"
    r = post(url + "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' removed successfully."
    again = post(url + "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert again.status_code == 404 and again.json()["error"]["message"] == "The lora adapter 'sql' cannot be found."
    gone = post(url + "/v1/completions", {"model": "sql", "prompt": "x", "max_tokens": 2})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"


def test_runtime_updating_without_enable_lora(serve_process, adapters):
    sp = serve_process(*FAST, env=RUNTIME)
    r = post(sp.url + "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": adapters["sql"]})
    assert r.status_code == 500 and r.json()["error"]["message"] == (
        "Call to add_lora method failed: LoRA is not enabled. Use --enable-lora to enable LoRA.")
    assert post(sp.url + "/v1/unload_lora_adapter", {"lora_name": "sql"}).status_code == 404
    assert [m["id"] for m in httpx.get(sp.url + "/v1/models").json()["data"]] == ["vllm-vcr/sim"]
    assert "lora_requests_info" not in httpx.get(sp.url + "/metrics").text


def test_control_api_lists_adapters(serve_process, adapters, serve_harness):
    control = serve_harness.free_port()
    sp = serve_process(*FAST, "--enable-lora", "--lora-modules", f"sql={adapters['sql']}",
                       "--control-address", f"127.0.0.1:{control}", env=RUNTIME)
    for _ in range(3):
        assert post(sp.url + "/v1/completions", {"model": "sql", "prompt": "q", "max_tokens": 2}).status_code == 200
    report = httpx.get(f"http://127.0.0.1:{control}/loras").json()
    assert report["enabled"] and report["max_loras"] == 1
    (sql,) = report["adapters"]
    assert sql["name"] == "sql" and sql["id"] == 1 and sql["requests_total"] == 3
    assert sql["running"] == 0 and sql["waiting"] == 0
    assert httpx.get(f"http://127.0.0.1:{control}/stats").json()["requests_completed"] == 3


def test_lora_flag_errors(serve_process, adapters):
    for args, needle in (
            (["--lora-modules", f"sql={adapters['sql']}"], "--lora-modules needs --enable-lora"),
            (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "max_cpu_loras (2) must be >= max_loras (4)"),
            (["--enable-lora", "--lora-modules", f"w={adapters['wide']}"], "LoRA rank 32 is greater than max_lora_rank"),
            (["--enable-lora", "--max-lora-rank", "7"], "--max-lora-rank")):
        sp = serve_process(*args, wait=False)
        assert sp.proc.wait(20) == 2, sp.log()
        assert needle in sp.log()


def test_adapter_keys_prefix_cache_and_kv_events(serve_process, adapters, tmp_path):
    """The adapter is part of the prefix-cache key (no hit across adapters) and of the BlockStored
    events (lora_name, lora_id, extra keys), as vLLM's block hashes and events carry it."""
    import zmq

    from vllm_vcr.kv_events import BlockStored, decode_batch

    endpoint = f"ipc://{tmp_path}/kv-events"
    sp = serve_process(*FAST, "--enable-lora", "--lora-modules", f"sql={adapters['sql']}",
                       "--enable-prompt-tokens-details", "--block-size", "16", "--kv-events-config",
                       json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                   "endpoint": endpoint, "topic": "kv"}))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        prompt = list(range(10, 74))  # 4 full blocks

        def cached(model: str) -> int:
            r = post(sp.url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1})
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached("vllm-vcr/sim") == 0
        assert cached("vllm-vcr/sim") > 0
        assert cached("sql") == 0  # same tokens, another adapter: another key
        assert cached("sql") > 0
        # the subscriber joins asynchronously: store fresh blocks until a batch with them arrives
        stored: list = []
        for i in range(50):
            post(sp.url + "/v1/completions", {"model": "sql", "prompt": [200 + i] * 32, "max_tokens": 1})
            while sub.poll(100):
                stored += [ev for ev in decode_batch(sub.recv_multipart()[-1]).events if isinstance(ev, BlockStored)]
            if any(ev.lora_name for ev in stored):
                break
        with_lora = [ev for ev in stored if ev.lora_name is not None]
        assert with_lora, f"no BlockStored event of the adapter reached the subscriber: {stored[:2]}"
        ev = with_lora[0]
        assert ev.lora_name == "sql" and ev.lora_id == 1
        assert ev.extra_keys[0][0] == "sql"  # vLLM's untagged extra keys: the adapter's name per block
    finally:
        sub.close()
        ctx.term()


async def test_max_loras_defers_another_adapter(serve_process, adapters, serve_harness):
    """With --max-loras 1 a request of a second adapter waits (deferred) until the first adapter's
    request has left the batch, as vLLM's scheduler skips it."""
    import asyncio

    control = serve_harness.free_port()
    sp = serve_process("--inter-token-latency", "5", "--time-to-first-token", "2", "--enable-lora",
                       "--max-loras", "1", "--lora-modules", f"sql={adapters['sql']}", f"chat={adapters['chat']}",
                       "--control-address", f"127.0.0.1:{control}", env=RUNTIME)
    done: list[str] = []

    async def run(c: httpx.AsyncClient, model: str, n: int) -> None:
        r = await c.post(sp.url + "/v1/completions", json={"model": model, "prompt": "q", "max_tokens": n,
                                                          "ignore_eos": True})
        assert r.status_code == 200
        done.append(model)

    async def deferred(c: httpx.AsyncClient) -> float:  # the engine's skipped waiting requests ("deferred")
        text = (await c.get(sp.url + "/metrics")).text
        return sum(s.value for f in text_string_to_metric_families(text)
                   if f.name == "vllm:num_requests_waiting_by_reason" for s in f.samples
                   if s.labels["reason"] == "deferred")

    async def running(c: httpx.AsyncClient, name: str) -> int:
        loras = (await c.get(f"http://127.0.0.1:{control}/loras")).json()["adapters"]
        return next(a["running"] for a in loras if a["name"] == name)

    async with httpx.AsyncClient(timeout=30) as c:
        first = asyncio.ensure_future(run(c, "sql", 400))
        while await running(c, "sql") < 1:
            await asyncio.sleep(0.02)
        second = asyncio.ensure_future(run(c, "chat", 2))
        deferred_seen = False
        while not first.done():
            deferred_seen = deferred_seen or await deferred(c) == 1
            await asyncio.sleep(0.02)
        await asyncio.gather(first, second)
    assert done == ["sql", "chat"] and deferred_seen


def test_lora_load_and_swap_in_time(serve_process, adapters):
    import time

    sp = serve_process(*FAST, "--enable-lora", "--max-loras", "1", "--max-cpu-loras", "2",
                       "--lora-load-time", "400", "--lora-swap-in-time", "100",
                       "--lora-modules", f"sql={adapters['sql']}", f"chat={adapters['chat']}")

    def timed(model: str) -> float:
        t0 = time.monotonic()
        assert post(sp.url + "/v1/completions", {"model": model, "prompt": "q", "max_tokens": 1}).status_code == 200
        return time.monotonic() - t0

    assert timed("sql") >= 0.5  # first use: disk, then into the GPU slot
    assert timed("chat") >= 0.5  # the only slot goes to chat; sql stays in the CPU pool
    assert timed("sql") >= 0.1  # swap-in from the CPU pool
