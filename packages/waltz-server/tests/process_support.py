"""Helpers of the waltz-server tests that run real processes: the ``waltz`` command in
its own process (:func:`waltz`), and load through the client library on a system
harness (:func:`library_client`, :class:`Writers`)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from waltz_api.errors import WaltzError
from waltz_client import AsyncWaltzClient, ClientConfig
from waltz_client.simple import MemoryMarks, Put
from waltz_conformance.suites.system.harness import SystemHarness

DEADLINE = 90.0
"""Generous: for each event waited for, on a slow shared machine."""


def waltz(*args: str) -> subprocess.CompletedProcess[str]:
    """``waltz ARGS`` in its own process (bounded), its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "waltz_server.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def library_client(harness: SystemHarness, partition: int) -> AsyncWaltzClient:
    """A client of the client library on one partition of ``harness`` (ZeroMQ), its
    high-water marks in memory; not started."""
    return AsyncWaltzClient(
        MemoryMarks(),
        ClientConfig(
            harness.coordination_uri,
            transport="zmq",
            partitions=[partition],
            transaction_timeout=30.0,
            request_timeout=10.0,
        ),
    )


@dataclass
class Writers:
    """``count`` tasks submitting unique records to one partition through ``client``
    until stopped; every acknowledgement kept (id -> data, and when)."""

    client: AsyncWaltzClient
    partition: int
    count: int
    payload: Callable[[int, int], bytes]
    """The data of a writer's n-th submission: payload(writer, n), unique."""
    acked: dict[int, bytes] = field(default_factory=dict)
    acked_at: dict[int, float] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    acked_twice: list[int] = field(default_factory=list)
    """Ids acknowledged to two submissions."""
    stopping: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._write(w)) for w in range(self.count)]

    async def _write(self, writer: int) -> None:
        seq = 0
        while not self.stopping:
            seq += 1
            data = self.payload(writer, seq)
            try:
                result = await self.client.submit(Put(data, self.partition))
            except WaltzError as exc:
                self.errors[type(exc).__name__] += 1
                await asyncio.sleep(0.2)
                continue
            assert result.committed  # (Put never declines)
            if result.transaction_id in self.acked:
                self.acked_twice.append(result.transaction_id)
            self.acked[result.transaction_id] = data
            self.acked_at[result.transaction_id] = time.monotonic()

    @property
    def highest(self) -> int:
        return max(self.acked, default=-1)

    async def stop(self) -> None:
        """No new submission; those in flight end (decided or timed out), bounded."""
        self.stopping = True
        _, pending = await asyncio.wait(self.tasks, timeout=DEADLINE)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
