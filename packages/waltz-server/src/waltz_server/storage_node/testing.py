"""Helpers for tests that run storage nodes: records, and a real node subprocess.

:class:`StorageNodeProcess` runs ``waltz storage --config FILE`` as a child
process, waits until it serves (a handshake succeeds), and stops it by its pid
(SIGTERM, or SIGKILL to simulate a crash). System tests of other components
use it as well.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from waltz_server.storage_node.client import StorageClient

log = logging.getLogger(__name__)

READY_MARKER = "storage node ready on"
"""Logged (INFO) by a node once it listens."""


class StorageNodeProcess:
    """A ``waltz storage --config`` child process (started, killed and restarted by pid)."""

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
        ``waltz`` to run (e.g. another venv's ``bin/waltz``; default: this Python's
        ``-m waltz_cli``); set the attribute to start the next run from another."""
        self.config_path = None if config_path is None else Path(config_path)
        self.endpoint = endpoint
        self.log_path = log_path
        self.env = env
        self.wrap = list(wrap)
        self.new_session = new_session
        self.command = list(command) or [sys.executable, "-m", "waltz_cli"]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"storage node already running (pid {self.process.pid})")
        with self.log_path.open("ab") as log_file:
            args = [*self.wrap, *self.command, "storage"]
            if self.config_path is not None:
                args += ["--config", str(self.config_path)]
            self.process = subprocess.Popen(
                args,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=None if self.env is None else {**os.environ, **self.env},
                start_new_session=self.new_session,
            )
        log.info("storage node started (pid %d)", self.process.pid)

    async def wait_ready(self, transport: Transport, timeout: float = 30.0) -> None:
        """Wait until the node answers a handshake; raises with its log if it died.

        Probes start once the node logged that it is ready (log level INFO or
        lower), or after a few seconds otherwise: a probe racing the bind only
        costs retries."""
        started = time.monotonic()
        deadline = started + timeout
        while True:
            if self.process is None or self.process.poll() is not None:
                code = self.process.returncode if self.process else None
                raise WaltzError(f"storage node exited with {code}: {self.output()[-2000:]}")
            if READY_MARKER not in self.output() and time.monotonic() < started + 10:
                await asyncio.sleep(0.05)
                continue
            try:
                client = await StorageClient.connect(
                    transport, self.endpoint, sender="probe", timeout=5.0
                )
            except (WaltzError, TimeoutError) as exc:
                if time.monotonic() > deadline:
                    raise WaltzError(
                        f"storage node at {self.endpoint} not ready after {timeout}s ({exc}): "
                        f"{self.output()[-2000:]}"
                    ) from exc
                await asyncio.sleep(0.1)
                continue
            await client.close()
            return

    def output(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")
        return ""

    def kill(self) -> None:
        """SIGKILL (a crash) and reap."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def terminate(
        self, timeout: float = 30.0, signum: signal.Signals = signal.SIGTERM
    ) -> int | None:
        """SIGTERM (or ``signum``: a clean shutdown), SIGKILL if it does not end in
        time; the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            os.kill(self.process.pid, signum)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode

    def __enter__(self) -> StorageNodeProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()
