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

import abc
import asyncio
import dataclasses
import logging
import random
import uuid
from collections.abc import Callable, Mapping, Sequence
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
from waltz_api.features import MAX_FEATURE_LEVEL
from waltz_api.types import LOST_SESSION, NO_TRANSACTION, Record, RecordHeader, SessionInfo
from waltz_sim.damage import INDEX_CHECKPOINT, ZEROS, corruption_message, merged
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
    corrupt: dict[int, str] = field(default_factory=dict)
    """Records whose stored bytes are not what was written (``ZEROS``, ``CHECKSUM``,
    ``STALE``, ``holds <id>``), not yet found by a start-up recovery: a read of one
    raises CorruptionError naming it."""
    unreadable: list[tuple[int, int]] = field(default_factory=list)
    """Ranges whose reads fail with EIO (a latent sector error), while the fault lasts."""
    closed: str | None = None
    """Why the last start-up recovery left the partition closed (a read failed)."""
    acked_end: int = 0
    """The acknowledged end, kept apart from the records (the ``fs`` engine keeps it in
    its control file): the log end the last completed flush made durable, lowered by a
    truncation before it is done. A lost write of the records leaves it as it was, so a
    start-up recovery that finds the log ending below it knows the records there were
    acknowledged, not a torn unsynced write (:meth:`recover`)."""

    def sync(self) -> None:
        """An fdatasync completed: the durable state is the written one (the records, then
        the acknowledged end: :attr:`acked_end`)."""
        del self.durable[self.common :]
        self.durable.extend(self.written[self.common :])
        self.common = len(self.written)
        self.durable_info = self.written_info
        self.acked_end = len(self.written)

    def truncate_written(self, transaction_id: int) -> None:
        del self.written[transaction_id + 1 :]
        self.common = min(self.common, len(self.written))
        self.acked_end = min(self.acked_end, len(self.written))
        self._clip(len(self.written))

    def _clip(self, end: int) -> None:
        """Forget the damage of records at or above ``end`` (cut from the log)."""
        self.missing = [(a, min(b, end - 1)) for a, b in self.missing if a < end]
        self.unreadable = [(a, min(b, end - 1)) for a, b in self.unreadable if a < end]
        self.corrupt = {i: how for i, how in self.corrupt.items() if i < end}

    def cut(self, end: int) -> None:
        """Start-up recovery cut the log at ``end`` (flushed: durable too)."""
        del self.written[end:]
        del self.durable[end:]
        self.common = min(self.common, len(self.written))
        self.visible = min(self.visible, len(self.written))
        self._clip(len(self.written))

    def mark_lost(self) -> None:
        info = dataclasses.replace(self.written_info, low_water_mark_session_id=LOST_SESSION)
        self.written_info = self.durable_info = info

    def recover(self) -> list[str]:
        """The start-up recovery of the ``fs`` engine over this damage (after a restart);
        returns what it found. It reads the records after the index's last checkpoint
        (:data:`INDEX_CHECKPOINT`); in them, a run of damaged records:

        - with zeros: the shape of a torn write: the log is cut there (the records after
          it too: recovery cannot tell them from a torn write's pages), silently only
          above the acknowledged end (:attr:`acked_end`; below it, LOST_SESSION);
        - at the end of the log: a damaged tail: cut, and the session info says
          LOST_SESSION (the records may have been acknowledged);
        - with intact records after it: moved aside, a missing range until repaired.

        An EIO while reading leaves the partition closed until a later start."""
        self.closed = None
        self.visible = len(self.written)
        end = len(self.written)
        scan_from = (end // INDEX_CHECKPOINT) * INDEX_CHECKPOINT
        while scan_from and scan_from - 1 in self.corrupt:  # the checkpoint's record is bad
            scan_from -= INDEX_CHECKPOINT
        for first, last in self.unreadable:
            if first < end and last >= max(scan_from - 1, 0):
                self.closed = (
                    f"reading transactions {first}..{last} at start-up failed: [Errno 5] "
                    "Input/output error"
                )
                return [f"could not be recovered and stays closed: {self.closed}"]
        damaged = sorted(i for i in self.corrupt if scan_from <= i < end)
        runs: list[tuple[int, int]] = []
        for i in damaged:
            if runs and runs[-1][1] == i - 1:
                runs[-1] = (runs[-1][0], i)
            else:
                runs.append((i, i))
        found: list[str] = []
        for first, last in runs:
            zeros = any(self.corrupt[i] == ZEROS for i in range(first, last + 1))
            if zeros or last == len(self.written) - 1:
                cut = len(self.written) - first
                self.cut(first)
                if zeros:
                    found.append(
                        f"zeros at transaction {first}: the shape of a torn write; the log is "
                        f"cut there ({cut} records)"
                    )
                else:
                    self.mark_lost()
                    found.append(f"a damaged tail, transactions {first}..{last}: cut, LOST_SESSION")
                break
            self.missing = merged([*self.missing, (first, last)])
            found.append(f"transactions {first}..{last} damaged: missing until repaired")
        for i in damaged:
            self.corrupt.pop(i, None)
        if len(self.written) < self.acked_end:
            if self.written_info.low_water_mark_session_id != LOST_SESSION:
                self.mark_lost()
                found.append(
                    f"the log ends at {len(self.written)}, below its acknowledged end "
                    f"{self.acked_end}: acknowledged records lost, LOST_SESSION"
                )
            self.acked_end = len(self.written)
        return found

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
        self.acked_end = len(self.written)
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
            corrupt=dict(self.corrupt),
            acked_end=len(self.written),
        )

    @property
    def unrepaired(self) -> bool:
        return (
            bool(self.missing or self.corrupt or self.unreadable)
            or self.closed is not None
            or self.written_info.low_water_mark_session_id == LOST_SESSION
        )

    def intact(self) -> list[Record]:
        """What a reader gets: the records up to the first missing or corrupt one."""
        end = min([len(self.written), *(first for first, _ in self.missing), *self.corrupt])
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
        self._clip(len(self.written))
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
        self.must_reach: dict[int, int] = {}
        """Per partition, the log end this disk held when a storage fault damaged it: it
        counts as impaired (the nemesis' rule) until it holds that much again, intact (or
        as much as the longest other replica, when the cluster cut its tail)."""
        self.needs_marks: set[int] = set()
        """Damaged partitions whose log lost its end (cut, wiped, restored): they count as
        impaired until a store session also wrote their marks again (SetLowWaterMark), as
        the cluster took them back as clean replicas."""
        self.fences: dict[int, int] = {}
        """Each partition's fence (the session id of its session info), as the last
        :meth:`read_back` found it."""
        self.backups: list[tuple[float, dict[int, PartitionImage]]] = []
        """Crash-consistent snapshots of the disk (its durable state), oldest first."""
        self.on_session_info: Callable[[int, SessionInfo, SessionInfo], None] | None = None
        """A fault's trigger: called with the partition, its session info before and the
        new one once a ``set_session_info`` is durable."""
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
        world = incarnation.process.world
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
