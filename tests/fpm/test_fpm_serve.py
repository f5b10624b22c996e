"""`serve --forward-pass-metrics-port`: a ZMQ subscriber per DP rank gets one record per engine step,
whose sums agree with /metrics and the control API's /stats."""

from __future__ import annotations

import re

import httpx
import msgspec
import zmq

from vllm_vcr.fpm import decode
from vllm_vcr.testing.waits import free_port_run
from vllm_vcr.trace.io import read_trace

N_REQUESTS = 6
MAX_TOKENS = 5


def _metric(text: str, name: str, engine: str) -> float:
    m = re.search(rf'^{re.escape(name)}{{[^}}]*engine="{engine}"[^}}]*}} (\S+)$', text, re.M)
    assert m, name
    return float(m.group(1))


def test_subscriber_gets_one_record_per_step(serve_process, serve_harness, tmp_path):
    base = free_port_run(2)  # rank r publishes on base + r
    control = serve_harness.free_port()
    sp = serve_process("-dp", "2", "--forward-pass-metrics-port", str(base), "--inter-token-latency", "2",
                       "--control-address", f"127.0.0.1:{control}",
                       "--forward-pass-metrics-trace", str(tmp_path / "fpm.jsonl"))
    ctx = zmq.Context()
    subs = []
    for rank in range(2):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{base + rank}")
        subs.append(sub)
    try:
        for sub in subs:  # an idle rank's heartbeat says its subscription is in place (ZMQ slow joiner)
            assert sub.poll(5000), "no idle heartbeat"
            assert decode(sub.recv_multipart()[2]).step == 0
        with httpx.Client(base_url=sp.url, timeout=30) as client:
            for i in range(N_REQUESTS):
                r = client.post("/v1/completions", json={"model": "vllm-vcr/sim", "prompt": f"{i} story number {i}",
                                                         "max_tokens": MAX_TOKENS, "ignore_eos": True})
                assert r.status_code == 200, r.text
            metrics = client.get("/metrics").text
        stats = httpx.get(f"http://127.0.0.1:{control}/stats").json()
        records = {0: [], 1: []}
        heartbeats = {0: 0, 1: 0}
        for rank, sub in enumerate(subs):
            # idle for a second: a heartbeat with nothing after it ends the steps (on a loaded
            # machine a rank may also idle for a second between two requests)
            while sub.poll(1500):
                topic, seq, payload = sub.recv_multipart()
                rec = decode(payload)
                assert rec.dp_rank == rank and topic == b""
                if rec.step == 0:  # Dynamo's idle heartbeat: all zeros, wall_time 0
                    assert rec.wall_time == 0 and rec.scheduled_requests.num_decode_requests == 0
                    heartbeats[rank] += 1
                    if not sub.poll(300):
                        break
                else:
                    records[rank].append(rec)
    finally:
        for sub in subs:
            sub.close(linger=0)
        ctx.term()
    assert heartbeats[0] >= 1 and heartbeats[1] >= 1
    assert stats["requests_received"] == N_REQUESTS and stats["requests_completed"] == N_REQUESTS
    for rank, recs in records.items():
        assert recs, f"no records from rank {rank}"
        assert [r.step for r in recs] == list(range(1, len(recs) + 1))  # one per step, none lost
        e = str(rank)
        prompt = _metric(metrics, "vllm:prompt_tokens_total", e)
        hits = _metric(metrics, "vllm:prefix_cache_hits_total", e)
        generated = _metric(metrics, "vllm:generation_tokens_total", e)
        finished = sum(float(x) for x in re.findall(
            rf'^vllm:request_success_total{{[^}}]*engine="{e}"[^}}]*}} (\S+)$', metrics, re.M))
        assert sum(r.scheduled_requests.sum_prefill_tokens for r in recs) == prompt - hits
        assert sum(r.scheduled_requests.num_decode_requests for r in recs) == generated - finished
        assert msgspec.to_builtins(recs[0])["worker_id"]
    # the same records, in the trace (after shut-down closes it)
    assert sp.stop() == 0
    trace = read_trace(tmp_path / "fpm.jsonl")
    assert trace.meta.source == "fpm" and not trace.records
    published = sorted((r.dp_rank, r.step) for recs in records.values() for r in recs)
    assert sorted((d["dp_rank"], d["step"]) for d in trace.fpm) == published


def test_a_taken_port_stops_start_up_naming_the_flag(serve_harness):
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "vllm_vcr", "serve", "--port", str(serve_harness.free_port()),
                               "--forward-pass-metrics-port", str(port)], capture_output=True, text=True,
                              timeout=60, env=serve_harness.subprocess_env())
    assert proc.returncode == 2
    assert f"--forward-pass-metrics-port: cannot bind {port}" in proc.stderr
