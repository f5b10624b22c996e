"""play's step floor and logprobs on the wire, against the scripted fake frontend (no vLLM needed)."""

from __future__ import annotations

import asyncio
import signal

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.cli import build_parser, main
from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.wire.cli import play_engine_args
from vllm_vcr.wire.handshake import ReadyInfo
from vllm_vcr.wire.logprobs import prompt_tensors, sample_lists
from vllm_vcr.wire.server import PlayServer

from .test_wire_protocol import FakeFrontend, _req, enc

FLOOR = 0.005


def _play_args(*argv: str):
    parser, _ = build_parser()
    return play_engine_args(parser.parse_args(["play", *argv]), 4096)


def test_the_floor_is_on_by_default_and_can_be_turned_off(monkeypatch):
    monkeypatch.delenv("MOCK_MIN_STEP_TIME_MS", raising=False)
    assert _play_args().min_step_time == pytest.approx(0.002)
    assert _play_args("--min-step-time", "0").min_step_time == 0.0
    assert _play_args("--min-step-time", "4.5").min_step_time == pytest.approx(0.0045)
    monkeypatch.setenv("MOCK_MIN_STEP_TIME_MS", "1")
    assert _play_args().min_step_time == pytest.approx(0.001)


def test_a_negative_floor_is_a_cli_error(capsys):
    assert main(["play", "--min-step-time", "-2"]) == 2
    assert "--min-step-time must be >= 0" in capsys.readouterr().err


async def _serve(fe: FakeFrontend, **args) -> tuple[PlayServer, asyncio.Task]:
    eargs = EngineArgs(config=EngineConfig(log_requests=False), vocab_size=100, kv_cache_size=64, **args)
    ready = ReadyInfo(max_model_len=2048, num_gpu_blocks=64, block_size=16, max_num_seqs=8,
                      max_num_batched_tokens=512, instance_id="test-engine")
    server = PlayServer(eargs.validate(), handshake_address=fe.addr(fe.hs), ready=ready, handshake_timeout=10)
    task = asyncio.create_task(server.run())
    await fe.handshake()
    return server, task


async def _stop(server: PlayServer, task: asyncio.Task, fe: FakeFrontend) -> None:
    server._on_signal(signal.SIGTERM)
    await asyncio.wait_for(task, 10)
    fe.close()


async def test_each_step_is_its_own_message_floor_apart():
    fe = FakeFrontend()
    server, task = await _serve(fe, min_step_time=FLOOR)
    try:
        await fe.send(b"\x00\x00", b"\x00", enc.encode(_req("r-1", max_tokens=12)))
        messages = []
        while not messages or messages[-1].outputs[0].finish_reason is None:
            msg = await fe.recv()
            if msg.outputs:
                messages.append(msg)
        assert [[len(o.new_token_ids) for o in m.outputs] for m in messages] == [[1]] * 12
        gaps = [b.timestamp - a.timestamp for a, b in zip(messages, messages[1:])]
        assert min(gaps) >= FLOOR - 1e-6  # a busy machine stretches them, never shortens them
    finally:
        await _stop(server, task, fe)


def _ext_hook(code: int, data: memoryview):
    assert code == 3
    return bytes(data)


def _array(enc_arr, numpy_dtype: str | None = None) -> np.ndarray:
    dtype, shape, raw = enc_arr
    return np.frombuffer(raw, dtype=numpy_dtype or dtype).reshape(shape)


async def test_logprobs_ride_on_the_outputs():
    fe = FakeFrontend()
    server, task = await _serve(fe)
    raw_dec = msgspec.msgpack.Decoder(ext_hook=_ext_hook)
    try:
        body = _req("r-1", max_tokens=3, prompt=(5, 6, 7, 8))
        body[3].update(logprobs=2, prompt_logprobs=1)
        await fe.send(b"\x00\x00", b"\x00", enc.encode(body))
        outs = []
        while not outs or outs[-1][5] is None:
            frames = await asyncio.wait_for(fe.outputs[0].recv_multipart(), 10)
            outs += raw_dec.decode(frames[0])[1]
        tokens = [t for o in outs for t in o[1]]
        assert len(tokens) == 3
        for i, o in enumerate(outs):
            ids_enc, lps_enc, ranks_enc, cu = o[2]
            assert (ids_enc[0], lps_enc[0], ranks_enc[0], cu) == ("<i4", "<f4", "<i8", None)
            ids, ranks = _array(ids_enc), _array(ranks_enc)
            assert ids.shape == (1, 3) and ids[0, 0] == o[1][0] and ranks.shape == (1,)
            assert (o[3] is not None) == (i == 0)  # prompt logprobs once, with the first token
        tids, tlps, tranks, *rest = outs[0][3]
        assert [tids[0], tlps[0], tranks[0]] == ["int32", "float32", "int64"] and rest == [None, None]
        assert _array(tids, "<i4")[:, 0].tolist() == [6, 7, 8]  # prompt positions 1..P-1
        assert not server.bridges[0].logprobs.requests  # forgotten once finished
    finally:
        await _stop(server, task, fe)


async def test_an_aborted_logprobs_request_is_forgotten():
    fe = FakeFrontend()
    server, task = await _serve(fe, min_step_time=0.05)
    try:
        body = _req("r-1", max_tokens=50)
        body[3]["logprobs"] = 1
        await fe.send(b"\x00\x00", b"\x00", enc.encode(body))
        await fe.recv()
        assert "r-1" in server.bridges[0].logprobs.requests
        await fe.send(b"\x00\x00", b"\x01", enc.encode(["r-1"]))
        for _ in range(100):
            if not server.bridges[0].logprobs.requests:
                break
            await asyncio.sleep(0.01)
        assert not server.bridges[0].logprobs.requests
    finally:
        await _stop(server, task, fe)


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 99), min_size=1, max_size=6), k=st.sampled_from([-1, 0, 1, 2, 5, 20]),
       start=st.integers(0, 50), greedy=st.booleans())
def test_rows_are_what_vllms_sampler_writes(tokens, k, start, greedy):
    ids, lps, ranks, cu = sample_lists(tokens, start, k, 100, greedy)
    width = 99 if k == -1 else k
    assert ids.shape == lps.shape == (len(tokens), width + 1) and ranks.shape == (len(tokens),) and cu is None
    assert ids[:, 0].tolist() == tokens
    for row in range(len(tokens)):
        rank = int(ranks[row])
        assert rank >= 1 and (rank == 1 or not greedy)
        top = ids[row, 1:].tolist()
        assert len(set(top)) == len(top)  # the top K are distinct tokens
        assert all(a > b for a, b in zip(lps[row, 1:], lps[row, 2:]))  # falling with the rank
        if rank <= width:  # the sampled token sits at its rank, with the same logprob
            assert top[rank - 1] == tokens[row] and lps[row, rank] == lps[row, 0]
        else:
            assert tokens[row] not in top


def test_a_one_token_prompt_has_no_prompt_logprobs():
    assert prompt_tensors([3], 2, 100) is None
    assert prompt_tensors([3, 4], 2, 100)[0][1] == [1, 3]
