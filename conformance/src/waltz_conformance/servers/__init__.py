"""Real external servers for system tests: started in temp dirs on free loopback ports.

Each server class starts its process (a :class:`waltz_api.supervised.SupervisedProcess`),
waits until it serves, and stops it by its pid (also at interpreter exit, should a
test run crash). Tests of any
package reuse them::

    from waltz_conformance.servers.zookeeper import ZooKeeperServer

    with ZooKeeperServer() as zk:
        uri = zk.uri("/waltz")

The session-scoped pytest fixture ``zookeeper_server`` (from the conformance
pytest plugin) shares one server across a test session.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable

from waltz_api.ports import free_port as free_port  # re-exported: the servers use it

log = logging.getLogger(__name__)


def port_is_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    """Poll ``check()`` until true; raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class BlackHole:
    """A listener on ``host:port`` that accepts connections and never answers, nor closes
    them until :meth:`close` (a hung server, or one accepting before it serves).
    SO_REUSEADDR: a real server can bind the port again once :meth:`close_listener` is
    called, while the accepted connections stay open. ``port`` 0 picks a free one."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1") -> None:
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, port))
        self.listener.listen(16)
        self.host = host
        self.port: int = self.listener.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self.first_accept = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="black-hole", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # the listener was closed
            self.accepted.append(conn)
            self.first_accept.set()

    def close_listener(self) -> None:
        """Accept no more connections (the accepted ones stay open, unanswered)."""
        # shutdown wakes the thread blocked in accept(); close alone may not on Linux
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            raise RuntimeError("the black hole's accept thread did not end")

    def close(self) -> None:
        """Close the listener and every accepted connection."""
        if self.listener.fileno() != -1:
            self.close_listener()
        for conn in self.accepted:
            conn.close()
