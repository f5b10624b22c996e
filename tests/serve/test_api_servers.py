"""`serve --api-server-count N`: N API server processes in front of one engine-core process per
data-parallel rank, started through the real CLI and driven with the openai SDK."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import zmq
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServeProcess, scaled, subprocess_env
from vllm_vcr.fpm import decode as decode_fpm
from vllm_vcr.kv_events.events import decode_batch
from vllm_vcr.trace.io import read_trace
from vllm_vcr.testing.waits import free_port, free_port_run, wait_until

MODEL = "vllm-vcr/sim"
HEADER = "x-vllm-vcr-api-server"


def start(tmp_path: Path, name: str, *args: str, env: dict[str, str] | None = None) -> ServeProcess:
    control = free_port()
    sp = ServeProcess(["--control-address", f"127.0.0.1:{control}", *args], log_path=tmp_path / f"{name}.log",
                      env=env)
    sp.control = f"http://127.0.0.1:{control}"
    sp.wait_ready(120)
    wait_until(lambda: READY.search(sp.log()), 60, "every process to report ready")
    return sp


READY = re.compile(r"API server\(s\) \(pids ([\d ]+)\), \d+ engine core process\(es\) \(pids ([\d ]+)\)")


def pids(sp: ServeProcess) -> tuple[list[int], list[int]]:
    """(API server pids, engine core pids) as the ready line names them."""
    m = READY.search(sp.log())
    assert m, sp.log()
    return [int(p) for p in m.group(1).split()], [int(p) for p in m.group(2).split()]


def client(sp: ServeProcess, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=sp.url + "/v1", api_key="x", max_retries=0, **kw)


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lv), v in samples.items()
               if n == name and all(dict(lv).get(k) == want for k, want in labels.items()))


@pytest.fixture(scope="module")
def fleet_of_processes(tmp_path_factory):
    """2 API servers, 2 engine cores (data parallel), a control API, vLLM's dev-mode routes."""
    sp = start(tmp_path_factory.mktemp("api-servers"), "serve", "--api-server-count", "2",
               "--data-parallel-size", "2", "--time-to-first-token", "5", "--inter-token-latency", "2",
               "--enable-access-log",
               env={"VLLM_SERVER_DEV_MODE": "1"})
    yield sp
    assert sp.stop(timeout=30) == 0, sp.log()


def test_every_api_server_answers_and_the_counts_add_up(fleet_of_processes):
    sp = fleet_of_processes
    httpx.post(sp.control + "/stats/reset", timeout=30).raise_for_status()
    before = metrics(sp.url)
    seen: dict[str, int] = {}
    ids: list[str] = []
    lock = threading.Lock()

    def one(_: int) -> None:
        with client(sp) as c:  # a connection of its own: the processes race for it
            raw = c.completions.with_raw_response.create(model=MODEL, prompt="hello", max_tokens=3)
            body = raw.parse()
        with lock:
            seen[raw.headers[HEADER]] = seen.get(raw.headers[HEADER], 0) + 1
            ids.append(body.id)
        assert body.choices[0].finish_reason == "length"

    sent = 0
    with ThreadPoolExecutor(8) as pool:
        while len(seen) < 2 and sent < 400:
            list(pool.map(one, range(sent, sent + 16)))
            sent += 16
    assert set(seen) == {"0", "1"}, seen

    with client(sp) as c:  # one code path renders every response: streams too
        chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    sent += 1

    assert len(set(ids)) == len(ids)  # request ids unique across the API servers

    # /stats through the one control address: the sum over both engine-core processes
    stats = httpx.get(sp.control + "/stats", timeout=30).json()
    assert stats["requests_received"] == stats["requests_completed"] == sent, stats
    config = httpx.get(sp.control + "/config", timeout=30).json()
    assert config["inter_token_latency"] == 2

    # /metrics, whichever API server answers: counters summed over the processes, as vLLM's multiprocess registry
    def added_up() -> bool:
        after = metrics(sp.url)
        done = total(after, "vllm:request_success_total") - total(before, "vllm:request_success_total")
        http = (total(after, "http_requests_total", handler="/v1/completions")
                - total(before, "http_requests_total", handler="/v1/completions"))
        return done == sent and http == sent - 1

    for _ in range(4):  # every scrape (both API servers answer some) shows all of it
        wait_until(added_up, 30, "/metrics to count every request")
    after = metrics(sp.url)
    engines = {dict(lv)["engine"] for (n, lv), v in after.items() if n == "vllm:request_success_total" and v}
    assert engines == {"0", "1"}  # both data-parallel ranks served
    tokens = total(after, "vllm:generation_tokens_total") - total(before, "vllm:generation_tokens_total")
    assert tokens == 3 * (sent - 1) + 4
    assert not [n for n, _ in after if n.endswith("_created") or n.startswith("process_")]


def test_control_api_fans_out_patches(fleet_of_processes):
    sp = fleet_of_processes
    r = httpx.patch(sp.control + "/config", json={"max_num_seqs": 64}, timeout=30)
    assert r.status_code == 200 and r.json()["max_num_seqs"] == 64
    r = httpx.patch(sp.control + "/config", json={"failure_injection_rate": 2}, timeout=30)
    assert r.status_code == 400 and "error" in r.json()
    assert httpx.get(sp.control + "/nope", timeout=30).status_code == 404
    r = httpx.patch(sp.control + "/config", json={"max_num_seqs": 128}, timeout=30)
    assert r.json()["max_num_seqs"] == 128


def test_engine_operations_go_over_the_wire(fleet_of_processes):
    sp = fleet_of_processes
    for _ in range(4):  # whichever API server answers, every engine core resets
        r = httpx.post(sp.url + "/reset_prefix_cache", timeout=30)
        assert r.status_code == 200 and r.json() == {"success": True}
    assert httpx.get(sp.url + "/health", timeout=30).status_code == 200


def _each_server(sp: ServeProcess, method: str, path: str, **kw) -> list[httpx.Response]:
    """`path` on fresh connections until both API servers have answered it (one process: once)."""
    out, answered = [], set()
    for _ in range(60):
        with httpx.Client() as h:
            r = h.request(method, sp.url + path, timeout=scaled(60), **kw)
        out.append(r)
        answered.add(r.headers.get(HEADER))
        if answered == {"0", "1"} or answered == {None}:
            return out
    raise AssertionError(f"not every API server answered {path}: {answered}")


def _pending_completion(sp: ServeProcess, results: list) -> threading.Thread:
    def run() -> None:
        r = httpx.post(sp.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       timeout=scaled(60))
        results.append((r.status_code, r.json()["choices"][0]["finish_reason"]))

    t = threading.Thread(target=run)
    t.start()
    return t


def _sleep_wake_pause_resume(sp: ServeProcess) -> list:
    """The dev-mode engine operations, in vLLM's order of use by an RL trainer; what each answers
    (and which of the held requests finished when)."""
    seen: list = []

    def once(method: str, path: str) -> None:
        if method == "POST":  # an operation: once, whichever API server takes it
            r = httpx.post(sp.url + path, timeout=scaled(60))
            seen.append((path, (r.status_code, r.json())))
            return
        bodies = [(r.status_code, r.json()) for r in _each_server(sp, method, path)]
        assert all(b == bodies[0] for b in bodies), (path, bodies)  # every API server sees the same state
        seen.append((path, bodies[0]))

    once("POST", "/sleep?level=1")
    once("GET", "/is_sleeping")
    held: list = []
    t = _pending_completion(sp, held)  # queues in the sleeping engine
    wait_until(lambda: httpx.get(sp.control + "/stats", timeout=30).json()["waiting"] == 1, 30,
               "the request to wait")
    seen.append(("while asleep", list(held)))
    once("POST", "/wake_up?tags=weights")
    once("GET", "/is_sleeping")
    once("POST", "/release_kv_cache_memory")  # refused: still asleep (the KV cache)
    once("POST", "/wake_up")
    t.join(scaled(60))
    seen.append(("after wake_up", list(held)))
    once("GET", "/is_sleeping")
    once("POST", "/pause?mode=wait")
    once("GET", "/is_paused")
    once("POST", "/release_kv_cache_memory")  # a completed pause: released
    once("GET", "/is_sleeping")
    once("POST", "/wake_up?tags=kv_cache")
    once("POST", "/resume")
    once("GET", "/is_paused")
    once("GET", "/is_sleeping")
    once("POST", "/update_weight_version")  # 422: no body
    r = httpx.post(sp.url + "/update_weight_version", json={"new_version": "v7"}, timeout=30)
    seen.append(("/update_weight_version v7", r.json()))
    once("GET", "/weight_info")  # every API server knows it: the engine cores hold it
    r = httpx.post(sp.url + "/update_weight_version", json={"new_version": "default"}, timeout=30)
    assert r.status_code == 200
    return seen


def test_sleep_wake_pause_resume_answer_as_one_process(fleet_of_processes, tmp_path):
    """/sleep, /wake_up, /is_sleeping, /pause, /resume, /is_paused, /release_kv_cache_memory and
    the weight version go to the engine cores as utility calls: every API server sees the same
    state, and the answers are those of one process with its engines in it."""
    many = _sleep_wake_pause_resume(fleet_of_processes)
    control = free_port()
    one = ServeProcess(["--api-server-count", "1", "--data-parallel-size", "2", "--time-to-first-token", "5",
                        "--control-address", f"127.0.0.1:{control}",
                        "--inter-token-latency", "2"], env={"VLLM_SERVER_DEV_MODE": "1"},
                       log_path=tmp_path / "one.log")
    one.control = f"http://127.0.0.1:{control}"
    try:
        one.wait_ready(60)
        assert "1 API server" not in one.log()  # the engines in the one process
        alone = _sleep_wake_pause_resume(one)
    finally:
        assert one.stop(timeout=30) == 0
    assert many == alone
    assert ("while asleep", []) in many and ("after wake_up", [(200, "length")]) in many
    assert ("/is_sleeping", (200, {"is_sleeping": True})) in many


def test_abort_requests_aborts_that_api_servers_requests(fleet_of_processes):
    """vLLM's /abort_requests acts on the requests of the API server it reaches (its output
    processor's); they end with finish_reason abort."""
    sp = fleet_of_processes
    # a stream that outlasts the abort's search for its API server on a loaded machine (new
    # connections land on either server): 4000 tokens at 50 ms, ended by the abort
    httpx.patch(sp.control + "/config", json={"inter_token_latency": 50}, timeout=30).raise_for_status()
    try:
        _abort_one_stream(sp)
    finally:
        httpx.patch(sp.control + "/config", json={"inter_token_latency": 2}, timeout=30).raise_for_status()


def _abort_one_stream(sp) -> None:
    with httpx.Client() as h:  # one connection: the stream and the abort reach the same API server
        with h.stream("POST", sp.url + "/v1/completions", timeout=scaled(60),
                      json={"model": MODEL, "prompt": "x", "max_tokens": 4000, "stream": True}) as resp:
            server = resp.headers[HEADER]
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            results: dict = {}

            def abort() -> None:
                for _ in range(60):
                    with httpx.Client() as other:
                        r = other.post(sp.url + "/abort_requests", json={}, timeout=30)
                    if r.headers[HEADER] == server:
                        results["abort"] = r.json()
                        return

            t = threading.Thread(target=abort)
            t.start()
            events = [line for line in lines if line.startswith("data:")]
            t.join(scaled(60))
    assert results["abort"]["status"] == "aborted" and results["abort"]["aborted"] >= 1, results
    assert events[-1] == "data: [DONE]" and '"finish_reason":"abort"' in events[-2], events[-3:]


def _subscribers(ctx, base: int, ranks: int) -> list:
    subs = []
    for rank in range(ranks):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(f"tcp://127.0.0.1:{base + rank}")
        subs.append(sub)
    return subs


def test_data_parallel_size_alone_runs_one_engine_core_process_per_rank(tmp_path):
    """`--data-parallel-size 2` alone: vLLM's default of as many API servers as ranks, one
    engine-core process per rank; each publishes its own KV events (the endpoint's port + rank) and
    forward-pass metrics (--forward-pass-metrics-port + rank); both serve; SIGTERM ends them all."""
    kv = free_port_run(2)
    fpm = free_port_run(2)
    while fpm in (kv - 1, kv, kv + 1):
        fpm = free_port_run(2)
    sp = start(tmp_path, "dp", "--data-parallel-size", "2", "--inter-token-latency", "2",
               "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                 "endpoint": f"tcp://*:{kv}", "topic": "kv"}),
               "--forward-pass-metrics-port", str(fpm), "--forward-pass-metrics-trace", str(tmp_path / "fpm.jsonl"))
    api, engines = pids(sp)
    assert len(api) == 2 and len(engines) == 2
    assert "Defaulting api_server_count to data_parallel_size (2)." in sp.log()
    children = {p.pid for p in psutil.Process(sp.proc.pid).children()}
    assert set(api + engines) <= children
    ctx = zmq.Context()
    kv_subs, fpm_subs = _subscribers(ctx, kv, 2), _subscribers(ctx, fpm, 2)
    try:
        sources = httpx.get(sp.url + "/kv_event_sources", timeout=30).json()
        assert sorted(sources) == ["0", "1"], sources
        for sub in fpm_subs:  # an idle rank's heartbeat: its subscription is in place
            assert sub.poll(scaled(10) * 1000), "no FPM heartbeat"
            sub.recv_multipart()
        before = metrics(sp.url)
        sent = {0: 3, 1: 2}

        def ready() -> bool:  # (the KV subscription has no heartbeat: requests until events come)
            for rank, n in sent.items():
                for i in range(n):
                    r = httpx.post(sp.url + "/v1/completions", headers={"X-data-parallel-rank": str(rank)},
                                   json={"model": MODEL, "prompt": f"rank {rank} request {i} " * 8, "max_tokens": 3},
                                   timeout=scaled(60))
                    assert r.status_code == 200, r.text
            return all(sub.poll(500) for sub in kv_subs)

        rounds = 1
        while not ready():
            rounds += 1
            assert rounds < 20, "no KV events from a rank"
        for rank, sub in enumerate(kv_subs):
            topic, _seq, payload = sub.recv_multipart()
            assert topic == b"kv" and decode_batch(payload).data_parallel_rank == rank
        for rank, sub in enumerate(fpm_subs):  # records of steps, from each rank's own process
            got = []
            while sub.poll(scaled(5) * 1000) and not got:
                rec = decode_fpm(sub.recv_multipart()[2])
                assert rec.dp_rank == rank
                if rec.step:
                    got.append(rec)
            assert got, f"no FPM records from rank {rank}"

        def per_engine() -> dict[str, float]:
            after = metrics(sp.url)
            return {e: total(after, "vllm:request_success_total", engine=e)
                    - total(before, "vllm:request_success_total", engine=e) for e in ("0", "1")}

        wait_until(lambda: per_engine() == {"0": 3.0 * rounds, "1": 2.0 * rounds}, 30, "each engine's count")
        stats = httpx.get(sp.control + "/stats", timeout=30).json()
        assert stats["requests_completed"] >= 5 * rounds
    finally:
        for sub in kv_subs + fpm_subs:
            sub.close(linger=0)
        ctx.term()
    sp.proc.send_signal(signal.SIGTERM)
    assert sp.proc.wait(scaled(60)) == 0, sp.log()
    for pid in api + engines:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    trace = read_trace(tmp_path / "fpm.jsonl")  # one file, both ranks' lines, whole
    assert trace.meta.source == "fpm" and {d["dp_rank"] for d in trace.fpm} == {0, 1}
    sp.stop()


def test_sigterm_drains_every_process(tmp_path):
    """Two API servers (vLLM's default for two ranks), two engine cores, a stream on each: SIGTERM
    lets both finish, then every process exits, the parent with 0."""
    sp = start(tmp_path, "drain", "--data-parallel-size", "2", "--shutdown-timeout", "60",
               "--time-to-first-token", "10", "--inter-token-latency", "20")
    api, engines = pids(sp)
    assert len(api) == len(engines) == 2
    result: dict = {}

    def stream(rank: int) -> None:
        with client(sp, timeout=scaled(60), default_headers={"X-data-parallel-rank": str(rank)}) as c:
            chunks = list(c.completions.create(model=MODEL, prompt="x", max_tokens=40, stream=True))
        result[rank] = (chunks[-1].choices[0].finish_reason, "".join(ch.choices[0].text for ch in chunks))

    threads = [threading.Thread(target=stream, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    wait_until(lambda: httpx.get(sp.control + "/stats", timeout=30).json()["running"] == 2, 30, "both streams to run")
    sp.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(scaled(60))
    assert {rank: finish for rank, (finish, _) in result.items()} == {0: "length", 1: "length"}  # drained, not cut
    assert sp.proc.wait(scaled(60)) == 0
    for pid in api + engines:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    sp.stop()


def test_killing_the_engine_core_stops_the_server_as_vllm(tmp_path):
    """vLLM 0.32 with --api-server-count 2 whose EngineCore gets SIGKILL: the parent sees the
    process gone, SIGTERMs the API servers, which drop what is in flight, and exits 1."""
    sp = start(tmp_path, "kill", "--api-server-count", "2", "--time-to-first-token", "10",
               "--inter-token-latency", "50")
    api, engines = pids(sp)
    results: dict = {}

    def non_streaming() -> None:
        try:
            with client(sp, timeout=scaled(60)) as c:
                results["plain"] = c.completions.create(model=MODEL, prompt="x", max_tokens=500)
        except Exception as e:  # noqa: BLE001 - what the client gets is the point
            results["plain"] = e

    def streaming() -> None:
        got = []
        try:
            with client(sp, timeout=scaled(60)) as c:
                for ch in c.completions.create(model=MODEL, prompt="x", max_tokens=500, stream=True):
                    got.append(ch)
            results["stream"] = (len(got), None)
        except Exception as e:  # noqa: BLE001
            results["stream"] = (len(got), e)

    threads = [threading.Thread(target=non_streaming), threading.Thread(target=streaming)]
    for t in threads:
        t.start()
    wait_until(lambda: httpx.get(sp.control + "/stats", timeout=30).json()["running"] == 2, 30,
               "both requests to run")
    psutil.Process(engines[0]).kill()
    for t in threads:
        t.join(scaled(60))
    # no answer from the engine: uvicorn's graceful-shutdown wait ends, the requests are cut
    # (a response not begun gets uvicorn's bare 500, a stream stops short of its end)
    plain = results["plain"]
    assert isinstance(plain, openai.APIConnectionError) or (
        isinstance(plain, openai.APIStatusError) and plain.status_code == 500), plain
    got, error = results["stream"]
    assert got > 0 and error is not None, results["stream"]
    assert sp.proc.wait(scaled(60)) == 1
    for pid in api:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert re.search(r"engine core 0 \(pid \d+\) died with exit code -9", sp.log())
    sp.stop()


@pytest.mark.parametrize("args, message", [
    (["--api-server-count", "0"], "--api-server-count: must be >= 1"),
    (["--api-server-count", "2", "--grpc"], "--api-server-count"),
    (["--data-parallel-size", "2", "--forward-pass-metrics-trace", "/tmp/fpm.jsonl.gz"],
     "--forward-pass-metrics-trace: 2 engine-core processes append to one plain file"),
])
def test_bad_api_server_count_is_one_line(args, message):
    r = subprocess.run([sys.executable, "-m", "vllm_vcr", "serve", "--port", str(free_port()), *args],
                       capture_output=True, text=True, env=subprocess_env(), timeout=scaled(60))
    assert r.returncode == 2
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def _spread(sp: ServeProcess, n: int, **headers: str) -> list[tuple[int, str]]:
    """`n` completions, each on a connection of its own, 8 at a time (the API servers race for
    them): (status, which API server answered) of each."""
    def one(_: int) -> tuple[int, str]:
        r = httpx.post(sp.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       headers=headers, timeout=scaled(60))
        return r.status_code, r.headers[HEADER]

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(n)))


def _until_both(sp: ServeProcess, n: int, **headers: str) -> list[tuple[int, str]]:
    """`_spread` of `n`, then more in batches of 16 until both API servers have answered (the
    kernel hands connections to whichever process accepts first)."""
    results = _spread(sp, n, **headers)
    while {server for _, server in results} != {"0", "1"} and len(results) < 400:
        results += _spread(sp, 16, **headers)
    assert {server for _, server in results} == {"0", "1"}, results
    return results


def test_a_fault_script_counts_across_the_api_servers(fleet_of_processes):
    """One script for every API server: "fail the next 30" fails 30 requests in all, not 30 per
    process; request_index and requests_seen count every process's requests."""
    sp = fleet_of_processes
    c = sp.control
    httpx.post(c + "/stats/reset", timeout=30).raise_for_status()
    rules = [{"action": "http_error", "error": "rate_limit", "count": 30},
             # never matches: keeps the script live, so every request is seen
             {"match": {"header": {"x-never": "*"}}, "action": "stall", "stall_ms": 1}]
    r = httpx.put(c + "/faults", json={"rules": rules}, timeout=30)
    assert r.status_code == 200 and r.json()["rules"][0]["remaining"] == 30, r.text
    # both API servers answered: had each counted its own 30, each would have failed all it served
    results = _until_both(sp, 48)
    failed = [server for status, server in results if status == 429]
    assert len(failed) == 30, results
    assert {status for status, _ in results} == {200, 429}
    script = httpx.get(c + "/faults", timeout=30).json()
    assert script["requests_seen"] == len(results) and len(script["rules"]) == 1, script
    stats = httpx.get(c + "/stats", timeout=30).json()
    assert stats["faults_injected"]["http_error"] == 30 and stats["faults_injected_total"] == 30, stats
    assert stats["requests_received"] == len(results) - 30  # the engines saw only what was not failed

    # request_index counts across the processes too: exactly indexes 3..7 fail
    r = httpx.put(c + "/faults", json={"rules": [{"match": {"request_index": [3, 7]}, "action": "http_error",
                                                   "error": 503}]}, timeout=30)
    assert r.status_code == 200
    results = _until_both(sp, 24)
    assert sum(status == 503 for status, _ in results) == 5, results
    assert httpx.get(c + "/faults", timeout=30).json()["requests_seen"] == len(results)
    r = httpx.delete(c + "/faults", timeout=30)
    assert r.json() == {"rules": [], "requests_seen": 0}
    assert all(status == 200 for status, _ in _spread(sp, 8))
    # a bad script is refused and nothing is installed, as with one process
    r = httpx.put(c + "/faults", json={"rules": [{"action": "http_error", "error": "nope"}]}, timeout=30)
    assert r.status_code == 400 and "error" in r.json()
    assert httpx.put(c + "/faults", json={"rules": 1}, timeout=30).status_code == 422
    assert httpx.get(c + "/faults", timeout=30).json()["rules"] == []


def test_rates_and_gauges_reach_every_api_server(fleet_of_processes):
    sp = fleet_of_processes
    c = sp.control
    r = httpx.patch(c + "/config", json={"http_error_rate": 1.0, "http_error_types": ["unavailable"]}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["http_error_rate"] == 1.0 and r.json()["inter_token_latency"] == 2
    try:
        results = _until_both(sp, 32)
        assert {status for status, _ in results} == {503}
        # a bad value changes nothing (the engine part of the same patch included)
        r = httpx.patch(c + "/config", json={"http_error_rate": 2, "max_num_seqs": 3}, timeout=30)
        assert r.status_code == 400 and "http_error_rate" in r.json()["error"]
        assert httpx.get(c + "/config", timeout=30).json()["max_num_seqs"] != 3
    finally:
        r = httpx.patch(c + "/config", json={"http_error_rate": 0.0, "max_num_seqs": 128}, timeout=30)
    assert r.status_code == 200 and r.json()["http_error_rate"] == 0.0 and r.json()["max_num_seqs"] == 128
    assert all(status == 200 for status, _ in _spread(sp, 8))

    # scripted gauges: /metrics shows them whichever API server answers the scrape
    r = httpx.put(c + "/gauges", json={"vllm:num_requests_waiting": {"function": "constant", "value": 7},
                                       "vllm:kv_cache_usage_perc": {"function": "constant", "value": 0.5}},
                  timeout=30)
    assert r.status_code == 200 and r.json()["vllm:num_requests_waiting"]["current"] == 7
    answered = set()
    for _ in range(40):
        with httpx.Client() as h:  # a connection of its own each time
            resp = h.get(sp.url + "/metrics", timeout=30)
        answered.add(resp.headers[HEADER])
        samples = {}
        for fam in text_string_to_metric_families(resp.text):
            for s in fam.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        waiting = [v for (n, _), v in samples.items() if n == "vllm:num_requests_waiting"]
        usage = [v for (n, _), v in samples.items() if n == "vllm:kv_cache_usage_perc"]
        assert waiting and set(waiting) == {7.0} and set(usage) == {0.5}, samples
        if len(answered) == 2:
            break
    assert answered == {"0", "1"}
    assert httpx.get(c + "/gauges", timeout=30).json()["vllm:kv_cache_usage_perc"]["current"] == 0.5
    assert httpx.delete(c + "/gauges", timeout=30).json() == {}
    assert httpx.put(c + "/gauges", json={"vllm:nope": {"function": "constant", "value": 1}},
                     timeout=30).status_code == 400
    wait_until(lambda: total(metrics(sp.url), "vllm:num_requests_waiting") == 0, 30, "the engines' own gauge")


def test_put_log_reaches_the_api_servers(fleet_of_processes):
    sp = fleet_of_processes
    c = sp.control

    def access_lines() -> int:
        return sp.log().count('"POST /v1/completions HTTP/1.1" 200')

    r = httpx.put(c + "/log", json={"filter": "info,uvicorn.access=off"}, timeout=30)
    assert r.json() == {"filter": "uvicorn::access=off,info"}
    try:
        before = access_lines()
        results = _until_both(sp, 24)
        assert {status for status, _ in results} == {200}
        assert access_lines() == before
    finally:
        r = httpx.put(c + "/log", json={"filter": "info"}, timeout=30)
    assert r.status_code == 200
    results = _until_both(sp, 24)
    wait_until(lambda: access_lines() >= before + len(results), 30, "the access log to be back")
    assert httpx.put(c + "/log", json={"filter": "x=bogus"}, timeout=30).status_code == 400


@pytest.mark.parametrize("taken_host, flags, said", [
    # the control address: one place, checked by the parent
    ("127.0.0.1", lambda port: ["--api-server-count", "2", "--control-address", f"127.0.0.1:{port}"],
     lambda port: "--control-address"),
    # rank 1 publishes forward-pass metrics on port + 1: the parent tries every rank's port
    ("0.0.0.0", lambda port: ["--data-parallel-size", "2", "--forward-pass-metrics-port", str(port - 1)],
     lambda port: f"--forward-pass-metrics-port: cannot bind {port - 1}"),
], ids=["control-address", "forward-pass-metrics-port"])
def test_a_taken_port_is_one_line_before_any_child_starts(taken_host, flags, said):
    import socket

    with socket.socket() as taken:
        taken.bind((taken_host, 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "vllm_vcr", "serve", "--port", str(free_port()), *flags(port)],
                           capture_output=True, text=True, env=subprocess_env(), timeout=scaled(60))
    assert r.returncode == 2
    assert said(port) in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "API server" not in r.stderr and "engine core" not in r.stderr, r.stderr


@pytest.mark.parametrize("args, count", [
    ([], 1),
    (["--data-parallel-size", "2"], 2),  # vLLM's default: as many API servers as ranks
    (["-dp", "3", "--api-server-count", "1"], 1),  # given: as given (the engines in one process)
    (["-dp", "2", "--api-server-count", "4"], 4),
    (["-dp", "2", "--data-parallel-rank", "1"], 1),  # one rank of an external load balancer
    (["-dp", "2", "--grpc"], 1),  # vLLM's gRPC server takes its own path first
    (["--engine-count", "2"], 1),  # vllm-vcr's own: engines in this process
])
def test_default_api_server_count_is_vllms(args, count):
    from vllm_vcr.serve.cli import default_api_server_count
    from vllm_vcr.testing.server import _parse

    assert default_api_server_count(_parse(["serve", *args])) == count




# --- the data-parallel ranks of an MoE model step together across the engine-core processes ------
MOE = "Qwen/Qwen3-30B-A3B"
DENSE = "meta-llama/Llama-3.1-8B-Instruct"
LONG = 8000  # prompt tokens on rank 1: one prefill step far longer than a decode step
PERF = ("--perf-model", "aic", "--max-model-len", "16384", "--max-num-batched-tokens", "8192",
        "--shutdown-timeout", "30")
needs_aic = pytest.mark.skipif(importlib.util.find_spec("aiconfigurator_core") is None,
                               reason="the aic extra is not installed: pip install 'vllm-vcr[aic]'")


@contextlib.contextmanager
def _serving(tmp_path: Path, name: str, *args: str):
    """start(), and the server stopped however the test ends."""
    sp = start(tmp_path, name, *args)
    try:
        yield sp
    finally:
        sp.stop()


def _priced_prefill(model: str) -> float:
    """The perf model's price of the step of LONG prompt tokens alone (on the virtual clock)."""
    from vllm_vcr.cli import build_parser
    from vllm_vcr.engine.clock import VirtualClock
    from vllm_vcr.engine.core import EngineCore
    from vllm_vcr.engine.types import EngineCoreRequest, SamplingParams
    from vllm_vcr.engine_cli import engine_args_from_cli
    from vllm_vcr.replay.inputs import engine_inputs

    parser, _ = build_parser()
    args = engine_args_from_cli(parser.parse_args(["serve", model, *PERF]))
    durations: list[float] = []
    core = EngineCore(args, clock=VirtualClock(0.0), **engine_inputs(args))
    assert core.latency.times_steps
    core.add_step_observer(lambda step: durations.append(step.duration))
    core.add_request(EngineCoreRequest(request_id="long", prompt_token_ids=[300 + i % 600 for i in range(LONG)],
                                       sampling_params=SamplingParams(max_tokens=1)))
    core.run_until_idle()
    assert len(durations) == 1, durations  # (one step: the whole prompt fits its token budget)
    return durations[0]


def _long_prompt_during_a_stream(sp: ServeProcess, model: str) -> list[float]:
    """A decode stream on rank 0; while it runs, a LONG prompt on rank 1. Returns the stream's gaps."""
    import time

    gaps: list[float] = []
    started = threading.Event()

    def stream() -> None:
        with client(sp, timeout=scaled(120), default_headers={"X-data-parallel-rank": "0"}) as c:
            last = None
            for _ in c.completions.create(model=model, prompt="x", max_tokens=400, stream=True,
                                          extra_body={"ignore_eos": True}):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                    if len(gaps) == 20:
                        started.set()
                last = now
        started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(scaled(60))
    with client(sp, timeout=scaled(120), default_headers={"X-data-parallel-rank": "1"}) as c:
        out = c.completions.create(model=model, prompt=[300 + i % 600 for i in range(LONG)], max_tokens=1)
    assert out.usage.prompt_tokens == LONG
    t.join(scaled(120))
    assert not t.is_alive() and len(gaps) > 100  # (tokens of back-to-back steps may share a chunk)
    return gaps


@needs_aic
def test_an_moe_models_ranks_step_together_across_engine_core_processes(tmp_path):
    """`-dp 2` runs each rank in its own engine-core process; for an MoE model they step in
    lockstep as vLLM's ranks do: rank 1's long prefill stretches rank 0's decode step around it to
    the prefill's length. SIGTERM still ends every process with 0."""
    priced = _priced_prefill(MOE)
    with _serving(tmp_path, "moe", MOE, "-dp", "2", *PERF) as sp:
        assert sp.log().count("steps in lockstep with the other data-parallel ranks") == 2
        gaps = _long_prompt_during_a_stream(sp, MOE)
        # rank 0's own steps are decodes of one sequence (a few ms); one of them lasted the prefill's step
        assert max(gaps) >= 0.5 * priced, (max(gaps), priced, sorted(gaps)[-5:])
        # SIGTERM with a stream on rank 0: the idle rank 1 stops (and leaves the lockstep), rank 0 drains
        result, t = _stream_on_rank_0(sp, 300)
        sp.proc.send_signal(signal.SIGTERM)
        t.join(scaled(120))
        assert result and result[-1].choices[0].finish_reason == "length"  # drained, not cut
        assert sp.proc.wait(scaled(60)) == 0, sp.log()


def _stream_on_rank_0(sp, max_tokens: int) -> tuple[list, threading.Thread]:
    """A stream of `max_tokens` pinned to rank 0, in a thread, running once this returns; its
    chunks land in the list (an API error ends it quietly: the engine core may be killed)."""
    result: list = []

    def stream() -> None:
        with contextlib.suppress(openai.APIError):
            with client(sp, timeout=scaled(120), default_headers={"X-data-parallel-rank": "0"}) as c:
                result.extend(c.completions.create(model=MOE, prompt="x", max_tokens=max_tokens, stream=True,
                                                   extra_body={"ignore_eos": True}))

    t = threading.Thread(target=stream)
    t.start()
    wait_until(lambda: httpx.get(sp.control + "/stats", timeout=30).json()["running"] == 1, 30, "the stream to run")
    return result, t


@needs_aic
def test_a_dense_models_ranks_step_on_their_own(tmp_path):
    """A dense model's ranks are independent engines in vLLM: no rank joins the lockstep."""
    with _serving(tmp_path, "dense", DENSE, "-dp", "2", *PERF) as sp:
        _long_prompt_during_a_stream(sp, DENSE)
        assert "steps in lockstep" not in sp.log()
        sp.proc.send_signal(signal.SIGTERM)
        assert sp.proc.wait(scaled(60)) == 0, sp.log()


@needs_aic
def test_an_moe_rank_killed_does_not_hold_the_others(tmp_path):
    """SIGKILL on rank 1's engine core while rank 0 streams in lockstep with it: the parent tells
    the lockstep the rank is gone (rank 0 steps on alone and drains its stream), takes the others
    down and exits 1, as with any engine core killed."""
    with _serving(tmp_path, "moe-kill", MOE, "-dp", "2", *PERF) as sp:
        api, engines = pids(sp)
        result, t = _stream_on_rank_0(sp, 2000)
        psutil.Process(engines[1]).kill()
        t.join(scaled(120))
        assert not t.is_alive()
        # rank 0 drained its stream at its own pace (waiting on the dead rank, each step would take ROUND_WAIT)
        assert result and result[-1].choices[0].finish_reason == "length", len(result)
        assert sp.proc.wait(scaled(60)) == 1, sp.log()
        for pid in api + engines:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert re.search(r"engine core 1 \(pid \d+\) died with exit code -9", sp.log())
