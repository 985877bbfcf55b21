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

Damage (the ``storage`` faults, :mod:`waltz_sim.storage_faults`) is kept as the ``fs``
engine would meet it (:mod:`waltz_storage_fs.recovery`, :mod:`waltz_storage_fs.engine`):
records whose bytes are not what was written (:attr:`PartitionImage.corrupt`: a read
raises CorruptionError naming the record), ranges whose reads fail with EIO
(:attr:`PartitionImage.unreadable`: StorageError), and what a start-up recovery makes of
them (:meth:`PartitionImage.recover`): damaged records with intact ones after them
become a missing range (repaired from a peer), a damaged tail is cut and marks the
session info LOST_SESSION, zeros (a write that never reached the disk) have the shape of
a torn write and are cut, LOST_SESSION when the cut reaches below the acknowledged end the
engine keeps apart from the records (:attr:`PartitionImage.acked_end`), and an EIO leaves
the partition closed.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

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
from waltz_api.features import MAX_FEATURE_LEVEL
from waltz_api.types import NO_TRANSACTION, Record, RecordHeader, SessionInfo
from waltz_sim.damage import corruption_message
from waltz_sim.diskmodel import Disk, DiskConfig, DiskWorld, PartitionImage
from waltz_sim.loop import Incarnation, current_incarnation

log = logging.getLogger(__name__)

_INT32 = (-(2**31), 2**31 - 1)


class SimDisk(Disk):
    """The ``sim`` engine's disk: a model of each partition's log (see the module)."""

    def __init__(
        self, world: DiskWorld, location: str, cluster_key: uuid.UUID, num_partitions: int
    ):
        super().__init__(world, location)
        self.cluster_key = cluster_key
        self.num_partitions = num_partitions
        self.partitions: dict[int, PartitionImage] = {}
        self.engine: SimStorageEngine | None = None
        self.feature_level = MAX_FEATURE_LEVEL

    def lose_power(self) -> str | None:
        lost = self.power_loss()
        return f"{lost} unsynced records lost" if lost else None

    async def read_back(self) -> dict[int, list[Record]]:
        self.fences = {p: i.written_info.session_id for p, i in self.partitions.items()}
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
        return any(image.unrepaired for image in self.partitions.values()) or not self._reached()

    @property
    def lost_records(self) -> bool:
        """A storage fault damaged it and the cluster did not repair it yet."""
        return not self._reached()

    def _reached(self) -> bool:
        """Whether every damaged partition holds again what it held (see ``must_reach``)."""
        for partition, target in list(self.must_reach.items()):
            image = self.partitions.get(partition)
            if image is None or image.unrepaired or partition in self.needs_marks:
                return False
            others = [
                len(disk.partitions[partition].written)
                for disk in self.world.disks.values()
                if isinstance(disk, SimDisk) and disk is not self and partition in disk.partitions
            ]
            if len(image.intact()) < min(target, max(others, default=target)):
                return False
            del self.must_reach[partition]
        return True

    def damaged(self, partition: int) -> None:
        """A fault is about to damage ``partition``: it must reach its log end again."""
        image = self.partitions.get(partition)
        end = len(image.written) if image is not None else 0
        self.must_reach[partition] = max(self.must_reach.get(partition, 0), end)

    def marks_written(self, partition: int, before: SessionInfo, info: SessionInfo) -> None:
        """A ``set_session_info`` is durable (``before`` was the info it replaced): marks of
        the session that wrote them (a SetLowWaterMark, a clean mark) take the replica
        back."""
        if info.low_water_mark_session_id == info.session_id >= 0:
            self.needs_marks.discard(partition)
        if self.on_session_info is not None:
            self.on_session_info(partition, before, info)

    def start_up_recovery(self) -> list[str]:
        """What a restarted engine's recovery finds in each partition (see
        :meth:`PartitionImage.recover`)."""
        found: list[str] = []
        for partition, image in sorted(self.partitions.items()):
            end = len(image.written)
            found.extend(f"partition {partition}: {what}" for what in image.recover())
            if len(image.written) < end:
                self.needs_marks.add(partition)
        return found

    def backup(self, now: float, keep: int = 8) -> None:
        """Keep a :meth:`snapshot` of the disk, taken at ``now`` (for a stale restore)."""
        self.backups = [*self.backups[-(keep - 1) :], (now, self.snapshot())]

    def snapshot(self) -> dict[int, PartitionImage]:
        """A copy of every partition as it is on the disk now (see
        :meth:`PartitionImage.copy`)."""
        return {p: image.copy() for p, image in sorted(self.partitions.items())}

    def restore(self, images: Mapping[int, PartitionImage]) -> None:
        """Put back a :meth:`snapshot` (a backup restored while the node is down), as
        ``waltz storage restore`` does: every partition is what the snapshot holds, one it
        did not hold is gone, and every restored partition's marks read LOST_SESSION (what
        it acknowledged since the snapshot was taken may be gone: it rejoins as a suspect
        replica, never as a voter)."""
        self._check_down("restore a snapshot on")
        for partition in self.partitions:
            self._lost_end(partition)
        self.partitions = {p: image.copy() for p, image in sorted(images.items())}
        for image in self.partitions.values():
            image.mark_lost()

    def wipe(self, partition: int | None = None) -> None:
        """A wiped disk (``partition``: only that partition's files): the node restarts with
        nothing for it, and its start creates it empty."""
        self._check_down("wipe")
        for wiped in [partition] if partition is not None else list(self.partitions):
            self._lost_end(wiped)
            self.partitions.pop(wiped, None)

    def _lost_end(self, partition: int) -> None:
        """``partition`` loses its end (wiped, restored): impaired until the cluster
        caught it up and took it back (``must_reach``, ``needs_marks``)."""
        self.damaged(partition)
        self.needs_marks.add(partition)

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
        if self._image.closed is not None:
            raise PartitionClosedError(_closed_message(self.partition_id, self._image.closed))
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
        before, image.written_info = image.written_info, info
        await self._fsync()
        self.disk.marks_written(self.partition_id, before, info)

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

    def _read(self, start: int, count: int, max_bytes: int | None = None) -> list[Record]:
        """Records from ``start`` as the ``fs`` engine reads them: up to a missing range
        (a read starting in one raises CorruptionError naming it), at most ``count`` and
        ``max_bytes`` of data (one record at least); an EIO on any of them raises
        StorageError, a corrupt one CorruptionError naming it."""
        image = self._check()
        if start < 0 or count <= 0 or start >= image.visible:
            return []
        end = min(image.visible, start + count)
        for first, last in image.missing:
            if first <= start <= last:
                raise CorruptionError(
                    f"partition {self.partition_id}: transaction {start} was lost to damage "
                    f"(missing range {first}..{last}); repair it from a peer"
                )
            if start < first < end:
                end = first  # a hole: the records before it are the answer
        out: list[Record] = []
        size = 0
        for record in image.written[start:end]:
            if max_bytes is not None and out and size + len(record.data) > max_bytes:
                break
            size += len(record.data)
            out.append(record)
        stop = start + len(out)
        for first, last in image.unreadable:
            if first < stop and last >= start:
                raise StorageError(
                    f"partition {self.partition_id}: reading transactions "
                    f"{max(first, start)}..{min(last, stop - 1)} failed: [Errno 5] "
                    "Input/output error"
                )
        bad = [i for i in image.corrupt if start <= i < stop]
        if bad:
            first_bad = min(bad)
            raise CorruptionError(
                corruption_message(self.partition_id, first_bad, image.corrupt[first_bad])
            )
        return out

    async def read_record(self, transaction_id: int) -> Record | None:
        await asyncio.sleep(0)
        records = self._read(transaction_id, 1)
        return records[0] if records else None

    async def read_header(self, transaction_id: int) -> RecordHeader | None:
        record = await self.read_record(transaction_id)
        return record.record_header if record is not None else None

    async def read_records(
        self, start: int, max_records: int, max_bytes: int = 16 * 1024 * 1024
    ) -> list[Record]:
        await asyncio.sleep(0)
        return self._read(start, max_records, max_bytes)

    async def read_headers(self, start: int, max_records: int) -> list[RecordHeader]:
        await asyncio.sleep(0)
        return [r.record_header for r in self._read(start, max_records)]


def _closed_message(partition_id: int, why: str) -> str:
    return (
        f"partition {partition_id} could not be recovered and stays closed: {why}; restart "
        "the storage node once the disk reads again"
    )


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
        feature_level: int | None = None,
    ) -> SimStorageEngine:
        if options:
            raise StorageError(
                f"the sim storage engine takes no options, got {', '.join(sorted(options))}"
            )
        incarnation = current_incarnation()
        world: DiskWorld = incarnation.process.world
        disk = world.disks.get(location)
        if disk is None:
            if cluster_key is None or num_partitions is None:
                raise StorageError(
                    f"{location} is not a Waltz storage yet: creating one needs the cluster "
                    "key and the number of partitions"
                )
            disk = world.disks[location] = SimDisk(world, location, cluster_key, num_partitions)
            disk.feature_level = feature_level or disk.feature_level
        if not isinstance(disk, SimDisk):
            raise StorageError(f"{location} is not a disk of the sim engine")
        if disk.pending_damage:
            for found in disk.apply_damage():
                world.trace.add("disk", f"{location}: start-up recovery: {found}")
        for found in disk.start_up_recovery():
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
    def feature_level(self) -> int:
        return self.disk.feature_level

    async def raise_feature_level(self, level: int) -> None:
        self._check_feature_level(level)
        self.disk.feature_level = max(self.disk.feature_level, level)

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
        if image.closed is not None:
            raise PartitionClosedError(_closed_message(partition_id, image.closed))
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
