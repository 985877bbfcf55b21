"""Helpers for tests that run storage nodes: records, and a real node subprocess.

:class:`StorageNodeProcess` runs ``waltz storage --config FILE`` as a child
process, waits until it serves (a handshake succeeds), and stops it by its pid
(SIGTERM, or SIGKILL to simulate a crash). System tests of other components
use it as well.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from waltz_api.contracts.transport import Transport
from waltz_api.errors import WaltzError
from waltz_api.storage_client import StorageClient
from waltz_api.supervised import WaltzCommandProcess

log = logging.getLogger(__name__)

READY_MARKER = "storage node ready on"
"""Logged (INFO) by a node once it listens."""


class StorageNodeProcess(WaltzCommandProcess):
    """A ``waltz storage --config`` child process (started, killed and restarted by pid;
    the options are :class:`~waltz_api.supervised.WaltzCommandProcess`'s)."""

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
        super().__init__(
            "storage",
            config_path,
            log_path,
            name="storage node",
            env=env,
            wrap=wrap,
            new_session=new_session,
            command=command,
        )
        self.endpoint = endpoint

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

    def __enter__(self) -> StorageNodeProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()
