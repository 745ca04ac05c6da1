"""Loopback ports for the processes a component starts: chosen together, so that none comes twice."""

from __future__ import annotations

import socket
from collections.abc import Collection


def free_ports(count: int, host: str = "127.0.0.1", avoid: Collection[int] = ()) -> list[int]:
    """`count` distinct ports free on `host` now, none of them in `avoid` (ports chosen for processes that have not
    bound them yet: the OS may offer a port again once the socket that found it is closed). Each socket stays bound
    until all are chosen. Another process may still take one before its user binds it."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            s = socket.socket()
            held.append(s)
            s.bind((host, 0))
            if (port := s.getsockname()[1]) not in avoid:
                ports.append(port)
        return ports
    finally:
        for s in held:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One port free on `host` now (see free_ports: choose the ports of processes started together in one call)."""
    return free_ports(1, host)[0]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False
