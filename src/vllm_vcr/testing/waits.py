"""Ports and waits for tests that start real servers, with timeouts that grow with the machine's load.

    port = free_port()
    wait_http_ok(url + "/health", timeout=60)          # 60 s times timeout_scale()
    wait_until(lambda: stats()["running"] == 0, 10, "the engine to go idle")

A timeout given to these functions is a base for an idle machine with a core per busy process;
`timeout_scale()` multiplies it: by `VLLM_VCR_TEST_TIMEOUT_SCALE` when that is set, else by the
one-minute load average per CPU (never below 1), so a suite sharing two cores with other jobs
waits longer instead of failing.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

SCALE_ENV = "VLLM_VCR_TEST_TIMEOUT_SCALE"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, taken below the range the kernel hands out for
    port 0 (see `free_port_run`): a server started a moment later on it cannot find it taken by
    another process's bind to port 0 (a vLLM frontend's ZMQ sockets) or outgoing connection."""
    return free_port_run(1, host)


def free_port_run(n: int, host: str = "0.0.0.0") -> int:
    """The first of `n` consecutive TCP ports nothing listens on, for a server that binds port + i
    for each rank i (KV events, forward-pass metrics). Taken at random below the range the kernel
    hands out for port 0 (/proc/sys/net/ipv4/ip_local_port_range), so no later bind to port 0 or
    outgoing connection lands on one of them; each is checked on `host` (0.0.0.0 by default, as
    such servers bind it)."""
    import random

    low = 32768
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    top = low - n
    if top <= 10000:  # (a machine that hands out nearly every port: any run of free ones)
        top = 65535 - n
    for _ in range(200):
        base = random.randint(10000, top)
        with contextlib.ExitStack() as held:
            try:
                for i in range(n):
                    s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    s.bind((host, base + i))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports found")


def listening(port: int) -> set[str] | None:
    """The local addresses (hex, as Linux's /proc/net/tcp{,6} write them) whose TCP sockets listen on
    `port`, or None where the machine has no such tables. A check that never connects: a connection
    to a port nothing listens on yet can be the port's own (TCP's simultaneous open, when the
    kernel picks that port as the source), which then keeps the server from binding it."""
    found: set[str] = set()
    tables = [t for t in ("/proc/net/tcp", "/proc/net/tcp6") if os.path.exists(t)]
    if not tables:
        return None
    for table in tables:
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, port_hex = fields[1].rsplit(":", 1)
            if int(port_hex, 16) == port and fields[3] == "0A":  # TCP_LISTEN
                found.add(address)
    return found


def timeout_scale() -> float:
    """How much longer than on an idle machine a wait may take now (>= 1 unless the variable says less)."""
    configured = os.environ.get(SCALE_ENV, "").strip()
    if configured:
        try:
            value = float(configured)
        except ValueError:
            raise ValueError(f"{SCALE_ENV} must be a number, got {configured!r}") from None
        if value > 0:
            return value
        raise ValueError(f"{SCALE_ENV} must be positive, got {configured!r}")
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


def scaled(seconds: float) -> float:
    """`seconds` times `timeout_scale()`."""
    return seconds * timeout_scale()


def wait_until(predicate: Callable[[], T], timeout: float, what: str = "the awaited state",
               interval: float = 0.05) -> T:
    """Call `predicate` every `interval` s until it returns something true, and return that; raise
    TimeoutError after `scaled(timeout)` seconds."""
    limit = scaled(timeout)
    deadline = time.monotonic() + limit
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {limit:.1f}s waiting for {what}")
        time.sleep(interval)


async def async_wait_until(predicate: Callable[[], Any], timeout: float, what: str = "the awaited state",
                           interval: float = 0.01) -> Any:
    """`wait_until` for a coroutine: `predicate` may return an awaitable (its result counts), and
    the wait sleeps on the event loop between calls."""
    limit = scaled(timeout)
    deadline = time.monotonic() + limit
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {limit:.1f}s waiting for {what}")
        await asyncio.sleep(interval)


def wait_http_ok(url: str, timeout: float, failure: Callable[[], str | None] = lambda: None,
                 interval: float = 0.05) -> None:
    """GET `url` until it answers 200; raise RuntimeError as soon as `failure()` returns a reason
    (e.g. the server process exited), TimeoutError after `scaled(timeout)` seconds."""
    import httpx

    limit = scaled(timeout)
    deadline = time.monotonic() + limit
    while True:
        reason = failure()
        if reason is not None:
            raise RuntimeError(reason)
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=max(1.0, min(5.0, limit / 10))).status_code == 200:
                return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{url} did not answer 200 within {limit:.1f}s")
        time.sleep(interval)
