"""The on-disk format (spec: on-disk-data-structures.txt), big-endian as the original.

Storage directory::

    <storage directory>/
        waltz-storage.ctl                  the control file
        0/                                 partition 0
            0000000000000000000.seg        segment data file (<first transaction id>.seg)
            0000000000000000000.idx        the segment's index file
        1/ ...
        quarantine/                        files recovery moved aside (never deleted)
            0/<time>-<reason>/             one folder per action, with a README

Format versions: the control file's version is the storage directory's format
(:data:`FORMAT_VERSION`, 4, the newest). Which one a directory is written in follows the
cluster's feature level (:mod:`waltz_api.features`, :data:`FORMAT_OF_LEVEL`): at level 1
format 2 (what 0.1.0 writes: no acknowledged end, so no lost-tail check), at level 2
format 3. Every version opens: version 1 (the original's three session fields) is
migrated to 2 at the first open; a version-2 directory stays version 2 until the engine
is told level 2 (:meth:`FsStorageEngine.raise_feature_level`), which migrates it in
place (the old file is kept beside it as ``waltz-storage.ctl.v<version>``) and gives
each partition the acknowledged end of the log it holds then. A version-3 directory is
not readable by 0.1.0, which knows version 2 only. Segment and index files carry their
own version (:data:`SEGMENT_FORMAT_VERSION`, 1, unchanged). Version 4
(:data:`JOURNAL_CONTROL_VERSION`, written at feature level 3)
is version 3 plus a node journal
(:mod:`waltz_storage_fs.journal`, :mod:`waltz_storage_fs.journaled`): after the partition
infos, two checkpoint slots written alternately (counter, journal position, the entry's
sequence number: int64 each, then a CRC-32C; the valid slot with the higher counter is
the checkpoint).

Control file: a 128-byte header (format version int32, creation time int64 in
ms, cluster key UUID, number of partitions int32, then reserved bytes of which
the first four hold a CRC-32C of the fields before them), then one partition
info per partition of the cluster: the partition id (int32) and two partition
info structs, written alternately. A struct (version 3) is session id,
low-water mark, local low-water mark, low-water-mark session id, acknowledged
end (int64 each), flags (int32: bit 0 hosted here, bit 1 marked unavailable by
an administrator), sequence number (int64) and a CRC-32C (uint32) of the
partition id and the struct's other fields: 56 bytes. The valid struct with
the higher sequence number is the current one. (Version 2 structs lack the
acknowledged end: 48 bytes; version 1 structs also lack the low-water-mark
session: 40 bytes.)

The *acknowledged end* is the id after the last record the engine made durable
and may have acknowledged (``max transaction id + 1``; the log's start when it is
empty). It is kept apart from the records so that start-up recovery can tell a
tail lost after it was acknowledged (a lost write: zeros or older bytes where
flushed records were, a short file, a missing segment) from the torn tail of a
write that was never flushed: the engine writes it, and flushes the control file,
after a commit group's data flushes completed (while the next group's data is being
flushed) and before any append of the group is acknowledged; a truncation lowers it
before it cuts the files.

Segment data and index files start with the same 128-byte header: format
version int32, creation time int64, cluster key UUID, partition id int32,
first transaction id int64, then reserved bytes of which the first four hold
a CRC-32C of the fields before them.

A record is: transaction id int64, ReqId (client id, generation, partition
id, sequence number: int32 each), transaction header int32, data length
int32, data CRC-32C uint32, the data, and the record CRC-32C uint32 of the
36 fixed bytes before the data (which include the data's checksum, so the
record checksum and the data checksum together cover every byte).

An index file body is an array of int64 record offsets in the data file,
entry ``i`` for transaction ``first + i``.
"""

from __future__ import annotations

import os
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import crc32c

from waltz_api.types import NO_SESSION, NO_TRANSACTION, Record, ReqId, SessionInfo

FORMAT_VERSION = 4
"""The storage directory's on-disk format: the control file's version."""
CONTROL_VERSIONS = (1, 2, 3, 4)
"""Control file versions this code opens (version 1 is migrated to 2 at the open)."""
FORMAT_OF_LEVEL = {1: 2, 2: 3, 3: 4}
"""The control file version written at each cluster feature level."""
ACKED_END_VERSION = 3
"""The first version that keeps each partition's acknowledged end."""
JOURNAL_CONTROL_VERSION = 4
"""The first version whose directory has a node journal (:mod:`waltz_storage_fs.journal`)
and whose control file keeps its checkpoint; written at feature level
:data:`JOURNAL_LEVEL`."""
JOURNAL_LEVEL = 3


LOST_TAIL_UNCHECKED = (
    "control file format {version} keeps no acknowledged ends (cluster feature level 1): "
    "a lost acknowledged tail cannot be told from a torn write, so it is not checked; "
    "raising the cluster's feature level to 2 (`waltz cluster features --raise`) "
    "migrates the directory to format 3"
)
"""What ``waltz storage verify`` notes, and the engine logs at open, on a directory of
format 1 or 2."""


def level_of_format(version: int) -> int:
    """The feature level a directory of control file ``version`` is written at."""
    return max((lvl for lvl, v in FORMAT_OF_LEVEL.items() if v <= version), default=1)


SEGMENT_FORMAT_VERSION = 1
"""The version in segment and index file headers."""
CONTROL_FILE_NAME = "waltz-storage.ctl"
QUARANTINE_DIR_NAME = "quarantine"
HEADER_SIZE = 128

SEGMENT_SUFFIX = ".seg"
INDEX_SUFFIX = ".idx"
TXID_DIGITS = 19

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# -- control file ---------------------------------------------------------------------

_CONTROL_HEADER = struct.Struct(">iq16si")  # version, creation ms, key, number of partitions
_HEADER_CRC = struct.Struct(">I")

_PARTITION_ID = struct.Struct(">i")
_INFO_FIELDS_V1 = struct.Struct(">qqqiq")  # session, low-water, local low-water, flags, sequence
_INFO_FIELDS_V2 = struct.Struct(">qqqqiq")  # ... and the low-water mark's session after local
_INFO_FIELDS = struct.Struct(">qqqqqiq")  # ... and the acknowledged end after that
INFO_STRUCT_SIZE = _INFO_FIELDS.size + 4  # + CRC-32C = 56 bytes
PARTITION_INFO_SIZE = _PARTITION_ID.size + 2 * INFO_STRUCT_SIZE  # 116 bytes
_LAYOUTS = {1: _INFO_FIELDS_V1, 2: _INFO_FIELDS_V2, 3: _INFO_FIELDS, 4: _INFO_FIELDS}
_CHECKPOINT = struct.Struct(">qqq")  # counter, journal position, entry sequence number
CHECKPOINT_SLOT_SIZE = _CHECKPOINT.size + 4  # + CRC-32C = 28 bytes
_STRUCT_SIZES = {version: layout.size + 4 for version, layout in _LAYOUTS.items()}

ACKED_END_UNKNOWN = -1
"""The acknowledged end of a struct migrated from an older version: recovery sets it to
the log's end (and checks nothing against it that once)."""

FLAG_ASSIGNED = 0x1
"""The partition is hosted by this storage node."""
FLAG_UNAVAILABLE = 0x2
"""An administrator marked the partition unavailable (it refuses storage requests)."""


def info_struct_size(version: int = FORMAT_VERSION) -> int:
    return _STRUCT_SIZES[version]


def partition_info_size(version: int = FORMAT_VERSION) -> int:
    return _PARTITION_ID.size + 2 * _STRUCT_SIZES[version]


@dataclass(frozen=True, slots=True)
class ControlHeader:
    version: int
    creation_time_ms: int
    cluster_key: uuid.UUID
    num_partitions: int


@dataclass(frozen=True, slots=True)
class InfoStruct:
    """One of a partition's two alternating partition info structs."""

    session_info: SessionInfo
    flags: int
    sequence: int
    acked_end: int = 0
    """The id after the last record made durable and maybe acknowledged (version 3);
    :data:`ACKED_END_UNKNOWN` in a directory migrated from an older version until its
    first recovery sets it."""

    @property
    def assigned(self) -> bool:
        return bool(self.flags & FLAG_ASSIGNED)

    @property
    def available(self) -> bool:
        return not self.flags & FLAG_UNAVAILABLE


def encode_control_header(header: ControlHeader) -> bytes:
    fields = _CONTROL_HEADER.pack(
        header.version, header.creation_time_ms, header.cluster_key.bytes, header.num_partitions
    )
    body = fields + _HEADER_CRC.pack(crc32c.crc32c(fields))
    return body + bytes(HEADER_SIZE - len(body))


def decode_control_header(raw: bytes) -> ControlHeader | None:
    """The header, or ``None`` when it is short or fails its checksum."""
    if len(raw) < HEADER_SIZE:
        return None
    fields = raw[: _CONTROL_HEADER.size]
    (stored,) = _HEADER_CRC.unpack_from(raw, _CONTROL_HEADER.size)
    if crc32c.crc32c(fields) != stored:
        return None
    version, created, key, num = _CONTROL_HEADER.unpack(fields)
    return ControlHeader(version, created, uuid.UUID(bytes=key), num)


def partition_info_offset(partition_id: int, version: int = FORMAT_VERSION) -> int:
    return HEADER_SIZE + partition_id * partition_info_size(version)


def info_struct_offset(partition_id: int, slot: int, version: int = FORMAT_VERSION) -> int:
    return (
        partition_info_offset(partition_id, version)
        + _PARTITION_ID.size
        + slot * _STRUCT_SIZES[version]
    )


def encode_info_struct(partition_id: int, info: InfoStruct, version: int = FORMAT_VERSION) -> bytes:
    """A struct in the current format (``version``: an older one, for tests' fixtures)."""
    s = info.session_info
    values = [s.session_id, s.low_water_mark, s.local_low_water_mark]
    if version >= 2:
        values.append(s.low_water_mark_session_id)
    if version >= 3:
        values.append(info.acked_end)
    fields = _LAYOUTS[version].pack(*values, info.flags, info.sequence)
    crc = crc32c.crc32c(fields, crc32c.crc32c(_PARTITION_ID.pack(partition_id)))
    return fields + _HEADER_CRC.pack(crc)


def decode_info_struct(
    partition_id: int, raw: bytes, version: int = FORMAT_VERSION
) -> InfoStruct | None:
    """The struct, or ``None`` when it is short or fails its checksum. A version-1 struct
    has no low-water-mark session: it reads as NO_SESSION (unknown); a struct older than
    version 3 has no acknowledged end: it reads as 0 (the migration sets it)."""
    layout = _LAYOUTS[version]
    if len(raw) < layout.size + 4:
        return None
    fields = raw[: layout.size]
    (stored,) = _HEADER_CRC.unpack_from(raw, layout.size)
    if crc32c.crc32c(fields, crc32c.crc32c(_PARTITION_ID.pack(partition_id))) != stored:
        return None
    values = list(layout.unpack(fields))
    flags, sequence = values[-2:]
    session, low, local_low = values[:3]
    low_session = values[3] if version >= 2 else NO_SESSION
    acked_end = values[4] if version >= 3 else 0
    return InfoStruct(SessionInfo(session, low, local_low, low_session), flags, sequence, acked_end)


def encode_partition_info(
    partition_id: int, first: InfoStruct, second: InfoStruct, version: int = FORMAT_VERSION
) -> bytes:
    return (
        _PARTITION_ID.pack(partition_id)
        + encode_info_struct(partition_id, first, version)
        + encode_info_struct(partition_id, second, version)
    )


def decode_partition_info(
    partition_id: int, raw: bytes, version: int = FORMAT_VERSION
) -> tuple[int | None, InfoStruct | None, InfoStruct | None]:
    """(stored partition id, struct 1, struct 2); a struct is ``None`` when invalid."""
    if len(raw) < _PARTITION_ID.size:
        return None, None, None
    (stored_id,) = _PARTITION_ID.unpack_from(raw, 0)
    size = _STRUCT_SIZES[version]
    first = decode_info_struct(partition_id, raw[4 : 4 + size], version)
    second = decode_info_struct(partition_id, raw[4 + size : 4 + 2 * size], version)
    return stored_id, first, second


def current_struct(
    first: InfoStruct | None, second: InfoStruct | None
) -> tuple[int, InfoStruct] | None:
    """(slot, struct) of the valid struct with the higher sequence number, or ``None``."""
    candidates = [(s.sequence, slot, s) for slot, s in ((0, first), (1, second)) if s is not None]
    if not candidates:
        return None
    _, slot, struct_ = max(candidates, key=lambda c: (c[0], c[1]))
    return slot, struct_


def initial_partition_info(partition_id: int, version: int = FORMAT_VERSION) -> bytes:
    """A partition info for a partition not hosted here: both structs valid."""
    empty = SessionInfo()
    return encode_partition_info(
        partition_id, InfoStruct(empty, 0, 1), InfoStruct(empty, 0, 0), version
    )


def invalid_partition_info(partition_id: int, version: int = FORMAT_VERSION) -> bytes:
    """A partition info whose two structs both fail their checksum (kept as such)."""
    raw = _PARTITION_ID.pack(partition_id) + bytes(2 * _STRUCT_SIZES[version])
    assert decode_partition_info(partition_id, raw, version)[1:] == (None, None)
    return raw


def checkpoint_offset(num_partitions: int, slot: int) -> int:
    """Where a version-4 control file keeps checkpoint slot ``slot`` (0 or 1): after the
    partition infos."""
    return partition_info_offset(num_partitions, JOURNAL_CONTROL_VERSION) + (
        slot * CHECKPOINT_SLOT_SIZE
    )


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """The journal's checkpoint (version 4): every entry before ``position`` is in
    flushed segment files; the entry there is numbered ``sequence``."""

    counter: int
    position: int
    sequence: int


def encode_checkpoint(checkpoint: Checkpoint) -> bytes:
    fields = _CHECKPOINT.pack(checkpoint.counter, checkpoint.position, checkpoint.sequence)
    return fields + _HEADER_CRC.pack(crc32c.crc32c(fields))


def decode_checkpoint(raw: bytes) -> Checkpoint | None:
    if len(raw) < CHECKPOINT_SLOT_SIZE:
        return None
    fields = raw[: _CHECKPOINT.size]
    if _HEADER_CRC.unpack_from(raw, _CHECKPOINT.size)[0] != crc32c.crc32c(fields):
        return None
    return Checkpoint(*_CHECKPOINT.unpack(fields))


def now_ms() -> int:
    """The wall clock in milliseconds (the engine asks its file layer: ``Files.now_ms``)."""
    return time.time_ns() // 1_000_000


# -- segment files --------------------------------------------------------------------

_SEGMENT_HEADER = struct.Struct(">iq16siq")  # version, creation ms, key, partition, first id


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    version: int
    creation_time_ms: int
    cluster_key: uuid.UUID
    partition_id: int
    first_transaction_id: int


def encode_segment_header(header: SegmentHeader) -> bytes:
    fields = _SEGMENT_HEADER.pack(
        header.version,
        header.creation_time_ms,
        header.cluster_key.bytes,
        header.partition_id,
        header.first_transaction_id,
    )
    body = fields + _HEADER_CRC.pack(crc32c.crc32c(fields))
    return body + bytes(HEADER_SIZE - len(body))


def decode_segment_header(raw: bytes) -> SegmentHeader | None:
    if len(raw) < HEADER_SIZE:
        return None
    fields = raw[: _SEGMENT_HEADER.size]
    (stored,) = _HEADER_CRC.unpack_from(raw, _SEGMENT_HEADER.size)
    if crc32c.crc32c(fields) != stored:
        return None
    version, created, key, partition_id, first = _SEGMENT_HEADER.unpack(fields)
    return SegmentHeader(version, created, uuid.UUID(bytes=key), partition_id, first)


def segment_file_name(first_transaction_id: int, suffix: str) -> str:
    return f"{first_transaction_id:0{TXID_DIGITS}d}{suffix}"


def parse_segment_file_name(name: str) -> tuple[int, str] | None:
    """(first transaction id, suffix) of a segment or index file name, else ``None``."""
    for suffix in (SEGMENT_SUFFIX, INDEX_SUFFIX):
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            if len(stem) == TXID_DIGITS and stem.isdigit():
                return int(stem), suffix
    return None


# -- the log's start (a dropped prefix) ------------------------------------------------

LOG_START_FILE_NAME = "log-start"
"""In a partition directory: the id of the first record kept once a prefix of the log was
dropped (archived elsewhere). Absent: the log starts at 0."""
_LOG_START = struct.Struct(">4sq")  # magic, first id; then CRC-32C of both
_LOG_START_MAGIC = b"WLS1"
LOG_START_SIZE = _LOG_START.size + 4


def encode_log_start(start: int) -> bytes:
    head = _LOG_START.pack(_LOG_START_MAGIC, start)
    return head + _HEADER_CRC.pack(crc32c.crc32c(head))


def decode_log_start(raw: bytes) -> int | None:
    """The start in a log-start file, or None when the bytes are not a valid one."""
    if len(raw) != LOG_START_SIZE:
        return None
    head = raw[: _LOG_START.size]
    (stored,) = _HEADER_CRC.unpack_from(raw, _LOG_START.size)
    if stored != crc32c.crc32c(head):
        return None
    magic, start = _LOG_START.unpack(head)
    if magic != _LOG_START_MAGIC or start < 0:
        return None
    return int(start)


# -- records ----------------------------------------------------------------------------

RECORD_HEAD = struct.Struct(">qiiiiiiI")  # id, ReqId x4, header, data length, data crc
_TXID = struct.Struct(">q")
_LENGTH_CRC = struct.Struct(">iI")  # at offset 28 of a record
RECORD_CRC = struct.Struct(">I")
_RECORD_CRC = RECORD_CRC
RECORD_OVERHEAD = RECORD_HEAD.size + _RECORD_CRC.size  # 40 bytes
INDEX_ENTRY = struct.Struct(">q")
INDEX_ENTRY_SIZE = INDEX_ENTRY.size


def check_int32(value: int, what: str) -> None:
    if not INT32_MIN <= value <= INT32_MAX:
        raise ValueError(f"{what} {value} does not fit in a signed 32-bit integer")


def encode_record(record: Record) -> bytes:
    """The record's bytes on disk. The caller has checked its data checksum."""
    r = record.req_id
    head = RECORD_HEAD.pack(
        record.transaction_id,
        r.client_id,
        r.generation,
        r.partition_id,
        r.seq_num,
        record.header,
        len(record.data),
        record.checksum,
    )
    return head + record.data + _RECORD_CRC.pack(crc32c.crc32c(head))


class RecordFormatError(Exception):
    """A record's bytes are invalid (internal: the engine raises CorruptionError)."""


def decode_record(buf: bytes | memoryview, pos: int) -> tuple[Record, int]:
    """Decode and check the record at ``pos`` of ``buf``; returns (record, end position).

    Raises RecordFormatError when the bytes are short or fail a check.
    """
    size = len(buf)
    if size - pos < RECORD_OVERHEAD:
        raise RecordFormatError("short record")
    txid, client, gen, part, seq, header, length, data_crc = RECORD_HEAD.unpack_from(buf, pos)
    data_start = pos + RECORD_HEAD.size
    end = data_start + length + _RECORD_CRC.size
    if length < 0 or end > size:
        raise RecordFormatError(f"bad data length {length}")
    (record_crc,) = _RECORD_CRC.unpack_from(buf, data_start + length)
    if crc32c.crc32c(buf[pos:data_start]) != record_crc:
        raise RecordFormatError("record checksum mismatch")
    data = bytes(buf[data_start : data_start + length])
    if crc32c.crc32c(data) != data_crc:
        raise RecordFormatError("data checksum mismatch")
    return Record(txid, ReqId(client, gen, part, seq), header, data, data_crc), end


@dataclass(frozen=True, slots=True)
class ScannedRecord:
    offset: int
    end: int
    record: Record


@dataclass
class ScanResult:
    """Where a scan stopped: ``end`` is the offset after the last good record."""

    end: int
    stop_reason: str = ""


def check_record(buf: bytes | memoryview, pos: int, expected_txid: int) -> int:
    """Check the record at ``pos`` (complete in ``buf``) without decoding it; its end.

    Raises RecordFormatError when it fails a check or is not ``expected_txid``."""
    size = len(buf)
    if size - pos < RECORD_OVERHEAD:
        raise RecordFormatError("short record")
    txid = _TXID.unpack_from(buf, pos)[0]
    length, data_crc = _LENGTH_CRC.unpack_from(buf, pos + 28)
    data_start = pos + RECORD_HEAD.size
    end: int = data_start + length + _RECORD_CRC.size
    if length < 0 or end > size:
        raise RecordFormatError(f"bad data length {length}")
    if crc32c.crc32c(buf[pos:data_start]) != _RECORD_CRC.unpack_from(buf, end - 4)[0]:
        raise RecordFormatError("record checksum mismatch")
    if crc32c.crc32c(buf[data_start : end - 4]) != data_crc:
        raise RecordFormatError("data checksum mismatch")
    if txid != expected_txid:
        raise RecordFormatError(f"transaction id {txid}, expected {expected_txid}")
    return end


def scan_offsets(
    fd: int,
    start: int,
    file_size: int,
    expected_txid: int,
    result: ScanResult,
    *,
    chunk_size: int = 1 << 20,
    pread: Callable[[int, int, int], bytes] = os.pread,
) -> Iterator[int]:
    """Yield the offsets of the good records of a data file from ``start``, in order.

    Stops (setting ``result.stop_reason``; ``result.end`` is the offset after
    the last good record) at the first record that is incomplete, fails a
    checksum or does not carry the next transaction id. Reads in chunks,
    never the whole file.
    """
    pos = start
    result.end = start
    buf = memoryview(b"")
    buf_start = start
    expected = expected_txid
    while pos < file_size:
        rel = pos - buf_start
        if len(buf) - rel < RECORD_OVERHEAD:
            buf = memoryview(pread(fd, max(chunk_size, RECORD_OVERHEAD), pos))
            buf_start, rel = pos, 0
            if len(buf) < RECORD_OVERHEAD:
                result.stop_reason = f"incomplete record at offset {pos}"
                return
        length = _LENGTH_CRC.unpack_from(buf, rel + 28)[0]
        need = RECORD_OVERHEAD + length
        if length < 0 or pos + need > file_size:
            result.stop_reason = f"incomplete or invalid record at offset {pos}"
            return
        if len(buf) - rel < need:
            buf = memoryview(pread(fd, max(chunk_size, need), pos))
            buf_start, rel = pos, 0
            if len(buf) < need:
                result.stop_reason = f"incomplete record at offset {pos}"
                return
        try:
            end = buf_start + check_record(buf, rel, expected)
        except RecordFormatError as exc:
            result.stop_reason = f"{exc} at offset {pos}"
            return
        yield pos
        result.end = pos = end
        expected += 1


def scan_records(
    fd: int,
    start: int,
    file_size: int,
    expected_txid: int,
    result: ScanResult,
    *,
    chunk_size: int = 1 << 20,
) -> Iterator[ScannedRecord]:
    """Like :func:`scan_offsets`, decoding each good record (the offline tools)."""
    for offset in scan_offsets(fd, start, file_size, expected_txid, result, chunk_size=chunk_size):
        head = os.pread(fd, RECORD_HEAD.size, offset)
        length = RECORD_HEAD.unpack(head)[6]
        buf = os.pread(fd, RECORD_OVERHEAD + length, offset)
        record, end = decode_record(buf, 0)
        yield ScannedRecord(offset, offset + end, record)


def max_txid_of(first: int, count: int) -> int:
    return first + count - 1 if count else NO_TRANSACTION


def struct_pack_offsets(offsets: list[int]) -> bytes:
    """Index entries for ``offsets``."""
    return struct.pack(f">{len(offsets)}q", *offsets)


def unpack_offsets(raw: bytes) -> list[int]:
    return list(struct.unpack(f">{len(raw) // INDEX_ENTRY_SIZE}q", raw))
