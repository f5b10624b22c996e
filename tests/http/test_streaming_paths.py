"""The streaming driver's two paths: chunks written straight to uvicorn's transport from the
engine's output callback, and the ASGI path it falls back to when the socket pushes back."""

from __future__ import annotations

import asyncio
import json
import re
import socket

import httpx
import pytest

from tests.conftest import async_wait_until, scaled
from vllm_vcr.http import streaming
from vllm_vcr.openai import chat

MODEL = "vllm-vcr/sim"


def _events(raw: bytes) -> list[bytes]:
    """De-chunk an HTTP/1.1 chunked body and split it into SSE data payloads."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    data = bytearray()
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        data += body[:size]
        assert body[size:size + 2] == b"\r\n", "chunk framing broken"
        body = body[size + 2:]
    return [e[6:] for e in bytes(data).split(b"\n\n") if e.startswith(b"data: ")]


async def test_tokens_go_straight_to_the_socket(inprocess, monkeypatch):
    counts = _count_writes(monkeypatch)
    url, _ = await inprocess(itl_ms=1.0)
    async with httpx.AsyncClient(timeout=scaled(30)) as c:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
                "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
            lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 40
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert counts["direct"] >= 10  # the per-token chunks took the direct path
    assert counts.get("batched", 0) >= 10  # most of them in the engine's steady batch


def _count_writes(monkeypatch) -> dict[str, int]:
    counts = {"direct": 0, "declined": 0}
    real = streaming.DirectBody.write

    def write(self, data):
        ok = real(self, data)
        counts["direct" if ok else "declined"] += 1
        return ok

    monkeypatch.setattr(streaming.DirectBody, "write", write)
    real_take = streaming.SteadyChunks.take

    def batch_take(self, tokens, ts):  # a steady batch's chunks: each written straight too
        declined = real_take(self, tokens, ts)
        taken = len(tokens) - len(declined or ())
        counts["direct"] += taken
        counts["batched"] = counts.get("batched", 0) + taken
        counts["batch_declined"] = counts.get("batch_declined", 0) + len(declined or ())
        return declined

    monkeypatch.setattr(streaming.SteadyChunks, "take", batch_take)
    return counts


def _pushed_back(counts: dict[str, int]) -> bool:
    """The server saw its socket stop taking writes: a direct write or a batch's token declined."""
    return counts["declined"] + counts.get("batch_declined", 0) > 0


async def _read_late(url: str, path: str, body: dict, counts: dict[str, int]) -> list[bytes]:
    """POST a stream from a socket with a small receive buffer, read nothing until the server's
    transport has paused writing (a write declined, `counts` from _count_writes) and a little
    longer (chunks queue), then read it all: its SSE payloads."""
    payload = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", int(url.rsplit(":", 1)[1])))
    await loop.sock_sendall(sock, b"POST %b HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                            b"content-length: %d\r\n\r\n%b" % (path.encode(), len(payload), payload))
    # not reading: however slow the machine, until the socket pushed back, not for a guessed time
    await async_wait_until(lambda: _pushed_back(counts), 30, "the server's socket to push back")
    await asyncio.sleep(0.2)
    raw = bytearray()
    while not raw.endswith(b"0\r\n\r\n"):
        data = await asyncio.wait_for(loop.sock_recv(sock, 65536), scaled(30))
        assert data, f"server closed early: {bytes(raw[:300])!r}"
        raw += data
    sock.close()
    return _events(bytes(raw))


async def test_a_client_that_stops_reading_loses_nothing(inprocess, monkeypatch):
    """Fill the socket (uvicorn pauses writing), then read: every token arrives, in order, framed."""
    counts = _count_writes(monkeypatch)
    url, engine = await inprocess(itl_ms=0.02, sndbuf=4096)
    n = 4000  # with 5 logprobs each: megabytes, more than the socket buffers hold
    events = await _read_late(url, "/v1/completions", {
        "model": MODEL, "prompt": "x", "max_tokens": n, "stream": True, "ignore_eos": True, "logprobs": 5,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, counts)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    seen = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert seen == sorted(seen) and seen[-1] == n
    assert chunks[-1]["usage"]["completion_tokens"] == n
    assert counts["declined"] >= 1  # the paused socket sent chunks through ASGI
    stats = (await engine.call_all(lambda core: core.current_stats()))[0]
    assert (stats.requests_completed, stats.requests_aborted) == (1, 0)


async def test_a_batched_stream_whose_client_stops_reading_loses_nothing(inprocess, monkeypatch):
    """A stream in a steady batch learns that its socket paused from the protocol's count of
    write-side changes (WriteSide), not by looking at its socket every step: its token
    is declined there and then, and every later chunk waits for the socket, in order."""
    counts = _count_writes(monkeypatch)
    counted_take = streaming.SteadyChunks.take

    def take(self, tokens, ts):  # tokens a batch took for a socket that had paused already
        paused = [d.blocked() for d in self.directs]
        declined = set(counted_take(self, tokens, ts) or ())
        counts["taken_while_paused"] = counts.get("taken_while_paused", 0) + sum(
            p and i not in declined for i, p in enumerate(paused))
        return sorted(declined) or None

    monkeypatch.setattr(streaming.SteadyChunks, "take", take)
    url, _ = await inprocess(itl_ms=0.05, sndbuf=4096)
    # first a stream read as it comes, which leaves nearly every token's text cached: then the
    # pause meets the batch's columns, not a token rendered on its own (which looks at the socket)
    for _ in range(5):
        await _stream_bytes(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4000,
                                                      "stream": True, "ignore_eos": True})
    n = 3000  # ~300 bytes a chunk: more than the socket buffers hold
    events = await _read_late(url, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": n, "stream": True,
        "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        counts)
    chunks = [json.loads(e) for e in events[:-1]]
    seen = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert events[-1] == b"[DONE]" and seen == list(range(n + 1))  # the role chunk, then every token once, in order
    assert counts.get("batched", 0) >= 10 and counts["batch_declined"] >= 1
    assert counts["taken_while_paused"] == 0


@pytest.mark.parametrize("batched", [False, True])
async def test_chunks_keep_their_order_across_both_paths(inprocess, monkeypatch, batched):
    """Every other direct write declines: queued chunks go through ASGI, later ones must wait.
    Batched: every other step of the steady batch declines its tokens too (as for a paused
    socket), which then come as outputs."""
    real = streaming.DirectBody.write
    flip = {"n": 0}

    def write(self, data):
        flip["n"] += 1
        return flip["n"] % 2 == 0 and real(self, data)

    monkeypatch.setattr(streaming.DirectBody, "write", write)
    if batched:
        real_take = streaming.SteadyChunks.take

        def take(self, tokens, ts):
            flip["n"] += 1
            if flip["n"] % 2:
                return real_take(self, tokens, ts)
            for i in range(len(tokens)):
                self._settle(i)
            return list(range(len(tokens)))

        monkeypatch.setattr(streaming.SteadyChunks, "take", take)
    else:
        monkeypatch.setattr(streaming.SteadyReader, "ready", lambda self: False)
    url, _ = await inprocess(itl_ms=0.5)
    async with httpx.AsyncClient(timeout=scaled(30)) as c:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 60, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        async with c.stream("POST", url + "/v1/completions", json=body) as r:
            lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and flip["n"] >= 10
    counts = [json.loads(ln[6:])["usage"]["completion_tokens"] for ln in lines[:-1]]
    assert counts == sorted(counts) and counts[-1] == 60


async def _stream_bytes(url: str, path: str, body: dict) -> list[bytes]:
    async with httpx.AsyncClient(timeout=scaled(30)) as c:
        async with c.stream("POST", url + path, json=body) as r:
            raw = b"".join([b async for b in r.aiter_raw()])
    # `created` is the second the request came in: the only field two identical requests may differ in
    return [re.sub(rb'"created":\d+', b'"created":0', e) for e in raw.split(b"\n\n") if e]


@pytest.mark.parametrize("path,usage", [("/v1/chat/completions", "continuous"), ("/v1/chat/completions", "final"),
                                        ("/v1/chat/completions", "none"), ("/v1/completions", "continuous"),
                                        ("/v1/completions", "none")])
async def test_the_per_token_fast_case_renders_the_full_paths_bytes(inprocess, monkeypatch, path, usage):
    """Every event of a stream is byte for byte what the full renderer makes, with the fast case
    on and off (a `%` in the id: the pre-rendered template must not read it as a format)."""
    url, _ = await inprocess(itl_ms=0.2)
    body = {"model": MODEL, "max_tokens": 300, "stream": True, "ignore_eos": True, "seed": 11,
            "request_id": "fast-100%d-%s"}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hello"
    if usage != "none":
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": usage == "continuous"}
    fast_taken = {"n": 0}
    first_fast = _count_first_fast(monkeypatch)
    with_fast = await _stream_bytes(url, path, body)
    assert first_fast == [1]  # the first event (chat: with the role chunk made up front) took the fast case
    monkeypatch.setattr(streaming.ChoiceStream, "enable_fast", lambda self, *a: fast_taken.update(n=-1))
    without = await _stream_bytes(url, path, body)
    assert fast_taken["n"] == -1 and first_fast == [1]  # the second stream really went without the fast case
    assert len(with_fast) >= 290 and with_fast == without


def _count_first_fast(monkeypatch) -> list[int]:
    """How many outputs `ChoiceStream.feed_first` rendered (it returns None for those it leaves)."""
    count = [0]
    real = streaming.ChoiceStream.feed_first

    def feed_first(self, out):
        data = real(self, out)
        count[0] += data is not None
        return data

    monkeypatch.setattr(streaming.ChoiceStream, "feed_first", feed_first)
    return count


async def test_the_fast_case_carries_most_tokens(inprocess, monkeypatch):
    """And those tokens go from the engine's step to the stream (`take`): no engine output."""
    calls = {"full": 0, "outputs": 0}
    real = chat.ChatStream.feed_full
    real_feed = streaming.ChoiceStream.feed

    def feed_full(self, out):
        calls["full"] += 1
        return real(self, out)

    def feed(self, out):
        calls["outputs"] += 1
        return real_feed(self, out)

    monkeypatch.setattr(chat.ChatStream, "feed_full", feed_full)
    monkeypatch.setattr(streaming.ChoiceStream, "feed", feed)
    url, _ = await inprocess(itl_ms=0.2)
    body = {"model": MODEL, "max_tokens": 100, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}]}
    events = await _stream_bytes(url, "/v1/chat/completions", body)
    assert len(events) >= 100 and calls["full"] <= 3  # the first token, the last, maybe a stats-only output
    assert calls["outputs"] <= 3


@pytest.mark.parametrize("path,usage", [("/v1/chat/completions", "continuous"), ("/v1/completions", "none")])
async def test_streams_in_a_steady_batch_get_the_bytes_they_would_alone(inprocess, monkeypatch, path, usage):
    """Concurrent streams decode in the engine's steady batches (engine/steady_batch.py), their
    chunks made and written as columns: every event is byte for byte what each stream gets with
    batching off, and /metrics counts the same tokens and inter-token latencies."""
    url, _ = await inprocess(itl_ms=1.0)
    batched = {"tokens": 0, "steps": 0}
    real_take = streaming.SteadyChunks.take

    def take(self, tokens, ts):
        declined = real_take(self, tokens, ts)
        batched["steps"] += 1
        batched["tokens"] += len(tokens) - len(declined or ())
        return declined

    monkeypatch.setattr(streaming.SteadyChunks, "take", take)

    def body(i: int) -> dict:
        b = {"model": MODEL, "max_tokens": 60, "stream": True, "ignore_eos": True, "seed": 100 + i,
             "request_id": f"batch-{i}"}
        if path == "/v1/chat/completions":
            b["messages"] = [{"role": "user", "content": f"hi {i}"}]
        else:
            b["prompt"] = f"hello {i}"
        if usage != "none":
            b["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return b

    async def metrics() -> dict[str, float]:
        async with httpx.AsyncClient(timeout=scaled(30)) as c:
            text = (await c.get(url + "/metrics")).text
        want = ("vllm:inter_token_latency_seconds_count", "vllm:generation_tokens_total")
        return {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(want)}

    n = 12
    m0 = await metrics()
    together = await asyncio.gather(*(_stream_bytes(url, path, body(i)) for i in range(n)))
    m1 = await metrics()
    assert batched["steps"] > 0 and batched["tokens"] >= n * 30  # most tokens came in batches
    monkeypatch.setattr(streaming.SteadyReader, "ready", lambda self: False)
    before = batched["tokens"]
    alone = await asyncio.gather(*(_stream_bytes(url, path, body(i)) for i in range(n)))
    m2 = await metrics()
    assert batched["tokens"] == before  # (the second round really went without batches)
    assert together == alone
    assert all(len(events) >= 60 for events in together)
    assert {k: m1[k] - m0[k] for k in m1} == {k: m2[k] - m1[k] for k in m1}
    assert m1["vllm:inter_token_latency_seconds_count"] - m0["vllm:inter_token_latency_seconds_count"] == n * 59
