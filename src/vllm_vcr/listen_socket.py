"""Claiming a TCP port before anything starts, so a clash is reported at once with the flag
that chose it (the serve port and the control API share this)."""

from __future__ import annotations

import socket


def bind_listener(host: str, port: int, what: str) -> socket.socket:
    """A bound, non-blocking TCP socket on host:port (not yet listening; the caller picks the
    backlog). A name that does not resolve raises socket.gaierror; a port that cannot be taken
    raises OSError whose message starts "cannot listen on {what}"."""
    family, type_, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {what}: {e.strerror or e}") from None
    return sock
