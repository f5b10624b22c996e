"""bench/run_bench.py's target lines and per-request table, stream_bench.py's gaps away from arrivals,
the null server's ITL-0 mode (the W1 floor) and per-request CPU knob, and uvicorn's timed floor."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import free_port, scaled, wait_http_ok, wait_until

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _w2(label: str, c: int, p99: float, us: float) -> dict:
    return {"label": label, "concurrency": c, "itl_1tok_ms": {"p99": p99}, "server_cpu_us_per_event": us}


def test_w2_verdict_compares_with_null_at_the_same_concurrency():
    rb = _load("run_bench")
    rows = [_w2("vllm-vcr", 1000, 23.5, 16.0), _w2("null", 1000, 22.0, 13.6),
            _w2("vllm-vcr", 256, 30.0, 30.0), _w2("null", 256, 22.0, 13.6), _w2("vllm-vcr", 32, 1.0, 1.0)]
    lines = rb.verdict_w2(rows)
    assert len(lines) == 2  # C=32 has no null row
    at_256, at_1000 = lines
    assert "C=1000" in at_1000 and "+1.50; target <= +2: met" in at_1000 and "1.18x; target <= 1.2x: met" in at_1000
    assert "C=256" in at_256 and at_256.count("NOT met") == 2


def test_burst_verdict_takes_the_median_of_the_rounds():
    rb = _load("run_bench")
    rows = [{"label": "vllm-vcr", "ttft_cfg_ms": 100.0, "ttft_ms": {"p50": p50, "p99": p99}}
            for p50, p99 in ((103.0, 150.0), (104.0, 118.0), (140.0, 119.0))]
    (line,) = rb.verdict_burst(rows)
    assert "p50 104.0 ms (+4.0%; target within 5 %: met)" in line
    assert "p99 119.0 ms (+19.0%; target within 20 %: met)" in line and "median of 3" in line


def test_gaps_away_from_arrivals_leave_out_the_ones_a_wave_of_sends_delayed():
    sb = _load("stream_bench")
    recs = []
    for t0, stamps in ((0.0, [0.1, 0.12, 0.2, 1.0, 1.02]), (0.9, [1.0, 1.1]), (0.95, [1.2, 1.9, 1.92])):
        r = sb.Rec(t0)
        r.stamps, r.ktoks, r.usage = stamps, [1] * len(stamps), len(stamps)
        recs.append(r)
    res = sb.analyse(recs)
    # every one-token gap, and those that ended with no send in the 0.5 s before (sends at 0, 0.9 and
    # 0.95 s): only the third request's gaps ending at 1.9 and 1.92 s
    assert res["itl_1tok_ms"]["n"] == 7
    calm = res["itl_1tok_calm_ms"]
    assert calm["n"] == 2 and round(calm["max"]) == 700 and round(calm["mean"]) == 360  # 700 and 20 ms
    assert not sb.away_from_sends([0.0, 0.9, 0.95], 0.2) and sb.away_from_sends([0.0, 0.9, 0.95], 0.51)


def test_w2_verdict_shows_the_gaps_away_from_arrivals_beside_the_target():
    rb = _load("run_bench")
    rows = [{**_w2("vllm-vcr", 1000, 40.0, 16.0), "itl_1tok_calm_ms": {"p99": 23.0}},
            {**_w2("null", 1000, 22.0, 15.0), "itl_1tok_calm_ms": {"p99": 22.5}}]
    (line,) = rb.verdict_w2(rows)
    assert "target <= +2: NOT met; away from arrivals 23.00 vs 22.50 ms)" in line


def test_w2_verdict_splits_cpu_into_user_and_system_time_when_measured():
    rb = _load("run_bench")
    rows = [{**_w2("vllm-vcr", 1000, 40.0, 24.0), "server_sys_us_per_event": 8.5},
            {**_w2("null", 1000, 22.0, 16.0), "server_sys_us_per_event": 9.0}]
    (line,) = rb.verdict_w2(rows)
    assert "(1.50x; target <= 1.2x: NOT met; user 15.5 vs 7.0, system 8.5 vs 9.0)" in line


def test_null_plus_cpu_servers_are_named_by_their_microseconds_and_judged_like_vllm_vcr():
    rb = _load("run_bench")
    assert [rb.null_cpu_us(n) for n in ("null+cpu50", "null+cpu250", "null", "null+cpu", "null+cpu0", "x+cpu5")] \
        == [50, 250, None, None, None, None]
    (line,) = rb.verdict_w2([_w2("null+cpu50", 1000, 25.0, 17.0), _w2("null", 1000, 22.0, 16.0)], "null+cpu50")
    assert line.startswith("* null+cpu50 vs null, C=1000: one-token ITL p99 25.00 vs 22.00 ms (+3.00; target <= +2: NOT met")


def test_requests_table_shows_server_cpu_per_request_not_per_event():
    rb = _load("run_bench")
    row = {"label": "null", "concurrency": 300, "requests": 6000, "ok": 6000, "req_per_s": 2380.0,
           "server_cpu_s": 0.372, "server_sys_us_per_event": 15.0, "content_events": 12000,
           "server_cpu_pct": 14.7, "ttft_ms": {"p50": 101.8, "p99": 122.8}, "errors": 0, "client_cpu_pct": 14.7,
           "other_cpu_pct": 0.0}
    table = rb.table_requests([row, {"label": "vllm-vcr", "failed": "boom"}])
    assert "| null | 300 | 6000 | 2,380 | 62 (30) | 14.7 | 101.8 / 122.8 | 0 |" in table  # 0.372 s / 6000
    assert "| vllm-vcr | | | failed |" in table


def test_stream_bench_counts_a_servers_user_and_system_time_apart():
    sb = _load("stream_bench")
    mon = sb.TreeCPU([os.getpid()])
    mon.start()
    t = time.process_time()
    while time.process_time() - t < 0.2:
        os.stat("/")  # system calls: some system time
    used, pids = mon.stop()
    assert os.getpid() in pids and 0 < mon.system < used
    assert abs(sum(mon.by_pid.values()) - used) < 1e-9 and mon.by_pid[os.getpid()] > 0  # (and each process's)


@contextlib.contextmanager
def _server(script: str, *args: str):
    """A bench server on a free port, and a connection to it; stopped afterwards."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(BENCH / script), "--port", str(port), *args])
    try:
        def connected() -> socket.socket | None:
            assert proc.poll() is None, f"{script} exited with {proc.returncode}"
            try:
                return socket.create_connection(("127.0.0.1", port), timeout=scaled(10))
            except OSError:
                return None

        sock = wait_until(connected, 20, f"{script} to listen", interval=0.1)
        with sock:
            yield sock
    finally:
        proc.terminate()
        proc.wait(scaled(10))


def _stream(sock: socket.socket, max_tokens: int) -> list[bytes]:
    """One streaming POST on a kept-alive connection: its SSE data lines, once its last chunk came."""
    body = json.dumps({"max_tokens": max_tokens}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%b" % (len(body), body))
    raw = b""
    while not raw.endswith(b"0\r\n\r\n"):
        data = sock.recv(65536)
        assert data
        raw += data
    return [ln for ln in raw.split(b"\n") if ln.startswith(b"data: ")]


def _assert_whole(events: list[bytes], n: int) -> None:
    assert len(events) == n + 1 and events[-1] == b"data: [DONE]"
    assert b'"finish_reason":"length"' in events[-2] and b'"completion_tokens":%d' % n in events[-2]


def test_null_server_at_itl_0_streams_every_chunk():
    with _server("null_sse_server.py", "--ttft-ms", "0", "--itl-ms", "0") as sock:
        _assert_whole(_stream(sock, 50), 50)


def _assert_timed(sock: socket.socket, ms_before_first: float, itl_ms: float) -> None:
    """Two streams on one kept-alive connection, each whole and no sooner than its deadlines allow."""
    for n in (20, 3):
        t0 = time.monotonic()
        events = _stream(sock, n)
        assert time.monotonic() - t0 >= (ms_before_first + (n - 1) * itl_ms) / 1e3
        _assert_whole(events, n)
        assert [b'"completion_tokens":%d}' % i in e for i, e in enumerate(events[:-1], 1)] == [True] * n


def test_null_server_with_per_request_cpu_still_streams_every_chunk():
    # 20 ms of CPU per request before its stream starts: no chunk can come sooner than that + TTFT + ITLs
    with _server("null_sse_server.py", "--ttft-ms", "1", "--itl-ms", "1", "--request-cpu-us", "20000") as sock:
        _assert_timed(sock, 20 + 1, 1)


def test_uvicorn_floor_times_its_chunks_and_ends_each_response_through_uvicorn():
    # the second request on the connection is only read once uvicorn saw the first response end
    with _server("asgi_floor_server.py", "--host", "127.0.0.1", "--ttft-ms", "30", "--itl-ms", "2") as sock:
        _assert_timed(sock, 30, 2)


def test_arrival_lag_matches_a_rounds_sends_with_its_arrivals_by_rank(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # (it imports stream_bench, as it does when run from bench/)
    al = _load("arrival_lag")
    # two rounds of four requests; the server noted each 1 ms after its send (the third 1.5 ms), and
    # handed it to the engine 20 ms later; arrivals outside a round (its warm-up) are left out
    rounds, server = [], [(5.0, 5.02)]
    for base in (10.0, 20.0):
        recs = [{"t0": base + i * 1e-3, "stamps": [base + i * 1e-3 + 0.1 + i * 1e-3]} for i in range(4)]
        server += [(r["t0"] + (1.5e-3 if i == 2 else 1e-3), r["t0"] + 0.021) for i, r in enumerate(recs)]
        rounds.append(recs)
    rows = al.lag_rows(server, rounds, parts=2)
    assert [(r["round"], r["part"], r["n"]) for r in rows] == [
        (1, "q1", 2), (1, "q2", 2), (1, "all", 4), (2, "q1", 2), (2, "q2", 2), (2, "all", 4)]
    whole = rows[2]
    assert round(whole["stamp_lag"][0], 6) == 1.0 and round(rows[1]["stamp_lag"][1], 6) == 1.45
    assert round(whole["to_engine"][0], 6) == 20.0
    assert round(rows[0]["ttft"][0], 6) == 100.5 and round(rows[1]["ttft"][1], 6) == 102.9


def test_serve_arrival_log_writes_each_requests_arrival_and_hand_off_at_exit(tmp_path):
    import httpx

    port = free_port()
    log = tmp_path / "arrivals.jsonl"
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent / "src")}
    proc = subprocess.Popen([sys.executable, str(BENCH / "serve_arrival_log.py"), "--log", str(log), "--",
                             "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 60,
                     lambda: None if proc.poll() is None else f"exited with {proc.returncode}", interval=0.1)
        sent = []
        for _ in range(2):
            sent.append(time.perf_counter())
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=scaled(10),
                           json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
            assert r.status_code == 200
        done = time.perf_counter()
    finally:
        proc.send_signal(signal.SIGINT)  # the log is written at exit
        try:
            proc.wait(scaled(20))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == 2
    for (arrival, in_engine), t in zip(rows, sent):
        assert t - 0.005 <= arrival <= in_engine <= done  # the same clock as the client's


def test_w2_rows_carry_the_tokens_an_engine_step_took_from_serves_metrics(serve_process):
    import httpx

    rb = _load("run_bench")
    server = serve_process()  # (run_bench's scrape needs only its .url)
    before = rb.scrape(server)
    prompts = 0
    for text in ("hi", "a different prompt"):  # (distinct: no prefix-cache hit shortens a prefill)
        r = httpx.post(server.url + "/v1/completions", timeout=10,
                       json={"prompt": text, "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200
        prompts += r.json()["usage"]["prompt_tokens"]
    after = rb.scrape(server)
    m = rb.server_side(before, after)
    steps = after["vllm:iteration_tokens_total_count"] - before["vllm:iteration_tokens_total_count"]
    assert m["generation_tokens"] == 8 and steps >= 2
    # every prompt token computed and every token generated, over the steps that took them
    assert m["tokens_per_step"] == round((prompts + 8) / steps, 1)


def test_the_api_server_plot_reads_run_bench_results(tmp_path):
    """bench/plot_api_servers.py: N = 1 and N = 2 first, then the floors, from run_bench's rows."""
    plot = _load("plot_api_servers")

    def req(label: str, cpu_s: float) -> dict:
        return {"label": label, "server_cpu_s": cpu_s, "ok": 1000}

    results = {
        "requests": [req("null", 0.04), req("vllm-vcr-api2", 0.5), req("vllm-vcr", 0.35), req("uvicorn-floor", 0.1)],
        "w2": [_w2("vllm-vcr", 1000, 35.0, 17.2), _w2("vllm-vcr-api2", 1000, 41.0, 29.8), _w2("null", 1000, 20.8, 15.0),
               _w2("vllm-vcr", 32, 22.0, 9.0)],
        "w1": [{"label": "vllm-vcr", "output_tok_per_s": 135000.0}],
    }
    panels = dict(plot.figures(results, None))
    assert list(panels["requests: server CPU µs per request"]) == ["vllm-vcr", "vllm-vcr-api2", "uvicorn-floor", "null"]
    assert panels["requests: server CPU µs per request"]["vllm-vcr"] == 350.0
    # only C = 1000 rows, the floors kept
    assert panels["W2 C = 1000: one-token ITL p99 (ms)"] == {"vllm-vcr": 35.0, "vllm-vcr-api2": 41.0, "null": 20.8}
    assert panels["W1: output tokens per second (thousands)"] == {"vllm-vcr": 135.0}
    out = tmp_path / "n.png"
    plot.plot(list(panels.items()), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_api_server_rows_split_cpu_per_event_by_process(tmp_path):
    """With --api-server-count N, serve's ready line names each process: the CPU per event is
    reported for the API servers, the engine cores and the rest (the parent) apart; one process: none."""
    rb = _load("run_bench")
    srv = rb.Server("vllm-vcr-api2", 1, tmp_path)
    (tmp_path / "vllm-vcr-api2-serve.log").write_text(
        "INFO vllm-vcr serve: model m, 2 API server(s) (pids 11 12), 1 engine core process(es) (pids 13), "
        "max_model_len 4096, listening on http://127.0.0.1:1 (ready in 900 ms)\n")
    r = {"content_events": 100_000, "server_cpu_s_by_pid": {"10": 0.1, "11": 0.5, "12": 0.7, "13": 0.9}}
    assert rb.cpu_by_role(srv, r) == {"API servers": 12.0, "engine cores": 9.0, "parent and the rest": 1.0}
    one = rb.Server("vllm-vcr", 1, tmp_path)
    (tmp_path / "vllm-vcr-serve.log").write_text("INFO vllm-vcr serve: model m, listening on http://127.0.0.1:1\n")
    assert rb.cpu_by_role(one, r) is None
