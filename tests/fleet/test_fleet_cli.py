"""`vllm-vcr fleet`: many serve workers in a few processes, started through the real CLI and
checked with real clients (openai SDK, httpx): every worker answers with its identity, has its own
/metrics and control /stats, and SIGTERM drains every worker in every process."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import scaled, subprocess_env
from vllm_vcr.testing.waits import wait_until

MODEL = "vllm-vcr/sim"


class Fleet:
    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None, preexec_fn=None):
        self.ports_file = tmp_path / "ports.json"
        self.log_path = tmp_path / "fleet.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_vcr", "fleet", "--host", "127.0.0.1", "--base-port", "0",
             "--ports-file", str(self.ports_file), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=subprocess_env(env), preexec_fn=preexec_fn)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> list[dict]:
        def ready() -> bool:
            assert self.proc.poll() is None, f"fleet exited with {self.proc.returncode}:\n{self.log()}"
            return self.ports_file.exists()

        wait_until(ready, scaled(timeout), "the fleet's ports file")
        self.workers = json.loads(self.ports_file.read_text())["workers"]
        return self.workers

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(scaled(timeout))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def fleet(tmp_path):
    started: list[Fleet] = []

    def start(*args: str, env: dict[str, str] | None = None, preexec_fn=None) -> Fleet:
        f = Fleet(tmp_path, *args, env=env, preexec_fn=preexec_fn)
        started.append(f)
        return f

    yield start
    for f in started:
        f.stop()


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_twenty_workers_in_two_processes_answer_count_and_drain(fleet):
    f = fleet("--workers", "20", "--processes", "2", "--control-base-port", "0", "--inter-token-latency", "20",
              "--seed", "3", "--shutdown-timeout", "60",
              env={"POD_NAME": "sim-pod-7", "POD_NAMESPACE": "tests"})
    workers = f.wait_ready()
    assert [w["index"] for w in workers] == list(range(20))
    assert len({w["port"] for w in workers}) == 20 and len({w["pid"] for w in workers}) == 2

    # every worker answers a real client, with its identity; each request is counted by its own worker only
    for w in workers:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{w['port']}/v1", api_key="x", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert raw.headers["x-inference-pod"] == "sim-pod-7"
        assert raw.headers["x-inference-namespace"] == "tests"
        assert raw.headers["x-inference-worker"] == w["name"] == f"worker-{w['index']}"
        assert raw.headers["x-inference-worker-index"] == str(w["index"])
        assert raw.parse().usage.completion_tokens == 2
    extra = workers[5]  # one worker gets two more requests
    for _ in range(2):
        httpx.post(f"http://127.0.0.1:{extra['port']}/v1/completions",
                   json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=30).raise_for_status()
    for w in workers:
        expected = 3 if w is extra else 1
        metrics = httpx.get(f"http://127.0.0.1:{w['port']}/metrics", timeout=30).text
        done = sum(float(v) for v in re.findall(r'^vllm:request_success_total\{[^}]*\} ([0-9.]+)$', metrics, re.M))
        assert done == expected, w
        stats = httpx.get(f"http://127.0.0.1:{w['control_port']}/stats", timeout=30).json()
        assert stats["requests_completed"] == expected and stats["requests_received"] == expected, w

    # SIGTERM: a stream in flight on a worker of each process finishes, then every process exits 0
    first, last = workers[0], workers[-1]
    outcomes: dict[str, object] = {}

    def stream(w: dict) -> None:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{w['port']}/v1", api_key="x", max_retries=0,
                               timeout=scaled(60))
        try:
            chunks = list(client.completions.create(model=MODEL, prompt="drain me", max_tokens=100, stream=True,
                                                    extra_body={"ignore_eos": True}))
            outcomes[w["name"]] = (chunks[-1].choices[0].finish_reason if chunks[-1].choices else
                                   chunks[-2].choices[0].finish_reason)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            outcomes[w["name"]] = e

    threads = [threading.Thread(target=stream, args=(w,)) for w in (first, last)]
    for t in threads:
        t.start()
    wait_until(lambda: all(httpx.get(f"http://127.0.0.1:{w['control_port']}/stats").json()["running"] == 1
                           for w in (first, last)), scaled(30), "both streams running")
    f.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(scaled(60))
    assert outcomes == {first["name"]: "length", last["name"]: "length"}, f.log()
    assert f.proc.wait(scaled(60)) == 0, f.log()
    log = f.log()
    assert log.count("received SIGTERM: draining 10 workers") == 2
    assert "Traceback" not in log, log
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{first['port']}/health")


def test_heterogeneous_workers_from_yaml(fleet, tmp_path):
    spec = tmp_path / "workers.yaml"
    spec.write_text(
        "workers:\n"
        "  - name: v\n"
        "    served-model-name: [llama-a]\n"
        "    max-model-len: 2048\n"
        "  - name: sg\n"
        "    count: 2\n"
        "    engine-type: sglang\n"
        "    served-model-name: [qwen-b]\n"
        "    time-to-first-token: 5\n")
    f = fleet("--workers-config", str(spec), "--processes", "2")
    workers = {w["name"]: w for w in f.wait_ready()}
    assert sorted(workers) == ["sg-0", "sg-1", "v"]
    v = httpx.Client(base_url=f"http://127.0.0.1:{workers['v']['port']}", timeout=30)
    models = v.get("/v1/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [("llama-a", 2048)]
    assert "vllm:num_requests_running" in v.get("/metrics").text
    for name in ("sg-0", "sg-1"):
        sg = httpx.Client(base_url=f"http://127.0.0.1:{workers[name]['port']}", timeout=30)
        r = sg.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
        assert r.headers["x-inference-worker"] == name
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{workers[name]['port']}/v1", api_key="x", max_retries=0)
        assert client.completions.create(model="qwen-b", prompt="x", max_tokens=1).model == "qwen-b"
        metrics = sg.get("/metrics").text
        assert "sglang:num_running_reqs{" in metrics and "vllm:" not in metrics
    assert f.stop() == 0


def test_a_worker_that_cannot_start_stops_the_fleet_with_one_line(fleet, tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        spec = tmp_path / "workers.yaml"
        spec.write_text("- name: ok\n- name: clash\n  control-address: 127.0.0.1:%d\n" % port)
        f = fleet("--workers-config", str(spec), "--processes", "2")
        assert f.proc.wait(scaled(120)) == 2, f.log()
    log = f.log()
    assert re.search(r"worker clash: --control-address: .*", log), log
    assert "Traceback" not in log, log


@pytest.mark.parametrize("args, message", [
    (["--workers", "2", "--port", "9000"], "--port: a fleet numbers its workers' ports from --base-port"),
    (["--workers", "3", "--base-port", "65534"], "--base-port: 65534 + 3 workers runs past port 65535"),
    (["--workers", "2", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["--workers", "2", "--kv-events-base-port", "0"], "--kv-events-base-port: 0 is not a base port"),
    (["--workers", "5", "--control-base-port", "8001"], "--control-base-port: 8001 + 5 workers overlaps"),
])
def test_bad_fleet_command_lines_exit_2(args, message, capsys):
    from vllm_vcr.cli import main

    try:
        code = main(["fleet", *args])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("text, message", [
    ("- name: a\n  port: 9000\n", "`port` is assigned per worker; use --base-port"),
    ("- name: a\n  count: 0\n", "entry 0: count must be a positive integer"),
    ("- name: a\n  no-such-flag: 1\n", "entry 0 (a): unrecognized arguments: --no-such-flag"),
    ("- name: a\n- name: a\n", "two workers are named 'a'"),
    ("workers: 3\n", "must hold a non-empty list of workers"),
])
def test_bad_workers_config_exits_2(text, message, tmp_path, capsys):
    from vllm_vcr.cli import main

    spec = tmp_path / "w.yaml"
    spec.write_text(text)
    assert main(["fleet", "--workers-config", str(spec)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_plan_gives_each_worker_its_ports_and_flags():
    from vllm_vcr.cli import build_parser
    from vllm_vcr.fleet.cli import _check_fleet_flags
    from vllm_vcr.fleet.plan import plan_workers, shard

    parser, _ = build_parser()
    args = parser.parse_args(["fleet", "MODEL-X", "--base-port", "9100", "--control-base-port", "9300",
                              "--kv-events-base-port", "9500", "--fpm-base-port", "9700", "--max-num-seqs", "7"])
    _check_fleet_flags(args)
    groups = [{"name": "a", "count": 2, "engine-count": 2}, {"model": "other", "engine_type": "sglang",
                                                              "max-num-seqs": 3}]
    plans = plan_workers(args, groups)
    assert [p.name for p in plans] == ["a-0", "a-1", "worker-2"]
    assert [p.args.port for p in plans] == [9100, 9101, 9102]
    assert [p.args.control_address for p in plans] == ["127.0.0.1:9300", "127.0.0.1:9301", "127.0.0.1:9302"]
    # one port per engine: worker a-0 has two
    assert [json.loads(p.args.kv_events_config)["endpoint"] for p in plans] == [
        "tcp://*:9500", "tcp://*:9502", "tcp://*:9504"]
    assert [p.args.forward_pass_metrics_port for p in plans] == [9700, 9702, 9704]
    assert [p.args.model_tag for p in plans] == ["MODEL-X", "MODEL-X", "other"]
    assert [p.args.max_num_seqs for p in plans] == [7, 7, 3]
    assert [p.args.engine_type for p in plans] == ["vllm", "vllm", "sglang"]
    assert [len(s) for s in shard(plans, 2)] == [1, 2]
    assert [len(s) for s in shard(plans * 10, 4)] == [7, 8, 7, 8]


def _timers_when_idle(workers: int) -> tuple[int, int]:
    """(timers the event loop holds, servers on the shared Date tick) with `workers` idle workers
    hosted in this process (asyncio's own loop, whose timers can be counted)."""
    import asyncio

    from vllm_vcr.cli import build_parser
    from vllm_vcr.fleet.cli import _check_fleet_flags
    from vllm_vcr.fleet.host import FleetHost
    from vllm_vcr.fleet.plan import plan_workers
    from vllm_vcr.server_ticks import ticking_servers

    parser, _ = build_parser()
    args = parser.parse_args(["fleet", "--workers", str(workers), "--base-port", "0", "--host", "127.0.0.1",
                              "--control-base-port", "0"])
    _check_fleet_flags(args)
    host = FleetHost(plan_workers(args, None), env={})

    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        host.on_ready = ready.set_result
        task = loop.create_task(host.run())
        await asyncio.wait_for(ready, scaled(60))
        await asyncio.sleep(0.3)  # start-up's own timers (warm-up, control start) have fired
        found = (sum(1 for h in loop._scheduled if not h.cancelled()), ticking_servers())
        host.handle_signal(signal.SIGTERM)
        assert await task == 0
        return found

    return asyncio.run(main())


def test_idle_workers_hold_no_timer_of_their_own():
    """An idle worker costs no wake-ups: the loop's timers do not grow with the workers (one shared
    Date tick, one heap trimmer), and the tick serves every API and control server."""
    few, many = _timers_when_idle(2), _timers_when_idle(8)
    assert few[1] == 4 and many[1] == 16
    assert many[0] == few[0] <= 3, (few, many)


def test_sigterm_while_workers_load_stops_every_process(fleet):
    """--startup-time: the workers are still loading (nothing listens yet) when SIGTERM comes; every
    host process stops them and the fleet exits 0 without waiting for the loading to end."""
    f = fleet("--workers", "4", "--processes", "2", "--startup-time", "600")
    wait_until(lambda: f.log().count("simulating model loading") == 4, scaled(60), "four workers loading")
    f.proc.send_signal(signal.SIGTERM)
    assert f.proc.wait(scaled(30)) == 0, f.log()
    assert not f.ports_file.exists()
    assert "Traceback" not in f.log()


def _free_range(n: int) -> int:
    """A base port whose n ports are free now on 127.0.0.1 and on all interfaces."""
    import socket

    from vllm_vcr.testing.waits import free_port

    for _ in range(50):
        base = free_port()
        if base + n > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def test_each_worker_publishes_its_own_kv_events_and_forward_pass_metrics(fleet):
    import msgspec
    import zmq

    from vllm_vcr.fpm import decode
    from vllm_vcr.kv_events.events import decode_batch

    kv, fpm = _free_range(3), _free_range(3)
    f = fleet("--workers", "3", "--processes", "2", "--kv-events-base-port", str(kv), "--fpm-base-port", str(fpm),
              "--inter-token-latency", "2", "--block-size", "16")
    workers = f.wait_ready()
    ctx = zmq.Context()
    fpm_sub, kv_sub = ctx.socket(zmq.SUB), ctx.socket(zmq.SUB)
    for sock, port in ((fpm_sub, fpm + 2), (kv_sub, kv + 2)):
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        assert fpm_sub.poll(int(scaled(10) * 1000)), "no idle heartbeat from worker 2's forward-pass metrics"
        assert decode(fpm_sub.recv_multipart()[2]).step == 0
        url = f"http://127.0.0.1:{workers[2]['port']}/v1/completions"
        topic = None
        for i in range(20):  # until the KV subscription has joined (ZMQ's slow joiner): a new prefix each time
            httpx.post(url, json={"model": MODEL, "prompt": f"{i} " + "a long shared story " * 20, "max_tokens": 2},
                       timeout=30).raise_for_status()
            if kv_sub.poll(500):
                topic, _seq, payload = kv_sub.recv_multipart()
                break
        assert topic == b"kv@worker-2@" + MODEL.encode()
        assert decode_batch(payload).events
        steps = []
        while fpm_sub.poll(int(scaled(5) * 1000)):  # the records of the steps, then an idle heartbeat again
            rec = decode(fpm_sub.recv_multipart()[2])
            if rec.step:
                steps.append(rec)
            elif steps:
                break
        assert steps and msgspec.to_builtins(steps[0])["worker_id"]
    finally:
        fpm_sub.close()
        kv_sub.close()
        ctx.term()
    assert f.stop() == 0


def test_an_open_file_limit_too_low_for_the_workers_stops_the_fleet(fleet):
    """A host process whose hard open-file limit cannot hold its workers says so and the fleet exits 2."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 200
    if hard != resource.RLIM_INFINITY and hard < low:
        pytest.skip("hard limit already below the test's")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, low))

    f = fleet("--workers", "60", "--processes", "2", "--control-base-port", "0", preexec_fn=limit)
    assert f.proc.wait(scaled(120)) == 2, f.log()
    assert not f.ports_file.exists()
    assert re.search(r"open-file limit 200 is below the ~\d+ that 30 workers need in one process", f.log())


def test_a_thousand_workers_start_and_every_one_answers(fleet):
    """The scale the fleet is for: 1,000 workers through the real CLI, each answering a completion
    on its own port and counting it on its own control API; SIGTERM then stops every process."""
    import asyncio

    f = fleet("--workers", "1000", "--control-base-port", "0", "--time-to-first-token", "0",
              "--inter-token-latency", "0")
    workers = f.wait_ready(timeout=240)
    assert len(workers) == 1000 and len({w["port"] for w in workers}) == 1000

    async def check_all() -> list[str]:
        bad: list[str] = []
        gate = asyncio.Semaphore(32)
        async with httpx.AsyncClient(timeout=scaled(60), limits=httpx.Limits(max_connections=64)) as c:
            async def one(w: dict) -> None:
                async with gate:
                    r = await c.post(f"http://127.0.0.1:{w['port']}/v1/completions",
                                     json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
                    if r.status_code != 200 or r.headers.get("x-inference-worker-index") != str(w["index"]):
                        bad.append(f"{w['name']}: {r.status_code} {r.text[:200]}")
                        return
                    s = (await c.get(f"http://127.0.0.1:{w['control_port']}/stats")).json()
                    if s["requests_completed"] != 1:
                        bad.append(f"{w['name']}: stats {s}")

            await asyncio.gather(*(one(w) for w in workers))
        return bad

    assert asyncio.run(check_all()) == []
    assert f.stop() == 0, f.log()[-3000:]
    assert "Traceback" not in f.log()
