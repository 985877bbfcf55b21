"""Free TCP ports on the loopback interface: for ``waltz dev``, tests and benchmarks.

A port is free when asked; another process may take it before it is bound again, so
a caller binds it soon (and a test that loses the race fails visibly, it never hangs).

The ports are chosen *below* the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), never inside it: the kernel gives
ephemeral ports to every outgoing connection (a ZooKeeper voter's, a client's), so a
port chosen there could be taken by one between the choosing and the binding, or
while a restarted member is down (the system suite lost a server start that way
under load). Below the range only another ``free_port`` caller can take it; each
process walks the range from its own random start, and every port is checked by
binding it before it is given.
"""

from __future__ import annotations

import os
import random
import socket
import threading
from pathlib import Path

LOOPBACK = "127.0.0.1"

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000
"""The lowest port given: below it live well-known services' ports."""
_DEFAULT_EPHEMERAL_START = 32_768


def ephemeral_start(path: Path = _RANGE_FILE) -> int:
    """The first port of the kernel's ephemeral range (32768 when it cannot be read)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_START


class _Ports:
    """This process's walk over the ports below the ephemeral range."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._low = _LOWEST
        self._high = max(ephemeral_start(), _LOWEST + 1_000)
        self._next = self._low
        self.restart()

    def restart(self) -> None:
        """Begin the walk at a random port (again in a forked child, which would
        otherwise walk the same ports as its parent)."""
        self._lock = threading.Lock()
        self._next = random.SystemRandom().randrange(self._low, self._high)

    def take(self, host: str, count: int) -> list[int]:
        chosen: list[int] = []
        span = self._high - self._low
        with self._lock:
            for _ in range(span):
                if len(chosen) == count:
                    return chosen
                port = self._next
                self._next = self._low + (self._next + 1 - self._low) % span
                if _bindable(host, port):
                    chosen.append(port)
        if len(chosen) == count:
            return chosen
        # every port below the ephemeral range is taken: let the kernel choose
        return chosen + _kernel_ports(count - len(chosen), host)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_ports(count: int, host: str) -> list[int]:
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


_PORTS = _Ports()
os.register_at_fork(after_in_child=_PORTS.restart)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on ``host`` a moment ago, below the ephemeral range."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct TCP ports that were free on ``host`` a moment ago, below the
    ephemeral range (none given twice by this process until it has walked them all)."""
    return _PORTS.take(host, count)
