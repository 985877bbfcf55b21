"""The file-segment storage engine (plugin ``fs``): the engine (a storage directory, its
control file, the partitions it hosts); a partition is
:class:`~waltz_storage_fs.partition.FsStoragePartition` (its read path
:mod:`waltz_storage_fs.reads`), the options :mod:`waltz_storage_fs.options`.

Threads: one *committer* owns every write (:mod:`waltz_storage_fs.committer`).
Appends of all partitions queue to it; it writes every queued batch as one group (one
``pwrite`` per batch for the data, one for the index entries), then issues one
``fdatasync`` per touched data file; once they completed, it writes each touched
partition's new acknowledged end into the control file and flushes it (so that
recovery can tell an acknowledged tail lost from a torn write:
:mod:`waltz_storage_fs.format`), while the next group's data is flushed, and only
then resolves the appends' futures. While a group is on the disk the next appends
queue up, so concurrent appends coalesce (group commit). Reads run in a
small pool of engine-owned threads with ``pread`` through the index; nothing keeps a
segment, or an index, in memory. A scrub (:mod:`waltz_storage_fs.scrub`) reads in
that pool too, and there writes the new segment file of a split that nobody reads
yet; the committer then makes it part of the log. Where the committer and the reads
run is the engine's *runner*: threads (the default), or the event loop
(:class:`~waltz_storage_fs.committer.LoopRunner`, for the simulation).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from waltz_api.contracts.storage import StorageEngine
from waltz_api.errors import (
    CorruptionError,
    PartitionClosedError,
    PartitionNotFoundError,
    StorageError,
)
from waltz_storage_fs import format as fmt
from waltz_storage_fs import journaled
from waltz_storage_fs.committer import Committer, Job, Runner, ThreadRunner
from waltz_storage_fs.control import ControlFile
from waltz_storage_fs.files import REAL_FILES, Files, make_dirs, remove_tree
from waltz_storage_fs.journal import JOURNAL_FILE_NAME, Journal
from waltz_storage_fs.options import FsOptions
from waltz_storage_fs.partition import FsStoragePartition
from waltz_storage_fs.quarantine import Quarantine

__all__ = ["FsOptions", "FsStorageEngine", "FsStoragePartition"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class FsStorageEngine(StorageEngine):
    """A storage directory on a local file system (spec: On Disk Data Structures)."""

    def __init__(
        self,
        directory: Path,
        control: ControlFile,
        options: FsOptions,
        loop: asyncio.AbstractEventLoop,
        runner: Runner,
        *,
        files: Files = REAL_FILES,
    ) -> None:
        self.directory = directory
        self.control = control
        self.options = options
        self.files = files
        """The file layer (the real one unless a test injects another)."""
        self._loop = loop
        self._partitions: dict[int, FsStoragePartition] = {}
        self._closed_partitions: dict[int, str] = {}
        self._runner = runner
        self._committer = runner.start_committer(self)
        self._closed = False
        self.journal: Journal | None = None
        """The node journal (format 4): a round's one flush (:mod:`waltz_storage_fs.journaled`)."""
        self.journal_failed: OSError | None = None
        """A checkpoint failed: nothing more is written until the node restarts."""
        self.fsync_observer: Callable[[float], None] | None = None
        """Called (on the committer thread) with the seconds of each flush to disk
        alone: a group's data files (one ``fdatasync`` each, at once), or the control
        file (the acknowledged ends); the storage node's metrics set it."""

    @classmethod
    async def open(
        cls,
        location: str,
        *,
        cluster_key: uuid.UUID | None = None,
        num_partitions: int | None = None,
        options: Mapping[str, Any] | None = None,
        feature_level: int | None = None,
        files: Files = REAL_FILES,
        runner: Runner | None = None,
    ) -> FsStorageEngine:
        """See :meth:`StorageEngine.open`; ``files`` is the file layer (tests inject
        :class:`~waltz_storage_fs.powerloss.PowerLossFiles`), ``runner`` where the
        committer and the reads run (default: threads; one runner per open). A new
        directory is created in the format of ``feature_level`` (format 3 at level 2, 2
        at level 1); an existing one keeps its format (a version-1 one becomes 2)."""
        opts = FsOptions.from_mapping(options)
        level = cls.max_feature_level if feature_level is None else feature_level
        if level not in fmt.FORMAT_OF_LEVEL:
            raise StorageError(
                f"the fs engine writes at feature levels "
                f"{', '.join(map(str, fmt.FORMAT_OF_LEVEL))}, not {level!r}: upgrade the "
                "storage node"
            )
        version = fmt.FORMAT_OF_LEVEL[level]
        directory = Path(location)
        loop = asyncio.get_running_loop()
        if runner is None:
            runner = ThreadRunner(opts.read_threads)
        try:
            control = await runner.run(
                lambda: _open_control(
                    files, directory, cluster_key, num_partitions, version, options=opts
                )
            )
        except BaseException:
            await runner.close()
            raise
        engine = cls(directory, control, opts, loop, runner, files=files)
        if not control.keeps_acked_end:
            log.warning(
                "%s: %s", directory, fmt.LOST_TAIL_UNCHECKED.format(version=control.version)
            )
        try:
            engine.check_given(cluster_key, num_partitions)
            # the journal first: a damaged one refuses the open before anything is cut
            scan = await runner.run(lambda: journaled.open_journal(engine))
            await runner.run(engine._recover_all)
            if scan is not None:
                await runner.run(lambda: journaled.replay(engine, scan))
        except BaseException:
            await engine.close()
            raise
        return engine

    def check_given(self, cluster_key: uuid.UUID | None, num_partitions: int | None) -> None:
        self.check_cluster_key(
            cluster_key if cluster_key is not None else self.cluster_key,
            num_partitions if num_partitions is not None else self.num_partitions,
        )

    def _recover_all(self) -> None:
        for pid in range(self.num_partitions):
            first, second = self.control.read_partition(pid)
            current = fmt.current_struct(first, second)
            directory = self.directory / str(pid)
            if current is None:
                reason = (
                    f"partition {pid}: both partition info structs in {self.control.path} fail "
                    "their checksum, so its session info is unknown; the partition stays closed. "
                    "Remove the partition (remove_partition / `waltz storage` admin) and add it "
                    "again so that recovery copies it from the other replicas"
                )
                log.error(reason)
                self._closed_partitions[pid] = reason
                continue
            slot, struct = current
            if not struct.assigned:
                if self.files.exists(directory):
                    if self.files.listdir(directory):
                        self._move_directory_aside(pid, "an interrupted removal")
                    else:  # an interrupted add_partition: nothing in it
                        self.files.rmdir(directory)
                        self.files.fsync_dir(self.directory)
                continue
            if first is None or second is None:
                log.warning(
                    "partition %d: one partition info struct is torn; using the other (session %d)",
                    pid,
                    struct.session_info.session_id,
                )
            part = FsStoragePartition(self, pid, slot, struct)
            try:
                part.recover()
            except (CorruptionError, OSError) as exc:
                part.close_files()
                reason = f"partition {pid} could not be recovered and stays closed: {exc}"
                log.error(reason)
                self._closed_partitions[pid] = reason
                continue
            self._partitions[pid] = part

    def hosted(self) -> dict[int, FsStoragePartition]:
        """The partitions open here (recovered or added)."""
        return self._partitions

    def close_partitions(self, error: OSError) -> None:
        """After an I/O error of the journal: every partition is closed (each shares it)."""
        for part in self._partitions.values():
            if part.broken is None:
                part.mark_broken(error)

    def checkpoint_due(self, size: int) -> bool:
        """Whether the committer makes a journal checkpoint before a round of about
        ``size`` bytes."""
        return journaled.checkpoint_due(self, size)

    def checkpoint(self) -> None:
        """A journal checkpoint (committer side; :mod:`waltz_storage_fs.journaled`)."""
        journaled.checkpoint(self)

    def _move_directory_aside(self, partition_id: int, cause: str) -> None:
        """A directory of a partition not hosted here: its files go to the quarantine."""
        directory = self.directory / str(partition_id)
        quarantine = Quarantine(self.files, self.directory, partition_id)
        why = (
            f"the control file says partition {partition_id} is not hosted here, but its "
            f"directory {directory} exists ({cause}?)"
        )
        folder = quarantine.folder("not-hosted", f"{directory} moved here whole: {why}")
        self.files.replace(directory, folder / directory.name)
        self.files.fsync_dir(folder)
        self.files.fsync_dir(self.directory)
        log.warning("partition %d: moved %s to %s: %s", partition_id, directory, folder, why)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def quarantined(self) -> dict[int, list[Path]]:
        """Per partition, the quarantine folders its recovery made at this open."""
        return {pid: list(p.quarantined) for pid, p in self._partitions.items() if p.quarantined}

    # -- threads ---------------------------------------------------------------------------

    def committer(self) -> Committer:
        if self._closed:
            raise StorageError("the storage engine is closed")
        return self._committer

    async def run_committed(self, action: Callable[[], None]) -> None:
        """Run ``action`` in the committer thread, after every append queued before it."""
        future: asyncio.Future[None] = self._loop.create_future()
        self.committer().submit(Job(future, action=action))
        await asyncio.shield(future)

    async def run_read(self, fn: Callable[[], _T]) -> _T:
        if self._closed:
            raise StorageError("the storage engine is closed")
        return await self._runner.run(fn)

    # -- the contract --------------------------------------------------------------------

    @property
    def cluster_key(self) -> uuid.UUID:
        return self.control.header.cluster_key

    @property
    def num_partitions(self) -> int:
        return self.control.header.num_partitions

    max_feature_level = max(fmt.FORMAT_OF_LEVEL)

    @property
    def feature_level(self) -> int:
        """The level of the control file's format (kept in the file itself)."""
        return fmt.level_of_format(self.control.version)

    async def raise_feature_level(self, level: int) -> None:
        """Migrate the control file to the format of ``level`` (format 2 to 3: each
        partition's acknowledged end is the end of the log it holds then), in the
        committer, between two groups of appends (they wait for it)."""
        self._check_feature_level(level)
        version = fmt.FORMAT_OF_LEVEL[level]
        if self.control.version >= version:
            return

        def upgrade() -> None:
            if self.control.version >= version:
                return
            before = self.control.version
            live = [p for p in self._partitions.values() if p.broken is None]
            journal = None
            try:
                for part in live:
                    part.sync_last_segment()
                if version >= fmt.JOURNAL_CONTROL_VERSION:
                    journal = journaled.create_journal(self)  # before the file naming it
                self.control = self.control.upgrade(version)
            except OSError as exc:  # the old file is whole: nothing changed
                if journal is not None:
                    journal.close()
                raise StorageError(
                    f"{self.directory}: the control file could not be migrated to format "
                    f"{version} ({exc}); it stays format {before}: fix the disk and try again"
                ) from exc
            try:
                for part in live:
                    part.adopt_control()
                self.control.sync()
                self.journal = journal
            except OSError as exc:  # as for a failed control flush: recovery checks them
                for part in live:
                    part.mark_broken(exc)
                raise StorageError(
                    f"{self.directory}: the acknowledged ends could not be written after the "
                    f"migration to format {version} ({exc}); the partitions are closed until "
                    "the node restarts"
                ) from exc
            log.info(
                "%s: feature level %d: the control file is now format %d (was %d); each "
                "partition's acknowledged end is kept from now on",
                self.directory,
                level,
                version,
                before,
            )

        await self.run_committed(upgrade)

    def partition_ids(self) -> list[int]:
        return sorted({*self._partitions, *self._closed_partitions})

    def partition(self, partition_id: int) -> FsStoragePartition:
        part = self._partitions.get(partition_id)
        if part is not None:
            return part
        if partition_id in self._closed_partitions:
            raise PartitionClosedError(self._closed_partitions[partition_id])
        raise PartitionNotFoundError(
            f"partition {partition_id} is not hosted by the storage at {self.directory}; "
            f"hosted: {self.partition_ids() or 'none'} (add it first)"
        )

    def closed_partitions(self) -> dict[int, str]:
        """Partitions that could not be recovered, with the reason."""
        return dict(self._closed_partitions)

    def _check_partition_id(self, partition_id: int) -> None:
        if not 0 <= partition_id < self.num_partitions:
            raise PartitionNotFoundError(
                f"partition {partition_id} does not exist: the cluster has partitions "
                f"0..{self.num_partitions - 1}"
            )

    async def add_partition(self, partition_id: int) -> FsStoragePartition:
        self._check_partition_id(partition_id)
        if partition_id in self._partitions:
            return self._partitions[partition_id]
        if partition_id in self._closed_partitions:
            raise PartitionClosedError(
                self._closed_partitions[partition_id] + " (remove it before adding it again)"
            )
        holder: list[FsStoragePartition] = []

        def add() -> None:
            directory = self.directory / str(partition_id)
            if self.files.exists(directory):
                self._move_directory_aside(partition_id, "left by an earlier host")
            self.files.mkdir(directory)
            self.files.fsync_dir(self.directory)
            slot, struct = self.control.reset_partition(partition_id, assigned=True)
            part = FsStoragePartition(self, partition_id, slot, struct)
            part.publish()
            holder.append(part)

        await self.run_committed(add)
        self._partitions[partition_id] = holder[0]
        return holder[0]

    async def remove_partition(self, partition_id: int) -> None:
        self._check_partition_id(partition_id)
        part = self._partitions.pop(partition_id, None)
        self._closed_partitions.pop(partition_id, None)

        def remove() -> None:
            if part is not None:
                part.close_files()
            self.control.reset_partition(partition_id, assigned=False)
            directory = self.directory / str(partition_id)
            if self.files.exists(directory):
                remove_tree(self.files, directory)  # the administrator's removal

        await self.run_committed(remove)

    async def close(self) -> None:
        if self._closed:
            return
        if self.journal is not None and self.journal_failed is None:
            try:  # a clean stop leaves no round to replay (a checkpoint: nothing else to do)
                await self.run_committed(lambda: None)
            except (StorageError, OSError) as exc:
                log.warning("%s: no checkpoint at the close (%s)", self.directory, exc)
        self._closed = True
        self._committer.stop()
        await self._runner.close()
        for part in self._partitions.values():
            part.close_files()
        if self.journal is not None:
            self.journal.close()
        self.control.close()


def _open_control(
    files: Files,
    directory: Path,
    cluster_key: uuid.UUID | None,
    num_partitions: int | None,
    version: int,
    *,
    options: FsOptions,
) -> ControlFile:
    path = directory / fmt.CONTROL_FILE_NAME
    if files.exists(path):
        return ControlFile.open(path, files)
    if files.exists(directory) and any(
        name not in (fmt.CONTROL_FILE_NAME + ".tmp", JOURNAL_FILE_NAME)
        for name in files.listdir(directory)
    ):
        raise CorruptionError(
            f"{directory} holds files but no control file {fmt.CONTROL_FILE_NAME}; it is not a "
            "Waltz storage directory (choose an empty or new directory)"
        )
    if cluster_key is None or num_partitions is None:
        raise StorageError(
            f"{directory} is not a Waltz storage directory yet: creating one needs the "
            "cluster key and the number of partitions"
        )
    if num_partitions < 1:
        raise StorageError(f"number of partitions must be >= 1, not {num_partitions}")
    make_dirs(files, directory)
    if version >= fmt.JOURNAL_CONTROL_VERSION:
        # first: a crash before the control file leaves a directory that opens as new
        if files.exists(directory / JOURNAL_FILE_NAME):
            files.unlink(directory / JOURNAL_FILE_NAME)
        Journal.create(files, directory, cluster_key, options.journal_size).close()
    return ControlFile.create(directory, cluster_key, num_partitions, files, version)
