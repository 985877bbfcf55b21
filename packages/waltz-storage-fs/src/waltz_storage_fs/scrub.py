"""Scrubbing: reading back a partition's sealed segments while the engine runs.

``FsStoragePartition.scrub`` (the contract's ``StoragePartition.scrub``) works in three
steps, none of which holds up the appends of other partitions for long:

1. :func:`verify` (a reader thread) reads the index and the records of the sealed
   segments (every one but the last, which the committer appends to) from an id on,
   within a byte budget, and checks each record as a read does (both checksums, its
   id, and that it ends where the next one begins). It stops at the first record that
   fails.
2. :func:`prepare` (a reader thread) plans what start-up recovery would do with that
   damage (:mod:`waltz_storage_fs.recovery`): the damaged record starts where the last
   intact one before it ends; the first intact record after it is found as recovery
   finds it (:func:`~waltz_storage_fs.recovery.resync`). The records from there to the
   segment's end are copied to a new segment file named after their first id (data and
   index, flushed, the directory flushed). Nobody reads that file yet, and nothing else
   of the partition runs meanwhile: the storage node issues one call of a partition at a
   time (the contract), so the segment cannot change under the copy.
3. :meth:`FsStoragePartition.commit_scrub` (the committer thread) copies the damaged
   bytes to the quarantine, makes the new segment part of the log, publishes the view
   with the hole, then cuts the damaged segment at the damaged record. A crash before
   the cut leaves the damaged segment whole: recovery then moves the new file aside as
   one that does not follow (its records are still in the damaged segment), and the
   next scrub finds the damage again. After the cut the hole survives a restart.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from waltz_api.errors import StorageError
from waltz_storage_fs import format as fmt
from waltz_storage_fs.files import OPEN_NEW, Files, copy_range
from waltz_storage_fs.quarantine import Quarantine
from waltz_storage_fs.recovery import Segment, record_end, resync

log = logging.getLogger(__name__)

INDEX_BATCH = 8192
"""Index entries read at once (64 KiB)."""
SPAN_CAP = 8 << 20
"""Most record bytes read by one pread (a call with a larger budget reads several)."""


class SealedSegment(Protocol):
    """What the scrub reads of a segment (the engine's published view of it)."""

    @property
    def first(self) -> int: ...
    @property
    def count(self) -> int: ...
    @property
    def end(self) -> int:
        """The byte offset after its last record."""

    @property
    def data_fd(self) -> int: ...
    @property
    def index_fd(self) -> int: ...


@dataclass(frozen=True)
class Damage:
    """The first record of a sealed segment that did not read back."""

    segment: int
    """The segment's first id (its file name)."""
    txid: int
    reason: str


@dataclass(frozen=True)
class Verified:
    """What :func:`verify` read."""

    next_start: int | None
    records: int
    bytes_read: int
    damage: Damage | None = None


def verify(files: Files, segments: Sequence[SealedSegment], start: int, max_bytes: int) -> Verified:
    """Check the records of ``segments`` (sealed, ascending) from id ``start`` on, reading
    at most ``max_bytes`` record bytes (at least one record); stops at the first damaged
    record (``damage``, ``next_start`` its id)."""
    records = 0
    read = 0
    for seg in segments:
        top = seg.first + seg.count
        if seg.count <= 0 or top <= start:
            continue
        txid = max(start, seg.first)
        while txid < top:
            if records and read >= max_bytes:
                return Verified(txid, records, read)
            rel = txid - seg.first
            n = min(top - txid, INDEX_BATCH)
            want = n + 1 if txid + n < top else n
            raw = files.pread(seg.index_fd, want * fmt.INDEX_ENTRY_SIZE, _entry(rel))
            if len(raw) != want * fmt.INDEX_ENTRY_SIZE:
                return _damaged(seg, txid, records, read, "its index is shorter than the segment")
            offsets = fmt.unpack_offsets(raw)
            if want == n:
                offsets.append(seg.end)
            if rel == 0 and offsets[0] != fmt.HEADER_SIZE:
                return _damaged(seg, txid, records, read, "its index entry is wrong")
            # the records that fit the budget (the call's first one always does)
            k = 0
            bad = False
            while k < n:
                lo, hi = offsets[k], offsets[k + 1]
                if not fmt.HEADER_SIZE <= lo < hi <= seg.end:
                    bad = True  # a wrong index entry: the records before it are checked first
                    break
                if (records or k) and (
                    read + hi - offsets[0] > max_bytes or hi - offsets[0] > SPAN_CAP
                ):
                    break
                k += 1
            if k:
                lo, hi = offsets[0], offsets[k]
                buf = files.pread(seg.data_fd, hi - lo, lo)
                read += len(buf)
                if len(buf) != hi - lo:
                    reason = "the segment is shorter than its index"
                    return _damaged(seg, txid, records, read, reason)
                for i in range(k):
                    try:
                        end = fmt.check_record(buf, offsets[i] - lo, txid + i)
                    except fmt.RecordFormatError as exc:
                        reason = f"{exc} at offset {offsets[i]}"
                        return _damaged(seg, txid + i, records, read, reason)
                    if end != offsets[i + 1] - lo:
                        reason = "it does not end where the next one begins"
                        return _damaged(seg, txid + i, records, read, reason)
                    records += 1
                txid += k
            if bad:
                # the entry after the record at ``txid`` is wrong, or its own is: the first
                # of the two that does not hold an intact record is the damage
                end = record_end(files, seg.data_fd, offsets[k], seg.end, txid)
                if end > 0:
                    read += end - offsets[k]
                    records += 1
                    txid += 1
                return _damaged(seg, txid, records, read, "its index entry is wrong")
            if k == 0:
                return Verified(txid, records, read)
    return Verified(None, records, read)


def _entry(rel: int) -> int:
    return fmt.HEADER_SIZE + rel * fmt.INDEX_ENTRY_SIZE


def _damaged(seg: SealedSegment, txid: int, records: int, read: int, reason: str) -> Verified:
    return Verified(txid, records, read, Damage(seg.first, txid, reason))


# -- the split ------------------------------------------------------------------------------


@dataclass
class Plan:
    """How to make a hole of damage found in a sealed segment (:func:`prepare`)."""

    segment: int
    count: int
    size: int
    """The segment's record count and byte end when planned (a commit checks them)."""
    first_damaged: int
    last_damaged: int
    cut_at: int
    """The offset of the first damaged record: the segment ends there afterwards."""
    damaged_end: int
    """The end of the damaged bytes (copied to the quarantine)."""
    reason: str
    moved_to: int | None = None
    """The first id of the new segment holding the intact records after the damage."""
    new_count: int = 0
    new_size: int = 0
    data_fd: int = -1
    index_fd: int = -1
    data_path: Path | None = None
    index_path: Path | None = None

    def hand_over(self) -> None:
        """The new segment's files are the log's now: :meth:`discard` leaves them."""
        self.data_fd = self.index_fd = -1
        self.data_path = self.index_path = None

    def discard(self, files: Files) -> None:
        """Close and delete the new segment's files (a plan not carried out; nothing once
        they were handed over)."""
        for fd in (self.data_fd, self.index_fd):
            if fd >= 0:
                files.close(fd)
        self.data_fd = self.index_fd = -1
        for path in (self.index_path, self.data_path):
            if path is not None and files.exists(path):
                files.unlink(path)


def prepare(
    files: Files,
    directory: Path,
    seg: SealedSegment,
    damage: Damage,
    *,
    cluster_key: uuid.UUID,
    partition_id: int,
    created_ms: int,
) -> Plan:
    """Plan the hole for ``damage`` in ``seg`` and write the new segment file of the
    intact records after it, if there are any (its header says it was created at
    ``created_ms``, as its records were: the age an archiver's retention reads)."""
    first, top, size = seg.first, seg.first + seg.count, seg.end
    e = damage.txid
    cut_at = fmt.HEADER_SIZE
    while e > first:
        # the damaged record starts where the last intact record before it ends
        raw = files.pread(seg.index_fd, fmt.INDEX_ENTRY_SIZE, _entry(e - 1 - first))
        if len(raw) == fmt.INDEX_ENTRY_SIZE:
            (offset,) = fmt.INDEX_ENTRY.unpack(raw)
            end = record_end(files, seg.data_fd, offset, size, e - 1)
            if end > 0:
                cut_at = end
                break
        e -= 1  # that one is damaged too
    found = resync(
        files, seg.data_fd, seg.index_fd, first=first, p=cut_at, size=size, e=e, limit=top - 1
    )
    plan = Plan(first, seg.count, size, e, top - 1, cut_at, size, damage.reason)
    if found is None:
        return plan
    q, j = found
    offsets = _moved_offsets(files, seg, j, q)
    if offsets is None:
        return plan  # more damage after it: everything after the cut moves aside
    data_path = directory / fmt.segment_file_name(j, fmt.SEGMENT_SUFFIX)
    index_path = directory / fmt.segment_file_name(j, fmt.INDEX_SUFFIX)
    if files.exists(data_path) or files.exists(index_path):
        log.warning("%s exists already: the damage in it moves aside whole", data_path)
        return plan
    plan.last_damaged, plan.damaged_end = j - 1, q
    plan.moved_to, plan.new_count, plan.new_size = j, top - j, fmt.HEADER_SIZE + size - q
    plan.data_path, plan.index_path = data_path, index_path
    try:
        encoded = fmt.encode_segment_header(
            fmt.SegmentHeader(fmt.SEGMENT_FORMAT_VERSION, created_ms, cluster_key, partition_id, j)
        )
        plan.data_fd = files.open(data_path, OPEN_NEW, 0o644)
        plan.index_fd = files.open(index_path, OPEN_NEW, 0o644)
        files.pwrite(plan.index_fd, encoded + fmt.struct_pack_offsets(offsets), 0)
        files.pwrite(plan.data_fd, encoded, 0)
        copy_range(files, seg.data_fd, (q, size), plan.data_fd, fmt.HEADER_SIZE)
        files.fsync(plan.data_fd)
        files.fsync(plan.index_fd)
        files.fsync_dir(directory)
    except BaseException:
        plan.discard(files)
        raise
    return plan


def _moved_offsets(files: Files, seg: SealedSegment, j: int, q: int) -> list[int] | None:
    """The index entries of the records ``j..`` of ``seg`` once they start at offset
    ``q`` of a new file: its own entries moved, or where a scan finds the records when
    those are wrong; None when the records there do not all read back."""
    count = seg.first + seg.count - j
    raw = files.pread(seg.index_fd, count * fmt.INDEX_ENTRY_SIZE, _entry(j - seg.first))
    old = fmt.unpack_offsets(raw) if len(raw) == count * fmt.INDEX_ENTRY_SIZE else []
    if (
        not old
        or old[0] != q
        or any(b <= a for a, b in itertools.pairwise(old))
        or old[-1] >= seg.end
    ):
        result = fmt.ScanResult(q)
        old = list(fmt.scan_offsets(seg.data_fd, q, seg.end, j, result, pread=files.pread))
        if len(old) != count or result.end != seg.end:
            return None
    shift = fmt.HEADER_SIZE - q
    return [offset + shift for offset in old]


class CutFailedError(Exception):
    """The damaged segment could not be cut (``error``): its files are in an unknown state
    until start-up recovery."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def commit(
    files: Files,
    storage_directory: Path,
    partition_id: int,
    segments: list[Segment],
    plan: Plan,
    *,
    publish: Callable[[], None],
) -> tuple[int, int] | None:
    """Carry out ``plan`` on the partition's ``segments`` (the committer's): the damaged
    bytes to the quarantine, the new segment into the list, ``publish`` (readers see the
    hole), then the damaged segment cut. Returns the range now missing, or None (the
    plan's files deleted) when the segment changed since it was planned. Raises
    StorageError when the quarantine cannot be written (nothing changed), and
    CutFailedError when the cut fails."""
    seg = next((s for s in segments if s.first == plan.segment), None)
    if seg is None or seg is segments[-1] or (seg.count, seg.size) != (plan.count, plan.size):
        plan.discard(files)
        return None
    first, last = plan.first_damaged, plan.last_damaged
    moved = ""
    if plan.moved_to is not None:
        moved = (
            f"; the intact records after them, from {plan.moved_to}, were moved to {plan.data_path}"
        )
    why = (
        f"a scrub found transactions {first}..{last} of {seg.data_path.name} damaged "
        f"({plan.reason}){moved}; they are missing until repaired from a peer"
    )
    name = f"{seg.data_path.name}@{plan.cut_at}"
    try:
        quarantine = Quarantine(files, storage_directory, partition_id)
        folder = quarantine.folder(
            f"scrub-damaged-records-{first}-{last}",
            f"partition {partition_id}: {name} holds bytes {plan.cut_at}..{plan.damaged_end} "
            f"of {seg.data_path}: {why}",
        )
        quarantine.save(folder, name, seg.data_fd, plan.cut_at, plan.damaged_end)
    except OSError as exc:  # nothing of the log changed
        plan.discard(files)
        raise StorageError(
            f"partition {partition_id}: could not copy damaged bytes to the quarantine "
            f"({exc}); the damage stays in place (reads of it fail)"
        ) from exc
    if plan.moved_to is not None:
        new = Segment(seg.data_path.parent, plan.moved_to, plan.data_fd, plan.index_fd)
        plan.hand_over()
        new.count, new.size, new.created_ms = plan.new_count, plan.new_size, seg.created_ms
        segments.insert(segments.index(seg) + 1, new)
    seg.count = first - seg.first
    seg.size = plan.cut_at
    publish()  # readers stop at the cut before it is made
    try:
        files.ftruncate(seg.data_fd, seg.size)
        files.fdatasync(seg.data_fd)
        files.ftruncate(seg.index_fd, fmt.HEADER_SIZE + seg.count * fmt.INDEX_ENTRY_SIZE)
        files.fsync(seg.index_fd)
    except OSError as exc:
        raise CutFailedError(exc) from exc
    log.warning(
        "partition %d: copied bytes %d..%d of %s to %s and cut them from the log: %s",
        partition_id,
        plan.cut_at,
        plan.damaged_end,
        seg.data_path.name,
        folder,
        why,
    )
    return first, last
