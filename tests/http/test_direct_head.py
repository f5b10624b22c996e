"""A stream's head and end written straight to uvicorn's transport (`DirectBody.start`,
`DirectBody.finish`, `SSEWriter.start_direct` / `close_direct`) are the bytes uvicorn's own `send`
writes, and leave its request cycle (and a head observer such as the http_* series' one) as that
`send` leaves them: the same hostile default headers, headers, keep-alive, method and bodies go
through both, on two real uvicorn cycles."""

from __future__ import annotations

import asyncio
import logging

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from vllm_vcr.http.sse import SSE_HEADERS, SSEWriter
from vllm_vcr.http.uvicorn_internals import DirectBody
from vllm_vcr.serve.app import _ResponseHead


class Transport:
    def __init__(self) -> None:
        self.data = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


class Flow:
    write_paused = False


def cycle_for(defaults: list, keep_alive: bool, method: str) -> tuple[RequestResponseCycle, list]:
    responses: list[int] = []
    log = logging.getLogger("test-direct-head")
    c = RequestResponseCycle(scope={"type": "http", "method": method, "path": "/", "http_version": "1.1",
                                    "query_string": b"", "client": None},
                             transport=Transport(), flow=Flow(), logger=log, access_logger=log, access_log=False,
                             default_headers=defaults, message_event=asyncio.Event(), expect_100_continue=True,
                             keep_alive=keep_alive, on_response=lambda: responses.append(1))
    return c, responses


def state(c: RequestResponseCycle, responses: list) -> tuple:
    return (c.transport.data, c.transport.closed, c.response_started, c.response_complete, c.chunked_encoding,
            c.expected_content_length, c.keep_alive, c.waiting_for_100_continue, c.message_event.is_set(),
            len(responses))


def run(coro) -> Exception | None:  # noqa: ANN001
    try:
        asyncio.run(coro)
    except Exception as e:  # noqa: BLE001 - compared by type
        return e
    return None


header_bytes = st.one_of(st.binary(max_size=12), st.sampled_from(
    [b"content-length", b"Content-Length", b"transfer-encoding", b"connection", b"Connection", b"date",
     b"server", b"chunked", b"close", b"keep-alive, Close", b"12", b"-3", b"\r\n", b"x\x00y", b"caf\xc3\xa9"]))
headers = st.lists(st.tuples(header_bytes, header_bytes), max_size=4)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(defaults=headers, app_headers=st.one_of(st.just(SSE_HEADERS), headers), keep_alive=st.booleans(),
       method=st.sampled_from(["POST", "GET", "HEAD"]), status=st.sampled_from([200, 204, 304, 400, 599, 700]),
       body=st.binary(max_size=64), more=st.lists(st.binary(min_size=1, max_size=16), max_size=2))  # (write: never empty)
def test_direct_head_and_end_are_uvicorns_send(defaults, app_headers, keep_alive, method, status, body, more):
    plain, plain_responses = cycle_for(defaults, keep_alive, method)
    direct_cycle, direct_responses = cycle_for(list(defaults), keep_alive, method)

    async def through_send() -> None:
        await plain.send({"type": "http.response.start", "status": status, "headers": app_headers})
        for part in more:
            await plain.send({"type": "http.response.body", "body": part, "more_body": True})
        await plain.send({"type": "http.response.body", "body": body, "more_body": False})

    async def directly() -> None:
        direct = DirectBody.start(direct_cycle.send, status, app_headers)
        if direct is None:  # declined, and nothing done: the caller sends as usual
            assert not direct_cycle.response_started and direct_cycle.transport.data == b""
            await direct_cycle.send({"type": "http.response.start", "status": status, "headers": app_headers})
            direct = DirectBody.attach(direct_cycle.send)
        for part in more:
            if direct is None or not direct.write(part):
                await direct_cycle.send({"type": "http.response.body", "body": part, "more_body": True})
        if direct is None or not direct.finish(body):
            await direct_cycle.send({"type": "http.response.body", "body": body, "more_body": False})

    plain_error = run(through_send())
    direct_error = run(directly())
    assert type(plain_error) is type(direct_error), (plain_error, direct_error)
    assert state(plain, plain_responses) == state(direct_cycle, direct_responses)


@settings(max_examples=100, deadline=None)
@given(date=st.binary(max_size=40), keep_alive=st.booleans(), body=st.binary(max_size=64),
       observed=st.booleans())
def test_sse_writer_direct_start_and_close_match_start_and_close(date, keep_alive, body, observed):
    defaults = [(b"date", date), (b"server", b"uvicorn")]
    plain, plain_responses = cycle_for(defaults, keep_alive, "POST")
    direct_cycle, direct_responses = cycle_for(defaults, keep_alive, "POST")
    raw_send = direct_cycle.send  # (one bound method: the app's scope holds the server's send)
    plain_send = _ResponseHead(plain.send) if observed else plain.send
    direct_send = _ResponseHead(raw_send) if observed else raw_send

    async def plain_stream() -> None:
        w = SSEWriter(plain_send)
        await w.start()
        await w.close(body)

    async def direct_stream() -> None:
        d = SSEWriter(direct_send)
        direct = d.start_direct(raw_send)
        if direct is None:  # (a date uvicorn refuses: declined, nothing done)
            assert not direct_cycle.response_started
            await d.start()
        if direct is None or not d.close_direct(direct, body):
            await d.close(body)
        assert d.started and d.closed

    plain_error = run(plain_stream())
    direct_error = run(direct_stream())
    assert type(plain_error) is type(direct_error), (plain_error, direct_error)
    assert state(plain, plain_responses) == state(direct_cycle, direct_responses)
    if observed:
        assert (plain_send.status, plain_send.size) == (direct_send.status, direct_send.size)


def test_a_wrapper_that_is_not_an_observer_keeps_the_asgi_path():
    c, _ = cycle_for([(b"server", b"uvicorn")], True, "POST")

    async def wrapped(message):  # noqa: ANN001 - e.g. a header-adding wrapper
        await c.send(message)

    assert SSEWriter(wrapped).start_direct(c.send) is None
    assert not c.response_started


def test_a_paused_or_gone_socket_keeps_the_asgi_path():
    for attr in ("paused", "gone"):
        c, _ = cycle_for([(b"server", b"uvicorn")], True, "POST")
        if attr == "paused":
            c.flow.write_paused = True
        else:
            c.disconnected = True
        assert DirectBody.start(c.send, 200, SSE_HEADERS) is None
        assert not c.response_started and c.transport.data == b""
