"""The file-segment storage engine (plugin ``fs``).

Threads: one *committer* thread owns every write. Appends of all partitions
queue to it; each round it writes every queued batch (one ``pwrite`` per
batch for the data, one for the index entries), then issues one
``fdatasync`` per touched data file, and only then resolves the appends'
futures. While a round is on the disk the next appends queue up, so
concurrent appends coalesce (group commit). Reads run in a small pool of
engine-owned threads with ``pread`` through the index; nothing keeps a
segment, or an index, in memory.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import fcntl
import logging
import operator
import os
import shutil
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

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
from waltz_api.types import NO_TRANSACTION, Record, RecordHeader, SessionInfo
from waltz_api.wire import RecordBlock
from waltz_storage_fs import format as fmt

log = logging.getLogger(__name__)

DEFAULT_SEGMENT_SIZE = 1 << 30
DEFAULT_INDEX_CHECKPOINT = 1000
DEFAULT_READ_THREADS = 2


@dataclass(frozen=True)
class FsOptions:
    """Engine options (``options`` mapping of :meth:`FsStorageEngine.open`)."""

    segment_size: int = DEFAULT_SEGMENT_SIZE
    """A new segment starts once the current data file reaches this many bytes."""
    index_checkpoint_interval: int = DEFAULT_INDEX_CHECKPOINT
    """The index file is flushed every this many records (the spec's 1000)."""
    read_threads: int = DEFAULT_READ_THREADS

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> FsOptions:
        options = dict(options or {})
        known = {"segment_size", "index_checkpoint_interval", "read_threads"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise StorageError(
                f"unknown fs storage option(s) {', '.join(unknown)}; "
                f"valid: {', '.join(sorted(known))}"
            )
        values: dict[str, int] = {}
        for key, value in options.items():
            if isinstance(value, bool) or not isinstance(value, int | str):
                raise StorageError(f"fs storage option {key} must be an integer, not {value!r}")
            try:
                values[key] = int(value)
            except ValueError:
                raise StorageError(
                    f"fs storage option {key} must be an integer, not {value!r}"
                ) from None
        result = cls(**values)
        if result.segment_size < fmt.HEADER_SIZE + fmt.RECORD_OVERHEAD:
            raise StorageError(f"segment_size {result.segment_size} is too small (min 168)")
        if result.index_checkpoint_interval < 1 or result.read_threads < 1:
            raise StorageError("index_checkpoint_interval and read_threads must be >= 1")
        return result


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- segments -------------------------------------------------------------------------


class _Segment:
    """One segment's files. ``count``/``size`` are the committer's (written) view."""

    __slots__ = ("count", "data_fd", "data_path", "first", "index_fd", "index_path", "size")

    def __init__(self, directory: Path, first: int, data_fd: int, index_fd: int) -> None:
        self.first = first
        self.data_path = directory / fmt.segment_file_name(first, fmt.SEGMENT_SUFFIX)
        self.index_path = directory / fmt.segment_file_name(first, fmt.INDEX_SUFFIX)
        self.data_fd = data_fd
        self.index_fd = index_fd
        self.count = 0
        self.size = fmt.HEADER_SIZE

    def close(self) -> None:
        """Close both files (idempotent: a closed fd number may be reused)."""
        fds = (self.data_fd, self.index_fd)
        self.data_fd = self.index_fd = -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)


@dataclass(frozen=True, slots=True)
class _SegView:
    """What readers see of a segment: only durable records."""

    first: int
    count: int
    end: int
    data_fd: int
    index_fd: int


@dataclass(frozen=True, slots=True)
class _View:
    segments: tuple[_SegView, ...]
    max_txid: int


_EMPTY_VIEW = _View((), NO_TRANSACTION)

_T = TypeVar("_T")
_BLOCK_HEAD = struct.Struct(">q20xiI")  # a stored record's id, data length, data crc
_WIRE_FIXED = fmt.RECORD_HEAD.size  # 36: the stored head, as long as the wire's
_SPLIT_HEAD = struct.Struct(">28s4s4s")  # id + ReqId + header, length, data crc


_DATA, _INDEX = 0, 1

# -- committer jobs ---------------------------------------------------------------------


@dataclass
class _Job:
    future: asyncio.Future[None]
    partition: FsStoragePartition | None = None
    blob: bytes = b""
    lengths: list[int] = field(default_factory=list)
    first_txid: int = 0
    action: Callable[[], None] | None = None


class _Committer(threading.Thread):
    """The one thread that writes. Appends are group-committed; others are barriers."""

    def __init__(self, engine: FsStorageEngine, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(name=f"waltz-fs-committer:{engine.directory}", daemon=True)
        self._engine = engine
        self._loop = loop
        self._cond = threading.Condition()
        self._pending: list[_Job] = []
        self._stopping = False
        self._sync_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="waltz-fs-sync"
        )

    def submit(self, job: _Job) -> None:
        with self._cond:
            if self._stopping:
                raise StorageError("the storage engine is closed")
            self._pending.append(job)
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if not self._pending:
                    self._sync_pool.shutdown(wait=True)
                    return
                jobs, self._pending = self._pending, []
            try:
                self._round(jobs)
            except BaseException as exc:  # never leave a waiter hanging
                log.exception("storage committer failed")
                self._finish([(job, exc) for job in jobs if not job.future.done()])

    def _round(self, jobs: list[_Job]) -> None:
        results: list[tuple[_Job, BaseException | None]] = []
        group: list[_Job] = []
        for job in jobs:
            if job.action is None:
                group.append(job)
                continue
            if group:
                results.extend(self._commit_appends(group))
                group = []
            try:
                job.action()
                results.append((job, None))
            except BaseException as exc:
                results.append((job, exc))
        if group:
            results.extend(self._commit_appends(group))
        self._finish(results)

    def _commit_appends(self, jobs: list[_Job]) -> list[tuple[_Job, BaseException | None]]:
        results: list[tuple[_Job, BaseException | None]] = []
        touched: dict[FsStoragePartition, set[tuple[int, int]]] = {}
        done: list[_Job] = []
        for job in jobs:
            part = job.partition
            assert part is not None
            if part.broken is not None:
                results.append((job, part.broken_error()))
                continue
            try:
                flushes = touched.setdefault(part, set())
                part.write_batch(job, flushes)
                done.append(job)
            except OSError as exc:
                part.mark_broken(exc)
                results.append((job, part.broken_error()))
        # One flush per touched file. The data files and the index files that
        # reached a checkpoint are flushed concurrently (the file system can then
        # fold them into one journal commit); an index entry made durable before
        # its record is harmless: recovery verifies the checkpointed entry and
        # falls back to the checkpoint before it, whose flush completed.
        syncs = [
            (part, kind, fd) for part, flushes in touched.items() for kind, fd in sorted(flushes)
        ]
        for (part, _, _), error in zip(syncs, self._sync_all(syncs), strict=True):
            if error is not None and part.broken is None:
                part.mark_broken(error)
        for job in done:
            assert job.partition is not None
            if job.partition.broken is not None:
                results.append((job, job.partition.broken_error()))
            else:
                results.append((job, None))
        for part in touched:
            if part.broken is None:
                part.publish()
        return results

    def _sync_all(self, syncs: list[tuple[FsStoragePartition, int, int]]) -> list[OSError | None]:
        """Flush the files of a round (data, and index files at a checkpoint)."""

        def sync(kind: int, fd: int) -> OSError | None:
            # fdatasync for both kinds: it flushes the size too, not the mtime
            try:
                os.fdatasync(fd)
            except OSError as exc:
                return exc
            return None

        started = time.perf_counter()
        if len(syncs) == 1:
            errors = [sync(syncs[0][1], syncs[0][2])]
        else:
            futures = [self._sync_pool.submit(sync, kind, fd) for _, kind, fd in syncs]
            errors = [f.result() for f in futures]
        observer = self._engine.fsync_observer
        if observer is not None and syncs:
            observer(time.perf_counter() - started)
        return errors

    def _finish(self, results: list[tuple[_Job, BaseException | None]]) -> None:
        if results:
            self._loop.call_soon_threadsafe(_resolve, results)


def _resolve(results: list[tuple[_Job, BaseException | None]]) -> None:
    for job, exc in results:
        if job.future.done():
            continue
        if exc is None:
            job.future.set_result(None)
        else:
            job.future.set_exception(exc)


# -- partitions -------------------------------------------------------------------------


class FsStoragePartition(StoragePartition):
    """A partition directory: segments, recovered at open, written by the committer."""

    def __init__(
        self,
        engine: FsStorageEngine,
        partition_id: int,
        slot: int,
        struct: fmt.InfoStruct,
    ) -> None:
        self.partition_id = partition_id
        self._engine = engine
        self.directory = engine.directory / str(partition_id)
        self._segments: list[_Segment] = []
        self._view = _EMPTY_VIEW
        self._info = struct.session_info
        self._info_slot = slot
        self._info_sequence = struct.sequence
        self._next_txid = 0  # loop side: the id the next append must start with
        self.broken: OSError | None = None
        self._closed = False

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
        segs = tuple(
            _SegView(s.first, s.count, s.size, s.data_fd, s.index_fd) for s in self._segments
        )
        max_txid = segs[-1].first + segs[-1].count - 1 if segs else NO_TRANSACTION
        self._view = _View(segs, max_txid)

    def _check_open(self) -> None:
        if self._closed:
            raise PartitionClosedError(f"partition {self.partition_id} is closed")
        if self.broken is not None:
            raise self.broken_error()

    # -- recovery (runs in a worker thread at open) -------------------------------------

    def recover(self) -> None:
        """Open the segments, rebuild the index tail, truncate a torn or corrupt tail."""
        if not self.directory.is_dir():
            # add_partition makes the directory durable before the control file says
            # the partition is hosted: a missing directory is data lost outside Waltz
            raise CorruptionError(
                f"the directory {self.directory} of hosted partition {self.partition_id} is missing"
            )
        found: dict[int, set[str]] = {}
        for entry in os.listdir(self.directory):
            parsed = fmt.parse_segment_file_name(entry)
            if parsed is None:
                log.warning("partition %d: ignoring unknown file %s", self.partition_id, entry)
                continue
            found.setdefault(parsed[0], set()).add(parsed[1])
        firsts = sorted(found)
        dir_changed = False
        for first in firsts:
            if fmt.SEGMENT_SUFFIX not in found[first]:  # index left by an interrupted delete
                (self.directory / fmt.segment_file_name(first, fmt.INDEX_SUFFIX)).unlink()
                dir_changed = True
        firsts = [f for f in firsts if fmt.SEGMENT_SUFFIX in found[f]]
        expected_first = 0
        for i, first in enumerate(firsts):
            last = i == len(firsts) - 1
            if first != expected_first:
                if i == 0:
                    raise CorruptionError(
                        f"partition {self.partition_id}: the first segment starts at transaction "
                        f"{first}, not 0: segment files are missing from {self.directory}"
                    )
                log.warning(
                    "partition %d: segment %d does not follow the log (expected %d); "
                    "removing it and every later segment",
                    self.partition_id,
                    first,
                    expected_first,
                )
                for later in firsts[i:]:
                    for suffix in (fmt.SEGMENT_SUFFIX, fmt.INDEX_SUFFIX):
                        (self.directory / fmt.segment_file_name(later, suffix)).unlink(
                            missing_ok=True
                        )
                dir_changed = True
                break
            seg = self._open_segment(first, last)
            if seg is None:  # a torn new segment, never written to
                dir_changed = True
                continue
            self._segments.append(seg)
            expected_first = seg.first + seg.count
        if dir_changed:
            _fsync_dir(self.directory)
        self.publish()
        self._next_txid = self._view.max_txid + 1

    def _open_segment(self, first: int, last: bool) -> _Segment | None:
        engine = self._engine
        data_path = self.directory / fmt.segment_file_name(first, fmt.SEGMENT_SUFFIX)
        index_path = self.directory / fmt.segment_file_name(first, fmt.INDEX_SUFFIX)
        data_fd = os.open(data_path, os.O_RDWR)
        index_fd = os.open(index_path, os.O_RDWR | os.O_CREAT, 0o644)
        seg = _Segment(self.directory, first, data_fd, index_fd)
        try:
            data_size = os.fstat(data_fd).st_size
            header = fmt.decode_segment_header(os.pread(data_fd, fmt.HEADER_SIZE, 0))
            if header is None:
                if last and data_size <= fmt.HEADER_SIZE:
                    log.warning(
                        "partition %d: removing segment %s, whose creation was interrupted",
                        self.partition_id,
                        data_path.name,
                    )
                    seg.close()
                    data_path.unlink()
                    index_path.unlink(missing_ok=True)
                    return None
                raise CorruptionError(f"{data_path}: the segment header fails its checksum")
            self._check_header(header, first, data_path)
            expected_header = fmt.encode_segment_header(header)
            interval = engine.options.index_checkpoint_interval
            index_header = fmt.decode_segment_header(os.pread(index_fd, fmt.HEADER_SIZE, 0))
            trusted = 0
            if index_header != header:
                log.warning("partition %d: rebuilding index %s", self.partition_id, index_path)
                os.ftruncate(index_fd, 0)
                os.pwrite(index_fd, expected_header, 0)
            else:
                entries = (os.fstat(index_fd).st_size - fmt.HEADER_SIZE) // fmt.INDEX_ENTRY_SIZE
                trusted = entries if not last else (entries // interval) * interval
            start = fmt.HEADER_SIZE
            while trusted:
                start = self._verify_entry(seg, trusted - 1, data_size)
                if start >= 0:
                    break
                log.warning(
                    "partition %d: index %s entry %d does not match its data; "
                    "scanning from the checkpoint before it",
                    self.partition_id,
                    index_path.name,
                    trusted - 1,
                )
                trusted = ((trusted - 1) // interval) * interval
                start = fmt.HEADER_SIZE
            result = fmt.ScanResult(start)
            count = trusted
            pending: list[int] = []
            for offset in fmt.scan_offsets(data_fd, start, data_size, first + trusted, result):
                pending.append(offset)
                if len(pending) == 65536:  # rebuild the index in bounded pieces
                    os.pwrite(
                        index_fd,
                        fmt.struct_pack_offsets(pending),
                        fmt.HEADER_SIZE + count * fmt.INDEX_ENTRY_SIZE,
                    )
                    count += len(pending)
                    pending = []
            if pending:
                os.pwrite(
                    index_fd,
                    fmt.struct_pack_offsets(pending),
                    fmt.HEADER_SIZE + count * fmt.INDEX_ENTRY_SIZE,
                )
                count += len(pending)
            seg.count = count
            seg.size = result.end
            if data_size > result.end:
                log.warning(
                    "partition %d: truncating %d bytes after transaction %d in %s (%s)",
                    self.partition_id,
                    data_size - result.end,
                    first + seg.count - 1,
                    data_path.name,
                    result.stop_reason,
                )
                os.ftruncate(data_fd, result.end)
                os.fdatasync(data_fd)
            os.ftruncate(index_fd, fmt.HEADER_SIZE + seg.count * fmt.INDEX_ENTRY_SIZE)
            os.fsync(index_fd)
            return seg
        except BaseException:
            seg.close()
            raise

    def _check_header(self, header: fmt.SegmentHeader, first: int, path: Path) -> None:
        if header.version != fmt.FORMAT_VERSION:
            raise CorruptionError(f"{path}: unsupported segment format version {header.version}")
        if header.cluster_key != self._engine.cluster_key:
            raise CorruptionError(
                f"{path}: the segment belongs to cluster {header.cluster_key}, "
                f"not {self._engine.cluster_key}"
            )
        if header.partition_id != self.partition_id or header.first_transaction_id != first:
            raise CorruptionError(
                f"{path}: header says partition {header.partition_id} from transaction "
                f"{header.first_transaction_id}; the file name and directory disagree"
            )

    def _verify_entry(self, seg: _Segment, index: int, data_size: int) -> int:
        """The end offset of the record at index entry ``index`` if it checks out, else -1."""
        raw = os.pread(seg.index_fd, fmt.INDEX_ENTRY_SIZE, fmt.HEADER_SIZE + index * 8)
        if len(raw) != fmt.INDEX_ENTRY_SIZE:
            return -1
        (offset,) = fmt.INDEX_ENTRY.unpack(raw)
        if not fmt.HEADER_SIZE <= offset <= data_size - fmt.RECORD_OVERHEAD:
            return -1
        head = os.pread(seg.data_fd, fmt.RECORD_HEAD.size, offset)
        if len(head) != fmt.RECORD_HEAD.size:
            return -1
        length = fmt.RECORD_HEAD.unpack(head)[6]
        if length < 0 or offset + fmt.RECORD_OVERHEAD + length > data_size:
            return -1
        buf = os.pread(seg.data_fd, fmt.RECORD_OVERHEAD + length, offset)
        try:
            record, end = fmt.decode_record(buf, 0)
        except fmt.RecordFormatError:
            return -1
        if record.transaction_id != seg.first + index:
            return -1
        return int(offset) + end

    # -- committer side (runs in the committer thread) ----------------------------------

    def write_batch(self, job: _Job, flushes: set[tuple[int, int]]) -> None:
        engine = self._engine
        seg = self._segments[-1] if self._segments else None
        if seg is None or (seg.size >= engine.options.segment_size and seg.count > 0):
            if seg is not None:
                os.fdatasync(seg.data_fd)
                os.fsync(seg.index_fd)
            seg = self._create_segment(job.first_txid)
        offsets: list[int] = []
        pos = seg.size
        for length in job.lengths:
            offsets.append(pos)
            pos += length
        os.pwrite(seg.data_fd, job.blob, seg.size)
        index_pos = fmt.HEADER_SIZE + seg.count * fmt.INDEX_ENTRY_SIZE
        os.pwrite(seg.index_fd, fmt.struct_pack_offsets(offsets), index_pos)
        interval = engine.options.index_checkpoint_interval
        crossed = (seg.count + len(offsets)) // interval != seg.count // interval
        seg.count += len(offsets)
        seg.size = pos
        flushes.add((_DATA, seg.data_fd))
        if crossed:
            flushes.add((_INDEX, seg.index_fd))

    def _create_segment(self, first: int) -> _Segment:
        header = fmt.encode_segment_header(
            fmt.SegmentHeader(
                fmt.FORMAT_VERSION, fmt.now_ms(), self._engine.cluster_key, self.partition_id, first
            )
        )
        self.directory.mkdir(exist_ok=True)
        data_path = self.directory / fmt.segment_file_name(first, fmt.SEGMENT_SUFFIX)
        index_path = self.directory / fmt.segment_file_name(first, fmt.INDEX_SUFFIX)
        data_fd = os.open(data_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        index_fd = os.open(index_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        seg = _Segment(self.directory, first, data_fd, index_fd)
        try:
            os.pwrite(index_fd, header, 0)
            os.fsync(index_fd)
            os.pwrite(data_fd, header, 0)
            os.fsync(data_fd)
            _fsync_dir(self.directory)
        except BaseException:
            seg.close()
            raise
        self._segments.append(seg)
        log.info("partition %d: new segment %s", self.partition_id, data_path.name)
        return seg

    def truncate_now(self, transaction_id: int) -> None:
        if self.broken is not None:
            raise self.broken_error()
        try:
            self._truncate_files(transaction_id)
        except OSError as exc:  # the files are in an unknown state until recovery
            self.mark_broken(exc)
            raise self.broken_error() from exc

    def _truncate_files(self, transaction_id: int) -> None:
        removed = False
        while self._segments and self._segments[-1].first > transaction_id:
            seg = self._segments.pop()
            seg.close()
            seg.data_path.unlink()
            seg.index_path.unlink(missing_ok=True)
            removed = True
        if self._segments:
            seg = self._segments[-1]
            keep = transaction_id - seg.first + 1
            if keep < seg.count:
                raw = os.pread(
                    seg.index_fd,
                    fmt.INDEX_ENTRY_SIZE,
                    fmt.HEADER_SIZE + keep * fmt.INDEX_ENTRY_SIZE,
                )
                (end,) = fmt.INDEX_ENTRY.unpack(raw)
                if not fmt.HEADER_SIZE <= end <= seg.size:
                    raise CorruptionError(
                        f"{seg.index_path}: entry {keep} points at {end}, outside the data file"
                    )
                os.ftruncate(seg.data_fd, end)
                os.fdatasync(seg.data_fd)
                os.ftruncate(seg.index_fd, fmt.HEADER_SIZE + keep * fmt.INDEX_ENTRY_SIZE)
                os.fsync(seg.index_fd)
                seg.count = keep
                seg.size = end
        if removed:
            _fsync_dir(self.directory)
        self.publish()

    def set_info_now(self, info: SessionInfo) -> None:
        if self.broken is not None:
            raise self.broken_error()
        slot = 1 - self._info_slot
        sequence = self._info_sequence + 1
        try:
            self._engine.control.write_struct(
                self.partition_id, slot, fmt.InfoStruct(info, fmt.FLAG_ASSIGNED, sequence)
            )
        except OSError as exc:
            self.mark_broken(exc)
            raise self.broken_error() from exc
        self._info, self._info_slot, self._info_sequence = info, slot, sequence

    def close_files(self) -> None:
        self._closed = True
        for seg in self._segments:
            seg.close()
        self._segments = []
        self._view = _EMPTY_VIEW

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

    async def append(self, records: Sequence[Record]) -> None:
        self._check_open()
        if not records:
            return
        expected = self._next_txid
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
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        job = _Job(future, self, b"".join(parts), lengths, expected)
        self._engine.committer().submit(job)
        self._next_txid = expected + len(records)
        try:
            await asyncio.shield(future)
        except BaseException:
            if not future.done():  # cancelled while on its way to disk: wait it out
                await asyncio.wait([future])
            raise

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
        return await self._engine.run_read(
            lambda: self._read_now(view, start, max_records, max_bytes, headers)
        )

    def _read_now(
        self, view: _View, start: int, max_records: int, max_bytes: int, headers: bool
    ) -> list[Record]:
        out: list[Record] = []
        for seg, txid, buf, lo, offsets, k in self._spans(
            view, start, max_records, max_bytes, headers
        ):
            mv = memoryview(buf)
            for i in range(k):
                try:
                    record, end = fmt.decode_record(mv, offsets[i] - lo)
                except fmt.RecordFormatError as exc:
                    raise CorruptionError(
                        f"partition {self.partition_id}: transaction {txid + i} is corrupt "
                        f"({exc}) in segment {seg.first} at offset {offsets[i]}"
                    ) from exc
                if record.transaction_id != txid + i or end != offsets[i + 1] - lo:
                    raise CorruptionError(
                        f"partition {self.partition_id}: the record at offset {offsets[i]} of "
                        f"segment {seg.first} is not transaction {txid + i}"
                    )
                out.append(record)
        return out

    def _read_block_now(
        self, view: _View, start: int, max_records: int, max_bytes: int
    ) -> RecordBlock:
        """The records as a wire block, built from the stored bytes: each record's
        checksums (of its stored head and of its data) and id are verified, then its
        bytes are rearranged to the wire layout (no Record is built)."""
        parts: list[bytes] = []
        append = parts.append
        unpack = _BLOCK_HEAD.unpack_from
        split = _SPLIT_HEAD.unpack_from
        unpack_crc = fmt.RECORD_CRC.unpack_from
        crc = crc32c.crc32c
        count = 0
        # (bytes slices: cheaper than memoryview slices for pieces this small)
        for seg, txid, buf, lo, offsets, k in self._spans(
            view, start, max_records, max_bytes, False
        ):
            for i in range(k):
                a = offsets[i] - lo
                b = offsets[i + 1] - lo
                found, length, data_crc = unpack(buf, a)
                d = a + _WIRE_FIXED
                e = b - 4
                head = buf[a:d]
                if found != txid + i or d + length != e or crc(head) != unpack_crc(buf, e)[0]:
                    self._corrupt(buf[a:b], txid + i, seg.first, offsets[i])
                data = buf[d:e]
                if crc(data) != data_crc:
                    self._corrupt(buf[a:b], txid + i, seg.first, offsets[i])
                # stored: id, ReqId, header, length, crc, data, head crc
                # wire:   id, ReqId, header, crc, length, data
                ids, stored_length, stored_crc = split(head)
                append(ids)
                append(stored_crc)
                append(stored_length)
                append(data)
            count += k
        return RecordBlock(count, b"".join(parts))

    def _corrupt(self, raw: bytes, txid: int, segment: int, offset: int) -> NoReturn:
        try:
            record, _ = fmt.decode_record(raw, 0)
        except fmt.RecordFormatError as exc:
            raise CorruptionError(
                f"partition {self.partition_id}: transaction {txid} is corrupt "
                f"({exc}) in segment {segment} at offset {offset}"
            ) from exc
        raise CorruptionError(
            f"partition {self.partition_id}: the record at offset {offset} of "
            f"segment {segment} is not transaction {txid} (it holds {record.transaction_id})"
        )

    def _spans(
        self, view: _View, start: int, max_records: int, max_bytes: int, headers: bool
    ) -> Iterator[tuple[_SegView, int, bytes, int, list[int], int]]:
        """The stored bytes of the records to read, one span per segment:
        ``(segment, first id, bytes, file offset of the bytes, record offsets, count)``;
        the index's offsets are checked, the records are not."""
        firsts = [s.first for s in view.segments]
        txid = start
        taken = 0
        budget = max_bytes  # data bytes still allowed (records), span bytes per pread (headers)
        span_cap = 8 * 1024 * 1024
        while taken < max_records and txid <= view.max_txid:
            seg = view.segments[bisect.bisect_right(firsts, txid) - 1]
            rel = txid - seg.first
            n = min(max_records - taken, seg.count - rel)
            want = n + 1 if rel + n < seg.count else n
            raw = os.pread(
                seg.index_fd,
                want * fmt.INDEX_ENTRY_SIZE,
                fmt.HEADER_SIZE + rel * fmt.INDEX_ENTRY_SIZE,
            )
            if len(raw) != want * fmt.INDEX_ENTRY_SIZE:
                raise CorruptionError(
                    f"partition {self.partition_id}: the index of segment {seg.first} is "
                    "shorter than the segment"
                )
            offsets = fmt.unpack_offsets(raw)
            if want == n:
                offsets.append(seg.end)
            # how many records fit the byte budget (the very first one always does)
            k = 0
            data_bytes = 0
            whole = offsets[n] - offsets[0]
            if (whole <= span_cap) if headers else (whole - n * fmt.RECORD_OVERHEAD <= budget):
                k, data_bytes = n, whole - n * fmt.RECORD_OVERHEAD  # all of them (fast path)
            while k < n:
                span = offsets[k + 1] - offsets[k]
                if taken or k:
                    if headers and offsets[k + 1] - offsets[0] > span_cap:
                        break
                    if not headers and data_bytes + span - fmt.RECORD_OVERHEAD > budget:
                        break
                data_bytes += span - fmt.RECORD_OVERHEAD
                k += 1
            if k == 0:
                break
            lo, hi = offsets[0], offsets[k]
            if not fmt.HEADER_SIZE <= lo < hi <= seg.end or not all(
                map(operator.lt, offsets[:k], offsets[1 : k + 1])
            ):
                raise CorruptionError(
                    f"partition {self.partition_id}: the index of segment {seg.first} has "
                    f"invalid offsets around transaction {txid}"
                )
            buf = os.pread(seg.data_fd, hi - lo, lo)
            if len(buf) != hi - lo:
                raise CorruptionError(
                    f"partition {self.partition_id}: segment {seg.first} is shorter than its index"
                )
            yield seg, txid, buf, lo, offsets, k
            taken += k
            txid += k
            if not headers:
                budget -= data_bytes
            if k < n:
                break


# -- the control file ---------------------------------------------------------------------


class ControlFile:
    """``waltz-storage.ctl``: the header and the per-partition info structs."""

    def __init__(self, path: Path, fd: int, header: fmt.ControlHeader) -> None:
        self.path = path
        self.fd = fd
        self.header = header

    @classmethod
    def create(cls, directory: Path, cluster_key: uuid.UUID, num_partitions: int) -> ControlFile:
        header = fmt.ControlHeader(fmt.FORMAT_VERSION, fmt.now_ms(), cluster_key, num_partitions)
        body = fmt.encode_control_header(header) + b"".join(
            fmt.initial_partition_info(p) for p in range(num_partitions)
        )
        path = directory / fmt.CONTROL_FILE_NAME
        tmp = directory / (fmt.CONTROL_FILE_NAME + ".tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(fd, body, 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(directory)
        return cls.open(path)

    @classmethod
    def open(cls, path: Path) -> ControlFile:
        fd = os.open(path, os.O_RDWR)
        try:
            # one engine per storage directory: a second writer would corrupt it
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StorageError(
                f"the storage directory {path.parent} is in use by another storage engine "
                "(another storage node process?); stop it first"
            ) from None
        header = fmt.decode_control_header(os.pread(fd, fmt.HEADER_SIZE, 0))
        if header is None:
            os.close(fd)
            raise CorruptionError(
                f"{path}: the control file header is short or fails its checksum; the storage "
                "directory cannot be opened (restore it, or recreate the node's storage)"
            )
        if header.version != fmt.FORMAT_VERSION:
            os.close(fd)
            raise CorruptionError(f"{path}: unsupported control file version {header.version}")
        return cls(path, fd, header)

    def read_partition(
        self, partition_id: int
    ) -> tuple[fmt.InfoStruct | None, fmt.InfoStruct | None]:
        raw = os.pread(self.fd, fmt.PARTITION_INFO_SIZE, fmt.partition_info_offset(partition_id))
        stored_id, first, second = fmt.decode_partition_info(partition_id, raw)
        if stored_id is not None and stored_id != partition_id:
            return None, None
        return first, second

    def write_struct(self, partition_id: int, slot: int, struct: fmt.InfoStruct) -> None:
        os.pwrite(
            self.fd,
            fmt.encode_info_struct(partition_id, struct),
            fmt.info_struct_offset(partition_id, slot),
        )
        os.fdatasync(self.fd)

    def reset_partition(self, partition_id: int, assigned: bool) -> tuple[int, fmt.InfoStruct]:
        """Rewrite both structs with fresh session info (add and remove a partition).

        The slot that is not current is written first with a higher sequence
        number, so a crash in between leaves the new state winning or the old
        state intact. Returns (current slot, struct)."""
        flags = fmt.FLAG_ASSIGNED if assigned else 0
        first, second = self.read_partition(partition_id)
        current = fmt.current_struct(first, second)
        base = max((s.sequence for s in (first, second) if s is not None), default=0)
        slot = 1 - current[0] if current is not None else 0
        self.write_struct(partition_id, slot, fmt.InfoStruct(SessionInfo(), flags, base + 1))
        struct = fmt.InfoStruct(SessionInfo(), flags, base + 2)
        self.write_struct(partition_id, 1 - slot, struct)
        return 1 - slot, struct

    def close(self) -> None:
        os.close(self.fd)


# -- the engine ----------------------------------------------------------------------------


class FsStorageEngine(StorageEngine):
    """A storage directory on a local file system (spec: On Disk Data Structures)."""

    def __init__(
        self,
        directory: Path,
        control: ControlFile,
        options: FsOptions,
        loop: asyncio.AbstractEventLoop,
        readers: concurrent.futures.ThreadPoolExecutor,
    ) -> None:
        self.directory = directory
        self.control = control
        self.options = options
        self._loop = loop
        self._partitions: dict[int, FsStoragePartition] = {}
        self._closed_partitions: dict[int, str] = {}
        self._committer = _Committer(self, loop)
        self._committer.start()
        self._readers = readers
        self._closed = False
        self.fsync_observer: Callable[[float], None] | None = None
        """Called (on the committer thread) with the seconds of each group commit's
        flush to disk alone; the storage node's metrics set it."""

    @classmethod
    async def open(
        cls,
        location: str,
        *,
        cluster_key: uuid.UUID | None = None,
        num_partitions: int | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> FsStorageEngine:
        opts = FsOptions.from_mapping(options)
        directory = Path(location)
        loop = asyncio.get_running_loop()
        readers = concurrent.futures.ThreadPoolExecutor(
            max_workers=opts.read_threads, thread_name_prefix="waltz-fs-reader"
        )
        try:
            control = await loop.run_in_executor(
                readers, _open_control, directory, cluster_key, num_partitions
            )
        except BaseException:
            readers.shutdown(wait=True)
            raise
        engine = cls(directory, control, opts, loop, readers)
        try:
            engine.check_given(cluster_key, num_partitions)
            await loop.run_in_executor(engine._readers, engine._recover_all)
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
                if directory.exists():
                    log.warning("removing %s: partition %d is not hosted here", directory, pid)
                    shutil.rmtree(directory)
                    _fsync_dir(self.directory)
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

    # -- threads ---------------------------------------------------------------------------

    def committer(self) -> _Committer:
        if self._closed:
            raise StorageError("the storage engine is closed")
        return self._committer

    async def run_committed(self, action: Callable[[], None]) -> None:
        """Run ``action`` in the committer thread, after every append queued before it."""
        future: asyncio.Future[None] = self._loop.create_future()
        self.committer().submit(_Job(future, action=action))
        await asyncio.shield(future)

    async def run_read(self, fn: Callable[[], _T]) -> _T:
        if self._closed:
            raise StorageError("the storage engine is closed")
        return await self._loop.run_in_executor(self._readers, fn)

    # -- the contract --------------------------------------------------------------------

    @property
    def cluster_key(self) -> uuid.UUID:
        return self.control.header.cluster_key

    @property
    def num_partitions(self) -> int:
        return self.control.header.num_partitions

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
            if directory.exists():
                shutil.rmtree(directory)
            directory.mkdir()
            _fsync_dir(self.directory)
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
            if directory.exists():
                shutil.rmtree(directory)
                _fsync_dir(self.directory)

        await self.run_committed(remove)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._committer.stop()
        await self._loop.run_in_executor(self._readers, self._committer.join)
        self._readers.shutdown(wait=True)
        for part in self._partitions.values():
            part.close_files()
        self.control.close()


def _open_control(
    directory: Path, cluster_key: uuid.UUID | None, num_partitions: int | None
) -> ControlFile:
    path = directory / fmt.CONTROL_FILE_NAME
    if path.exists():
        return ControlFile.open(path)
    if directory.exists() and any(
        p.name != fmt.CONTROL_FILE_NAME + ".tmp" for p in directory.iterdir()
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
    directory.mkdir(parents=True, exist_ok=True)
    if directory.parent.exists():
        _fsync_dir(directory.parent)
    return ControlFile.create(directory, cluster_key, num_partitions)
