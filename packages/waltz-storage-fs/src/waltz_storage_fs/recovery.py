"""Start-up recovery of one partition directory: never delete what may be data.

(Above 800 lines on purpose: one decision procedure, read top to bottom, whose every
case is listed below; split, its cases would lose their order.)

Recovery reads every segment file's header, trusts each index up to its last
flushed checkpoint (a non-last segment's index was flushed whole before the
next segment began), scans the records after it, and decides what to do with
whatever does not read back:

- **A torn tail** (the last segment ends inside a record, or in zeros where the
  disk never wrote the pages of the last, unflushed write), *above the acknowledged
  end* the control file keeps (:mod:`waltz_storage_fs.format`): cut. It was never
  acknowledged.
- **A lost acknowledged tail**: the log ends below the acknowledged end, whatever
  the shape (zeros or older bytes where flushed records were, a short file, a
  missing segment: a lost write). Never taken for a torn write: handled as a
  damaged tail (below), the README and the log saying both ends.
- **Damaged records with intact ones after them** (a bit flip, a zeroed or
  truncated region in a segment that was flushed whole): the damaged bytes are
  copied to the quarantine, the intact records after them move to a new
  segment file named after their first id, and the log has a *hole*
  (:meth:`PartitionLayout.missing_ranges`) that the server repairs from a peer.
  Later segments are never touched.
- **A damaged tail of the last segment** (nothing valid after it, and not the
  shape of a torn write): copied to the quarantine and cut; the records it
  held may have been acknowledged, so the partition records LOST_SESSION as
  its low-water-mark session (it is then caught up like a replica restored
  from a backup).
- **A file that cannot belong to the log** (a segment header naming another
  cluster, partition or first id; a segment starting inside the log already
  recovered; an index without its segment; an unreadable header): moved whole
  into the quarantine, the rest untouched.

- **A dropped prefix** (records archived elsewhere and deleted, ``drop_prefix``): the
  ``log-start`` file names the first id kept. It is written (flushed, renamed) before
  any segment is deleted, so segments wholly below it are what an interrupted deletion
  left: they are deleted now; the ids below it are never a hole. A damaged
  ``log-start`` file is moved aside; the log then starts at its first segment and the
  partition is LOST (it may have lost a hole at its start).

Quarantine: ``<storage dir>/quarantine/<partition>/<UTC time>-<reason>/``, one
folder per action, holding the moved files or the copied bytes and a
``README.txt`` that says what came from where and which transactions it held.
Every step is crash-safe: a crash half-way leaves the originals in place, and
the next recovery does the same again (a quarantine folder may then hold a
copy twice, never a byte less).
"""

from __future__ import annotations

import logging
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import crc32c

from waltz_api.errors import CorruptionError
from waltz_storage_fs import format as fmt
from waltz_storage_fs.files import (
    OPEN_CREATE,
    OPEN_NEW,
    OPEN_READ,
    OPEN_WRITE,
    Files,
    copy_range,
)
from waltz_storage_fs.quarantine import Quarantine

log = logging.getLogger(__name__)

SECTOR = 512
"""Unwritten pages of an interrupted write read back as zeros, in whole sectors."""
SEARCH_WINDOW = 16 << 20
"""How far past damaged bytes recovery searches for the next intact record."""
SEARCH_IDS = 4096
"""How many transaction ids past the damaged one a searched record may carry."""
_TXID = struct.Struct(">q")


class Segment:
    """One segment's files. ``count``/``size`` are the committer's (written) view."""

    __slots__ = (
        "count",
        "created_ms",
        "data_fd",
        "data_path",
        "first",
        "index_fd",
        "index_path",
        "size",
    )

    def __init__(self, directory: Path, first: int, data_fd: int, index_fd: int) -> None:
        self.first = first
        self.data_path = directory / fmt.segment_file_name(first, fmt.SEGMENT_SUFFIX)
        self.index_path = directory / fmt.segment_file_name(first, fmt.INDEX_SUFFIX)
        self.data_fd = data_fd
        self.index_fd = index_fd
        self.count = 0
        self.size = fmt.HEADER_SIZE
        self.created_ms = -1

    @property
    def end(self) -> int:
        """The id after the segment's last record."""
        return self.first + self.count


def close_segment(files: Files, seg: Segment) -> None:
    """Close both files (idempotent: a closed fd number may be reused)."""
    fds = (seg.data_fd, seg.index_fd)
    seg.data_fd = seg.index_fd = -1
    for fd in fds:
        if fd >= 0:
            files.close(fd)


def read_log_start(files: Files, directory: Path) -> int | None:
    """The start recorded in ``directory``'s log-start file: 0 without one, None when
    the file is damaged."""
    path = directory / fmt.LOG_START_FILE_NAME
    if not files.exists(path):
        return 0
    fd = files.open(path, OPEN_READ)
    try:
        raw = files.pread(fd, fmt.LOG_START_SIZE + 1, 0)
    finally:
        files.close(fd)
    return fmt.decode_log_start(raw)


def write_log_start(files: Files, directory: Path, start: int) -> None:
    """Record ``start`` durably: a new file, flushed, renamed over the old one, and the
    directory flushed (a crash leaves the old or the new start, never a torn one)."""
    path = directory / fmt.LOG_START_FILE_NAME
    temporary = directory / (fmt.LOG_START_FILE_NAME + ".tmp")
    fd = files.open(temporary, OPEN_NEW, 0o644)
    try:
        files.pwrite(fd, fmt.encode_log_start(start), 0)
        files.fdatasync(fd)
    finally:
        files.close(fd)
    files.replace(temporary, path)
    files.fsync_dir(directory)


def delete_segment_files(files: Files, seg: Segment) -> None:
    """Close and unlink a segment's files (the index first: never an index without its
    data); the caller flushes the directory."""
    close_segment(files, seg)
    if files.exists(seg.index_path):
        files.unlink(seg.index_path)
    files.unlink(seg.data_path)


@dataclass
class PartitionLayout:
    """What recovery found: the segments (ascending, holes between them allowed)."""

    segments: list[Segment] = field(default_factory=list)
    start: int = 0
    """The first id kept (the ids below it were dropped: archived elsewhere)."""
    lost_tail: bool = False
    """Records after the last segment's end may have been acknowledged and lost."""
    quarantined: list[Path] = field(default_factory=list)


def missing_ranges(segments: list[Segment], start: int = 0) -> list[tuple[int, int]]:
    """The holes of a segment list: ids from ``start`` below the last end that no
    segment holds."""
    ranges = []
    expected = start
    for seg in segments:
        if seg.first > expected:
            ranges.append((expected, seg.first - 1))
        expected = max(expected, seg.end)
    return ranges


def record_end(files: Files, fd: int, offset: int, size: int, txid: int) -> int:
    """The end of the intact record ``txid`` at ``offset`` of a data file of ``size``
    bytes, or -1."""
    if not fmt.HEADER_SIZE <= offset <= size - fmt.RECORD_OVERHEAD:
        return -1
    head = files.pread(fd, fmt.RECORD_HEAD.size, offset)
    if len(head) != fmt.RECORD_HEAD.size:
        return -1
    length = fmt.RECORD_HEAD.unpack(head)[6]
    if length < 0 or offset + fmt.RECORD_OVERHEAD + length > size:
        return -1
    buf = files.pread(fd, fmt.RECORD_OVERHEAD + length, offset)
    try:
        end = fmt.check_record(buf, 0, txid)
    except fmt.RecordFormatError:
        return -1
    return offset + end


def resync(
    files: Files,
    data_fd: int,
    index_fd: int,
    *,
    first: int,
    p: int,
    size: int,
    e: int,
    limit: int | None,
) -> tuple[int, int] | None:
    """(offset, id) of the first intact record after damaged bytes at offset ``p`` of
    the data file (``size`` bytes) of the segment starting at ``first`` (the damaged
    record should have been ``e``), or None. Ids stay at or below ``limit``. Start-up
    recovery and a scrub (:mod:`waltz_storage_fs.scrub`) split a segment there."""

    def intact(offset: int, txid: int) -> bool:
        return (limit is None or txid <= limit) and record_end(
            files, data_fd, offset, size, txid
        ) > 0

    # 1. the damaged record's own head, when only its data is damaged
    head = files.pread(data_fd, fmt.RECORD_HEAD.size, p)
    if len(head) == fmt.RECORD_HEAD.size:
        txid, *_, length, _ = fmt.RECORD_HEAD.unpack(head)
        end = p + fmt.RECORD_OVERHEAD + length
        if txid == e and length >= 0 and end <= size:
            crc = files.pread(data_fd, 4, end - 4)
            if crc32c.crc32c(head) == fmt.RECORD_CRC.unpack(crc)[0] and intact(end, e + 1):
                return end, e + 1
    # 2. the index entries after it
    entries = (files.size(index_fd) - fmt.HEADER_SIZE) // fmt.INDEX_ENTRY_SIZE
    rel = e + 1 - first
    if rel < entries:
        n = min(entries - rel, 1 << 20)
        raw = files.pread(index_fd, n * fmt.INDEX_ENTRY_SIZE, fmt.HEADER_SIZE + rel * 8)
        for k, offset in enumerate(fmt.unpack_offsets(raw)):
            if p < offset < size and intact(offset, e + 1 + k):
                return offset, e + 1 + k
    # 3. a search of the bytes after it for the id of a later record
    if size - p - 1 < fmt.RECORD_OVERHEAD:
        return None
    window = files.pread(data_fd, min(size - p - 1, SEARCH_WINDOW), p + 1)
    best: tuple[int, int] | None = None
    for prefix in {_TXID.pack(e + 1)[:6], _TXID.pack(e + SEARCH_IDS)[:6]}:
        at = window.find(prefix)
        tries = 0
        while at >= 0 and (best is None or p + 1 + at < best[0]) and tries < 100_000:
            tries += 1
            if at + 8 <= len(window):
                (txid,) = _TXID.unpack_from(window, at)
                if e < txid <= e + SEARCH_IDS and intact(p + 1 + at, txid):
                    best = (p + 1 + at, txid)
                    break
            at = window.find(prefix, at + 1)
    return best


# -- recovery ------------------------------------------------------------------------------


@dataclass
class _Candidate:
    first: int
    header_ok: bool
    fix_header: fmt.SegmentHeader | None = None
    """A valid header from the index file, for a data file whose own header is damaged."""


class PartitionRecovery:
    """Recovers one partition directory (runs once, in a worker thread, at open)."""

    def __init__(
        self,
        files: Files,
        storage_directory: Path,
        partition_id: int,
        *,
        cluster_key: uuid.UUID,
        index_checkpoint_interval: int,
        verify_all: bool = False,
        mark_lost: Callable[[], None],
        acked_end: int = fmt.ACKED_END_UNKNOWN,
    ) -> None:
        self.files = files
        self.directory = storage_directory / str(partition_id)
        self.partition_id = partition_id
        self.cluster_key = cluster_key
        self.interval = index_checkpoint_interval
        self.verify_all = verify_all
        """Scan every record, whatever the indexes vouch for."""
        self.mark_lost = mark_lost
        """Records LOST_SESSION durably (before damage that shows it is cut away)."""
        self.acked_end = acked_end
        """The acknowledged end in the control file: the log held every id below it
        (ACKED_END_UNKNOWN: not known, in a directory migrated at this open)."""
        self._tail_saved = False
        self.quarantine = Quarantine(files, storage_directory, partition_id)
        self.layout = PartitionLayout()
        self._dir_changed = False

    # -- driver ------------------------------------------------------------------------

    def run(self) -> PartitionLayout:
        if not self.files.is_dir(self.directory):
            # add_partition makes the directory durable before the control file says
            # the partition is hosted: a missing directory is data lost outside Waltz
            raise CorruptionError(
                f"the directory {self.directory} of hosted partition {self.partition_id} is missing"
            )
        try:
            start = self._log_start()
            candidates = self._drop_below(start, self._read_headers())
            self._chain(candidates)
            self._finish_drop(start)
            self._check_acked_end()
            if self._dir_changed:
                self.files.fsync_dir(self.directory)
        except BaseException:
            for seg in self.layout.segments:
                close_segment(self.files, seg)
            raise
        self.layout.quarantined = list(self.quarantine.folders)
        return self.layout

    # -- the dropped prefix ----------------------------------------------------------------

    def _log_start(self) -> int:
        start = read_log_start(self.files, self.directory)
        if start is not None:
            return start
        path = self.directory / fmt.LOG_START_FILE_NAME
        self._move_aside(
            [path],
            "damaged-log-start",
            "the file naming the log's first kept transaction fails its checksum; the log "
            "now starts at its first segment (any records missing before it are lost)",
        )
        self._lose_tail()
        return -1

    def _drop_below(self, start: int, candidates: list[_Candidate]) -> list[_Candidate]:
        """Delete the segments an interrupted ``drop_prefix`` left: those followed by a
        segment starting at or below the log's start (so wholly below it)."""
        kept: list[_Candidate] = []
        for i, candidate in enumerate(candidates):
            following = candidates[i + 1].first if i + 1 < len(candidates) else None
            if following is not None and following <= start:
                for path in reversed(self._paths(candidate.first)):
                    self.files.unlink(path)
                self._dir_changed = True
                log.info(
                    "partition %d: deleted segment %d, below the log's start %d (an "
                    "interrupted deletion of an archived prefix)",
                    self.partition_id,
                    candidate.first,
                    start,
                )
                continue
            kept.append(candidate)
        return kept

    def _finish_drop(self, start: int) -> None:
        segments = self.layout.segments
        if start < 0:  # the log-start file was damaged: the log starts where it starts
            self.layout.start = segments[0].first if segments else 0
            return
        while segments and segments[0].first < start and segments[0].end <= start:
            seg = segments.pop(0)
            delete_segment_files(self.files, seg)
            self._dir_changed = True
        if segments and segments[0].first < start:
            log.warning(
                "partition %d: segment %d holds records below the log's start %d; keeping them",
                self.partition_id,
                segments[0].first,
                start,
            )
            start = segments[0].first
        self.layout.start = start

    def _check_acked_end(self) -> None:
        """A log that ends below its acknowledged end lost records it acknowledged (no
        bytes left to move aside, or they were: LOST either way)."""
        segments = self.layout.segments
        end = segments[-1].end if segments else self.layout.start
        if end >= self.acked_end:
            return
        self._lose_tail()
        why = self._below_acked(end)
        if not self._tail_saved:
            self.quarantine.folder(
                "lost-tail", f"partition {self.partition_id}: nothing to keep here: {why}"
            )
        log.warning("partition %d: %s", self.partition_id, why)

    def _below_acked(self, end: int) -> str:
        return (
            f"the acknowledged end recorded in the control file was {self.acked_end} and the "
            f"log ends at {end}: transactions {end}..{self.acked_end - 1} were made durable and "
            "may have been acknowledged, then lost (a lost write, or files cut or removed "
            "outside Waltz), not a torn write (lost tail; the replica is caught up from its "
            "peers)"
        )

    def _data_path(self, first: int) -> Path:
        return self.directory / fmt.segment_file_name(first, fmt.SEGMENT_SUFFIX)

    def _index_path(self, first: int) -> Path:
        return self.directory / fmt.segment_file_name(first, fmt.INDEX_SUFFIX)

    def _paths(self, first: int) -> list[Path]:
        paths = [self._data_path(first)]
        if self.files.exists(self._index_path(first)):
            paths.append(self._index_path(first))
        return paths

    def _move_aside(self, paths: list[Path], reason: str, why: str) -> None:
        names = ", ".join(p.name for p in paths)
        folder = self.quarantine.folder(
            reason,
            f"partition {self.partition_id}: recovery moved {names} here from "
            f"{self.directory}: {why}",
        )
        self.quarantine.move(folder, *paths)
        log.warning(
            "partition %d: moved %s from %s to %s: %s",
            self.partition_id,
            names,
            self.directory,
            folder,
            why,
        )

    # -- pass 1: names and headers --------------------------------------------------------

    def _read_headers(self) -> list[_Candidate]:
        found: dict[int, set[str]] = {}
        for entry in self.files.listdir(self.directory):
            if entry in (fmt.LOG_START_FILE_NAME, fmt.LOG_START_FILE_NAME + ".tmp"):
                continue
            parsed = fmt.parse_segment_file_name(entry)
            if parsed is None:
                log.warning(
                    "partition %d: ignoring %s (not a segment or index file name)",
                    self.partition_id,
                    self.directory / entry,
                )
                continue
            found.setdefault(parsed[0], set()).add(parsed[1])
        for first in sorted(found):
            if fmt.SEGMENT_SUFFIX not in found[first]:
                self._move_aside(
                    [self._index_path(first)],
                    "orphan-index",
                    "an index file without its segment data file (an interrupted removal)",
                )
        firsts = sorted(f for f in found if fmt.SEGMENT_SUFFIX in found[f])
        candidates: list[_Candidate] = []
        for first in firsts:
            candidate = self._check_header(first, last=first == firsts[-1])
            if candidate is not None:
                candidates.append(candidate)
        return candidates

    def _check_header(self, first: int, last: bool) -> _Candidate | None:
        path = self._data_path(first)
        fd = self.files.open(path, OPEN_WRITE)
        try:
            size = self.files.size(fd)
            header = fmt.decode_segment_header(self.files.pread(fd, fmt.HEADER_SIZE, 0))
        finally:
            self.files.close(fd)
        if header is None:
            if last and size <= fmt.HEADER_SIZE and first >= self.acked_end:
                # its creation was interrupted before the header was flushed: no record
                log.warning(
                    "partition %d: removing segment %s, whose creation was interrupted "
                    "(%d bytes, no valid header, so no record)",
                    self.partition_id,
                    path.name,
                    size,
                )
                for p in self._paths(first):
                    self.files.unlink(p)
                self._dir_changed = True
                return None
            index_header = self._index_header(first)
            if index_header is not None:
                return _Candidate(first, header_ok=True, fix_header=index_header)
            return _Candidate(first, header_ok=False)
        if header.version != fmt.SEGMENT_FORMAT_VERSION:
            raise CorruptionError(
                f"{path}: segment format version {header.version} is not one this Waltz reads "
                f"({fmt.SEGMENT_FORMAT_VERSION}); a newer Waltz wrote it"
            )
        problem = self._header_problem(header, first)
        if problem is not None:
            self._move_aside(
                self._paths(first), "foreign-segment", f"it cannot belong here: {problem}"
            )
            return None
        return _Candidate(first, header_ok=True)

    def _header_problem(self, header: fmt.SegmentHeader, first: int) -> str | None:
        if header.cluster_key != self.cluster_key:
            return (
                f"its header names cluster {header.cluster_key}, this storage belongs to "
                f"{self.cluster_key}"
            )
        if header.partition_id != self.partition_id:
            return f"its header names partition {header.partition_id}"
        if header.first_transaction_id != first:
            return (
                f"its header says it starts at transaction {header.first_transaction_id}, "
                f"its name says {first}"
            )
        return None

    def _index_header(self, first: int) -> fmt.SegmentHeader | None:
        """The index file's copy of the header, if it is valid and fits the file name."""
        path = self._index_path(first)
        if not self.files.exists(path):
            return None
        fd = self.files.open(path, OPEN_WRITE)
        try:
            header = fmt.decode_segment_header(self.files.pread(fd, fmt.HEADER_SIZE, 0))
        finally:
            self.files.close(fd)
        if (
            header is None
            or header.version != fmt.SEGMENT_FORMAT_VERSION
            or self._header_problem(header, first) is not None
        ):
            return None
        return header

    # -- pass 2: the chain --------------------------------------------------------------------

    def _chain(self, candidates: list[_Candidate]) -> None:
        pending = {c.first: c for c in candidates}
        expected = 0
        while pending:
            first = min(pending)
            candidate = pending.pop(first)
            last = not pending
            if first < expected:
                self._move_aside(
                    self._paths(first),
                    "does-not-follow",
                    f"it starts at transaction {first}, but the segments before it already "
                    f"hold transactions up to {expected - 1}",
                )
                continue
            if not candidate.header_ok:
                why = "its header is damaged (and its index's copy too): its records are unknown"
                if last:
                    why += "; the records it held may have been acknowledged (lost tail)"
                    self._lose_tail()
                    self._tail_saved = True
                self._move_aside(self._paths(first), "unreadable-segment", why)
                continue
            if candidate.fix_header is not None:
                self._fix_header(first, candidate.fix_header)
            for seg in self._recover_segment(first, last, pending):
                self.layout.segments.append(seg)
                expected = seg.end

    def _lose_tail(self) -> None:
        if not self.layout.lost_tail:
            self.mark_lost()
            self.layout.lost_tail = True

    def _fix_header(self, first: int, header: fmt.SegmentHeader) -> None:
        path = self._data_path(first)
        fd = self.files.open(path, OPEN_WRITE)
        try:
            folder = self.quarantine.folder(
                "damaged-header",
                f"partition {self.partition_id}: the first {fmt.HEADER_SIZE} bytes of {path} "
                "(its segment header, which failed its checksum); recovery rewrote the header "
                "from the index file's copy",
            )
            self.quarantine.save(folder, f"{path.name}.header", fd, 0, fmt.HEADER_SIZE)
            self.files.pwrite(fd, fmt.encode_segment_header(header), 0)
            self.files.fdatasync(fd)
        finally:
            self.files.close(fd)
        log.warning(
            "partition %d: %s had a damaged header; rewrote it from its index (the old "
            "bytes are in %s)",
            self.partition_id,
            path.name,
            folder,
        )

    # -- one segment ------------------------------------------------------------------------

    def _recover_segment(
        self, first: int, last: bool, pending: dict[int, _Candidate]
    ) -> list[Segment]:
        """Open and check one segment file; it may be split where it is damaged (the
        parts after the damage become segment files of their own)."""
        out: list[Segment] = []
        while True:
            seg, stop = self._open_and_scan(first, last)
            out.append(seg)
            if stop is None:
                return out
            resumed = self._handle_damage(seg, stop, last, pending)
            if resumed is None:
                return out
            first = resumed

    def _open_and_scan(self, first: int, last: bool) -> tuple[Segment, str | None]:
        """Open a segment, rebuild its index after the trusted part; returns it and,
        when it does not read back to its end, why (its count and size stop there)."""
        files = self.files
        data_fd = files.open(self._data_path(first), OPEN_WRITE)
        try:
            index_fd = files.open(self._index_path(first), OPEN_CREATE, 0o644)
        except BaseException:
            files.close(data_fd)
            raise
        seg = Segment(self.directory, first, data_fd, index_fd)
        try:
            data_size = files.size(data_fd)
            header = fmt.decode_segment_header(files.pread(data_fd, fmt.HEADER_SIZE, 0))
            assert header is not None  # checked by _check_header (or fixed)
            seg.created_ms = header.creation_time_ms
            expected_header = fmt.encode_segment_header(header)
            index_header = fmt.decode_segment_header(files.pread(index_fd, fmt.HEADER_SIZE, 0))
            trusted = 0
            if index_header != header:
                log.warning(
                    "partition %d: rebuilding index %s", self.partition_id, seg.index_path.name
                )
                files.ftruncate(index_fd, 0)
                files.pwrite(index_fd, expected_header, 0)
            else:
                entries = (files.size(index_fd) - fmt.HEADER_SIZE) // fmt.INDEX_ENTRY_SIZE
                trusted = entries if not last else (entries // self.interval) * self.interval
                if self.verify_all:
                    trusted = 0
            start = fmt.HEADER_SIZE
            while trusted:
                start = self._verify_entry(seg, trusted - 1, data_size)
                if start >= 0:
                    break
                log.warning(
                    "partition %d: index %s entry %d does not match its data; "
                    "scanning from the checkpoint before it",
                    self.partition_id,
                    seg.index_path.name,
                    trusted - 1,
                )
                trusted = ((trusted - 1) // self.interval) * self.interval
                start = fmt.HEADER_SIZE
            result = fmt.ScanResult(start)
            count = trusted
            pending: list[int] = []
            for offset in fmt.scan_offsets(
                data_fd, start, data_size, first + trusted, result, pread=files.pread
            ):
                pending.append(offset)
                if len(pending) == 65536:  # rebuild the index in bounded pieces
                    files.pwrite(
                        index_fd,
                        fmt.struct_pack_offsets(pending),
                        fmt.HEADER_SIZE + count * fmt.INDEX_ENTRY_SIZE,
                    )
                    count += len(pending)
                    pending = []
            if pending:
                files.pwrite(
                    index_fd,
                    fmt.struct_pack_offsets(pending),
                    fmt.HEADER_SIZE + count * fmt.INDEX_ENTRY_SIZE,
                )
                count += len(pending)
            seg.count = count
            seg.size = result.end
            if data_size == result.end:
                files.ftruncate(index_fd, fmt.HEADER_SIZE + count * fmt.INDEX_ENTRY_SIZE)
                files.fsync(index_fd)
                return seg, None
            return seg, result.stop_reason or "trailing bytes"
        except BaseException:
            close_segment(files, seg)
            raise

    def _verify_entry(self, seg: Segment, index: int, data_size: int) -> int:
        """The end offset of the record at index entry ``index`` if it checks out, else -1."""
        raw = self.files.pread(
            seg.index_fd, fmt.INDEX_ENTRY_SIZE, fmt.HEADER_SIZE + index * fmt.INDEX_ENTRY_SIZE
        )
        if len(raw) != fmt.INDEX_ENTRY_SIZE:
            return -1
        (offset,) = fmt.INDEX_ENTRY.unpack(raw)
        return self._record_end(seg.data_fd, offset, data_size, seg.first + index)

    def _record_end(self, fd: int, offset: int, size: int, txid: int) -> int:
        """The end of the intact record ``txid`` at ``offset``, or -1."""
        return record_end(self.files, fd, offset, size, txid)

    # -- damage ----------------------------------------------------------------------------

    def _handle_damage(
        self, seg: Segment, reason: str, last: bool, pending: dict[int, _Candidate]
    ) -> int | None:
        """``seg`` reads back only up to ``seg.size``; decide about the rest. Returns the
        first id of a new segment file made of the intact records after the damage (to
        recover next), or None."""
        files = self.files
        p = seg.size
        e = seg.end
        size = files.size(seg.data_fd)
        limit = min(pending) if pending else None
        resync = self._resync(seg, p, size, e, limit)
        # the next segment starting where the intact records do: the copy of an interrupted
        # split of this segment (redone), or records this one must not claim
        if (
            resync is not None
            and resync[1] == limit
            and not self._is_copy_of(self._data_path(limit), seg.data_fd, resync[0], size)
        ):
            resync = None
        acked = e < self.acked_end  # then this is no torn write: records were flushed here
        if last and not acked and resync is None and self._torn(seg.data_fd, p, size, e):
            log.warning(
                "partition %d: cutting %d bytes after transaction %d in %s: the torn tail of "
                "a write that was not flushed (%s)",
                self.partition_id,
                size - p,
                e - 1,
                seg.data_path.name,
                reason,
            )
            self._cut(seg)
            return None
        if (
            last
            and not acked
            and resync is not None
            and self._has_zero_sector(seg.data_fd, p, resync[0])
        ):
            # A write torn by a power loss may leave pages after unwritten ones: taken for
            # one (had a zeroed region of flushed data done this, the bytes are kept here).
            why = (
                f"bytes {p}..{size} of the last segment, after transaction {e - 1}: zeros then "
                f"records from {resync[1]}, the shape of a write torn by a power loss; "
                "recovery cut them from the log"
            )
            self._save_and_cut(seg, p, size, "torn-write", why)
            return None
        if resync is None:
            if last:
                why = (
                    f"bytes {p}..{size} of the last segment {seg.data_path.name}, after "
                    f"transaction {e - 1}, fail their checksums ({reason}) and are not the "
                    "shape of a torn write: the records they held may have been acknowledged "
                    "(lost tail; the replica is caught up from its peers)"
                )
                if acked:
                    why = (
                        f"bytes {p}..{size} of the last segment {seg.data_path.name}, after "
                        f"transaction {e - 1}, fail their checksums ({reason}): "
                        + self._below_acked(e)
                    )
                self._lose_tail()
                self._save_and_cut(seg, p, size, "damaged-tail", why)
                self._tail_saved = True
                return None
            why = (
                f"bytes {p}..{size} of {seg.data_path.name}, after transaction {e - 1}, fail "
                f"their checksums ({reason}); transactions from {e} up to the next segment "
                f"({limit}) are missing until repaired from a peer"
            )
            self._save_and_cut(seg, p, size, f"damaged-records-{e}", why)
            return None
        return self._split(seg, resync, reason, pending)

    def _cut(self, seg: Segment) -> None:
        self.files.ftruncate(seg.data_fd, seg.size)
        self.files.fdatasync(seg.data_fd)
        self.files.ftruncate(seg.index_fd, fmt.HEADER_SIZE + seg.count * fmt.INDEX_ENTRY_SIZE)
        self.files.fsync(seg.index_fd)

    def _save_and_cut(self, seg: Segment, start: int, end: int, reason: str, why: str) -> None:
        folder = self.quarantine.folder(
            reason,
            f"partition {self.partition_id}: {seg.data_path.name}@{start} holds bytes "
            f"{start}..{end} of {seg.data_path}: {why}",
        )
        self.quarantine.save(folder, f"{seg.data_path.name}@{start}", seg.data_fd, start, end)
        self._cut(seg)
        log.warning(
            "partition %d: copied bytes %d..%d of %s to %s and cut them from the log: %s",
            self.partition_id,
            start,
            end,
            seg.data_path.name,
            folder,
            why,
        )

    def _split(
        self, seg: Segment, resync: tuple[int, int], reason: str, pending: dict[int, _Candidate]
    ) -> int:
        """Damaged bytes from ``p = seg.size`` up to the intact record ``j`` at offset
        ``q`` (``resync``): the records from ``q`` become segment file ``j`` (written and
        flushed first), the damaged bytes go to the quarantine, then ``seg`` is cut at
        ``p``. A crash between the steps leaves ``seg`` whole; the next recovery does the
        same again."""
        files = self.files
        p = seg.size
        q, j = resync
        size = files.size(seg.data_fd)
        target = self._data_path(j)
        pending.pop(j, None)
        if files.exists(target):
            if self._is_copy_of(target, seg.data_fd, q, size):
                # the same split, interrupted before: every byte of our copy is in seg
                for path in self._paths(j):
                    files.unlink(path)
            else:
                self._move_aside(
                    self._paths(j),
                    "does-not-follow",
                    f"its records from {j} are also in {seg.data_path.name} (from offset {q})",
                )
        header = fmt.SegmentHeader(
            fmt.SEGMENT_FORMAT_VERSION, self.files.now_ms(), self.cluster_key, self.partition_id, j
        )
        fd = files.open(target, OPEN_NEW, 0o644)
        try:
            files.pwrite(fd, fmt.encode_segment_header(header), 0)
            copy_range(files, seg.data_fd, (q, size), fd, fmt.HEADER_SIZE)
            files.fsync(fd)
        finally:
            files.close(fd)
        files.fsync_dir(self.directory)
        why = (
            f"bytes {p}..{q} of {seg.data_path.name} (transactions {seg.end}..{j - 1}) fail "
            f"their checksums ({reason}); the intact records after them, from {j}, were moved "
            f"to {target.name}; transactions {seg.end}..{j - 1} are missing until repaired "
            "from a peer"
        )
        self._save_and_cut(seg, p, q, f"damaged-records-{seg.end}-{j - 1}", why)
        return j

    def _is_copy_of(self, path: Path, src_fd: int, start: int, end: int) -> bool:
        """Whether ``path``'s records are a prefix of the source bytes ``start..end``."""
        fd = self.files.open(path, OPEN_WRITE)
        try:
            size = self.files.size(fd)
            if size - fmt.HEADER_SIZE > end - start:
                return False
            position = fmt.HEADER_SIZE
            while position < size:
                n = min(1 << 20, size - position)
                mine = self.files.pread(fd, n, position)
                theirs = self.files.pread(src_fd, n, start + position - fmt.HEADER_SIZE)
                if mine != theirs:
                    return False
                position += n
            return True
        finally:
            self.files.close(fd)

    # -- finding intact records after damaged bytes -------------------------------------------

    def _resync(
        self, seg: Segment, p: int, size: int, e: int, limit: int | None
    ) -> tuple[int, int] | None:
        """(offset, id) of the first intact record after the damaged bytes at ``p``
        (whose first record should have been ``e``), or None (:func:`resync`)."""
        return resync(
            self.files, seg.data_fd, seg.index_fd, first=seg.first, p=p, size=size, e=e, limit=limit
        )

    def _torn(self, fd: int, p: int, size: int, e: int) -> bool:
        """Whether bytes ``p..size`` (nothing intact in them) have the shape of a write
        that was not flushed when the power went: a record cut short, or zeros."""
        files = self.files
        if size - p < fmt.RECORD_OVERHEAD:
            return True
        head = files.pread(fd, fmt.RECORD_HEAD.size, p)
        txid, *_, length, _ = fmt.RECORD_HEAD.unpack(head)
        if txid == e and length >= 0 and p + fmt.RECORD_OVERHEAD + length > size:
            return True  # the file ends inside the record
        return self._has_zero_sector(fd, p, size)

    def _has_zero_sector(self, fd: int, start: int, end: int) -> bool:
        """Whether bytes ``start..end`` hold an unwritten sector: zeros from ``start`` to
        the sector boundary after it, a whole sector of zeros, or zeros up to ``end`` at
        the end of the file."""
        files = self.files
        boundary = -(-start // SECTOR) * SECTOR
        if boundary > start:
            lead = files.pread(fd, min(boundary, end) - start, start)
            if lead and not any(lead):
                return True
            if boundary >= end:
                return False
        zero = bytes(SECTOR)
        position = boundary
        while position < end:
            chunk = files.pread(fd, min(1 << 20, end - position), position)
            if not chunk:
                return False
            at = chunk.find(zero)
            while at >= 0:
                aligned = -(-at // SECTOR) * SECTOR
                if chunk[aligned : aligned + SECTOR] == zero:
                    return True
                at = chunk.find(zero, at + 1)
            tail = len(chunk) % SECTOR
            if position + len(chunk) == end and tail and not any(chunk[-tail:]):
                return True  # the last, partial sector
            position += len(chunk)
        return False
