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

import abc
import asyncio
import dataclasses
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
    CorruptionError,
    PartitionClosedError,
    PartitionNotFoundError,
    StorageAppendError,
    StorageError,
)
from waltz_api.types import LOST_SESSION, NO_TRANSACTION, Record, RecordHeader, SessionInfo
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
    missing: list[tuple[int, int]] = field(default_factory=list)
    """Ranges (first, last) lost to damage below intact records, until repaired."""

    def sync(self) -> None:
        """An fdatasync completed: the durable state is the written one."""
        del self.durable[self.common :]
        self.durable.extend(self.written[self.common :])
        self.common = len(self.written)
        self.durable_info = self.written_info

    def truncate_written(self, transaction_id: int) -> None:
        del self.written[transaction_id + 1 :]
        self.common = min(self.common, len(self.written))
        self.missing = [
            (first, min(last, transaction_id))
            for first, last in self.missing
            if first <= transaction_id
        ]

    def damage(self, rng: random.Random) -> str | None:
        """Damage found at start-up: records lost below intact ones (a missing range),
        or a lost tail of acknowledged records (LOST_SESSION). Returns what, or None."""
        length = len(self.written)
        if length < 4:
            return None
        if rng.random() < 0.5:
            first = rng.randrange(0, length - 2)
            last = min(first + rng.randint(0, 4), length - 2)
            self.missing = sorted([*self.missing, (first, last)])
            return f"transactions {first}..{last} lost to damage (intact ones after them)"
        lost = self.lose_tail(rng.randint(1, min(5, length - 1)))
        return f"its last {lost} transactions lost to damage (a lost tail)"

    def lose_tail(self, count: int) -> int:
        """Damage found at start-up: the last ``count`` records (acknowledged) are gone, and
        the engine says so (``low_water_mark_session_id == LOST_SESSION``, as the ``fs``
        engine reports a damaged tail it moved aside). Returns how many went."""
        lost = max(0, min(count, len(self.written)))
        del self.written[len(self.written) - lost :]
        del self.durable[len(self.written) :]
        self.common = min(self.common, len(self.written))
        self.visible = len(self.written)
        self.missing = [
            (f, min(last, self.visible - 1)) for f, last in self.missing if f < self.visible
        ]
        info = dataclasses.replace(self.written_info, low_water_mark_session_id=LOST_SESSION)
        self.written_info = self.durable_info = info
        return lost

    def copy(self) -> PartitionImage:
        """The image as a snapshot of the disk takes it now (what was written, synced or
        not: a crash-consistent copy), to restore later (:meth:`SimDisk.restore`)."""
        return PartitionImage(
            written=list(self.written),
            durable=list(self.written),
            common=len(self.written),
            visible=len(self.written),
            written_info=self.written_info,
            durable_info=self.written_info,
            missing=list(self.missing),
        )

    @property
    def unrepaired(self) -> bool:
        return bool(self.missing) or self.written_info.low_water_mark_session_id == LOST_SESSION

    def intact(self) -> list[Record]:
        """What a reader gets: the records up to the first missing one."""
        end = min([len(self.written), *(first for first, _ in self.missing)])
        return self.written[:end]

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
        end = len(self.written)
        self.missing = [(first, min(last, end - 1)) for first, last in self.missing if first < end]
        return max(0, before - len(self.written))


class Disk(abc.ABC):
    """The disk of one storage node, in the world (it survives the node's crashes): the
    faults every kind of simulated disk has (the hooks of the nemesis and the scripts).
    :class:`SimDisk` is the ``sim`` engine's model; ``waltz_sim.fsdisk.FsDisk`` the file
    system under the real ``fs`` engine."""

    def __init__(self, world: World, location: str) -> None:
        self.world = world
        self.location = location
        self.extra_fsync: list[float] = []
        """Slow-fsync faults in force (seconds added to each fsync)."""
        self.failing_fsyncs = 0
        """The next this-many fsyncs fail (a fault)."""
        self.fsyncs = 0
        self.fsync_errors = 0
        self.pending_damage = False
        """Damage the next start-up recovery finds (a fault)."""
        self.stall: asyncio.Event | None = None
        """A stalled disk (scripted scenarios): every fsync, once its time is up, waits until
        the event is set (the stall ends: the fsyncs waiting for it complete then)."""

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

    async def flush_wait(self) -> None:
        """The time an fsync takes (slowed by the faults in force; held while stalled)."""
        await asyncio.sleep(self.fsync_delay())
        while self.stall is not None and not self.stall.is_set():
            await self.stall.wait()

    @abc.abstractmethod
    def lose_power(self) -> str | None:
        """A power loss: lose what no flush covered; what was lost (None: nothing)."""

    @abc.abstractmethod
    async def read_back(self) -> dict[int, list[Record]]:
        """Each partition's readable records, as a restarted engine would find them (up to
        a range lost to damage and not repaired): the replicas the checker judges."""

    @property
    @abc.abstractmethod
    def unrepaired(self) -> bool:
        """Damage found and not repaired yet (a missing range, a lost tail)."""


class SimDisk(Disk):
    """The ``sim`` engine's disk: a model of each partition's log (see the module)."""

    def __init__(self, world: World, location: str, cluster_key: uuid.UUID, num_partitions: int):
        super().__init__(world, location)
        self.cluster_key = cluster_key
        self.num_partitions = num_partitions
        self.partitions: dict[int, PartitionImage] = {}
        self.engine: SimStorageEngine | None = None

    def lose_power(self) -> str | None:
        lost = self.power_loss()
        return f"{lost} unsynced records lost" if lost else None

    async def read_back(self) -> dict[int, list[Record]]:
        return self.contents()

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
        """Each partition's readable records, as a restarted engine would find them (up to
        a range lost to damage and not repaired)."""
        return {p: list(image.intact()) for p, image in sorted(self.partitions.items())}

    @property
    def unrepaired(self) -> bool:
        return any(image.unrepaired for image in self.partitions.values())

    def snapshot(self) -> dict[int, PartitionImage]:
        """A copy of every partition as it is on the disk now (see
        :meth:`PartitionImage.copy`)."""
        return {p: image.copy() for p, image in sorted(self.partitions.items())}

    def restore(self, images: Mapping[int, PartitionImage]) -> None:
        """Put back a :meth:`snapshot` (a backup restored while the node is down): every
        partition is what the snapshot holds; one it did not hold is gone."""
        self._check_down("restore a snapshot on")
        self.partitions = {p: image.copy() for p, image in sorted(images.items())}

    def wipe(self, partition: int | None = None) -> None:
        """A wiped disk (``partition``: only that partition's files): the node restarts with
        nothing for it, and its start creates it empty."""
        self._check_down("wipe")
        if partition is None:
            self.partitions.clear()
        else:
            self.partitions.pop(partition, None)

    def lose_tail(self, partition: int, count: int) -> int:
        """The node's next start-up recovery finds the last ``count`` records of
        ``partition`` lost to damage (LOST_SESSION); returns how many."""
        self._check_down("damage")
        return self.partitions[partition].lose_tail(count)

    def _check_down(self, what: str) -> None:
        if self.engine is not None and not self.engine.closed:
            raise StorageError(
                f"cannot {what} the disk {self.location} while its storage node runs: crash "
                "the node first"
            )

    def apply_damage(self) -> list[str]:
        """The start-up recovery finds the pending damage (in one partition)."""
        self.pending_damage = False
        candidates = [p for p, image in sorted(self.partitions.items()) if len(image.written) >= 4]
        if not candidates:
            return []
        partition = self.rng.choice(candidates)
        found = self.partitions[partition].damage(self.rng)
        return [] if found is None else [f"partition {partition}: {found}"]


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
        while disk.stall is not None and not disk.stall.is_set():
            await disk.stall.wait()
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

    def missing_ranges(self) -> list[tuple[int, int]]:
        return list(self._check().missing)

    async def repair(self, records: Sequence[Record]) -> None:
        image = self._check()
        if not image.missing:
            raise StorageAppendError(
                f"partition {self.partition_id} has no missing range to repair; nothing stored"
            )
        first, last = image.missing[0]
        ids = [r.transaction_id for r in records]
        if not records or ids != list(range(first, first + len(ids))) or ids[-1] > last:
            raise StorageAppendError(
                f"partition {self.partition_id}: repair records {ids[:1]}..{ids[-1:]} do not "
                f"fill the missing range {first}..{last} from its start; nothing stored"
            )
        for record in records:
            if crc32c.crc32c(record.data) != record.checksum:
                raise ChecksumError(
                    f"partition {self.partition_id}: transaction {record.transaction_id}: the "
                    "data does not match its CRC-32C checksum; nothing was stored"
                )
        image = await self._write()
        if image.missing[:1] != [(first, last)]:
            raise StorageAppendError(f"partition {self.partition_id}: the range changed")
        image.written[first : first + len(records)] = list(records)
        image.common = min(image.common, first)
        end = first + len(records) - 1
        image.missing = ([(end + 1, last)] if end < last else []) + image.missing[1:]
        await self._fsync()

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

    def _visible(self, start: int = 0, count: int | None = None) -> list[Record]:
        """The visible records; a read reaching a range lost to damage raises."""
        image = self._check()
        end = image.visible if count is None else min(image.visible, start + count)
        for first, last in image.missing:
            if first < end and last >= start:
                raise CorruptionError(
                    f"partition {self.partition_id}: transaction {max(first, start)} was lost "
                    f"to damage (missing range {first}..{last}); repair it from a peer"
                )
        return image.written[: image.visible]

    async def read_record(self, transaction_id: int) -> Record | None:
        await asyncio.sleep(0)
        records = self._visible(transaction_id, 1)
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
        records = self._visible(start, max(max_records, 0))
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
        records = self._visible(start, max(max_records, 0))
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
        if not isinstance(disk, SimDisk):
            raise StorageError(f"{location} is not a disk of the sim engine")
        if disk.pending_damage:
            for found in disk.apply_damage():
                world.trace.add("disk", f"{location}: start-up recovery: {found}")
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


__all__ = [
    "Disk",
    "DiskConfig",
    "PartitionImage",
    "SimDisk",
    "SimStorageEngine",
    "SimStoragePartition",
]
