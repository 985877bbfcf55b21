"""The real ``fs`` engine in the simulation: its files on a simulated disk.

``waltz simulate --storage-engine fs`` runs the storage nodes on
:class:`SimFsEngine` (plugin ``sim-fs``): the real
:class:`~waltz_storage_fs.engine.FsStorageEngine`, opened with two seams of its own:

- its *file layer* is the node's :class:`SimFiles`, an in-memory file system
  (:class:`~waltz_storage_fs.powerloss.PowerLossFiles`) that belongs to the world and
  outlives the node's incarnations (one per data directory, in :class:`FsDisk`). It
  knows what each file holds as written (the page cache) and as durable (what a
  completed ``fdatasync``/``fsync`` covered), and each directory its entries as made
  and as flushed. A kill -9 keeps everything written; a power loss keeps a crash
  state drawn by the seed: the durable one (half the time), or the durable state
  plus the unflushed writes with the last one torn at a sector boundary, or file
  contents and directory entries out of step (the states the power-loss harness
  checks at every step);
- its *runner* is a :class:`~waltz_storage_fs.committer.LoopRunner`: the committer
  runs on the loop; a round's flushes take a drawn fsync latency (plus the slow-fsync
  faults in force, held while a script stalls the disk) between being requested and
  completing, and only their completion makes the writes durable: a crash in between
  loses them. Reads take a drawn write latency.

The disk model's faults have their counterparts: slow fsyncs (the latency), failing
fsyncs (the next flush raises EIO, and half the time the page cache drops that file's
unflushed writes: the engine closes the partition until the node restarts), damage
found at start-up (the data of one or a few records flipped on the medium: the engine's
recovery, which checks every record at open here, turns it into a missing range below
intact records, repaired from a peer, or a lost tail it reports as ``LOST_SESSION``).

Every segment rolls often (a small ``segment_size`` drawn per node) and the index is
checkpointed every few records, so segment creation, truncation across segments and
index recovery run in every seed. The node journal (feature level 3) is small, and on
one node in four (drawn) smaller than the larger appends, which then take the direct
write to their segments (:meth:`~waltz_storage_fs.pipeline.Pipeline.write_alone`).
What does not go through the seams is listed in docs/simulation.md.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from waltz_api.errors import WaltzError
from waltz_api.types import LOST_SESSION, Record
from waltz_sim.disk import Disk
from waltz_sim.diskmodel import DiskWorld
from waltz_sim.loop import Incarnation, current_incarnation
from waltz_storage_fs import format as fmt
from waltz_storage_fs.committer import LoopRunner
from waltz_storage_fs.engine import FsStorageEngine
from waltz_storage_fs.files import OPEN_READ
from waltz_storage_fs.plugin import CAPABILITIES as FS_CAPABILITIES
from waltz_storage_fs.powerloss import STATES, PowerLossFiles

log = logging.getLogger(__name__)

EPOCH_MS = 1_700_000_000_000
"""The wall clock the simulated file system shows at virtual time 0 (headers' times)."""
SEGMENT_SIZES = (1500, 4000, 12000)
"""Drawn per storage node: a segment holds a few to a few dozen records."""
CHECKPOINT_INTERVALS = (2, 5, 16)
"""Drawn per storage node: records between flushes of the index."""
JOURNAL_SIZE = 256 * 1024
"""The node journal of most storage nodes (at feature level 3): it wraps and checkpoints
often, and holds any append the workloads make."""
SMALL_JOURNAL_SHARE = 0.25
SMALL_JOURNAL_SIZES = (4096, 6144, 8192)
"""The node journal of the others (a share drawn per node): an append larger than half
of it (a few in every seed) is written straight to its segments between two checkpoints
(``storage.journal_direct_written``), and the ring wraps every few rounds."""


class _Clocked(PowerLossFiles):
    """The simulated file system's wall clock is the loop's (the time in the headers and
    the quarantine's names)."""

    def __init__(self, disk: FsDisk) -> None:
        super().__init__(Path(disk.location))
        self.disk = disk

    def now_ms(self) -> int:
        return EPOCH_MS + round(self.disk.world.loop.time() * 1000)


class SimFiles(_Clocked):
    """A storage node's file system (see the module): its faults, and only its live
    incarnation may change it."""

    def __init__(self, disk: FsDisk) -> None:
        super().__init__(disk)
        self.owner: Incarnation | None = None
        """The incarnation whose engine uses the files (a dead one's calls fail)."""

    def _check(self) -> None:
        owner = self.owner
        if owner is not None and not owner.alive:
            raise OSError(errno.EIO, f"{owner.name} is dead: its writes go nowhere")

    def _flush(self, fd: int | None) -> None:
        """A flush (of a file; None: of a directory) completes now, or fails (a fault)."""
        disk = self.disk
        disk.fsyncs += 1
        if disk.failing_fsyncs > 0:
            disk.failing_fsyncs -= 1
            disk.fsync_errors += 1
            if fd is not None and disk.rng.random() < 0.5:
                # Linux may drop the dirty pages after a writeback error
                self.drop_unflushed(fd)
            raise OSError(errno.EIO, "fsync failed (a simulated disk error)")

    # -- every call that changes something: the live incarnation's only --------------------

    def open(self, path: Path, flags: int, mode: int = 0o644) -> int:
        self._check()
        return super().open(path, flags, mode)

    def pwrite(self, fd: int, data: bytes, offset: int) -> int:
        self._check()
        return super().pwrite(fd, data, offset)

    def ftruncate(self, fd: int, size: int) -> None:
        self._check()
        super().ftruncate(fd, size)

    def fdatasync(self, fd: int) -> None:
        self._check()
        self._flush(fd)
        super().fdatasync(fd)

    def fsync(self, fd: int) -> None:
        self._check()
        self._flush(fd)
        super().fsync(fd)

    def fsync_dir(self, path: Path) -> None:
        self._check()
        self._flush(None)
        super().fsync_dir(path)

    def mkdir(self, path: Path) -> None:
        self._check()
        super().mkdir(path)

    def rmdir(self, path: Path) -> None:
        self._check()
        super().rmdir(path)

    def unlink(self, path: Path) -> None:
        self._check()
        super().unlink(path)

    def replace(self, src: Path, dst: Path) -> None:
        self._check()
        super().replace(src, dst)

    def link(self, src: Path, dst: Path) -> None:
        self._check()
        super().link(src, dst)


class FsWorld(DiskWorld, Protocol):
    """What the fs engine's disk needs of its world: a disk's, and random streams."""

    def rng(self, name: str) -> random.Random: ...


class FsDisk(Disk):
    """The disk of a storage node that runs the ``fs`` engine (see the module)."""

    def __init__(self, world: FsWorld, location: str) -> None:
        super().__init__(world, location)
        self.files = SimFiles(self)
        rng = world.rng(f"fs-options:{location}")
        # the journal's size from a stream of its own: the other options' draws stay
        journal_rng = world.rng(f"fs-journal:{location}")
        small = journal_rng.random() < SMALL_JOURNAL_SHARE
        self.options: dict[str, int] = {
            "segment_size": rng.choice(SEGMENT_SIZES),
            "index_checkpoint_interval": rng.choice(CHECKPOINT_INTERVALS),
            "verify_on_open": 1,
            # at feature level 3: a small journal on the in-memory disk, which wraps and
            # checkpoints often; on some nodes one smaller than the larger appends
            "journal_size": journal_rng.choice(SMALL_JOURNAL_SIZES) if small else JOURNAL_SIZE,
            "checkpoint_bytes": 16 * 1024,
        }
        self.engine: SimFsEngine | None = None

    # -- faults ---------------------------------------------------------------------------

    def lose_power(self) -> str | None:
        state = "durable" if self.rng.random() < 0.5 else self.rng.choice(STATES)
        pending = self.files.lose_power(state)
        if not pending:
            return None
        return f"power loss: the files keep their {state} state ({pending} unflushed writes)"

    async def read_delay(self) -> None:
        """The time a read takes."""
        await asyncio.sleep(self.write_delay())

    def apply_damage(self) -> list[str]:
        """Damage the records of one partition on the medium, for the next start-up
        recovery to find: a few records below intact ones, or the last few."""
        records = {p: self._records(p) for p in self._partitions()}
        candidates = [p for p, found in records.items() if len(found) >= 4]
        if not candidates:
            return []
        partition = self.rng.choice(candidates)
        found = records[partition]
        if self.rng.random() < 0.5:
            first = self.rng.randrange(0, len(found) - 2)
            last = min(first + self.rng.randint(0, 4), len(found) - 3)
            what = f"transactions {found[first][0]}..{found[last][0]} damaged (intact ones after)"
        else:
            first, last = len(found) - self.rng.randint(1, min(5, len(found) - 1)), len(found) - 1
            what = f"its last {last - first + 1} transactions damaged"
        for _, path, data_at in found[first : last + 1]:
            self.files.corrupt(path, data_at)
        return [f"partition {partition}: {what}"]

    def _partitions(self) -> list[int]:
        files = self.files
        root = files.base
        return sorted(
            int(name)
            for name in files.listdir(root)
            if name.isdigit() and files.is_dir(root / name)
        )

    def _records(self, partition: int) -> list[tuple[int, Path, int]]:
        """(id, data file, offset of its data) of every record of the partition's files
        that reads back, in order (each segment up to its first bad record)."""
        files = self.files
        directory = files.base / str(partition)
        out: list[tuple[int, Path, int]] = []
        for name in files.listdir(directory):
            parsed = fmt.parse_segment_file_name(name)
            if parsed is None or parsed[1] != fmt.SEGMENT_SUFFIX:
                continue
            path = directory / name
            fd = files.open(path, OPEN_READ)
            try:
                size = files.size(fd)
                result = fmt.ScanResult(fmt.HEADER_SIZE)
                offsets = fmt.scan_offsets(
                    fd, fmt.HEADER_SIZE, size, parsed[0], result, pread=files.pread
                )
                for i, offset in enumerate(offsets):
                    head = files.pread(fd, fmt.RECORD_HEAD.size, offset)
                    if fmt.RECORD_HEAD.unpack(head)[6] > 0:  # the data's length
                        out.append((parsed[0] + i, path, offset + fmt.RECORD_HEAD.size))
            finally:
                files.close(fd)
        return out

    # -- the end ------------------------------------------------------------------------------

    @property
    def unrepaired(self) -> bool:
        engine = self.engine
        if engine is None:
            return False
        for partition_id in engine.partition_ids():
            try:
                part = engine.partition(partition_id)
                if part.missing_ranges() or (
                    part.session_info().low_water_mark_session_id == LOST_SESSION
                ):
                    return True
            except WaltzError:
                continue
        return False

    async def read_back(self) -> dict[int, list[Record]]:
        """Open a copy of the files as they are now (what was written: a restart after a
        crash) with the real engine, and read every partition from its log start (what
        it deleted is archived) up to its first hole."""
        copy = _Clocked(self)
        copy.preload(self.files.snapshot("read back").state("volatile"))
        if not copy.exists(copy.base / fmt.CONTROL_FILE_NAME):
            return {}
        engine = await FsStorageEngine.open(
            self.location, options=self.options, files=copy, runner=LoopRunner()
        )
        contents: dict[int, list[Record]] = {}
        try:
            for partition_id in engine.partition_ids():
                records: list[Record] = []
                contents[partition_id] = records
                try:
                    part = engine.partition(partition_id)
                    self.fences[partition_id] = part.session_info().session_id
                    end = part.max_transaction_id()
                    start = part.log_start()  # below it: deleted, in the archive
                except WaltzError:
                    continue  # a partition recovery closed: nothing readable
                size = 1000
                while start + len(records) <= end:
                    try:
                        batch = await part.read_records(start + len(records), size)
                    except WaltzError:  # a hole or a damaged record: read up to it
                        if size == 1:
                            break
                        size = 1
                        continue
                    if not batch:
                        break
                    records.extend(batch)
        finally:
            await engine.close()
        return contents


class SimFsEngine(FsStorageEngine):
    """The real fs engine on a storage node's :class:`FsDisk` (plugin ``sim-fs``)."""

    @classmethod
    async def open(
        cls,
        location: str,
        *,
        cluster_key: uuid.UUID | None = None,
        num_partitions: int | None = None,
        options: Mapping[str, Any] | None = None,
        feature_level: int | None = None,
        files: Any = None,
        runner: Any = None,
    ) -> FsStorageEngine:
        incarnation = current_incarnation()
        world: FsWorld = incarnation.process.world
        disk = world.disks.get(location)
        if disk is None:
            disk = world.disks[location] = FsDisk(world, location)
        assert isinstance(disk, FsDisk), f"{location} is not a disk of the fs engine"
        disk.files.owner = incarnation
        if disk.pending_damage:
            for found in disk.apply_damage():
                world.trace.add("disk", f"{location}: damaged: {found}")
        engine = await super().open(
            location,
            cluster_key=cluster_key,
            num_partitions=num_partitions,
            options={**disk.options, **(options or {})},
            feature_level=feature_level,
            files=disk.files,
            runner=LoopRunner(flush_wait=disk.flush_wait, read_wait=disk.read_delay),
        )
        assert isinstance(engine, SimFsEngine)
        disk.pending_damage = False
        disk.engine = engine
        incarnation.resources.append(_Life(disk, engine))
        return engine


class _Life:
    """What a storage node's crash, pause and resume mean for its engine: nothing but
    that it is gone (its committer task is cancelled with the process's other tasks;
    the files keep what it wrote)."""

    def __init__(self, disk: FsDisk, engine: SimFsEngine) -> None:
        self.disk = disk
        self.engine = engine

    def on_crash(self, power_loss: bool) -> None:
        if self.disk.engine is self.engine:
            self.disk.engine = None

    def on_pause(self) -> None:
        """The kernel goes on: nothing to do."""

    def on_resume(self) -> None:
        """Nothing to do."""


__all__ = ["FS_CAPABILITIES", "FsDisk", "SimFiles", "SimFsEngine"]
