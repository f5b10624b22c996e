"""Dynamo bootstrap handoffs between two real `vllm-vcr serve` processes, driven over HTTP as a
router drives them: how a failed prefill and a vLLM-type (source-first) prefill's answer behave."""

from __future__ import annotations

import concurrent.futures
import secrets
import time

import httpx
import pytest

from ..conftest import free_port, scaled

MODEL = "vllm-vcr/sim"
LONG_SESSION_MS = "120000"  # far longer than any wait below: an answer must not come from the timeout


def meta(boot: int, room: int, handoff_id: str) -> dict:
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": room, "handoff_id": handoff_id}


def complete(url: str, params: dict, max_tokens: int = 4, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=timeout, json={
        "model": MODEL, "prompt": "Hello there, how are you", "max_tokens": max_tokens, "ignore_eos": True,
        "kv_transfer_params": params})


@pytest.fixture
def pair(serve_process):
    def start(*prefill_args: str, session_ms: str = LONG_SESSION_MS):
        boot = free_port()
        prefill = serve_process("--worker-type", "prefill", "--side-channel-port", str(free_port()),
                                "--bootstrap-port", str(boot), "--handoff-session-timeout-ms", session_ms,
                                *prefill_args)
        decode = serve_process("--worker-type", "decode", "--inter-token-latency", "1",
                               "--handoff-session-timeout-ms", session_ms)
        return prefill, decode, boot
    return start


@pytest.mark.parametrize("decoder_first", [True, False], ids=["decoder-first", "prefill-first"])
def test_a_failed_prefill_aborts_its_decoder_at_once(pair, decoder_first):
    """--failure-injection-rate fails the prefill request; its decoder is told ABORT right away
    (as when the prefill's client leaves), not after the 120 s session timeout."""
    prefill, decode, boot = pair("--failure-injection-rate", "1")
    room = secrets.randbits(63)
    params = meta(boot, room, "h-fail")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        t0 = time.monotonic()
        if decoder_first:
            dec = pool.submit(complete, decode.url, params)
            time.sleep(0.3)  # the decoder connects and waits in the room
            pre = complete(prefill.url, params)
        else:
            pre = complete(prefill.url, params)
            dec = pool.submit(complete, decode.url, params)  # the room is remembered as aborted
        d = dec.result(timeout=scaled(60))
        waited = time.monotonic() - t0
    assert pre.status_code == 500, pre.text  # the injected engine error, as vLLM's frontend answers it
    assert d.status_code >= 400, d.text
    assert f"prefill worker aborted bootstrap room {room}" in d.text
    assert waited < scaled(20), waited  # the session timeout is 120 s


def test_a_source_first_prefill_answers_once_its_decoder_has_pulled(pair):
    """vLLM type (source first): the prefill computes at once and holds its KV, but its answer
    (with the kv_transfer_params) waits until the handoff is complete: the decoder pulled."""
    prefill, decode, boot = pair()
    room = secrets.randbits(63)
    params = meta(boot, room, "h-ok")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pre = pool.submit(complete, prefill.url, params)
        time.sleep(0.5)
        assert not pre.done()  # no decoder yet: no answer (the session timeout is 120 s)
        d = complete(decode.url, params, max_tokens=3)
        p = pre.result(timeout=scaled(30))
    assert d.status_code == 200 and d.json()["choices"][0]["finish_reason"] == "length", d.text
    assert p.status_code == 200, p.text
    body = p.json()
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 1
    assert body["kv_transfer_params"]["bootstrap_room"] == room and body["kv_transfer_params"]["handoff_id"] == "h-ok"


def test_a_source_first_prefill_without_a_decoder_fails_after_the_session_timeout(pair):
    """No decoder within --handoff-session-timeout-ms: the prefill's KV is freed and its client gets
    the handoff's error (as Dynamo's mocker sends an error output when the source session fails)."""
    prefill, _, boot = pair(session_ms="2000")
    room = secrets.randbits(63)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pre = pool.submit(complete, prefill.url, meta(boot, room, "h-alone"))
        time.sleep(0.5)
        assert not pre.done()
        p = pre.result(timeout=scaled(30))
    assert p.status_code == 500 and p.json()["error"]["type"] == "InternalServerError", p.text
    assert p.json()["error"]["message"] == \
        f"handoff session timed out after 2000 ms waiting for the decode worker (bootstrap room {room})"
    usage = [line for line in httpx.get(prefill.url + "/metrics").text.splitlines()
             if line.startswith("vllm:kv_cache_usage_perc")]
    assert usage and float(usage[0].rsplit(" ", 1)[1]) == 0.0
