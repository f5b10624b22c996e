"""The engine-core tap: its recording rules (no sockets) and a live run between a minimal
frontend written here and `vllm-vcr play` as the engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from vllm_vcr.engine.types import EngineCoreOutputs, EngineCoreRequest, SamplingParams
from vllm_vcr.inspect.perfetto import read_step_stats
from vllm_vcr.record.tap_recorder import TapRecorder
from vllm_vcr.record.zmq_tap import config_hash
from vllm_vcr.trace.io import read_trace
from vllm_vcr.trace.schema import validate_record

SRC = Path(__file__).resolve().parents[2] / "src"


def _req(rid: str, n_prompt: int, client: int = 0, **kw) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(range(n_prompt)),
                             sampling_params=SamplingParams(max_tokens=8), client_index=client, **kw)


def _out(rid, toks, finish=None, prefill_stats=None):
    o = [rid, toks, None, None, None, finish, None, None, None, None, None, prefill_stats]
    return o + [None, 0, None, None, None, None, None]


def _env(outputs, running=None, finished=None):
    stats = None if running is None else {"num_running_reqs": running, "num_waiting_reqs": 0}
    return [0, outputs, stats, 1.0, None, finished, None, None, None]


def test_recorder_rules():
    r = TapRecorder(block_size=16)
    r.on_add(_req("a", 40), 10.0)
    r.on_add(_req("b", 20, client=1), 10.010)
    assert r.tracked["b"].concurrency == 2
    ps = {"num_prompt_tokens": 40, "num_local_cached_tokens": 16, "num_external_cached_tokens": 8}
    assert r.on_outputs(_env([_out("a", [5], prefill_stats=ps)], running=2), 10.030) == []
    r.on_outputs(_env([_out("a", [6, 7]), _out("b", [1])], running=2), 10.040)
    done = r.on_outputs(_env([_out("a", [8], finish=1), _out("b", [2])], running=2), 10.050)
    assert len(done) == 1
    a = done[0]
    assert validate_record(a) is None
    assert (a.prompt_tokens, a.cached_tokens, a.output_tokens, a.concurrency) == (40, 24, 4, 1)
    assert a.ttft_ms == pytest.approx(30.0) and a.arrival_ms == 0.0
    assert a.itl_ms == pytest.approx([10.0, 10.0]) and a.itl_tokens == [2, 1]
    # the step that closed a's first gap also gave b its first token: 20 prompt tokens of prefill
    assert a.itl_ctx.num_running == [2, 2] and a.itl_ctx.prefill_tokens == [20, 0]
    assert a.finish_reason == "length" and len(a.block_hashes) == 2
    # abort paths: an ABORT input, an ABORT finish, finished_requests without an output
    r.on_add(_req("c", 5), 10.060)
    r.on_add(_req("d", 5), 10.061)
    r.on_abort(["b"])
    assert r.on_outputs(_env([_out("c", [], finish=2)]), 10.07) == []
    assert r.on_outputs(_env([], finished=["d"]), 10.08) == []
    assert r.dropped == 3 and not r.tracked
    # single-token requests and utility routing
    r.on_add(_req("e", 3), 10.1)
    (e,) = r.on_outputs(_env([_out("e", [9], finish=0)]), 10.12)
    assert e.output_tokens == 1 and e.itl_ms is None and e.itl_ctx is None and e.finish_reason == "stop"
    line = r.step_stats_line(_env([], running=3), 10.2)
    assert line["scheduler"]["num_running_reqs"] == 3 and line["ts_ms"] == pytest.approx(200.0)


def test_config_hash_is_stable():
    h = config_hash("H100", "v0.33.0", "--max-num-seqs 64")
    assert len(h) == 64 and h == config_hash("H100", "v0.33.0", "--max-num-seqs 64")
    assert h != config_hash("H200", "v0.33.0", "--max-num-seqs 64")


class MiniFrontend:
    """The frontend side of vLLM's engine-core protocol, just enough to drive the tap."""

    def __init__(self, handshake: str, clients: int = 1):
        import zmq

        self.ctx = zmq.Context()
        self.hs = self.ctx.socket(zmq.ROUTER)
        self.hs.bind(handshake)
        self.inps, self.outs, self.in_addrs, self.out_addrs = [], [], [], []
        for _ in range(clients):  # one input/output pair per API server
            inp, out = self.ctx.socket(zmq.ROUTER), self.ctx.socket(zmq.PULL)
            self.in_addrs.append(f"tcp://127.0.0.1:{inp.bind_to_random_port('tcp://127.0.0.1')}")
            self.out_addrs.append(f"tcp://127.0.0.1:{out.bind_to_random_port('tcp://127.0.0.1')}")
            self.inps.append(inp)
            self.outs.append(out)
        for s in (self.hs, *self.inps, *self.outs):
            s.RCVTIMEO = 60000
        self.enc, self.dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()

    def handshake(self) -> dict:
        ident, hello = self.hs.recv_multipart()
        assert self.dec.decode(hello)["status"] == "HELLO"
        self.hs.send_multipart([ident, self.enc.encode({
            "addresses": {"inputs": self.in_addrs, "outputs": self.out_addrs,
                          "coordinator_input": None, "coordinator_output": None,
                          "frontend_stats_publish_address": None}, "parallel_config": {}})])
        payloads = [inp.recv_multipart() for inp in self.inps]  # registration on every input
        self.engine = payloads[0][0]
        assert self.dec.decode(self.hs.recv_multipart()[1])["status"] == "READY"
        return self.dec.decode(payloads[0][1])

    def send(self, kind: bytes, body, client: int = 0) -> None:
        self.inps[client].send_multipart([self.engine, kind, self.enc.encode(body)])

    def wait_finished(self, ids: set[str], client: int = 0, allowed: set[str] = frozenset()) -> None:
        dec = msgspec.msgpack.Decoder(EngineCoreOutputs)
        done: set[str] = set()
        while not ids <= done:
            env = dec.decode(self.outs[client].recv_multipart()[0])
            got = {o.request_id for o in env.outputs}
            assert got <= ids | allowed, f"client {client} got outputs of {got - ids}"
            done |= {o.request_id for o in env.outputs if o.finish_reason is not None}

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err or ""


def test_tap_between_a_frontend_and_play(tmp_path: Path):
    from tests.conftest import free_port

    fe_hs, eng_hs, eng_in, eng_out = (f"tcp://127.0.0.1:{free_port()}" for _ in range(4))
    trace, steps = tmp_path / "tap.jsonl.gz", tmp_path / "steps.jsonl"
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    fe = MiniFrontend(fe_hs)
    tap = subprocess.Popen(
        [sys.executable, "-m", "vllm_vcr", "record", "--frontend-handshake", fe_hs,
         "--engine-handshake", eng_hs, "--input-address", eng_in, "--output-address", eng_out,
         "--trace-out", str(trace), "--step-stats-out", str(steps), "--model", "sim",
         "--gpu", "CPU", "--record-tokens"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    play = subprocess.Popen(
        [sys.executable, "-m", "vllm_vcr", "play", "--handshake-address", eng_hs,
         "--time-to-first-token", "15", "--inter-token-latency", "4"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ready = fe.handshake()  # the engine's own ready payload, relayed by the tap
        assert ready["block_size"] > 0 and "max_num_seqs" in ready
        ids = set()
        for i in range(4):
            fe.send(b"\x00", EngineCoreRequest(
                request_id=f"r-{i}", prompt_token_ids=list(range(7, 47 + i)),
                sampling_params=SamplingParams(max_tokens=5, ignore_eos=True)))
            ids.add(f"r-{i}")
            time.sleep(0.01)
        fe.send(b"\x00", EngineCoreRequest(request_id="gone", prompt_token_ids=[1, 2, 3],
                                           sampling_params=SamplingParams(max_tokens=500, ignore_eos=True)))
        time.sleep(0.05)
        fe.send(b"\x01", ["gone"])
        fe.wait_finished(ids, allowed={"gone"})
        time.sleep(0.2)
    finally:
        log = _stop(tap)
        _stop(play)
        fe.close()
    assert tap.returncode == 0, log
    assert "recorded 4 requests" in log
    t = read_trace(trace)
    assert not t.truncated
    m = t.meta
    assert (m.source, m.model, m.gpu, m.block_size) == ("tap", "sim", "CPU", 16)
    assert m.vllm_version and bytes.fromhex(m.ready_response_hex)
    assert msgspec.msgpack.decode(bytes.fromhex(m.ready_response_hex)) == ready
    assert len(m.config_hash) == 64
    recs = sorted(t.records, key=lambda r: r.arrival_ms)
    assert [r.prompt_tokens for r in recs] == [40, 41, 42, 43]
    for r in recs:
        assert r.output_tokens == 5 and r.finish_reason == "length"
        assert len(r.output_token_ids) == 5 and r.ttft_ms >= 10.0
        assert len(r.itl_ctx.num_running) == len(r.itl_ms) and min(r.itl_ctx.num_running) >= 1
        assert r.block_hashes and r.block_hashes[0] == recs[0].block_hashes[0]
    assert recs[0].arrival_ms == 0.0 and recs[-1].concurrency >= 2
    side = read_step_stats(steps)
    assert side and "num_running_reqs" in side[0][1]


def test_tap_routes_outputs_to_each_api_server(tmp_path: Path):
    from tests.conftest import free_port

    fe_hs, eng_hs, eng_in, eng_out = (f"tcp://127.0.0.1:{free_port()}" for _ in range(4))
    trace = tmp_path / "tap.jsonl"
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    fe = MiniFrontend(fe_hs, clients=2)
    tap = subprocess.Popen(
        [sys.executable, "-m", "vllm_vcr", "record", "--frontend-handshake", fe_hs,
         "--engine-handshake", eng_hs, "--input-address", eng_in, "--output-address", eng_out,
         "--trace-out", str(trace)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    play = subprocess.Popen(
        [sys.executable, "-m", "vllm_vcr", "play", "--handshake-address", eng_hs,
         "--time-to-first-token", "5", "--inter-token-latency", "2"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        fe.handshake()
        for client in (0, 1):
            for i in range(3):
                fe.send(b"\x00", EngineCoreRequest(
                    request_id=f"c{client}-{i}", prompt_token_ids=list(range(20)), client_index=client,
                    sampling_params=SamplingParams(max_tokens=4, ignore_eos=True)), client=client)
        for client in (0, 1):
            fe.wait_finished({f"c{client}-{i}" for i in range(3)}, client=client)
    finally:
        log = _stop(tap)
        _stop(play)
        fe.close()
    assert tap.returncode == 0, log
    assert len(read_trace(trace).records) == 6
