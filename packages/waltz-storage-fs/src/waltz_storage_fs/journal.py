"""A shared node journal: one durable round for every partition (issue 31).

Used by a directory of control file format 4 (:mod:`waltz_storage_fs.journaled`: the
checkpoints, the replay at the open, the migration from format 3; docs/performance.md,
"One durable round per storage node"). This module holds its format, its writer, the
scan that recovery runs and the plan of what a replay writes back into the segments
(:func:`replay_plan`).

The journal is one file per storage directory, ``waltz-storage.jnl``, preallocated and
zero-filled when it is created (so that an ``fdatasync`` of a round never also writes
the file's size or allocates blocks). It is a ring: a 4 KiB header, then the *body*,
where each round's *entry* is written at the next 512-byte boundary after the one
before, and at the body's start again when it would not fit before the body's end.

Header (first 4 KiB): magic ``WJNL``, version int32, creation time int64 (ms), cluster
key (16 bytes), body size int64, salt (8 random bytes), CRC-32C of those fields.

Entry: magic ``WJE1``, sequence number int64 (one more than the entry before, for as
long as the journal exists), body length int32, body CRC-32C uint32, head CRC-32C
uint32 (of the salt and the head's fields); then the body: for each partition written
in the round, partition id int32, first transaction id int64, record count int32, byte
length int32, and the records in the segment files' record format. The salt keeps
record data (which a client chooses) from ever passing for an entry head.

Recovery scans from a checkpoint (a position and the sequence number of the entry
there, kept by the engine) entry after entry while each one is whole and carries the
next sequence number. Where it stops, the rest of the body tells what the stop is
(:class:`JournalScan`):

- ``zeros``: only zeros there: the preallocated tail, nothing was ever written;
- ``torn``: bytes that are no whole entry with the next number (a torn write of a
  round whose flush never completed, or an older lap's entries): never acknowledged;
- ``damaged``: a whole entry with the next number or a later one is somewhere else in
  the body: an entry that had been made durable (a later round was only written once
  it was) is gone. Nothing may be cut there: :meth:`Journal.open` raises.

An entry is only written once the one before it is durable (one round in flight), so a
torn entry is always the last one written; every entry before it was durable. A lost
write of the *last* entry before a power loss (a disk that acknowledged a flush it did
not keep) looks like ``zeros`` or ``torn``: only a later durable write can witness
it, the next round's entry here (the control file's acknowledged end does it today, at
the cost of a second flush per round).
"""

from __future__ import annotations

import os
import struct
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import crc32c

from waltz_api.errors import CorruptionError, StorageError
from waltz_storage_fs import format as fmt
from waltz_storage_fs.files import OPEN_NEW, OPEN_WRITE, Files

JOURNAL_FILE_NAME = "waltz-storage.jnl"
JOURNAL_VERSION = 1
HEADER_BLOCK = 4096
"""The header's block: the body starts after it."""
ALIGN = 512
"""Each entry starts at a multiple of this (a sector: a torn write keeps whole ones)."""
_ZERO_CHUNK = 1 << 20

_HEADER = struct.Struct(">4siq16sq8s")  # magic, version, creation ms, key, body size, salt
_HEADER_MAGIC = b"WJNL"
_CRC = struct.Struct(">I")
_HEAD = struct.Struct(">4sqiI")  # magic, sequence number, body length, body crc
_HEAD_MAGIC = b"WJE1"
HEAD_SIZE = _HEAD.size + _CRC.size  # 24 bytes
_CHUNK = struct.Struct(">iqii")  # partition, first id, record count, byte length


@dataclass(frozen=True, slots=True)
class JournalHeader:
    version: int
    created_ms: int
    cluster_key: uuid.UUID
    body_size: int
    salt: bytes

    @property
    def body_end(self) -> int:
        return HEADER_BLOCK + self.body_size


@dataclass(frozen=True, slots=True)
class Chunk:
    """One partition's records in one round."""

    partition_id: int
    first_txid: int
    count: int
    blob: bytes
    """The records, in the segment files' record format."""


@dataclass(frozen=True, slots=True)
class Entry:
    position: int
    sequence: int
    end: int
    """The position after it (before the alignment's padding)."""
    chunks: tuple[Chunk, ...]


@dataclass
class JournalScan:
    """What a scan found (:func:`scan`)."""

    entries: list[Entry] = field(default_factory=list)
    position: int = HEADER_BLOCK
    """Where the next entry goes (after the last whole one)."""
    sequence: int = 0
    """The next entry's sequence number."""
    tail: str = "zeros"
    """``zeros``, ``torn`` or ``damaged`` (see the module)."""
    found: list[tuple[int, int]] = field(default_factory=list)
    """``damaged``: (position, sequence) of each whole entry found past the stop."""


def _align(position: int) -> int:
    return -(-position // ALIGN) * ALIGN


def encode_header(header: JournalHeader) -> bytes:
    body = _HEADER.pack(
        _HEADER_MAGIC,
        header.version,
        header.created_ms,
        header.cluster_key.bytes,
        header.body_size,
        header.salt,
    )
    body += _CRC.pack(crc32c.crc32c(body))
    return body + bytes(HEADER_BLOCK - len(body))


def decode_header(raw: bytes, path: Path | str = JOURNAL_FILE_NAME) -> JournalHeader:
    if len(raw) < _HEADER.size + _CRC.size:
        raise CorruptionError(f"{path}: the journal's header is short ({len(raw)} bytes)")
    fields = raw[: _HEADER.size]
    (crc,) = _CRC.unpack_from(raw, _HEADER.size)
    magic, version, created, key, body_size, salt = _HEADER.unpack(fields)
    if magic != _HEADER_MAGIC or crc32c.crc32c(fields) != crc:
        raise CorruptionError(
            f"{path}: the journal's header is damaged: restore the storage directory from "
            "a replica (waltz storage repair) or a backup"
        )
    if version != JOURNAL_VERSION:
        raise StorageError(
            f"{path}: journal version {version}; this Waltz reads version "
            f"{JOURNAL_VERSION}: upgrade the storage node"
        )
    return JournalHeader(version, created, uuid.UUID(bytes=key), body_size, salt)


def encode_entry(salt: bytes, sequence: int, chunks: Sequence[Chunk]) -> bytes:
    """An entry's bytes (unpadded)."""
    body = b"".join(
        _CHUNK.pack(c.partition_id, c.first_txid, c.count, len(c.blob)) + c.blob for c in chunks
    )
    head = _HEAD.pack(_HEAD_MAGIC, sequence, len(body), crc32c.crc32c(body))
    return head + _CRC.pack(crc32c.crc32c(salt + head)) + body


def _head_at(salt: bytes, raw: bytes | memoryview, at: int) -> tuple[int, int, int] | None:
    """(sequence, body length, body crc) of a valid head at ``at`` of ``raw``."""
    if len(raw) - at < HEAD_SIZE or raw[at : at + 4] != _HEAD_MAGIC:
        return None
    head = bytes(raw[at : at + _HEAD.size])
    if _CRC.unpack_from(raw, at + _HEAD.size)[0] != crc32c.crc32c(salt + head):
        return None
    _, sequence, length, body_crc = _HEAD.unpack(head)
    if length < 0:
        return None
    return sequence, length, body_crc


def _decode_body(body: bytes) -> tuple[Chunk, ...] | None:
    chunks: list[Chunk] = []
    at = 0
    while at < len(body):
        if len(body) - at < _CHUNK.size:
            return None
        partition, first, count, length = _CHUNK.unpack_from(body, at)
        at += _CHUNK.size
        if length < 0 or count < 0 or at + length > len(body):
            return None
        chunks.append(Chunk(partition, first, count, body[at : at + length]))
        at += length
    return tuple(chunks)


class Journal:
    """An open journal (its writer): :meth:`append` writes an entry, :meth:`sync`
    makes it durable. One entry in flight: the next is written once the one before is
    durable (see the module)."""

    def __init__(self, files: Files, path: Path, fd: int, header: JournalHeader) -> None:
        self.files = files
        self.path = path
        self.fd = fd
        self.header = header
        self.position = HEADER_BLOCK
        self.sequence = 0
        self.live = HEADER_BLOCK
        """The position of the oldest entry not checkpointed (not to be written over)."""
        self._wrapped = False
        """Whether the write position has wrapped past ``live`` (it is then below it)."""

    @classmethod
    def create(
        cls, files: Files, directory: Path, cluster_key: uuid.UUID, body_size: int
    ) -> Journal:
        """Create the journal, zero-filled, durable (its entry in the directory too)."""
        if body_size < ALIGN or body_size % ALIGN:
            raise StorageError(f"journal body size {body_size}: a multiple of {ALIGN} needed")
        header = JournalHeader(
            JOURNAL_VERSION, files.now_ms(), cluster_key, body_size, os.urandom(8)
        )
        path = directory / JOURNAL_FILE_NAME
        fd = files.open(path, OPEN_NEW)
        try:
            files.pwrite(fd, encode_header(header), 0)
            for at in range(HEADER_BLOCK, header.body_end, _ZERO_CHUNK):
                files.pwrite(fd, bytes(min(_ZERO_CHUNK, header.body_end - at)), at)
            files.fsync(fd)
            files.fsync_dir(directory)
        except BaseException:
            files.close(fd)
            raise
        return cls(files, path, fd, header)

    @classmethod
    def open(
        cls, files: Files, directory: Path, checkpoint: tuple[int, int] = (HEADER_BLOCK, 0)
    ) -> tuple[Journal, JournalScan]:
        """Open the journal and scan it from ``checkpoint`` (position, sequence number).
        CorruptionError when the scan finds it ``damaged`` (nothing is cut)."""
        path = directory / JOURNAL_FILE_NAME
        fd = files.open(path, OPEN_WRITE)
        try:
            header = decode_header(files.pread(fd, HEADER_BLOCK, 0), path)
            if files.size(fd) < header.body_end:
                raise CorruptionError(
                    f"{path}: the journal is shorter ({files.size(fd)} bytes) than its "
                    f"header says ({header.body_end}): restore the storage directory from "
                    "a replica or a backup"
                )
            found = scan(files, fd, header, *checkpoint)
        except BaseException:
            files.close(fd)
            raise
        if found.tail == "damaged":
            files.close(fd)
            where = ", ".join(f"#{s} at {p}" for p, s in found.found[:5])
            raise CorruptionError(
                f"{path}: entry #{found.sequence} at offset {found.position} is not whole, "
                f"but later entries are ({where}): records made durable are lost. Nothing "
                "was cut; repair this node from a replica (waltz storage repair)"
            )
        journal = cls(files, path, fd, header)
        journal.position = journal._start(found.position)
        journal.sequence = found.sequence
        journal.live = journal._start(checkpoint[0])
        # the same position: an empty ring, or one that the entries since fill
        journal._wrapped = journal.position < journal.live or (
            journal.position == journal.live and bool(found.entries)
        )
        return journal, found

    def _start(self, position: int) -> int:
        """``position``, the end of the body read as its start (where the next entry
        goes): a position at the end would let the next lap wrap over the live entries."""
        return HEADER_BLOCK if position >= self.header.body_end else position

    def append(self, chunks: Sequence[Chunk]) -> int:
        """Write one round's entry (not durable until :meth:`sync`); the position it
        was written at (its sequence number is :attr:`sequence` less one). StorageError
        when the ring has no room before the oldest entry not checkpointed (checkpoint,
        then retry)."""
        entry = encode_entry(self.header.salt, self.sequence, chunks)
        if len(entry) > self.header.body_size:
            raise StorageError(
                f"{self.path}: a round of {len(entry)} bytes does not fit in the journal "
                f"({self.header.body_size} bytes): a bug (the committer writes an append "
                "larger than half the journal straight to its segments); restart the "
                "storage node"
            )
        at = self._place(len(entry))
        if at is None:
            raise StorageError(
                f"{self.path}: the journal is full (the entries from offset {self.live} are "
                "not checkpointed): checkpoint the segments first"
            )
        self.files.pwrite(self.fd, entry, at)
        end = _align(at + len(entry))
        self._wrapped = self._wrapped or at < self.position or end >= self.header.body_end
        self.position = self._start(end)
        self.sequence += 1
        return at

    @property
    def used(self) -> int:
        """The bytes of the body holding entries not checkpointed."""
        if self._wrapped:
            return self.header.body_size - (self.live - self.position)
        return self.position - self.live

    def fits(self, length: int) -> bool:
        """Whether an entry of ``length`` bytes (about) can be written now."""
        return self._place(length) is not None

    def _place(self, length: int) -> int | None:
        """Where an entry of ``length`` bytes goes: at the writer's position, or at the
        start of the ring when it does not fit before the end; None when the ring has no
        room for it before the oldest live entry (once the writer wrapped, the start of
        the ring is live: it never wraps again before a checkpoint)."""
        at, wraps = self.position, False
        if at + length > self.header.body_end:
            if self._wrapped:
                return None
            at, wraps = HEADER_BLOCK, True
        if (self._wrapped or wraps) and at + length > self.live:
            return None
        return at

    def sync(self) -> None:
        """Make the entries written durable (one ``fdatasync``: no size change)."""
        self.files.fdatasync(self.fd)

    def checkpointed(self, position: int) -> None:
        """Every entry before the one at ``position`` is in durable segments: their room
        may be written over."""
        position = self._start(position)
        if position < self.live or position == self.position:
            self._wrapped = False  # (at the writer's position: every entry is)
        self.live = position

    def close(self) -> None:
        self.files.close(self.fd)


def scan(files: Files, fd: int, header: JournalHeader, position: int, sequence: int) -> JournalScan:
    """Read the entries from ``position`` (the one numbered ``sequence``) while each is
    whole and numbered in turn, then tell what stopped it (see the module)."""
    salt = header.salt
    raw = files.pread(fd, header.body_size, HEADER_BLOCK)
    result = JournalScan(position=position, sequence=sequence)
    seen: set[int] = set()

    def whole(at: int, expected: int | None) -> Entry | None:
        rel = at - HEADER_BLOCK
        head = _head_at(salt, raw, rel)
        if head is None or (expected is not None and head[0] != expected):
            return None
        number, length, body_crc = head
        body = raw[rel + HEAD_SIZE : rel + HEAD_SIZE + length]
        if len(body) != length or crc32c.crc32c(body) != body_crc:
            return None
        chunks = _decode_body(body)
        if chunks is None:
            return None
        return Entry(at, number, at + HEAD_SIZE + length, chunks)

    while True:
        entry = None
        if result.position < header.body_end:
            entry = whole(result.position, result.sequence)
        if entry is None and result.position != HEADER_BLOCK:
            entry = whole(HEADER_BLOCK, result.sequence)  # the writer wrapped
        if entry is None or entry.position in seen:
            break
        seen.add(entry.position)
        result.entries.append(entry)
        result.position = min(_align(entry.end), header.body_end)
        result.sequence += 1
    for at in range(HEADER_BLOCK, header.body_end, ALIGN):
        if at in seen:
            continue
        later = whole(at, None)
        if later is not None and later.sequence >= result.sequence:
            result.found.append((at, later.sequence))
    if result.found:
        result.tail = "damaged"
    elif any(raw[result.position - HEADER_BLOCK :]):
        result.tail = "torn"
    else:
        result.tail = "zeros"
    return result


def replay_plan(entries: Sequence[Entry], ends: Mapping[int, int]) -> dict[int, list[Chunk]]:
    """What recovery writes back into each partition's segments: for each partition of
    ``ends`` (the id after the last record its segments hold once their own recovery
    ran), the records the entries hold from that id on, as chunks in order (a chunk cut
    at a record boundary where the end falls inside it). Entries of partitions not in
    ``ends`` are left out (not hosted any more).

    CorruptionError when a partition's records in the journal are not one run of
    consecutive ids, or start above its end (records the journal and the segments
    both lack: acknowledged, then lost): the journal then disagrees with the segments
    and nothing may be guessed."""
    plan: dict[int, list[Chunk]] = {}
    expected: dict[int, int] = {}
    for entry in entries:
        for chunk in entry.chunks:
            pid = chunk.partition_id
            if pid not in ends:
                continue
            after = expected.get(pid)
            if after is not None and chunk.first_txid != after:
                raise CorruptionError(
                    f"journal entry #{entry.sequence} holds partition {pid}'s ids from "
                    f"{chunk.first_txid}, the entry before it up to {after - 1}: the journal "
                    "disagrees with itself; repair this node from a replica"
                )
            if after is None and chunk.first_txid > ends[pid]:
                raise CorruptionError(
                    f"partition {pid}'s segments end before id {ends[pid]} and the journal "
                    f"(entry #{entry.sequence}) holds it from id {chunk.first_txid} on: ids "
                    f"{ends[pid]}..{chunk.first_txid - 1}, made durable, are in neither; "
                    "repair this partition from a replica"
                )
            expected[pid] = chunk.first_txid + chunk.count
            if expected[pid] <= ends[pid]:
                continue
            skip = max(0, ends[pid] - chunk.first_txid)
            blob = chunk.blob[_record_offset(chunk, skip, entry.sequence) :]
            plan.setdefault(pid, []).append(
                Chunk(pid, chunk.first_txid + skip, chunk.count - skip, blob)
            )
    return plan


def _record_offset(chunk: Chunk, index: int, sequence: int) -> int:
    """The offset in ``chunk.blob`` of its record ``index`` (each record checked)."""
    offset = 0
    for number in range(index):
        try:
            offset = fmt.check_record(chunk.blob, offset, chunk.first_txid + number)
        except fmt.RecordFormatError as exc:
            raise CorruptionError(
                f"journal entry #{sequence}: partition {chunk.partition_id}'s record "
                f"{chunk.first_txid + number} is invalid ({exc}) in a whole entry: a bug "
                "wrote it; repair this node from a replica"
            ) from None
    return offset


__all__ = [
    "ALIGN",
    "HEADER_BLOCK",
    "JOURNAL_FILE_NAME",
    "JOURNAL_VERSION",
    "Chunk",
    "Entry",
    "Journal",
    "JournalHeader",
    "JournalScan",
    "decode_header",
    "encode_entry",
    "encode_header",
    "replay_plan",
    "scan",
]
