"""Simulated disks and the ``sim`` storage engine plugin.

A :class:`SimDisk` belongs to the world (it outlives the storage node processes
that open it) and keeps three views of each partition, as a file system does:

- *visible*: what the engine answers (published once an append or a truncate
  completed its fdatasync, as the ``fs`` engine publishes);
- *written*: what reached the page cache: a restart after a process crash
  (kill -9) finds it, including writes whose fdatasync never completed;
- *durable*: what completed an fdatasync: the only thing a power loss keeps for sure.

A power loss leaves each partition either its durable state or the state of its
unsynced writes cut short (the last write torn: recovery drops a torn record, so a
prefix of the unsynced records survives, record by record). Faults chosen by the
seed: slow fsyncs, and fsync errors, after which the partition refuses everything
until its storage node restarts (the ``fs`` engine marks the partition broken; the
world's supervisor restarts the node). The engine keeps the StorageEngine contract:
``append``, ``truncate`` and ``set_session_info`` return only once durable.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import crc32c

from waltz_api.contracts.storage import StorageEngine, StoragePartition
from waltz_api.errors import (
    ChecksumError,
    PartitionClosedError,
    PartitionNotFoundError,
    StorageAppendError,
    StorageError,
)
from waltz_api.types import NO_TRANSACTION, Record, RecordHeader, SessionInfo
from waltz_sim.loop import Incarnation, current_incarnation

if TYPE_CHECKING:
    from waltz_sim.world import World

log = logging.getLogger(__name__)

_INT32 = (-(2**31), 2**31 - 1)


@dataclass
class DiskConfig:
    """Latencies in seconds (uniform between the bounds)."""

    write: tuple[float, float] = (0.00002, 0.0002)
    fsync: tuple[float, float] = (0.0003, 0.003)


@dataclass
class PartitionImage:
    """One partition's log on one disk (see the module docstring)."""

    written: list[Record] = field(default_factory=list)
    durable: list[Record] = field(default_factory=list)
    common: int = 0
    """``written[:common]`` and ``durable[:common]`` are the same records."""
    visible: int = 0
    """``written[:visible]`` is what the engine shows."""
    written_info: SessionInfo = field(default_factory=SessionInfo)
    durable_info: SessionInfo = field(default_factory=SessionInfo)
    broken: str | None = None

    def sync(self) -> None:
        """An fdatasync completed: the durable state is the written one."""
        del self.durable[self.common :]
        self.durable.extend(self.written[self.common :])
        self.common = len(self.written)
        self.durable_info = self.written_info

    def truncate_written(self, transaction_id: int) -> None:
        del self.written[transaction_id + 1 :]
        self.common = min(self.common, len(self.written))

    def lose_unsynced(self, rng: random.Random) -> int:
        """A power loss: keep the durable state, or the unsynced writes cut short (the
        last one torn). Returns how many written records did not survive."""
        before = len(self.written)
        if rng.random() < 0.5:
            # the unsynced writes are lost (a truncation not synced is undone too)
            self.written = list(self.durable)
        else:
            # the truncation (if any) reached the disk, and a prefix of the appends
            kept = rng.randint(self.common, len(self.written))
            del self.written[kept:]
        if rng.random() < 0.5:
            self.written_info = self.durable_info
        self.durable = list(self.written)
        self.common = len(self.written)
        self.durable_info = self.written_info
        self.visible = len(self.written)
        return max(0, before - len(self.written))


class SimDisk:
    """The disk of one storage node, in the world (it survives the node's crashes)."""

    def __init__(self, world: World, location: str, cluster_key: uuid.UUID, num_partitions: int):
        self.world = world
        self.location = location
        self.cluster_key = cluster_key
        self.num_partitions = num_partitions
        self.partitions: dict[int, PartitionImage] = {}
        self.extra_fsync: list[float] = []
        """Slow-fsync faults in force (seconds added to each fsync)."""
        self.failing_fsyncs = 0
        """The next this-many fsyncs fail (a fault)."""
        self.engine: SimStorageEngine | None = None
        self.fsyncs = 0
        self.fsync_errors = 0

    @property
    def rng(self) -> random.Random:
        return self.world.disk_rng

    def write_delay(self) -> float:
        return self.rng.uniform(*self.world.config.disk.write)

    def fsync_delay(self) -> float:
        delay = self.rng.uniform(*self.world.config.disk.fsync)
        if self.extra_fsync:
            delay += max(self.extra_fsync) * self.rng.uniform(0.5, 1.0)
        return delay

    def power_loss(self) -> int:
        """Lose what no fdatasync covered; returns the records lost."""
        lost = 0
        for image in self.partitions.values():
            lost += image.lose_unsynced(self.rng)
        return lost

    def after_process_crash(self) -> None:
        """A restart finds the page cache: what was written, synced or not, is visible."""
        for image in self.partitions.values():
            image.visible = len(image.written)
            image.broken = None

    def contents(self) -> dict[int, list[Record]]:
        """Each partition's records, as a restarted engine would find them."""
        return {p: list(image.written) for p, image in sorted(self.partitions.items())}


class SimStoragePartition(StoragePartition):
    def __init__(self, engine: SimStorageEngine, partition_id: int, image: PartitionImage) -> None:
        self.partition_id = partition_id
        self._engine = engine
        self._image = image

    @property
    def disk(self) -> SimDisk:
        return self._engine.disk

    def _check(self) -> PartitionImage:
        engine = self._engine
        if engine.closed:
            raise StorageError("the storage engine is closed")
        if engine.disk.partitions.get(self.partition_id) is not self._image:
            raise PartitionClosedError(f"partition {self.partition_id} is closed (removed)")
        if self._image.broken is not None:
            raise PartitionClosedError(
                f"partition {self.partition_id} failed: {self._image.broken}; restart the "
                "storage node to recover it"
            )
        return self._image

    async def _write(self) -> PartitionImage:
        await asyncio.sleep(self.disk.write_delay())
        return self._check()

    async def _fsync(self) -> PartitionImage:
        disk = self.disk
        await asyncio.sleep(disk.fsync_delay())
        image = self._check()
        disk.fsyncs += 1
        if disk.failing_fsyncs > 0:
            disk.failing_fsyncs -= 1
            disk.fsync_errors += 1
            # Linux may drop the dirty pages after a writeback error: the unsynced
            # writes may be gone for good, so the partition stops until a restart
            image.lose_unsynced(disk.rng)
            image.broken = "fdatasync failed (EIO)"
            raise StorageError(
                f"partition {self.partition_id}: fdatasync failed (EIO); the partition is "
                "closed until the storage node restarts"
            )
        image.sync()
        return image

    def max_transaction_id(self) -> int:
        return self._check().visible - 1

    def session_info(self) -> SessionInfo:
        return self._check().written_info

    async def set_session_info(self, info: SessionInfo) -> None:
        self._check()
        image = await self._write()
        image.written_info = info
        await self._fsync()

    def _validate(self, records: Sequence[Record]) -> None:
        image = self._check()
        expected = image.visible
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

    async def append(self, records: Sequence[Record]) -> None:
        self._validate(records)
        if not records:
            return
        image = await self._write()
        if len(image.written) != records[0].transaction_id:
            raise StorageAppendError(
                f"partition {self.partition_id}: the log changed under an append; nothing stored"
            )
        image.written.extend(records)
        image = await self._fsync()
        image.visible = len(image.written)

    async def truncate(self, transaction_id: int) -> None:
        image = self._check()
        if transaction_id < NO_TRANSACTION:
            raise StorageError(f"cannot truncate after transaction {transaction_id} (min -1)")
        if transaction_id + 1 >= len(image.written):
            return
        image = await self._write()
        image.truncate_written(transaction_id)
        image.visible = min(image.visible, len(image.written))
        await self._fsync()

    def _visible(self) -> list[Record]:
        image = self._check()
        return image.written[: image.visible]

    async def read_record(self, transaction_id: int) -> Record | None:
        await asyncio.sleep(0)
        records = self._visible()
        if 0 <= transaction_id < len(records):
            return records[transaction_id]
        return None

    async def read_header(self, transaction_id: int) -> RecordHeader | None:
        record = await self.read_record(transaction_id)
        return record.record_header if record is not None else None

    async def read_records(
        self, start: int, max_records: int, max_bytes: int = 16 * 1024 * 1024
    ) -> list[Record]:
        await asyncio.sleep(0)
        records = self._visible()
        out: list[Record] = []
        size = 0
        if start < 0:
            return out
        for record in records[start : start + max(max_records, 0)]:
            if out and size + len(record.data) > max_bytes:
                break
            size += len(record.data)
            out.append(record)
        return out

    async def read_headers(self, start: int, max_records: int) -> list[RecordHeader]:
        await asyncio.sleep(0)
        records = self._visible()
        if start < 0:
            return []
        return [r.record_header for r in records[start : start + max(max_records, 0)]]


class SimStorageEngine(StorageEngine):
    """A storage node's view of its :class:`SimDisk` (plugin ``sim``); one per process life."""

    partition_class: type[SimStoragePartition] = SimStoragePartition

    def __init__(self, disk: SimDisk, incarnation: Incarnation) -> None:
        self.disk = disk
        self.incarnation = incarnation
        self.closed = False
        self._partitions: dict[int, SimStoragePartition] = {}
        incarnation.resources.append(self)

    @classmethod
    async def open(
        cls,
        location: str,
        *,
        cluster_key: uuid.UUID | None = None,
        num_partitions: int | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> SimStorageEngine:
        if options:
            raise StorageError(
                f"the sim storage engine takes no options, got {', '.join(sorted(options))}"
            )
        incarnation = current_incarnation()
        world = incarnation.process.world
        disk = world.disks.get(location)
        if disk is None:
            if cluster_key is None or num_partitions is None:
                raise StorageError(
                    f"{location} is not a Waltz storage yet: creating one needs the cluster "
                    "key and the number of partitions"
                )
            disk = world.disks[location] = SimDisk(world, location, cluster_key, num_partitions)
        engine = cls(disk, incarnation)
        engine.check_cluster_key(
            cluster_key if cluster_key is not None else disk.cluster_key,
            num_partitions if num_partitions is not None else disk.num_partitions,
        )
        disk.engine = engine
        await asyncio.sleep(disk.fsync_delay())
        return engine

    @property
    def cluster_key(self) -> uuid.UUID:
        return self.disk.cluster_key

    @property
    def num_partitions(self) -> int:
        return self.disk.num_partitions

    def _check_open(self) -> None:
        if self.closed:
            raise StorageError("the storage engine is closed")

    def partition_ids(self) -> list[int]:
        return sorted(self.disk.partitions)

    def partition(self, partition_id: int) -> SimStoragePartition:
        self._check_open()
        image = self.disk.partitions.get(partition_id)
        if image is None:
            raise PartitionNotFoundError(
                f"partition {partition_id} is not hosted by the storage at {self.disk.location}; "
                f"hosted: {self.partition_ids() or 'none'} (add it first)"
            )
        part = self._partitions.get(partition_id)
        if part is None or part._image is not image:
            part = self.partition_class(self, partition_id, image)
            self._partitions[partition_id] = part
        if image.broken is not None:
            raise PartitionClosedError(
                f"partition {partition_id} failed: {image.broken}; restart the storage node"
            )
        return part

    async def add_partition(self, partition_id: int) -> SimStoragePartition:
        self._check_open()
        if not 0 <= partition_id < self.num_partitions:
            raise PartitionNotFoundError(
                f"partition {partition_id} does not exist: the cluster has partitions "
                f"0..{self.num_partitions - 1}"
            )
        if partition_id not in self.disk.partitions:
            await asyncio.sleep(self.disk.fsync_delay())
            self._check_open()
            self.disk.partitions.setdefault(partition_id, PartitionImage())
        return self.partition(partition_id)

    async def remove_partition(self, partition_id: int) -> None:
        self._check_open()
        await asyncio.sleep(self.disk.fsync_delay())
        self._check_open()
        self.disk.partitions.pop(partition_id, None)
        self._partitions.pop(partition_id, None)

    async def close(self) -> None:
        self.closed = True

    # -- the process's fate -------------------------------------------------------------

    def on_crash(self, power_loss: bool) -> None:
        self.closed = True
        if self.disk.engine is self:
            self.disk.engine = None
        self.disk.after_process_crash()

    def on_pause(self) -> None:
        """The kernel goes on: nothing to do."""

    def on_resume(self) -> None:
        """Nothing to do."""


__all__ = ["DiskConfig", "PartitionImage", "SimDisk", "SimStorageEngine", "SimStoragePartition"]
