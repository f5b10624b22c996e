"""Everything of `serve` that relies on uvicorn's internals, in one place.

uvicorn's public surface is the ASGI `send`/`receive` pair; the hot path goes below it in four
ways, each of them here and nowhere else:

- `stamping_arrival`: a subclass of uvicorn's httptools protocol that stamps each request's
  arrival as its first bytes are parsed, counts changes of a connection's write side
  (`WriteSide`) and calls the handler's disconnect hook from `connection_lost`;
- `DirectBody`: a started chunked response's body chunks written to the transport directly,
  exactly the bytes uvicorn's `send` would write, and only while `send` would not have to wait;
  `DirectBody.start` writes a response's head the same way (the bytes uvicorn's own `send` made
  for the same headers, kept), `DirectBody.finish` its last chunk and the response's end;
- `transport_of(send)`: the connection under a `send` (an injected fault resets it);
- `protocol_factory(server)`: the protocol factory uvicorn's own server would use;
- `MAX_HEAD_BYTES`: the request line and headers of one request are bounded (httptools has no
  bound of its own; uvicorn's h11 protocol has, and vLLM sets it to 4 MiB): beyond it the request
  gets uvicorn's own answer to an unreadable request, a 400 that closes the connection.

`check()` lists what this module needs of the installed uvicorn; tests/http/test_uvicorn_internals.py
runs it against a real server, and pyproject.toml bounds uvicorn to the versions it passed with.
Where anything is missing at run time, `DirectBody.attach` declines and streams go through ASGI.
"""

from __future__ import annotations

import asyncio
import functools
import time
import weakref
from collections.abc import Callable
from typing import Any

try:  # uvicorn's fast HTTP/1.1 protocol; without it every chunk goes through ASGI
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _HttptoolsProtocol
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle as _HttptoolsCycle
except ImportError:  # pragma: no cover - httptools is a dependency
    _HttptoolsCycle = _HttptoolsProtocol = None

ARRIVAL = "vllm_vcr.arrival"  # the scope key: time.time() when the request's first bytes were read
# The scope key of a callable the protocol calls when the client goes away mid-request (present,
# None, when the protocol does: the app sets it instead of watching `receive` in a second task);
# CLIENT_GONE once the client left with none set.
ON_DISCONNECT = "vllm_vcr.on_disconnect"
CLIENT_GONE = "gone"
# Beyond this many open connections one poll of the loop may return more sockets than libuv's
# 1024-event array, and libuv then polls again inside the same read phase: a read-phase stamp
# could then precede a request's arrival, so every request is stamped as it is parsed.
READ_PHASE_MAX_CONNECTIONS = 512
# vLLM's H11_MAX_INCOMPLETE_EVENT_SIZE_DEFAULT: the most bytes a request's head may take
MAX_HEAD_BYTES = 4 * 1024 * 1024

# what this module reads or calls on uvicorn's objects (check() verifies them)
PROTOCOL_NEEDS = ("data_received", "on_message_begin", "on_message_complete", "connection_lost", "pause_writing",
                  "on_headers_complete", "send_400_response", "logger", "connections", "cycle", "pipeline", "flow",
                  "scope")
CYCLE_NEEDS = ("transport", "flow", "response_started", "response_complete", "chunked_encoding", "disconnected",
               "scope", "send", "default_headers", "keep_alive", "access_log", "waiting_for_100_continue",
               "expected_content_length", "message_event", "on_response")
FLOW_NEEDS = ("write_paused", "resume_reading")
SERVER_NEEDS = ("server_state", "lifespan", "servers", "started", "config")


class WriteSide:
    """How many times a connection's write side changed anywhere in the process (its transport
    paused writing, or the connection was lost), counted by serve's protocol (its class says so:
    `reports_write_side`). A reader that found each of its sockets writable at one count need not
    look at them again until the count moves: streams in a steady batch are checked by that one
    comparison per step (SteadyChunks), not by reading two objects per stream that are cold by then."""

    changes = 0


class ReadPhase:
    """time.time() when the loop's current read phase handed its first bytes to a protocol.

    One poll of the sockets returns every socket that is readable at that moment, and the loop
    then runs their reads back to back before it runs anything it was asked to run "soon"
    (`call_soon`, which ends the phase here). A request whose first bytes began its connection's
    first read of the phase was in its socket when that poll returned (a readable socket's first
    unread byte is there), so it had arrived by the phase's stamp, however long the parsing of
    the requests read before it took: under a burst of 256 requests on one loop that parsing is
    1-3 ms, and stamping each request as it is parsed would leave it out of the configured TTFT."""

    def __init__(self) -> None:
        self.time: float | None = None
        self.number = 0  # which phase: a connection's reads are compared by it

    def begin(self) -> int:
        """Called on every read: starts a phase on its first one; the phase's number."""
        if self.time is None:
            self.time = time.time()
            self.number += 1
            asyncio.get_running_loop().call_soon(self._end)
        return self.number

    def _end(self) -> None:
        self.time = None


_read_phases: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per event loop (tests run several)
_stamping: dict[type, type] = {}


def read_phase_of(loop: asyncio.AbstractEventLoop) -> ReadPhase:
    phase = _read_phases.get(loop)
    if phase is None:
        phase = _read_phases[loop] = ReadPhase()
    return phase


def stamping_arrival(protocol_class: type) -> type:
    """uvicorn's HTTP protocol class, stamping `scope[ARRIVAL]` as each request begins (the
    httptools protocol; any other is returned as it is, and the app stamps when it is called),
    and calling `scope[ON_DISCONNECT]` when the client of an unfinished response goes away.

    A request that begins a connection's first read of this read phase (no request of the
    connection half-read before it) takes the read phase's stamp (`ReadPhase`): its first bytes
    were in the socket when the loop polled. Any other one (pipelined behind a request in the
    same read, or on a server with too many connections for one poll) is stamped as it is
    parsed: its bytes may have come in after the poll."""
    if not hasattr(protocol_class, "on_message_begin"):
        return protocol_class
    cls = _stamping.get(protocol_class)
    if cls is None:
        cls = _stamping[protocol_class] = type(
            f"ArrivalStamped{protocol_class.__name__}", (protocol_class,),
            {"data_received": _data_received(protocol_class), "on_message_begin": _message_begin(protocol_class),
             "on_message_complete": _message_complete(protocol_class),
             "connection_lost": _connection_lost(protocol_class), "pause_writing": _pause_writing(protocol_class),
             "on_headers_complete": _headers_complete(protocol_class),
             "reports_write_side": True, "_in_message": False, "_in_head": True, "_head_bytes": 0,
             "_fresh_read": False, "_phase_of_read": 0, "_read_phase": None,
             "__doc__": f"uvicorn's {protocol_class.__name__}, stamping each request's arrival."})
    return cls


def protocol_factory(server: Any) -> Callable[[], asyncio.Protocol]:
    """What uvicorn's own server would hand each accepted connection, with arrival stamps (a
    uvicorn.Server that has started)."""
    return functools.partial(stamping_arrival(server.config.http_protocol_class), config=server.config,
                             server_state=server.server_state, app_state=server.lifespan.state)


def _data_received(protocol_class: type) -> Callable:
    def data_received(self, data: bytes) -> None:
        reads = self._read_phase
        if reads is None:
            reads = self._read_phase = read_phase_of(asyncio.get_running_loop())
        phase = reads.begin()
        # only a connection's first read of a phase: a second one (a full buffer read again) may
        # hold bytes that came in after the poll
        self._fresh_read = not self._in_message and self._phase_of_read != phase
        self._phase_of_read = phase
        if self._in_head:  # bytes before a request's headers are complete (counted per read)
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._in_head = False
                self.logger.warning("request head over %d bytes: connection closed", MAX_HEAD_BYTES)
                self.send_400_response("Invalid HTTP request received.")  # uvicorn's answer (and closes)
                self._fresh_read = False
                return
        protocol_class.data_received(self, data)
        self._fresh_read = False
    return data_received


def _message_begin(protocol_class: type) -> Callable:
    def on_message_begin(self) -> None:
        protocol_class.on_message_begin(self)  # builds the request's scope
        phase_time = self._read_phase.time if self._read_phase is not None else None
        if self._fresh_read and phase_time is not None and len(self.connections) <= READ_PHASE_MAX_CONNECTIONS:
            self.scope[ARRIVAL] = phase_time
        else:
            self.scope[ARRIVAL] = time.time()
        self._fresh_read = False  # a request after this one in the same read came in later
        self._in_message = True
        self.scope[ON_DISCONNECT] = None
    return on_message_begin


def _headers_complete(protocol_class: type) -> Callable:
    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        protocol_class.on_headers_complete(self)
    return on_headers_complete


def _pause_writing(protocol_class: type) -> Callable:
    def pause_writing(self) -> None:
        WriteSide.changes += 1
        protocol_class.pause_writing(self)
    return pause_writing


def _connection_lost(protocol_class: type) -> Callable:
    def connection_lost(self, exc: Exception | None) -> None:
        WriteSide.changes += 1
        cycle = self.cycle
        protocol_class.connection_lost(self, exc)  # marks the unfinished cycle disconnected
        if cycle is not None and cycle.disconnected:
            client_left(cycle.scope)
    return connection_lost


def client_left(scope: dict) -> None:
    """The client of this request went away: call its handler's hook, if one is set (else mark the
    scope, for a handler not started yet)."""
    hook = scope.get(ON_DISCONNECT)
    scope[ON_DISCONNECT] = CLIENT_GONE
    if callable(hook):
        hook()


def _message_complete(protocol_class: type) -> Callable:
    def on_message_complete(self) -> None:
        self._in_message = False
        self._in_head = True  # what comes next on the connection is the next request's head
        protocol_class.on_message_complete(self)
        if not self.pipeline:
            # a large body paused reading until the app read it; the app no longer reads, and only
            # a reading socket sees its client leave (a pipelined request keeps uvicorn's pause)
            self.flow.resume_reading()
    return on_message_complete


CHUNK_FRAME = b"%x\r\n%b\r\n"  # a chunk of the chunked body


class DirectBody:
    """Body chunks of a started chunked response written to uvicorn's transport directly.

    Exactly the bytes uvicorn's `send` would write for `{"body": data, "more_body": True}` (`data`
    never empty: an empty chunk would end the body); it
    declines (returns False) whenever `send` would have to wait or do anything else: the socket
    is paused, the client is gone, the response is complete.
    """

    __slots__ = ("_cycle", "_write", "transport")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self.transport = cycle.transport
        self._write = cycle.transport.write

    @classmethod
    def attach(cls, send: Callable) -> DirectBody | None:
        cycle = getattr(send, "__self__", None)
        if _HttptoolsCycle is None or type(cycle) is not _HttptoolsCycle:
            return None
        try:
            ok = (cycle.response_started and cycle.chunked_encoding and not cycle.response_complete
                  and cycle.scope["method"] != "HEAD" and cycle.flow is not None)
        except AttributeError:  # a uvicorn whose cycle looks different: stay on ASGI
            return None
        return cls(cycle) if ok else None

    @classmethod
    def start(cls, send: Callable, status: int, headers: list[tuple[bytes, bytes]]) -> DirectBody | None:
        """`send({"type": "http.response.start", ...})` done directly, and the body attached: the
        head's bytes are the ones uvicorn's own `send` wrote for the same status, headers, default
        headers (the server's `date` and `server`, a new list every second), keep-alive and method
        (`_HeadCache`), and the cycle is left as that `send` leaves it. `headers` must be one
        unchanging object (the cache knows it by identity). None (nothing done) wherever `send`
        would wait, log, refuse the headers or meet a response already begun, and for a body that
        is not chunked (a HEAD request's, one with a Content-Length): then call `send`."""
        cycle = getattr(send, "__self__", None)
        if type(cycle) is not _HttptoolsCycle:
            return None
        try:
            if cycle.response_started or cycle.disconnected or cycle.flow.write_paused or cycle.access_log:
                return None
            last = _HEADS.last  # (the usual case: the same head as the last response's)
            if (last[0] is cycle.default_headers and last[1] is headers and last[2] == status
                    and last[3] == cycle.keep_alive and last[4] == cycle.scope["method"]):
                made = last[5]
            else:
                made = _HEADS.get(cycle, status, headers)
        except AttributeError:  # a uvicorn whose cycle looks different: stay on ASGI
            return None
        if made is None or not made[1]:  # (only a chunked body is written directly)
            return None
        head, cycle.chunked_encoding, cycle.expected_content_length, cycle.keep_alive = made
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        cycle.transport.write(head)
        return cls(cycle)

    def finish(self, data: bytes) -> bool:
        """`send({"type": "http.response.body", "body": data, "more_body": False})` done directly:
        the last chunk and the chunked body's end, then what uvicorn's `send` does as a response
        completes. False (nothing done) wherever `send` would wait or do anything else."""
        c = self._cycle
        if c.flow.write_paused or c.disconnected or c.response_complete:
            return False
        self._write(CHUNK_FRAME % (len(data), data) + b"0\r\n\r\n" if data else b"0\r\n\r\n")
        c.response_complete = True
        c.message_event.set()
        if not c.keep_alive:
            c.transport.close()
        c.on_response()
        return True

    def write(self, data: bytes) -> bool:
        c = self._cycle
        if c.flow.write_paused or c.disconnected or c.response_complete:
            return False
        self._write(CHUNK_FRAME % (len(data), data))
        return True

    def blocked(self) -> bool:
        """Whether the socket does not take writes now: paused, or its client gone."""
        c = self._cycle
        return c.flow.write_paused or c.disconnected

    def closed(self) -> bool:
        """`blocked`, or the response is complete: nothing may be written."""
        c = self._cycle
        return c.flow.write_paused or c.disconnected or c.response_complete

    def reports_write_side(self) -> bool:
        """Whether the connection's protocol counts its write-side changes (`WriteSide`)."""
        get_protocol = getattr(self.transport, "get_protocol", None)
        return get_protocol is not None and getattr(get_protocol(), "reports_write_side", False)


class _Recorder:
    """A transport that keeps what is written to it (for `_HeadCache`)."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False


class _NoFlow:
    write_paused = False


class _HeadCache:
    """Response heads, each made once by uvicorn's own `send` on a scratch cycle of the same
    default headers, keep-alive and method, with what that `send` left on the cycle: (bytes,
    chunked_encoding, expected_content_length, keep_alive), or None where it raised (the real
    `send` then raises the same). Known by the identity of the default-headers list and of the
    headers (the server makes a new default list when the `date` changes, once a second), so a
    few are kept; `last`: the one made or found last, with what it was made for."""

    def __init__(self) -> None:
        self._by: dict[tuple, tuple] = {}
        self.last: tuple = (None, None, None, None, None, None)

    def get(self, cycle: Any, status: int, headers: list[tuple[bytes, bytes]]) -> tuple[bytes, bool, int, bool] | None:
        defaults = cycle.default_headers
        keep_alive, method = cycle.keep_alive, cycle.scope["method"]
        key = (id(defaults), id(headers), status, keep_alive, method)
        hit = self._by.get(key)
        if hit is None or hit[0] is not defaults or hit[1] is not headers:  # (an id reused)
            if len(self._by) >= 16:
                self._by.clear()
            hit = self._by[key] = (defaults, headers, status, keep_alive, method,
                                   _made_head(defaults, status, headers, keep_alive, method))
        self.last = hit
        return hit[5]


_CYCLE_ARGS = ("scope", "transport", "flow", "logger", "access_logger", "access_log", "default_headers",
               "message_event", "expect_100_continue", "keep_alive", "on_response")


def _made_head(defaults: list[tuple[bytes, bytes]], status: int, headers: list[tuple[bytes, bytes]],
               keep_alive: bool, method: str) -> tuple[bytes, bool, int, bool] | None:
    transport = _Recorder()
    scratch = _HttptoolsCycle(scope={"type": "http", "method": method}, transport=transport, flow=_NoFlow(),
                              logger=None, access_logger=None, access_log=False, default_headers=defaults,
                              message_event=asyncio.Event(), expect_100_continue=False, keep_alive=keep_alive,
                              on_response=lambda: None)
    step = scratch.send({"type": "http.response.start", "status": status, "headers": headers})
    try:
        step.send(None)  # (it does not wait: the scratch flow is never paused)
    except StopIteration:
        pass
    except Exception:  # a header uvicorn refuses: the real `send` refuses it too
        return None
    else:  # pragma: no cover - a uvicorn whose start waits
        step.close()
        return None
    return b"".join(transport.written), scratch.chunked_encoding, scratch.expected_content_length, scratch.keep_alive


_HEADS = _HeadCache()


def transport_of(send: Callable) -> Any:
    """The transport under uvicorn's `send` (None under another server)."""
    return getattr(getattr(send, "__self__", None), "transport", None)


def check() -> list[str]:
    """What this module needs and the installed uvicorn lacks (empty: compatible). Attributes set
    in `__init__` are looked for on a real protocol and cycle by the test; here, on the classes,
    what the classes define."""
    missing = []
    if _HttptoolsProtocol is None:
        return ["uvicorn.protocols.http.httptools_impl"]
    for name in ("data_received", "on_message_begin", "on_message_complete", "connection_lost", "pause_writing",
                 "on_headers_complete", "send_400_response"):
        if not callable(getattr(_HttptoolsProtocol, name, None)):
            missing.append(f"HttpToolsProtocol.{name}")
    if not callable(getattr(_HttptoolsCycle, "send", None)):
        missing.append("RequestResponseCycle.send")
    import inspect

    params = set(inspect.signature(_HttptoolsCycle).parameters)
    for name in _CYCLE_ARGS:  # (_made_head builds a scratch cycle by these keywords)
        if name not in params:
            missing.append(f"RequestResponseCycle({name}=)")
    return missing
