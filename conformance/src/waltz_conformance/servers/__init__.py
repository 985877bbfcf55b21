"""Real external servers for system tests: started in temp dirs on free loopback ports.

Each server class starts its process, waits until it serves, and stops it by
its pid (also at interpreter exit, should a test run crash). Tests of any
package reuse them::

    from waltz_conformance.servers.zookeeper import ZooKeeperServer

    with ZooKeeperServer() as zk:
        uri = zk.uri("/waltz")

The session-scoped pytest fixture ``zookeeper_server`` (from the conformance
pytest plugin) shares one server across a test session.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable

from waltz_api.ports import free_port as free_port  # re-exported: the servers use it

log = logging.getLogger(__name__)

_live: dict[int, subprocess.Popen[bytes]] = {}
_live_lock = threading.Lock()


def port_is_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def track_process(process: subprocess.Popen[bytes]) -> None:
    """Remember ``process`` so it is killed at interpreter exit if still running."""
    with _live_lock:
        _live[process.pid] = process


def stop_process(
    process: subprocess.Popen[bytes], *, kill: bool = False, timeout: float = 10.0
) -> None:
    """Stop ``process`` by its pid: SIGTERM (or SIGKILL with ``kill``), then SIGKILL
    after ``timeout`` seconds; always reaped."""
    with _live_lock:
        _live.pop(process.pid, None)
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL if kill else signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("pid %d ignored SIGTERM for %.0fs; killing it", process.pid, timeout)
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=timeout)
    else:
        process.wait()


def wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    """Poll ``check()`` until true; raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@atexit.register
def _kill_leftovers() -> None:
    with _live_lock:
        leftovers = list(_live.values())
        _live.clear()
    for process in leftovers:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
