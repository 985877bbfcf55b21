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

import logging
import socket
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
