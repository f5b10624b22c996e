"""BurstAcceptor drains the listen backlog in one turn of the loop (uvloop's server takes one
connection per turn, which left a burst of 1000 new clients waiting seconds behind busy turns)."""

from __future__ import annotations

import asyncio
import socket

import uvloop  # a dependency of vllm-vcr on every platform it serves from (not Windows)

from vllm_vcr.http.acceptor import BurstAcceptor  # noqa: E402

N = 300


class _Echo(asyncio.Protocol):
    made = 0

    def connection_made(self, transport):  # noqa: ANN001
        type(self).made += 1
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data.upper())


async def _turns_to_accept(use_acceptor: bool) -> tuple[int, bytes]:
    """Loop turns until N connections waiting in the backlog have their protocols."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    listener.setblocking(False)
    clients = [socket.create_connection(listener.getsockname()) for _ in range(N)]
    _Echo.made = 0
    loop = asyncio.get_running_loop()
    if use_acceptor:
        server = BurstAcceptor(listener, _Echo)
    else:
        server = await loop.create_server(_Echo, sock=listener)
    turns = 0
    while _Echo.made < N and turns < 10 * N:
        await asyncio.sleep(0)
        turns += 1
    clients[0].sendall(b"ping")
    reply = await loop.run_in_executor(None, clients[0].recv, 16)
    server.close()
    if use_acceptor:  # stopped: a new connection stays in the backlog
        late = socket.create_connection(listener.getsockname())
        for _ in range(5):
            await asyncio.sleep(0)
        assert _Echo.made == N
        clients.append(late)
    for c in clients:
        c.close()
    listener.close()
    return turns, reply


def test_a_backlog_of_connections_is_taken_in_a_few_turns_not_one_per_turn():
    turns, reply = uvloop.run(_turns_to_accept(use_acceptor=True))
    assert turns <= 5 and reply == b"PING"
    plain, _ = uvloop.run(_turns_to_accept(use_acceptor=False))
    assert plain >= N // 2  # what it replaces: about one accept per turn


async def _stamping_server(app, n_clients: int):  # noqa: ANN001
    """uvicorn's httptools protocol with arrival stamps behind a BurstAcceptor, serving `app`,
    and `n_clients` connected sockets (every connection has its protocol)."""
    import functools

    import uvicorn
    from uvicorn.server import ServerState

    from vllm_vcr.http.uvicorn_internals import stamping_arrival

    config = uvicorn.Config(app, lifespan="off", log_config=None, http="httptools", access_log=False)
    config.load()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    factory = functools.partial(stamping_arrival(config.http_protocol_class), config=config,
                                server_state=ServerState(), app_state={})
    acceptor = BurstAcceptor(listener, factory)
    clients = [socket.create_connection(listener.getsockname()) for _ in range(n_clients)]
    for _ in range(50):  # let every connection get its protocol
        await asyncio.sleep(0.01)
    return acceptor, listener, clients


async def _answered_then_closed(acceptor: BurstAcceptor, listener: socket.socket, clients: list) -> None:
    loop = asyncio.get_running_loop()
    replies = await asyncio.gather(*(loop.run_in_executor(None, c.recv, 1024) for c in clients))
    acceptor.close()
    for c in clients:
        c.close()
    listener.close()
    assert all(r.startswith(b"HTTP/1.1 200") for r in replies)


async def test_arrival_is_stamped_as_requests_are_parsed_not_when_their_tasks_run():
    """Requests that arrive together are stamped together, although each handler then takes
    50 ms before the next one starts (as parsing, templating and tokenizing do under a burst)."""
    import time

    from vllm_vcr.http.uvicorn_internals import ARRIVAL

    calls: list[tuple[float, float]] = []

    async def app(scope, receive, send):  # noqa: ANN001
        calls.append((scope[ARRIVAL], time.time()))
        await receive()
        time.sleep(0.05)  # the request's own work, holding the loop
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    acceptor, listener, clients = await _stamping_server(app, 5)
    body = b"{}"
    for c in clients:  # all five requests arrive before the loop next reads
        c.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n" + body)
    await _answered_then_closed(acceptor, listener, clients)
    arrivals = sorted(a for a, _ in calls)
    started = sorted(t for _, t in calls)
    assert len(calls) == 5
    assert started[-1] - started[0] >= 0.19  # the handlers ran one after another
    assert arrivals[-1] - arrivals[0] < 0.1  # ... but their requests arrived together
    assert all(a <= t for a, t in calls)


async def _late_arrival_lag(sliced: bool) -> tuple[float, list[int]]:
    """Ten requests arrive together, each handler then holds the loop 30 ms; an eleventh request
    is sent 40 ms later. Returns how late its arrival was stamped, and the order the handlers ran."""
    import threading
    import time

    from vllm_vcr.http.acceptor import TurnSlices
    from vllm_vcr.http.uvicorn_internals import ARRIVAL

    order: list[int] = []
    stamps: dict[int, float] = {}

    async def app(scope, receive, send):  # noqa: ANN001
        n = int(scope["path"][1:])
        stamps[n] = scope[ARRIVAL]
        order.append(n)
        await receive()
        time.sleep(0.03)  # templating and tokenizing, holding the loop
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    acceptor, listener, clients = await _stamping_server(TurnSlices(app) if sliced else app, 11)
    sent_late: list[float] = []

    def send_late() -> None:
        time.sleep(0.04)
        sent_late.append(time.time())
        clients[10].sendall(b"GET /10 HTTP/1.1\r\nhost: x\r\n\r\n")

    for i, c in enumerate(clients[:10]):
        c.sendall(b"GET /%d HTTP/1.1\r\nhost: x\r\n\r\n" % i)
    threading.Thread(target=send_late).start()
    await _answered_then_closed(acceptor, listener, clients)
    return stamps[10] - sent_late[0], order


async def test_new_requests_share_the_loop_so_late_arrivals_are_stamped_on_time():
    """Without TurnSlices the eleventh request waits for all ten handlers (300 ms) before the loop
    reads it; with it, the loop reads between two handlers."""
    lag, order = await _late_arrival_lag(sliced=True)
    assert order[:10] == list(range(10))  # the waiting ones start in arrival order
    assert lag < 0.15
    plain, _ = await _late_arrival_lag(sliced=False)
    assert plain > 0.2  # what it replaces


async def test_queued_requests_start_in_order_and_cost_nothing_while_they_wait():
    """200 requests at once, 0.2 ms of work each: they start in arrival order, and a queued
    request is woken when its turn comes instead of checking again every turn."""
    import time

    from vllm_vcr.http.acceptor import TurnSlices

    started: list[int] = []

    async def app(scope, receive, send):  # noqa: ANN001
        started.append(scope["n"])
        t = time.perf_counter()
        while time.perf_counter() - t < 0.0002:
            pass

    gate = TurnSlices(app)
    checks = {"n": 0}
    real_check = gate._may_start

    def may_start() -> bool:
        checks["n"] += 1
        return real_check()

    gate._may_start = may_start
    await asyncio.gather(*(gate({"type": "http", "n": i}, None, None) for i in range(200)))
    assert started == list(range(200))
    assert checks["n"] == 200  # each request asked once; the queued ones were woken, not polled


async def _pumps_behind_other_work(requests: int, request_s: float, other_s: float) -> int:
    """`requests` at once through TurnSlices, each holding the loop `request_s`, while another
    task holds it `other_s` per turn (streams' tokens); how many turns the pump took."""
    import time

    from vllm_vcr.http.acceptor import TurnSlices

    def spin(seconds: float) -> None:
        t = time.perf_counter()
        while time.perf_counter() - t < seconds:
            pass

    async def app(scope, receive, send):  # noqa: ANN001
        spin(request_s)

    done = False

    async def other_work() -> None:
        while not done:
            spin(other_s)
            await asyncio.sleep(0)

    gate = TurnSlices(app)
    pumps = {"n": 0}
    real_pump = gate._pump

    def pump() -> None:
        pumps["n"] += 1
        real_pump()

    gate._pump = pump
    busy = asyncio.ensure_future(other_work())
    await asyncio.gather(*(gate({"type": "http"}, None, None) for _ in range(requests)))
    done = True
    await busy
    return pumps["n"]


async def test_a_loop_busy_with_other_work_does_not_slow_the_queue_to_one_request_per_turn():
    """The pump sizes each release by the released requests' own time: 5 ms of other work per
    turn (streams' tokens) must not cut new requests to one per turn."""
    # about 20 per turn at 50 µs each; one per turn would take 100
    assert await _pumps_behind_other_work(100, 0.00005, 0.005) <= 50


async def test_new_requests_get_half_of_a_loop_busy_with_streams():
    """At 1,000 open streams a turn is mostly the streams' tokens: a fixed 1 ms per turn for new
    requests admitted fewer than finished. 1 ms requests behind 5 ms of other work per turn are
    released several per turn (about 5), not one."""
    assert await _pumps_behind_other_work(60, 0.001, 0.005) <= 30  # one per turn would take about 60


async def _arrivals(requests: list[bytes], n_clients: int) -> list[tuple[int, float]]:
    """Send each client its bytes before the loop next reads; (request number, ARRIVAL) per request."""
    import time

    from vllm_vcr.http.uvicorn_internals import ARRIVAL

    seen: list[tuple[int, float]] = []

    async def app(scope, receive, send):  # noqa: ANN001
        seen.append((int(scope["path"][1:]), scope[ARRIVAL]))
        await receive()
        time.sleep(0.002)  # the request's own work
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    acceptor, listener, clients = await _stamping_server(app, n_clients)
    for c, data in zip(clients, requests):
        c.sendall(data)
    await _answered_then_closed(acceptor, listener, clients)
    return sorted(seen)


async def test_requests_waiting_when_the_loop_reads_take_the_time_its_read_phase_began():
    """20 requests in their sockets before the loop polls: all were there when it began reading,
    so all take that time, however long parsing the ones before took."""
    import time

    sent = time.time()
    reqs = [b"GET /%d HTTP/1.1\r\nhost: x\r\n\r\n" % i for i in range(20)]
    seen = await _arrivals(reqs, 20)
    assert len(seen) == 20
    stamps = {a for _, a in seen}
    assert len(stamps) == 1 and sent <= stamps.pop() <= time.time()


async def test_a_pipelined_request_and_a_crowded_server_stamp_each_request_as_it_is_parsed(monkeypatch):
    """A request behind another in the same read may have come in after the poll: its own stamp.
    Beyond READ_PHASE_MAX_CONNECTIONS one poll may not return every socket: each its own stamp."""
    from vllm_vcr.http import uvicorn_internals

    pipelined = b"GET /0 HTTP/1.1\r\nhost: x\r\n\r\nGET /1 HTTP/1.1\r\nhost: x\r\n\r\n"
    (_, first), (_, second) = await _arrivals([pipelined], 1)
    assert second > first
    monkeypatch.setattr(uvicorn_internals, "READ_PHASE_MAX_CONNECTIONS", 3)
    seen = await _arrivals([b"GET /%d HTTP/1.1\r\nhost: x\r\n\r\n" % i for i in range(5)], 5)
    assert len({a for _, a in seen}) == 5


async def test_a_second_read_of_a_connection_in_the_same_read_phase_is_stamped_as_it_is_parsed():
    """The loop reads a socket again within one phase only after a read filled its buffer: the
    second read may hold bytes that came in after the poll, so its request gets its own stamp."""
    import time

    import uvicorn
    from uvicorn.server import ServerState

    from vllm_vcr.http.uvicorn_internals import ARRIVAL, stamping_arrival

    async def app(scope, receive, send):  # noqa: ANN001
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    config = uvicorn.Config(app, lifespan="off", log_config=None, http="httptools", access_log=False)
    config.load()

    class Transport(asyncio.Transport):
        def get_extra_info(self, name, default=None):  # noqa: ANN001
            return ("127.0.0.1", 1) if name in ("peername", "sockname") else default

        def write(self, data):  # noqa: ANN001
            pass

        def is_closing(self) -> bool:
            return False

        def close(self) -> None:
            pass

        def pause_reading(self) -> None:
            pass

        def resume_reading(self) -> None:
            pass

    proto = stamping_arrival(config.http_protocol_class)(config=config, server_state=ServerState(), app_state={})
    proto.connection_made(Transport())
    other = stamping_arrival(config.http_protocol_class)(config=config, server_state=ServerState(), app_state={})
    other.connection_made(Transport())
    stamps = {}
    for p, path in ((other, b"/other"), (proto, b"/a"), (proto, b"/b")):  # one read phase: no await
        p.data_received(b"GET %b HTTP/1.1\r\nhost: x\r\n\r\n" % path)
        stamps[path.decode()] = p.scope[ARRIVAL]
        time.sleep(0.002)
    await asyncio.sleep(0.01)
    assert stamps["/a"] == stamps["/other"]
    assert stamps["/b"] >= stamps["/a"] + 0.004
    for p in (proto, other):
        p.connection_lost(None)
