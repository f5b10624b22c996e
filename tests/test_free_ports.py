"""The ports tests start servers on are taken where the kernel never hands one out by itself."""

import socket

from vllm_vcr.testing.waits import free_port, free_port_run


def _kernel_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def test_free_port_is_below_the_kernels_own_range_and_bindable():
    low, _ = _kernel_range()
    for _ in range(50):
        port = free_port()
        assert 10000 <= port < low or low <= 10001
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    import random

    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken, taken, taken + 1])
        monkeypatch.setattr(random, "randint", lambda a, b: next(picks))
        assert free_port() == taken + 1


def test_a_run_of_ports_is_free_end_to_end():
    base = free_port_run(4)
    for i in range(4):
        with socket.socket() as s:
            s.bind(("0.0.0.0", base + i))
