"""An fs partition (:class:`FsStoragePartition`): its segments, recovered at open,
written by the committer (:mod:`waltz_storage_fs.committer`), read through
:mod:`waltz_storage_fs.reads`."""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import logging
import struct
from collections.abc import Sequence
from pathlib import Path

import crc32c

from waltz_api.contracts.storage import LogExtent, ScrubProgress, StoragePartition
from waltz_api.errors import (
    ChecksumError,
    CorruptionError,
    PartitionClosedError,
    RecordsArchivedError,
    StorageAppendError,
    StorageError,
)
from waltz_api.types import LOST_SESSION, NO_TRANSACTION, Record, RecordHeader, SessionInfo
from waltz_api.wire import RecordBlock
from waltz_storage_fs import format as fmt
from waltz_storage_fs import scrub as scrubbing
from waltz_storage_fs.committer import DATA, INDEX, Job
from waltz_storage_fs.files import OPEN_NEW
from waltz_storage_fs.host import PartitionHost
from waltz_storage_fs.reads import PartitionReads
from waltz_storage_fs.recovery import (
    PartitionRecovery,
    Segment,
    close_segment,
    delete_segment_files,
    missing_ranges,
    write_log_start,
)
from waltz_storage_fs.views import EMPTY_VIEW, SegView, View

log = logging.getLogger(__name__)


class FsStoragePartition(PartitionReads, StoragePartition):
    """A partition directory: segments, recovered at open, written by the committer.

    The segments are ascending; a gap between two (or before the first) is a hole:
    records recovery found damaged and moved aside, reported by ``missing_ranges``
    until ``repair`` writes them back (into the segment before the hole, or a new
    segment named after the hole's first id)."""

    starts_appends = True
    """:meth:`start_append`: the storage node runs an append to completion."""

    def __init__(
        self,
        engine: PartitionHost,
        partition_id: int,
        slot: int,
        struct: fmt.InfoStruct,
    ) -> None:
        self.partition_id = partition_id
        self._engine = engine
        self._files = engine.files
        self.directory = engine.directory / str(partition_id)
        self._segments: list[Segment] = []
        self._start = 0  # committer side: the first id kept (the log-start file's)
        self._view = EMPTY_VIEW
        self._info = struct.session_info
        self._flags = struct.flags
        self._info_slot = slot
        self._info_sequence = struct.sequence
        keeps_end = engine.control.keeps_acked_end
        self._acked_end = struct.acked_end if keeps_end else fmt.ACKED_END_UNKNOWN
        """Committer side: the acknowledged end in the control file (format.py);
        ACKED_END_UNKNOWN for good in a directory of format 2 (feature level 1)."""
        self._durable_end = self._acked_end
        """Committer side: the end of the records flushed (the next control flush raises
        the acknowledged end to it); never above the log's end after a truncation."""
        self._dirty: set[tuple[int, int]] = set()
        """Committer side, with a node journal: the (kind, fd) of the segment files
        written since the last checkpoint (it flushes them)."""
        self._flushed_view: View | None = None
        """Committer side: the records flushed, published once the control file's flush
        covers them (None: nothing flushed since the last publish)."""
        self._next_txid = 0  # loop side: the id the next append must start with
        self.broken: OSError | None = None
        self._closed = False
        self.quarantined: list[Path] = []

    # -- state --------------------------------------------------------------------------

    def broken_error(self) -> PartitionClosedError:
        return PartitionClosedError(
            f"partition {self.partition_id} is closed after an I/O error ({self.broken}); "
            "restart the storage node so that recovery checks its files"
        )

    def mark_broken(self, exc: OSError) -> None:
        log.error("partition %d: I/O error, closing it: %s", self.partition_id, exc)
        self.broken = exc

    def publish(self) -> None:
        """Readers see the segments as they are now (an action's state, flushed)."""
        self._view = self._make_view()
        self._flushed_view = None  # an older state is never published after this one

    def take_flushed_view(self) -> View | None:
        """The records flushed since the last publish (their end is being acknowledged):
        readers see them once the control flush completed (:meth:`publish_view`)."""
        view, self._flushed_view = self._flushed_view, None
        return view

    def publish_view(self, view: View) -> None:
        self._view = view

    def _make_view(self) -> View:
        segs = tuple(
            SegView(s.first, s.count, s.size, s.data_fd, s.index_fd, s.created_ms)
            for s in self._segments
        )
        max_txid = segs[-1].first + segs[-1].count - 1 if segs else self._start - 1
        return View(
            segs,
            max_txid,
            tuple(missing_ranges(self._segments, self._start)),
            self._start,
        )

    def _check_open(self) -> None:
        if self._closed:
            raise PartitionClosedError(f"partition {self.partition_id} is closed")
        if self.broken is not None:
            raise self.broken_error()

    # -- recovery (runs in a worker thread at open) -------------------------------------

    def recover(self) -> None:
        """Open the segments (see :mod:`waltz_storage_fs.recovery`)."""
        layout = PartitionRecovery(
            self._files,
            self._engine.directory,
            self.partition_id,
            cluster_key=self._engine.cluster_key,
            index_checkpoint_interval=self._engine.options.index_checkpoint_interval,
            verify_all=bool(self._engine.options.verify_on_open),
            mark_lost=self._mark_lost,
            acked_end=self._acked_end,
        ).run()
        self._segments = layout.segments
        self._start = layout.start
        self.quarantined = layout.quarantined
        self.publish()
        self._next_txid = self._view.max_txid + 1
        end = self._durable_end = self._next_txid
        if end != self._acked_end and self._engine.control.keeps_acked_end:
            # below: the lost tail is marked and moved aside; above: records recovery
            # kept, made durable before they count as acknowledged (a migrated
            # directory's end is unknown until now)
            if end > self._acked_end and self._segments:
                self._files.fdatasync(self._segments[-1].data_fd)
            self._write_info(self._info, self._flags, acked_end=end)
        if self._view.missing:
            log.warning(
                "partition %d: transactions %s are missing (damaged, moved aside); the server "
                "repairs them from a peer, reads of them fail until then",
                self.partition_id,
                ", ".join(f"{a}..{b}" for a, b in self._view.missing),
            )

    def _mark_lost(self, acked_end: int | None = None) -> None:
        """Durably: the records after the log's end may have been lost (LOST_SESSION)."""
        info = dataclasses.replace(self._info, low_water_mark_session_id=LOST_SESSION)
        self._write_info(info, self._flags, acked_end=acked_end)
        log.warning(
            "partition %d: records it acknowledged may be lost: its low-water-mark session is "
            "LOST until a store session starts here again (the server catches it up)",
            self.partition_id,
        )

    def _write_info(
        self, info: SessionInfo, flags: int, *, acked_end: int | None = None, sync: bool = True
    ) -> None:
        """Write the struct that is not current (then it is), flushed unless ``sync`` is
        False (the caller flushes the control file before it relies on it, and writes
        no other struct of this partition until then)."""
        slot = 1 - self._info_slot
        sequence = self._info_sequence + 1
        end = self._acked_end if acked_end is None else acked_end
        if not self._engine.control.keeps_acked_end:
            end = fmt.ACKED_END_UNKNOWN  # format 2 has no place for it
        self._engine.control.write_struct(
            self.partition_id, slot, fmt.InfoStruct(info, flags, sequence, end), sync=sync
        )
        self._info, self._flags, self._acked_end = info, flags, end
        self._info_slot, self._info_sequence = slot, sequence

    def note_flushed(self) -> None:
        """After a group's data flush: its records are durable (what the next control
        flush covers, and what readers see after it)."""
        seg = self._segments[-1] if self._segments else None
        self._durable_end = seg.end if seg is not None else self._start
        self._flushed_view = self._make_view()

    def stage_acked_end(self) -> bool:
        """Write the durable end as the acknowledged end (not flushed: the committer
        flushes the control file with the next group's data, before it acknowledges the
        records it covers). Whether there was one to write: an end only rises here (a
        truncation since the flush lowered the durable end with the acknowledged one)."""
        end = self._durable_end
        if end <= self._acked_end or not self._engine.control.keeps_acked_end:
            return False
        if self._engine.journal is not None:
            return False  # the journal's entry is the proof; a checkpoint writes the end
        self._write_info(self._info, self._flags, acked_end=end, sync=False)
        return True

    def adopt_control(self) -> None:
        """After the control file was migrated to a format that keeps acknowledged ends
        (:meth:`FsStorageEngine.raise_feature_level`): the migration put the current
        struct in slot 0; write the log's end (flushed: its records are) as the
        acknowledged end (not flushed: the caller flushes the control file)."""
        self._info_slot = 0
        self._acked_end = fmt.ACKED_END_UNKNOWN
        seg = self._segments[-1] if self._segments else None
        end = seg.end if seg is not None else self._start
        self._durable_end = end
        self._write_info(self._info, self._flags, acked_end=end, sync=False)

    # -- committer side (runs in the committer thread) ----------------------------------

    def write_batch(self, job: Job, flushes: set[tuple[int, int]]) -> None:
        self.write_records(job.first_txid, job.blob, job.lengths, flushes)

    def write_records(
        self, first: int, blob: bytes, lengths: list[int], flushes: set[tuple[int, int]]
    ) -> None:
        """Append records at the log's end (not flushed: ``flushes`` gets the files to
        flush; with a node journal, the partition keeps them for the next checkpoint)."""
        engine = self._engine
        files = self._files
        seg = self._segments[-1] if self._segments else None
        if seg is None or (seg.size >= engine.options.segment_size and seg.count > 0):
            if seg is not None:
                files.fdatasync(seg.data_fd)
                files.fsync(seg.index_fd)
                self._dirty.difference_update({(DATA, seg.data_fd), (INDEX, seg.index_fd)})
            seg = self._create_segment(first)
        self._write_records(seg, blob, lengths)
        interval = engine.options.index_checkpoint_interval
        crossed = seg.count // interval != (seg.count - len(lengths)) // interval
        flushes.add((DATA, seg.data_fd))
        if crossed:
            flushes.add((INDEX, seg.index_fd))
        if engine.journal is not None:
            self._dirty.update({(DATA, seg.data_fd), (INDEX, seg.index_fd)})

    def flush_dirty(self) -> None:
        """A checkpoint's flush of the segment files written since the last one: then
        the log's end is durable in them."""
        for kind, fd in sorted(self._dirty):
            if kind == DATA:
                self._files.fdatasync(fd)
            else:
                self._files.fsync(fd)
        self._dirty.clear()
        seg = self._segments[-1] if self._segments else None
        self._durable_end = seg.end if seg is not None else self._start

    def checkpoint_end(self) -> None:
        """A checkpoint's acknowledged end (after :meth:`flush_dirty`; not flushed: the
        checkpoint flushes the control file once)."""
        if self._durable_end != self._acked_end:
            self._write_info(self._info, self._flags, acked_end=self._durable_end, sync=False)

    def replayed(self) -> None:
        """After recovery wrote records back from the journal: readers see them."""
        self.publish()
        self._next_txid = self._view.max_txid + 1

    @property
    def next_txid(self) -> int:
        """The id the next append starts with (the log's end)."""
        return self._next_txid

    def _write_records(self, seg: Segment, blob: bytes, lengths: list[int]) -> None:
        offsets: list[int] = []
        pos = seg.size
        for length in lengths:
            offsets.append(pos)
            pos += length
        self._files.pwrite(seg.data_fd, blob, seg.size)
        index_pos = fmt.HEADER_SIZE + seg.count * fmt.INDEX_ENTRY_SIZE
        self._files.pwrite(seg.index_fd, fmt.struct_pack_offsets(offsets), index_pos)
        seg.count += len(offsets)
        seg.size = pos

    def _create_segment(self, first: int) -> Segment:
        files = self._files
        created_ms = files.now_ms()
        header = fmt.encode_segment_header(
            fmt.SegmentHeader(
                fmt.SEGMENT_FORMAT_VERSION,
                created_ms,
                self._engine.cluster_key,
                self.partition_id,
                first,
            )
        )
        data_path = self.directory / fmt.segment_file_name(first, fmt.SEGMENT_SUFFIX)
        index_path = self.directory / fmt.segment_file_name(first, fmt.INDEX_SUFFIX)
        data_fd = files.open(data_path, OPEN_NEW, 0o644)
        try:
            index_fd = files.open(index_path, OPEN_NEW, 0o644)
        except BaseException:
            files.close(data_fd)
            raise
        seg = Segment(self.directory, first, data_fd, index_fd)
        seg.created_ms = created_ms
        try:
            files.pwrite(index_fd, header, 0)
            files.fsync(index_fd)
            files.pwrite(data_fd, header, 0)
            files.fsync(data_fd)
            files.fsync_dir(self.directory)
        except BaseException:
            close_segment(files, seg)
            raise
        bisect.insort(self._segments, seg, key=lambda s: s.first)
        log.info("partition %d: new segment %s", self.partition_id, data_path.name)
        return seg

    def repair_now(self, first: int, blob: bytes, lengths: list[int]) -> None:
        """Write records copied from a peer into the lowest hole, flushed."""
        if self.broken is not None:
            raise self.broken_error()
        missing = missing_ranges(self._segments, self._start)
        last = first + len(lengths) - 1
        if not missing or missing[0][0] != first or last > missing[0][1]:
            raise StorageAppendError(
                f"partition {self.partition_id}: repair of transactions {first}.."
                f"{last} does not fill the lowest missing range "
                f"({'none' if not missing else f'{missing[0][0]}..{missing[0][1]}'}); "
                "nothing was stored"
            )
        files = self._files
        try:
            # the last segment ending at the hole: an empty one (the damage began at its
            # first record) is where reads look for these ids, not the one before it
            before = [s for s in self._segments if s.end == first]
            seg = before[-1] if before else None
            if seg is None or seg.size >= self._engine.options.segment_size:
                if seg is not None:
                    files.fdatasync(seg.data_fd)
                    files.fsync(seg.index_fd)
                seg = self._create_segment(first)
            self._write_records(seg, blob, lengths)
            files.fdatasync(seg.data_fd)
            files.fsync(seg.index_fd)
        except OSError as exc:  # the files are in an unknown state until recovery
            self.mark_broken(exc)
            raise self.broken_error() from exc
        self.publish()

    def commit_scrub(self, plan: scrubbing.Plan) -> tuple[int, int] | None:
        """Make the hole a scrub planned (:func:`waltz_storage_fs.scrub.commit`); None
        when the segment changed since it was planned (the plan's files deleted)."""
        if self.broken is not None or self._closed:
            plan.discard(self._files)
            return None
        try:
            return scrubbing.commit(
                self._files,
                self._engine.directory,
                self.partition_id,
                self._segments,
                plan,
                publish=self.publish,
            )
        except scrubbing.CutFailedError as exc:  # the files are in an unknown state until recovery
            self.mark_broken(exc.error)
            raise self.broken_error() from exc.error

    def truncate_now(self, transaction_id: int) -> None:
        if self.broken is not None:
            raise self.broken_error()
        try:
            self._truncate_files(transaction_id)
        except OSError as exc:  # the files are in an unknown state until recovery
            self.mark_broken(exc)
            raise self.broken_error() from exc

    def _truncate_files(self, transaction_id: int) -> None:
        files = self._files
        # never an end staged later above the cut log (records written after the cut
        # are not durable before their own flush)
        self._durable_end = min(self._durable_end, transaction_id + 1)
        end = min(self._acked_end, transaction_id + 1)
        if any(a <= transaction_id for a, _ in missing_ranges(self._segments, self._start)):
            # records in a hole at or below the new end were acknowledged once: the log
            # ends before them now, with nothing to say it ever held them
            self._mark_lost(acked_end=end)
        elif end != self._acked_end:
            # first, flushed: a crash before the cut leaves records above the end, kept
            # as a write that was never acknowledged; never an end above a cut log
            self._write_info(self._info, self._flags, acked_end=end)
        removed = False
        while self._segments and self._segments[-1].first > transaction_id:
            seg = self._segments.pop()
            delete_segment_files(files, seg)  # the index first: never one without its data
            removed = True
        if removed:
            # durable before the cut below: a crash in between must not leave a later
            # segment after a shortened one (a hole)
            files.fsync_dir(self.directory)
        if transaction_id + 1 < self._start:
            # below the dropped prefix: the (now empty) log continues after the cut; a
            # crash before this leaves it empty at the old start, which is no hole
            write_log_start(files, self.directory, transaction_id + 1)
            self._start = transaction_id + 1
        if self._segments:
            seg = self._segments[-1]
            keep = transaction_id - seg.first + 1
            if keep < seg.count:
                raw = files.pread(
                    seg.index_fd,
                    fmt.INDEX_ENTRY_SIZE,
                    fmt.HEADER_SIZE + keep * fmt.INDEX_ENTRY_SIZE,
                )
                (end,) = fmt.INDEX_ENTRY.unpack(raw)
                if not fmt.HEADER_SIZE <= end <= seg.size:
                    raise CorruptionError(
                        f"{seg.index_path}: entry {keep} points at {end}, outside the data file"
                    )
                files.ftruncate(seg.data_fd, end)
                files.fdatasync(seg.data_fd)
                files.ftruncate(seg.index_fd, fmt.HEADER_SIZE + keep * fmt.INDEX_ENTRY_SIZE)
                files.fsync(seg.index_fd)
                seg.count = keep
                seg.size = end
        self.publish()

    def drop_prefix_now(self, through: int) -> None:
        """Delete the segments wholly at or below ``through`` (all of them when it is at
        or past the log's end), after recording the new start durably."""
        if self.broken is not None:
            raise self.broken_error()
        segments = self._segments
        max_txid = segments[-1].end - 1 if segments else self._start - 1
        if through >= max_txid:
            doomed, kept, start = list(segments), [], through + 1
        else:
            doomed = [s for s in segments[:-1] if s.end - 1 <= through]
            kept = segments[len(doomed) :]
            start = min(through + 1, kept[0].first)
        if start <= self._start:
            return
        files = self._files
        try:
            # first: a crash before the segments are gone leaves them below the start,
            # which recovery then deletes; never a prefix that looks like a hole
            write_log_start(files, self.directory, start)
            for seg in doomed:
                delete_segment_files(files, seg)
            if doomed:
                files.fsync_dir(self.directory)
            if start > self._acked_end:
                # a fast-forward past the log's end: after the start (a crash between
                # leaves the end below the log's, which is no loss)
                self._write_info(self._info, self._flags, acked_end=start)
        except OSError as exc:  # the files are in an unknown state until recovery
            self.mark_broken(exc)
            raise self.broken_error() from exc
        self._segments = kept
        self._start = start
        self._durable_end = max(self._durable_end, start)
        self.publish()
        log.info(
            "partition %d: deleted %d segment(s) of archived records; the local log starts at %d",
            self.partition_id,
            len(doomed),
            start,
        )

    def set_info_now(self, info: SessionInfo) -> None:
        self._set_struct_now(info, self._flags)

    def set_available_now(self, available: bool) -> None:
        flags = self._flags & ~fmt.FLAG_UNAVAILABLE
        self._set_struct_now(self._info, flags if available else flags | fmt.FLAG_UNAVAILABLE)

    def _set_struct_now(self, info: SessionInfo, flags: int) -> None:
        if self.broken is not None:
            raise self.broken_error()
        try:
            self._write_info(info, flags | fmt.FLAG_ASSIGNED)
        except OSError as exc:
            self.mark_broken(exc)
            raise self.broken_error() from exc

    def sync_last_segment(self) -> None:
        """Flush the last segment's data (committer side, with nothing under way: what
        it holds was flushed already; a format migration does not rely on that alone)."""
        if self._segments:
            self._files.fdatasync(self._segments[-1].data_fd)

    def close_files(self) -> None:
        self._closed = True
        self._dirty.clear()
        for seg in self._segments:
            close_segment(self._files, seg)
        self._segments = []
        self._view = EMPTY_VIEW

    # -- the contract (event loop side) -----------------------------------------------

    def max_transaction_id(self) -> int:
        self._check_open()
        return self._view.max_txid

    def session_info(self) -> SessionInfo:
        self._check_open()
        return self._info

    async def set_session_info(self, info: SessionInfo) -> None:
        self._check_open()
        await self._engine.run_committed(lambda: self.set_info_now(info))

    def missing_ranges(self) -> list[tuple[int, int]]:
        self._check_open()
        return list(self._view.missing)

    def log_start(self) -> int:
        self._check_open()
        view = self._view
        return view.start if view.segments else view.max_txid + 1

    def local_extents(self) -> list[LogExtent]:
        self._check_open()
        extents = []
        for seg in self._view.segments:
            if seg.count:
                extents.append(
                    LogExtent(seg.first, seg.first + seg.count - 1, seg.end, seg.created_ms)
                )
        return extents

    async def drop_prefix(self, through: int) -> int:
        self._check_open()
        if through >= self._next_txid - 1:
            self._next_txid = through + 1
        await self._engine.run_committed(lambda: self.drop_prefix_now(through))
        return self.log_start()

    def _archived(self, view: View, transaction_id: int) -> RecordsArchivedError:
        return RecordsArchivedError(
            f"partition {self.partition_id}: transaction {transaction_id} is below the local "
            f"log's start {view.start}: it was archived and deleted from this storage"
        )

    def available(self) -> bool:
        self._check_open()
        return not self._flags & fmt.FLAG_UNAVAILABLE

    async def set_available(self, available: bool) -> None:
        self._check_open()
        await self._engine.run_committed(lambda: self.set_available_now(available))

    def _encode(self, records: Sequence[Record], expected: int) -> tuple[bytes, list[int]]:
        """The records' stored bytes and lengths, checked: dense from ``expected``, each
        data matching its checksum, every field within the format's range."""
        parts: list[bytes] = []
        lengths: list[int] = []
        pack_head = fmt.RECORD_HEAD.pack
        pack_crc = fmt.RECORD_CRC.pack
        crc = crc32c.crc32c
        overhead = fmt.RECORD_OVERHEAD
        for i, record in enumerate(records):
            txid = record.transaction_id
            data = record.data
            if txid != expected + i:
                raise StorageAppendError(
                    f"partition {self.partition_id}: append of transaction "
                    f"{txid} at position {i} of the batch does not continue "
                    f"the log, which expects {expected + i}; nothing was stored (truncate or "
                    "ask max_transaction_id first)"
                )
            checksum = crc(data)
            if checksum != record.checksum:
                raise ChecksumError(
                    f"partition {self.partition_id}: transaction {txid}: the "
                    "data does not match its CRC-32C checksum; nothing was stored"
                )
            r = record.req_id
            try:
                head = pack_head(
                    txid,
                    r.client_id,
                    r.generation,
                    r.partition_id,
                    r.seq_num,
                    record.header,
                    len(data),
                    checksum,
                )
            except struct.error as exc:
                raise StorageAppendError(
                    f"partition {self.partition_id}: transaction {txid} has a "
                    f"field out of range for the on-disk format (ReqId and header are signed "
                    f"32-bit, the id signed 64-bit): {exc}; nothing was stored"
                ) from exc
            parts += (head, data, pack_crc(crc(head)))
            lengths.append(overhead + len(data))
        return b"".join(parts), lengths

    def start_append(self, records: Sequence[Record]) -> asyncio.Future[None]:
        """:meth:`append` without the wait: checks and hands the records to the committer
        at once (what is refused raises here), and returns the future resolved when they
        are durable and acknowledged (on the event loop; the storage node's run to
        completion path answers in its callback, no task in between)."""
        self._check_open()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not records:
            future.set_result(None)
            return future
        expected = self._next_txid
        blob, lengths = self._encode(records, expected)
        job = Job(future, self, blob, lengths, expected)
        self._engine.committer().submit(job)
        self._next_txid = expected + len(records)
        return future

    async def append(self, records: Sequence[Record]) -> None:
        self._check_open()
        if not records:
            return
        future = self.start_append(records)
        try:
            await asyncio.shield(future)
        except BaseException:
            if not future.done():  # cancelled while on its way to disk: wait it out
                await asyncio.wait([future])
            raise

    async def repair(self, records: Sequence[Record]) -> None:
        self._check_open()
        missing = self._view.missing
        if not records:
            return
        if not missing:
            raise StorageAppendError(
                f"partition {self.partition_id} has no missing range to repair; nothing was stored"
            )
        first, last = missing[0]
        if records[0].transaction_id != first or records[-1].transaction_id > last:
            raise StorageAppendError(
                f"partition {self.partition_id}: repair of transactions "
                f"{records[0].transaction_id}..{records[-1].transaction_id} does not fill the "
                f"lowest missing range {first}..{last} from its start; nothing was stored"
            )
        blob, lengths = self._encode(records, first)
        await self._engine.run_committed(lambda: self.repair_now(first, blob, lengths))

    async def scrub(self, start: int, max_bytes: int) -> ScrubProgress:
        self._check_open()
        engine = self._engine
        sealed = self._view.segments[:-1]
        found = await engine.run_read(
            lambda: scrubbing.verify(self._files, sealed, start, max(1, max_bytes))
        )
        damage = found.damage
        if damage is None:
            return ScrubProgress(found.next_start, found.records, found.bytes_read)
        seg = next(s for s in sealed if s.first == damage.segment)
        log.error(
            "partition %d: a scrub found transaction %d damaged in segment %d (%s)",
            self.partition_id,
            damage.txid,
            damage.segment,
            damage.reason,
        )
        plan = await engine.run_read(
            lambda: scrubbing.prepare(
                self._files,
                self.directory,
                seg,
                damage,
                cluster_key=engine.cluster_key,
                partition_id=self.partition_id,
                created_ms=seg.created_ms if seg.created_ms >= 0 else self._files.now_ms(),
            )
        )
        made: list[tuple[int, int] | None] = []
        future: asyncio.Future[None] = engine.loop.create_future()
        try:
            committer = engine.committer()
        except StorageError:  # closed meanwhile: the plan's files are nobody's
            plan.discard(self._files)
            raise
        # the committer carries the plan out or discards it, even if this call is cancelled
        committer.submit(Job(future, action=lambda: made.append(self.commit_scrub(plan))))
        await asyncio.shield(future)
        hole = made[0]
        if hole is None:
            log.warning(
                "partition %d: segment %d changed while a scrub planned its hole; the next "
                "pass checks it again",
                self.partition_id,
                damage.segment,
            )
            return ScrubProgress(damage.txid + 1, found.records, found.bytes_read)
        return ScrubProgress(hole[1] + 1, found.records, found.bytes_read, (hole,))

    async def truncate(self, transaction_id: int) -> None:
        self._check_open()
        if transaction_id < NO_TRANSACTION:
            raise StorageError(f"cannot truncate after transaction {transaction_id} (min -1)")
        if transaction_id >= self._next_txid - 1:
            await self._engine.run_committed(lambda: None)  # earlier appends are durable
            return
        self._next_txid = transaction_id + 1
        await self._engine.run_committed(lambda: self.truncate_now(transaction_id))

    async def read_record(self, transaction_id: int) -> Record | None:
        records = await self._read(transaction_id, 1, 1, headers=False)
        return records[0] if records else None

    async def read_header(self, transaction_id: int) -> RecordHeader | None:
        records = await self._read(transaction_id, 1, 1, headers=True)
        return records[0].record_header if records else None

    async def read_records(
        self, start: int, max_records: int, max_bytes: int = 16 * 1024 * 1024
    ) -> list[Record]:
        return await self._read(start, max_records, max_bytes, headers=False)

    async def read_headers(self, start: int, max_records: int) -> list[RecordHeader]:
        records = await self._read(start, max_records, 8 * 1024 * 1024, headers=True)
        return [r.record_header for r in records]

    async def read_block(
        self, start: int, max_records: int, max_bytes: int = 16 * 1024 * 1024
    ) -> RecordBlock:
        self._check_open()
        view = self._view
        if start < 0 or start > view.max_txid or max_records <= 0:
            return RecordBlock(0, b"")
        if start < view.start:
            raise self._archived(view, start)
        return await self._engine.run_read(
            lambda: self._read_block_now(view, start, max_records, max_bytes)
        )

    async def _read(
        self, start: int, max_records: int, max_bytes: int, *, headers: bool
    ) -> list[Record]:
        self._check_open()
        view = self._view
        if start < 0 or start > view.max_txid or max_records <= 0:
            return []
        if start < view.start:
            raise self._archived(view, start)
        return await self._engine.run_read(
            lambda: self._read_now(view, start, max_records, max_bytes, headers)
        )
