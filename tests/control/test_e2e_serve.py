"""End to end: a real `vllm-vcr serve --control-address ...`, driven with httpx, the openai SDK, and
the control API specification's curl examples run verbatim (from docs/control-api.md)."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from .control_helpers import free_port, port_is_free
from tests.conftest import scaled, wait_until

REPO = Path(__file__).resolve().parents[2]

SPEC_EXAMPLES = Path(__file__).parent / "spec_examples.txt"  # the control API specification's, verbatim
DOC = REPO / "docs" / "control-api.md"


@pytest.fixture(scope="module")
def serve(serve_harness, tmp_path_factory):
    """`vllm-vcr serve --engine-count 2 --control-address 127.0.0.1:PORT` (tests/conftest.py's harness)."""
    # The examples say localhost:8001; use that port when it is free so they run letter for letter.
    control_port = 8001 if port_is_free(8001) else free_port()
    log = Path(tmp_path_factory.mktemp("control-serve")) / "serve.log"
    env = {"RUST_LOG": "info", "VLLM_VCR_LOG": "info"}  # the default filter, whatever the caller's env says
    proc = serve_harness.ServeProcess(
        ["--engine-count", "2", "--log-requests", "--control-address", f"127.0.0.1:{control_port}"],
        env=env, log_path=log).wait_ready()
    proc.control_port = control_port
    proc.control_url = f"http://127.0.0.1:{control_port}"
    proc.stderr = proc.log  # serve logs to stderr; the harness keeps stdout and stderr in one file
    yield proc
    proc.stop()


@pytest.fixture
def ctl(serve):
    with httpx.Client(base_url=serve.control_url, timeout=10) as c:
        # each test starts from the defaults with fresh counters
        c.patch("/config", json={"time_to_first_token": 0, "inter_token_latency": 0, "max_num_seqs": 128,
                                 "failure_injection_rate": 0, "failure_types": ["error"]})
        wait_idle(c)
        c.post("/stats/reset")
        yield c


@pytest.fixture
def client(serve):
    openai = pytest.importorskip("openai", reason="openai, a test dependency: pip install 'vllm-vcr[test]'")
    with openai.OpenAI(base_url=f"{serve.url}/v1", api_key="x", max_retries=0, timeout=30) as c:
        yield c


def model_of(serve) -> str:
    return httpx.get(f"{serve.url}/v1/models").json()["data"][0]["id"]


def wait_idle(c: httpx.Client, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + scaled(timeout)
    while True:
        s = c.get("/stats").json()
        if s["running"] == 0 and s["waiting"] == 0:
            return s
        assert time.monotonic() < deadline, f"never idle: {s}"
        time.sleep(0.05)


def doc_examples() -> list[str]:
    """The shell blocks of the Examples section, before 'More:'."""
    text = DOC.read_text()
    section = text.split("## Examples", 1)[1].split("\nMore:", 1)[0]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


def test_doc_examples_are_the_specifications_verbatim():
    spec = SPEC_EXAMPLES.read_text()
    examples = doc_examples()
    assert len(examples) == 5
    for block in examples:
        assert block.strip() in spec, block


def test_spec_examples_run_verbatim_with_curl(serve, ctl):
    if shutil.which("curl") is None:
        pytest.skip("curl not installed")
    have_jq = shutil.which("jq") is not None
    outputs = []
    for block in doc_examples():
        if "jq" in block and not have_jq:
            block = block.replace(" | jq .requests_received", "")
        if serve.control_port != 8001:
            block = block.replace("localhost:8001", f"localhost:{serve.control_port}")
        r = subprocess.run(["bash", "-c", "set -euo pipefail\n" + block], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (block, r.stderr)
        outputs.append(r.stdout)
    import json

    slow, choke_release, fail, count, trace = outputs
    assert json.loads(slow)["time_to_first_token"] == 1000 and json.loads(slow)["inter_token_latency"] == 50
    first, second = [json.loads(line) for line in choke_release.splitlines()]
    assert (first["max_num_seqs"], first["inter_token_latency"]) == (1, 2000)
    assert (second["max_num_seqs"], second["inter_token_latency"]) == (128, 30)
    assert json.loads(fail)["failure_injection_rate"] == 1.0
    last = count.strip().splitlines()[-1]
    assert last == "0" if have_jq else json.loads(last)["requests_received"] == 0
    assert json.loads(trace) == {"filter": "vllm_vcr::engine=trace,info"}
    # leave the process as the other tests expect it
    ctl.put("/log", json={"filter": "info"})


def test_routes_and_codes_over_http(serve, ctl):
    cfg = ctl.get("/config").json()
    from vllm_vcr.control.schema import CONFIG_FIELDS
    from vllm_vcr.faults import RATE_FIELDS

    # the specification's 14 engine fields and the 4 of the output-length distribution, plus serve's HTTP
    # fault rates (docs/faults.md)
    assert len(CONFIG_FIELDS) == 18 and set(cfg) == {*CONFIG_FIELDS, *RATE_FIELDS} and cfg["failure_types"] == ["error"]
    assert ctl.patch("/config", json={"max_num_seqs": 64}).json()["max_num_seqs"] == 64
    for method, path, body, status in [
        ("PATCH", "/config", {"failure_injection_rate": 7}, 400),
        ("PATCH", "/config", {"time_scale": 2}, 400),
        ("PATCH", "/config", {"failure_types": ["segfault"]}, 422),
        ("PATCH", "/config", {"nope": 1}, 422),
        ("PUT", "/log", {"filter": "vllm_vcr::engine=maximum"}, 400),
        ("GET", "/v1/models", None, 404),
        ("DELETE", "/stats", None, 405),
    ]:
        r = ctl.request(method, path, json=body)
        assert r.status_code == status, (method, path, r.text)
        assert list(r.json()) == ["error"]
    assert "cannot change at run time" in ctl.patch("/config", json={"time_scale": 2}).json()["error"]


def test_stats_count_what_reached_the_engine(serve, ctl, client):
    model = model_of(serve)
    for _ in range(3):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert r.choices[0].finish_reason == "length"
    # rejected by the frontend before the engine saw it: not counted
    r = httpx.post(f"{serve.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500
    import openai

    with pytest.raises(openai.BadRequestError):  # longer than the context: the frontend refuses it
        client.completions.create(model=model, prompt="hi", max_tokens=10**7)
    s = wait_idle(ctl)
    assert (s["requests_received"], s["requests_completed"]) == (3, 3)


def test_failure_injection_on_then_off(serve, ctl, client):
    import openai

    model = model_of(serve)
    ctl.patch("/config", json={"failure_injection_rate": 1.0, "failure_types": ["error"]})
    for _ in range(3):
        with pytest.raises(openai.APIStatusError) as ei:
            client.completions.create(model=model, prompt="hello", max_tokens=4)
        assert ei.value.status_code == 500
    ctl.patch("/config", json={"failure_injection_rate": 0})
    r = client.completions.create(model=model, prompt="hello", max_tokens=4)
    assert r.choices[0].finish_reason == "length"
    s = wait_idle(ctl)
    assert (s["requests_received"], s["requests_failed"], s["requests_completed"]) == (4, 3, 1)


def test_invariant_after_mixed_run_with_disconnects(serve, ctl, client):
    model = model_of(serve)
    ctl.patch("/config", json={"inter_token_latency": 20})
    for _ in range(2):  # streams the client walks away from
        stream = client.completions.create(model=model, prompt="long story", max_tokens=500, stream=True)
        for i, _chunk in enumerate(stream):
            if i >= 2:
                break
        stream.close()
    for _ in range(2):
        client.completions.create(model=model, prompt="short", max_tokens=3)
    ctl.patch("/config", json={"failure_injection_rate": 1.0})
    import openai

    with pytest.raises(openai.APIStatusError):
        client.completions.create(model=model, prompt="doomed", max_tokens=3)
    ctl.patch("/config", json={"failure_injection_rate": 0})
    s = wait_idle(ctl)
    assert s.pop("faults_injected_total") == 0 and s.pop("faults_injected")  # serve's HTTP faults, none here
    assert s == {"requests_received": 5, "requests_completed": 2, "requests_failed": 1, "requests_aborted": 2,
                 "running": 0, "waiting": 0}


def test_patch_applies_to_the_next_request_in_flight_keeps_its_pacing(serve, ctl, client):
    model = model_of(serve)
    ctl.patch("/config", json={"inter_token_latency": 20})
    stream = client.completions.create(model=model, prompt="a", max_tokens=40, stream=True)
    it = iter(stream)
    for _ in range(3):
        next(it)
    t0 = time.monotonic()
    assert ctl.patch("/config", json={"inter_token_latency": 400}).status_code == 200
    t_new = time.monotonic()
    client.completions.create(model=model, prompt="b", max_tokens=3)
    new_took = time.monotonic() - t_new
    for _ in it:
        pass
    # the old stream's remaining ~37 tokens at 20 ms had long finished; at 400 ms they'd take 15 s
    assert time.monotonic() - t0 < min(scaled(5.0), 12.0)
    assert new_took > 0.7  # 2 gaps at 400 ms


def test_max_num_seqs_raise_admits_waiting_requests(serve, ctl, client):
    import threading

    model = model_of(serve)
    ctl.patch("/config", json={"max_num_seqs": 1, "inter_token_latency": 50})
    stop = threading.Event()

    def stream_until_stopped():
        s = client.completions.create(model=model, prompt="x", max_tokens=400, stream=True)
        for _ in s:
            if stop.is_set():
                break
        s.close()

    # engine-count 2: 4 requests -> 2 per engine, one running and one waiting on each
    threads = [threading.Thread(target=stream_until_stopped) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + scaled(10)
        while (s := ctl.get("/stats").json())["waiting"] != 2:
            assert time.monotonic() < deadline, s
            time.sleep(0.05)
        assert s["running"] == 2
        ctl.patch("/config", json={"max_num_seqs": 128})
        # the waiting requests start at each engine's next step
        deadline = time.monotonic() + scaled(10)
        while ((s := ctl.get("/stats").json())["running"], s["waiting"]) != (4, 0):
            assert time.monotonic() < deadline, s
            time.sleep(0.02)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    s = wait_idle(ctl)
    assert s["requests_aborted"] == 4


def test_put_log_changes_what_is_logged(serve, ctl, client):
    model = model_of(serve)

    def lines_for(tag: str) -> list[str]:
        return [ln for ln in serve.stderr().splitlines() if tag in ln]

    client.completions.create(model=model, prompt="one", max_tokens=1)
    assert any(" INFO vllm_vcr::engine: request" in ln for ln in serve.stderr().splitlines())

    assert ctl.put("/log", json={"filter": "warn"}).json() == {"filter": "warn"}
    before = len(lines_for("vllm_vcr::engine: request"))
    client.completions.create(model=model, prompt="two", max_tokens=1)
    time.sleep(0.2)
    assert len(lines_for("vllm_vcr::engine: request")) == before  # info is off now

    # debug for the control API only: its own rejected calls get logged
    ctl.put("/log", json={"filter": "vllm_vcr::control=debug,warn"})
    ctl.patch("/config", json={"max_num_seqs": 0})
    wait_until(lambda: lines_for("DEBUG vllm_vcr::control: control: PATCH /config -> 400"), 10,
               "the control API's debug line")

    ctl.put("/log", json={"filter": "info"})
    client.completions.create(model=model, prompt="three", max_tokens=1)
    wait_until(lambda: len(lines_for("vllm_vcr::engine: request")) > before, 10, "the engine's info line")


def test_bad_control_address_fails_clearly(serve_harness):
    import sys

    r = subprocess.run([sys.executable, "-m", "vllm_vcr", "serve", "--host", "127.0.0.1", "--port", "0",
                        "--control-address", "nonsense"],
                       capture_output=True, text=True, timeout=60, env=serve_harness.subprocess_env(), cwd=str(REPO))
    assert r.returncode != 0
    assert "--control-address" in r.stderr


def test_mock_control_address_env_turns_it_on(serve_harness, tmp_path):
    port = free_port()
    sp = serve_harness.ServeProcess([], env={"MOCK_CONTROL_ADDRESS": f"127.0.0.1:{port}"},
                                    log_path=tmp_path / "serve.log").wait_ready()
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=5)
        assert r.status_code == 200 and r.json()["requests_received"] == 0
    finally:
        sp.stop()


def test_put_log_bounds_the_loggers_its_targets_create(serve_harness, tmp_path_factory):
    """Python keeps every logger for the life of the process, and every setLevel walks them all:
    PUT /log creates at most MAX_NEW_LOGGERS of them, then refuses new targets with a 400."""
    from vllm_vcr.log_filter import MAX_NEW_LOGGERS, MAX_TARGETS

    sp = serve_harness.start_fast(tmp_path_factory, "log-bound")
    try:
        with httpx.Client(base_url=sp.control, timeout=30) as c:
            def put(names: list[str]) -> httpx.Response:
                return c.put("/log", json={"filter": ",".join(f"{n}=debug" for n in names) + ",info"})

            batches = [[f"probe{b}x{i}" for i in range(MAX_TARGETS)] for b in range(20)]  # 2560 targets
            codes = [put(names).status_code for names in batches]
            full = MAX_NEW_LOGGERS // MAX_TARGETS
            assert codes == [200] * full + [400] * (len(batches) - full)
            r = put(batches[-1])
            assert r.status_code == 400 and str(MAX_NEW_LOGGERS) in r.json()["error"]
            assert put(batches[0]).status_code == 200  # targets already created stay usable
            assert put(["vllm_vcr::engine", "uvicorn", "nonexistent"]).status_code == 400
            assert c.put("/log", json={"filter": "vllm_vcr::engine=debug,uvicorn=warn,info"}).status_code == 200
            assert httpx.get(sp.url + "/health").status_code == 200
    finally:
        sp.stop()


SPEC_CONFIG = Path(__file__).parent / "spec_config_example.json"  # the specification's Config example, verbatim


def test_config_has_the_types_of_the_specifications_example(serve, ctl):
    """Set to the example's values, GET /config answers the example's JSON: whole milliseconds
    as integers (200, not 200.0), the load factor and the failure rate as floats."""
    import json

    raw = SPEC_CONFIG.read_text()
    example = json.loads(raw)
    r = ctl.patch("/config", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    for got in (r.json(), ctl.get("/config").json()):
        shown = {k: got[k] for k in example}
        assert shown == example
        assert {k: type(v) for k, v in shown.items()} == {k: type(v) for k, v in example.items()}
    text = ctl.get("/config").text
    assert '"time_to_first_token":200,' in text and '"time_factor_under_load":1.0,' in text
    assert '"failure_injection_rate":0.0,' in text
    # a fraction of a millisecond (the CLI accepts one) is kept, not rounded
    assert ctl.patch("/config", json={"inter_token_latency": 0.5}).json()["inter_token_latency"] == 0.5
    ctl.patch("/config", json={"time_to_first_token": 0, "inter_token_latency": 0, "log_requests": True})
