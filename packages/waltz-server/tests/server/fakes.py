"""An in-process storage node with the storage node's fencing rules, for store tests.

It keeps each partition's log, session info and highest session id as the
real node does (surviving a "restart"), refuses requests of older sessions
with SessionFencedError, and can be taken offline (connections break,
connects fail) to simulate a crash, or held (requests wait) to simulate a hung node.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from waltz_api.errors import (
    ConnectError,
    ConnectionClosedError,
    SessionFencedError,
    StorageAppendError,
    StorageError,
)
from waltz_api.types import LOST_SESSION, Record, SessionInfo
from waltz_server.server.replica import LocalLog


@dataclass
class FakePartition:
    log: list[Record] = field(default_factory=list)
    session_info: SessionInfo = field(default_factory=SessionInfo)
    highest_session_id: int = -1


class FakeStorageNode:
    def __init__(self, name: str) -> None:
        self.name = name
        self.partitions: dict[int, FakePartition] = {}
        self.online = True
        self.connections: list[FakeReplicaConnection] = []
        self.append_delay = 0.0
        self.appends = 0
        self.hold: asyncio.Event | None = None
        """While set to an Event not yet set, every request waits for it (a node that
        accepted connections and answers nothing: hung, or very slow)."""

    def partition(self, partition_id: int) -> FakePartition:
        return self.partitions.setdefault(partition_id, FakePartition())

    async def connect(self, partition_id: int, session_id: int) -> FakeReplicaConnection:
        await asyncio.sleep(0)
        if not self.online:
            raise ConnectError(f"storage node {self.name} is down")
        connection = FakeReplicaConnection(self, partition_id, session_id)
        self.connections.append(connection)
        return connection

    def crash(self) -> None:
        self.online = False
        for connection in self.connections:
            connection.broken = True
        self.connections.clear()

    def restart(self) -> None:
        self.online = True

    def log(self, partition_id: int) -> list[Record]:
        return list(self.partition(partition_id).log)


class FakeReplicaConnection:
    """A ``ReplicaConnection`` without the optional features (no damage to report, no
    prefix to delete): a subclass declares those it adds in ``capabilities``."""

    capabilities: frozenset[str] = frozenset()

    def __init__(self, node: FakeStorageNode, partition_id: int, session_id: int) -> None:
        self.node = node
        self.partition_id = partition_id
        self.session_id = session_id
        self.broken = False

    @property
    def storage_node(self) -> str:
        return self.node.name

    async def _enter(self) -> FakePartition:
        await asyncio.sleep(0)
        hold = self.node.hold
        if hold is not None:
            await hold.wait()
        if self.broken or not self.node.online:
            raise ConnectionClosedError(f"connection to {self.node.name} broke")
        partition = self.node.partition(self.partition_id)
        if self.session_id < partition.highest_session_id:
            raise SessionFencedError(
                f"session {self.session_id} fenced by {partition.highest_session_id}",
                partition.highest_session_id,
            )
        partition.highest_session_id = self.session_id
        return partition

    async def last_session_info(self) -> SessionInfo:
        return (await self._enter()).session_info

    async def max_transaction_id(self) -> int:
        partition = await self._enter()
        return len(partition.log) - 1

    async def truncate(self, transaction_id: int) -> None:
        partition = await self._enter()
        del partition.log[transaction_id + 1 :]

    async def set_low_water_mark(self, low_water_mark: int) -> None:
        partition = await self._enter()
        partition.session_info = SessionInfo(
            self.session_id, low_water_mark, len(partition.log) - 1
        )

    async def mark_replica(self, low_water_mark: int, *, clean: bool, log_end: int = -1) -> None:
        partition = await self._enter()
        max_id = len(partition.log) - 1
        info = partition.session_info
        if clean:
            if info.low_water_mark != low_water_mark or max_id < log_end:
                raise StorageError(f"cannot mark clean: {info}, log end {max_id}")
            partition.session_info = SessionInfo(
                self.session_id, low_water_mark, info.local_low_water_mark, self.session_id
            )
        else:
            if max_id > low_water_mark:
                raise StorageError(f"truncate first: log end {max_id}")
            partition.session_info = SessionInfo(
                self.session_id, low_water_mark, max_id, LOST_SESSION
            )

    async def append(self, records: Sequence[Record]) -> None:
        partition = await self._enter()
        if self.node.append_delay:
            await asyncio.sleep(self.node.append_delay)
            partition = await self._enter()
        if records and records[0].transaction_id != len(partition.log):
            raise StorageAppendError(
                f"append at {records[0].transaction_id}, "
                f"but the log ends at {len(partition.log) - 1}"
            )
        for expected, record in enumerate(records, start=len(partition.log)):
            if record.transaction_id != expected:
                raise StorageAppendError("records are not dense")
        partition.log.extend(records)
        self.node.appends += 1

    def start_append(self, records: Sequence[Record]) -> asyncio.Future[None]:
        return asyncio.ensure_future(self.append(records))

    async def read_block(self, start: int, max_records: int, max_bytes: int) -> Sequence[Record]:
        return await self.read_records(start, max_records, max_bytes)

    async def missing_range(self) -> tuple[int, int] | None:
        return None

    async def repair(self, records: Sequence[Record]) -> None:
        raise StorageError(f"{self.node.name} has no repair (capability REPAIR)")

    async def local_log(self) -> LocalLog:
        raise StorageError(f"{self.node.name} has no local log (capability PREFIX)")

    async def prune(self, through: int) -> int:
        raise StorageError(f"{self.node.name} cannot delete a prefix (capability PREFIX)")

    async def read_records(self, start: int, max_records: int, max_bytes: int) -> list[Record]:
        partition = await self._enter()
        out: list[Record] = []
        size = 0
        for record in partition.log[start : start + max_records]:
            if out and size + len(record.data) > max_bytes:
                break
            out.append(record)
            size += len(record.data)
        return out

    async def close(self) -> None:
        self.broken = True
