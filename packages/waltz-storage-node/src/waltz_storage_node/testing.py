"""Helpers for tests that run storage nodes: records, and a real node subprocess.

:class:`StorageNodeProcess` runs ``waltz storage --config FILE`` as a child
process, waits until it serves (a handshake succeeds), and stops it by its pid
(SIGTERM, or SIGKILL to simulate a crash). System tests of other components
use it as well.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from waltz_api.contracts.transport import Transport
from waltz_api.errors import WaltzError
from waltz_api.storage_client import StorageClient
from waltz_api.supervised import SupervisedProcess

log = logging.getLogger(__name__)

READY_MARKER = "storage node ready on"
"""Logged (INFO) by a node once it listens."""


class StorageNodeProcess:
    """A ``waltz storage --config`` child process (started, killed and restarted by pid;
    a :class:`~waltz_api.supervised.SupervisedProcess`)."""

    def __init__(
        self,
        config_path: str | os.PathLike[str] | None,
        endpoint: str,
        log_path: Path,
        *,
        env: dict[str, str] | None = None,
        wrap: Sequence[str] = (),
        new_session: bool = False,
        command: Sequence[str] = (),
    ) -> None:
        """``config_path`` None: the node is configured by ``WALTZ_*`` variables in
        ``env`` alone (added to this process's environment). ``wrap`` is put before the
        command (``ip netns exec NAME``: the node in a network namespace); with
        ``new_session`` the node is not in this process's session (a Ctrl-C at the
        terminal reaches this process only, which stops the node). ``command`` is the
        ``waltz`` to run (another venv's ``bin/waltz``; default: this Python's ``-m
        waltz_cli``); the attribute may change between starts (an upgrade)."""
        self.config_path = None if config_path is None else Path(config_path)
        self.endpoint = endpoint
        self.log_path = log_path
        self.env = env
        self.wrap = list(wrap)
        self.command = list(command) or [sys.executable, "-m", "waltz_cli"]
        self.child = SupervisedProcess([], log_path, name="storage node", new_session=new_session)

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self.child.process

    @property
    def pid(self) -> int | None:
        return self.child.pid

    @property
    def running(self) -> bool:
        return self.child.running

    def start(self) -> None:
        args = [*self.wrap, *self.command, "storage"]
        if self.config_path is not None:
            args += ["--config", str(self.config_path)]
        self.child.argv = args
        self.child.env = None if self.env is None else {**os.environ, **self.env}
        self.child.start()

    async def wait_ready(self, transport: Transport, timeout: float = 30.0) -> None:
        """Wait until the node answers a handshake; raises ProcessStartError with its log
        if it died or is late.

        Probes start once the node logged that it is ready (log level INFO or
        lower), or after a few seconds otherwise: a probe racing the bind only
        costs retries."""
        started = time.monotonic()
        failure = "no handshake tried yet"

        async def serving() -> bool:
            nonlocal failure
            if READY_MARKER not in self.child.output() and time.monotonic() < started + 10:
                return False
            try:
                client = await StorageClient.connect(
                    transport, self.endpoint, sender="probe", timeout=5.0
                )
            except (WaltzError, TimeoutError) as exc:
                failure = str(exc)
                return False
            await client.close()
            return True

        await self.child.wait_ready(
            serving,
            timeout=timeout,
            interval=0.1,
            waiting_for=lambda: f"a handshake at {self.endpoint}: {failure}",
        )

    def output(self) -> str:
        """The whole log (every start's)."""
        return self.child.whole_log()

    def kill(self) -> None:
        """SIGKILL (a crash) and reap."""
        self.child.kill()

    def pause(self) -> None:
        """SIGSTOP: it answers nothing (its sockets stay open) until :meth:`resume`."""
        self.child.pause()

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        self.child.resume()

    def terminate(
        self, timeout: float = 30.0, signum: signal.Signals = signal.SIGTERM
    ) -> int | None:
        """SIGTERM (or ``signum``: a clean shutdown), SIGKILL if it does not end in
        time; the exit code."""
        return self.child.terminate(timeout, signum)

    def __enter__(self) -> StorageNodeProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()
