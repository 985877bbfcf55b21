"""The reference storage engine: the contract's model, in memory (plugin ``memory``).

A location is a key in a process-wide table, so closing and reopening an
engine at the same location sees what was stored (the suite's reopen tests),
but nothing survives the process: it is not durable, and it declares so.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import crc32c

from waltz_api.contracts.storage import StorageEngine, StoragePartition
from waltz_api.errors import (
    ChecksumError,
    PartitionClosedError,
    PartitionNotFoundError,
    RecordsArchivedError,
    StorageAppendError,
    StorageError,
)
from waltz_api.features import MAX_FEATURE_LEVEL
from waltz_api.types import NO_TRANSACTION, Record, RecordHeader, SessionInfo

_INT32 = (-(2**31), 2**31 - 1)


@dataclass
class _PartitionState:
    records: list[Record] = field(default_factory=list)
    start: int = 0
    """The id of ``records[0]``: the ones below were dropped (``drop_prefix``)."""
    info: SessionInfo = field(default_factory=SessionInfo)
    available: bool = True


@dataclass
class _StoreState:
    cluster_key: uuid.UUID
    num_partitions: int
    partitions: dict[int, _PartitionState] = field(default_factory=dict)
    feature_level: int = MAX_FEATURE_LEVEL


_STORES: dict[str, _StoreState] = {}
_STORES_LOCK = threading.Lock()


def forget(location: str) -> None:
    """Drop what is stored at ``location`` (tests)."""
    with _STORES_LOCK:
        _STORES.pop(location, None)


class MemoryStoragePartition(StoragePartition):
    def __init__(self, engine: MemoryStorageEngine, partition_id: int, state: _PartitionState):
        self.partition_id = partition_id
        self._engine = engine
        self._state = state

    def _check(self) -> _PartitionState:
        if self._engine.closed or self._engine.store.partitions.get(self.partition_id) is not (
            self._state
        ):
            raise PartitionClosedError(f"partition {self.partition_id} is closed")
        return self._state

    def max_transaction_id(self) -> int:
        state = self._check()
        return state.start + len(state.records) - 1

    def log_start(self) -> int:
        return self._check().start

    async def drop_prefix(self, through: int) -> int:
        state = self._check()
        if through >= state.start:
            del state.records[: through - state.start + 1]
            state.start = through + 1
        await asyncio.sleep(0)
        return state.start

    def _archived(self, transaction_id: int) -> RecordsArchivedError:
        return RecordsArchivedError(
            f"partition {self.partition_id}: transaction {transaction_id} is below the local "
            f"log's start {self._state.start} (archived, deleted here)"
        )

    def session_info(self) -> SessionInfo:
        return self._check().info

    async def set_session_info(self, info: SessionInfo) -> None:
        self._check().info = info
        await asyncio.sleep(0)

    def available(self) -> bool:
        return self._check().available

    async def set_available(self, available: bool) -> None:
        self._check().available = available
        await asyncio.sleep(0)

    async def append(self, records: Sequence[Record]) -> None:
        state = self._check()
        expected = state.start + len(state.records)
        for i, record in enumerate(records):
            if record.transaction_id != expected + i:
                raise StorageAppendError(
                    f"partition {self.partition_id}: transaction {record.transaction_id} does "
                    f"not continue the log, which expects {expected + i}; nothing was stored"
                )
            if crc32c.crc32c(record.data) != record.checksum:
                raise ChecksumError(
                    f"partition {self.partition_id}: transaction {record.transaction_id}: the "
                    "data does not match its CRC-32C checksum; nothing was stored"
                )
            r = record.req_id
            for value in (r.client_id, r.generation, r.partition_id, r.seq_num, record.header):
                if not _INT32[0] <= value <= _INT32[1]:
                    raise StorageAppendError(
                        f"transaction {record.transaction_id}: {value} does not fit in a signed "
                        "32-bit integer (ReqId fields and header); nothing was stored"
                    )
        state.records.extend(records)
        await asyncio.sleep(0)

    async def truncate(self, transaction_id: int) -> None:
        state = self._check()
        if transaction_id < NO_TRANSACTION:
            raise StorageError(f"cannot truncate after transaction {transaction_id} (min -1)")
        if transaction_id < state.start - 1:
            state.records.clear()
            state.start = transaction_id + 1
        else:
            del state.records[transaction_id + 1 - state.start :]
        await asyncio.sleep(0)

    async def read_record(self, transaction_id: int) -> Record | None:
        state = self._check()
        await asyncio.sleep(0)
        if 0 <= transaction_id < state.start:
            raise self._archived(transaction_id)
        if 0 <= transaction_id - state.start < len(state.records):
            return state.records[transaction_id - state.start]
        return None

    async def read_header(self, transaction_id: int) -> RecordHeader | None:
        record = await self.read_record(transaction_id)
        return record.record_header if record is not None else None

    async def read_records(
        self, start: int, max_records: int, max_bytes: int = 16 * 1024 * 1024
    ) -> list[Record]:
        state = self._check()
        await asyncio.sleep(0)
        out: list[Record] = []
        size = 0
        if start < 0:
            return out
        if start < state.start and start <= self.max_transaction_id():
            raise self._archived(start)
        at = start - state.start
        for record in state.records[at : at + max(max_records, 0)]:
            if out and size + len(record.data) > max_bytes:
                break
            size += len(record.data)
            out.append(record)
        return out

    async def read_headers(self, start: int, max_records: int) -> list[RecordHeader]:
        state = self._check()
        await asyncio.sleep(0)
        if start < 0:
            return []
        if start < state.start and start <= self.max_transaction_id():
            raise self._archived(start)
        at = start - state.start
        return [r.record_header for r in state.records[at : at + max(max_records, 0)]]


class MemoryStorageEngine(StorageEngine):
    """The in-memory model of a storage directory."""

    def __init__(self, location: str, store: _StoreState) -> None:
        self.location = location
        self.store = store
        self.closed = False
        self._partitions: dict[int, MemoryStoragePartition] = {}

    @classmethod
    async def open(
        cls,
        location: str,
        *,
        cluster_key: uuid.UUID | None = None,
        num_partitions: int | None = None,
        options: Mapping[str, Any] | None = None,
        feature_level: int | None = None,
    ) -> MemoryStorageEngine:
        if options:
            raise StorageError(
                f"the memory storage engine takes no options, got {', '.join(sorted(options))}"
            )
        with _STORES_LOCK:
            store = _STORES.get(location)
            if store is None:
                if cluster_key is None or num_partitions is None:
                    raise StorageError(
                        f"{location} is not a Waltz storage yet: creating one needs the cluster "
                        "key and the number of partitions"
                    )
                if num_partitions < 1:
                    raise StorageError(f"number of partitions must be >= 1, not {num_partitions}")
                store = _StoreState(cluster_key, num_partitions)
                if feature_level is not None:
                    store.feature_level = feature_level
                _STORES[location] = store
        engine = cls(location, store)
        engine.check_cluster_key(
            cluster_key if cluster_key is not None else store.cluster_key,
            num_partitions if num_partitions is not None else store.num_partitions,
        )
        await asyncio.sleep(0)
        return engine

    @property
    def cluster_key(self) -> uuid.UUID:
        return self.store.cluster_key

    @property
    def feature_level(self) -> int:
        return self.store.feature_level

    async def raise_feature_level(self, level: int) -> None:
        self._check_open()
        self._check_feature_level(level)
        self.store.feature_level = max(self.store.feature_level, level)
        await asyncio.sleep(0)

    @property
    def num_partitions(self) -> int:
        return self.store.num_partitions

    def _check_open(self) -> None:
        if self.closed:
            raise StorageError("the storage engine is closed")

    def partition_ids(self) -> list[int]:
        return sorted(self.store.partitions)

    def partition(self, partition_id: int) -> MemoryStoragePartition:
        self._check_open()
        state = self.store.partitions.get(partition_id)
        if state is None:
            raise PartitionNotFoundError(
                f"partition {partition_id} is not hosted by the storage at {self.location}; "
                f"hosted: {self.partition_ids() or 'none'} (add it first)"
            )
        part = self._partitions.get(partition_id)
        if part is None or part._state is not state:
            part = MemoryStoragePartition(self, partition_id, state)
            self._partitions[partition_id] = part
        return part

    async def add_partition(self, partition_id: int) -> MemoryStoragePartition:
        self._check_open()
        if not 0 <= partition_id < self.num_partitions:
            raise PartitionNotFoundError(
                f"partition {partition_id} does not exist: the cluster has partitions "
                f"0..{self.num_partitions - 1}"
            )
        self.store.partitions.setdefault(partition_id, _PartitionState())
        await asyncio.sleep(0)
        return self.partition(partition_id)

    async def remove_partition(self, partition_id: int) -> None:
        self._check_open()
        if not 0 <= partition_id < self.num_partitions:
            raise PartitionNotFoundError(
                f"partition {partition_id} does not exist: the cluster has partitions "
                f"0..{self.num_partitions - 1}"
            )
        self.store.partitions.pop(partition_id, None)
        self._partitions.pop(partition_id, None)
        await asyncio.sleep(0)

    async def close(self) -> None:
        self.closed = True
        await asyncio.sleep(0)
