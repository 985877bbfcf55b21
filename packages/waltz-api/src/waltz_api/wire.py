"""The Waltz wire protocol: a sans-IO codec (bytes <-> :mod:`waltz_api.messages`).

Nothing here touches a socket or an event loop (the design follows h11). A
transport moves *frames*; this module turns one frame into one message and back:

- :func:`encode` / :func:`decode`: one message <-> one frame. :func:`decode`
  answers any byte string with a message or a :class:`~waltz_api.errors.ProtocolError`
  (truncated, trailing bytes, unknown type, bad enum/bool/UTF-8, oversized, bad
  checksum: :class:`~waltz_api.errors.ChecksumError`), never another exception.
- :class:`ProtocolConnection`: the version handshake (``Hello`` / ``HelloResponse``)
  and the per-connection state; refuses messages before the handshake completes.
- :class:`FrameBuffer`: length-prefixed framing for byte-stream transports.
- :func:`checksum`: CRC-32C (Castagnoli) of transaction data.

Frame layout (protocol version 1)
=================================

All integers are big-endian, fixed width: ``i32``/``i64`` signed, ``u8``/``u32``/``u64``
unsigned. A *bool* is one byte, 0 or 1 (any other value is malformed). Every frame
starts with ``u8 type, u8 version`` and continues with the message's **fixed part**
(every fixed-width field, plus the length, count or presence byte of every
variable field, in field order) followed by the **tails** of the variable fields
in field order. A frame must be consumed exactly: missing or trailing bytes are
malformed. Variable fields:

- ``bytes`` / ``str``: ``u32`` byte length in the fixed part; the raw bytes (UTF-8 for
  ``str``) as the tail.
- ``locks`` (LockRequest): ``u32 n_read, u32 n_write, u32 n_append`` in the fixed part;
  the ``n_read + n_write + n_append`` lock hashes (``u64`` each; read, then write,
  then append) as the tail.
- ``versions``: ``u32`` count; one ``u8`` per version as the tail.
- ``record*`` / ``header*``: ``u32`` count; the records (or headers) back to back.
- ``record?`` / ``header?``: a presence bool; the record (or header) if present.

Composite values, always inline:

- ``ReqId`` = ``i32 client_id, i32 generation, i32 partition_id, i32 seq_num`` (16 bytes).
- ``SessionInfo`` = ``i64 session_id, i64 low_water_mark, i64 local_low_water_mark,
  i64 low_water_mark_session_id``.
- ``UUID`` = 16 bytes (RFC 4122 byte order).
- ``RecordHeader`` = ``i64 transaction_id, ReqId, i32 header`` (28 bytes).
- ``Record`` = ``i64 transaction_id, ReqId, i32 header, u32 checksum, u32 data_len``
  followed by ``data_len`` bytes of data (36 + data_len bytes).
- enums (``MountStatus``, ``ErrorCode``) are one ``u8`` holding the enum's value.

``checksum`` is the CRC-32C of the accompanying ``data`` (``u32``); the decoder
verifies it for AppendRequest, TransactionDataResponse and every Record.

Record blocks: a ``record*`` list may be held as a :class:`RecordBlock`, its records
still in their wire form (the bytes are the same). Range reads use them end to end: a
storage engine builds the block from its stored bytes, the storage node sends it, the
server forwards it without decoding, and the reader verifies the checksums once
(:func:`decode` with ``record_blocks=True`` checks the block's structure and leaves
the checksums to :meth:`RecordBlock.check` or to decoding its records).

Messages (``type``: fields, in wire order; fixed part first)::

    1  Hello                    versions:u32 count, sender:u32 len | versions (u8 each), sender
    2  HelloResponse            version:u8  (0 = no common version; the connection closes)
    10 MountRequest             ReqId, client_high_water_mark:i64, seq_num:i32
    11 MountResponse            ReqId, status:u8, high_water_mark:i64
    12 AppendRequest            ReqId, client_high_water_mark:i64, locks(3 x u32 counts),
                                header:i32, data_len:u32, checksum:u32 | lock hashes, data
    13 FeedRequest              ReqId, client_high_water_mark:i64
    14 FeedData                 ReqId, transaction_id:i64, header:i32
    15 TransactionDataRequest   ReqId, transaction_id:i64
    16 TransactionDataResponse  ReqId, transaction_id:i64, success:bool, data_len:u32,
                                checksum:u32, error_len:u32 | data, error
    17 FlushRequest             ReqId
    18 FlushResponse            ReqId, transaction_id:i64
    19 LockFailure              ReqId, transaction_id:i64
    20 HighWaterMarkRequest     ReqId
    21 HighWaterMarkResponse    ReqId, transaction_id:i64
    22 RangeReadRequest         ReqId, start_transaction_id:i64, max_records:i32, max_bytes:i64
    23 RangeReadResponse        ReqId, high_water_mark:i64, records:u32 count | Record*
    24 ErrorResponse            ReqId, code:u8, message_len:u32 | message

Server-storage messages begin with ``S`` = ``session_id:i64, seq_num:i64, partition_id:i32``::

    50 StorageOpenRequest       S, cluster_key:UUID, num_partitions:i32
    51 LastSessionInfoRequest   S
    52 LastSessionInfoResponse  S, SessionInfo
    53 MaxTransactionIdRequest  S
    54 MaxTransactionIdResponse S, transaction_id:i64
    55 TruncateRequest          S, transaction_id:i64
    56 SetLowWaterMarkRequest   S, low_water_mark:i64
    57 StorageAppendRequest     S, records:u32 count | Record*
    58 RecordHeaderRequest      S, transaction_id:i64
    59 RecordHeaderResponse     S, present:bool | RecordHeader?
    60 RecordRequest            S, transaction_id:i64
    61 RecordResponse           S, present:bool | Record?
    62 RecordHeaderListRequest  S, transaction_id:i64, max_records:i32
    63 RecordHeaderListResponse S, headers:u32 count | RecordHeader*
    64 RecordListRequest        S, transaction_id:i64, max_records:i32, max_bytes:i64
    65 RecordListResponse       S, records:u32 count | Record*
    66 SuccessResponse          S
    67 FailureResponse          S, code:u8, message_len:u32, highest_session_id:i64 | message
    68 MissingRangeRequest      S
    69 MissingRangeResponse     S, first:i64, last:i64
    70 RepairRequest            S, records:u32 count | Record*
    80 StorageAdminRequest      seq_num:i64, command_len:u32, arguments_len:u32
                                | command, arguments
    81 StorageAdminResponse     seq_num:i64, success:bool, result_len:u32, error_len:u32
                                | result, error

Handshake: the connecting side sends ``Hello`` (the versions it speaks); the
accepting side answers ``HelloResponse`` with the highest version both speak, or
0 when they share none (and closes). ``Hello`` and ``HelloResponse`` keep this
layout in every future version; their frame version byte is not checked. Every
other frame carries the negotiated version.

Stream transports (a byte stream rather than messages) prefix each frame with its
``u32`` length (:class:`FrameBuffer`, :func:`encode_stream`).

Test vectors (one frame of every message) for other implementations:
``packages/waltz-api/tests/data/wire_v1_vectors.txt``.
"""

from __future__ import annotations

import enum
import struct
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any, Final, overload

import crc32c as _crc32c_module

from waltz_api.errors import (
    ChecksumError,
    FrameTooLargeError,
    ProtocolError,
    VersionMismatchError,
)
from waltz_api.messages import (
    ALL_MESSAGES,
    AppendRequest,
    ErrorCode,
    ErrorResponse,
    FailureResponse,
    FeedData,
    FeedRequest,
    FlushRequest,
    FlushResponse,
    Hello,
    HelloResponse,
    HighWaterMarkRequest,
    HighWaterMarkResponse,
    LastSessionInfoRequest,
    LastSessionInfoResponse,
    LockFailure,
    MaxTransactionIdRequest,
    MaxTransactionIdResponse,
    Message,
    MissingRangeRequest,
    MissingRangeResponse,
    MountRequest,
    MountResponse,
    MountStatus,
    RangeReadRequest,
    RangeReadResponse,
    RecordHeaderListRequest,
    RecordHeaderListResponse,
    RecordHeaderRequest,
    RecordHeaderResponse,
    RecordListRequest,
    RecordListResponse,
    RecordRequest,
    RecordResponse,
    RepairRequest,
    SetLowWaterMarkRequest,
    StorageAdminRequest,
    StorageAdminResponse,
    StorageAppendRequest,
    StorageOpenRequest,
    SuccessResponse,
    TransactionDataRequest,
    TransactionDataResponse,
    TruncateRequest,
)
from waltz_api.types import LockRequest, Record, RecordHeader, ReqId, SessionInfo

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "ConnectionState",
    "FrameBuffer",
    "ProtocolConnection",
    "RecordBlock",
    "Role",
    "checksum",
    "decode",
    "encode",
    "encode_feed_data",
    "encode_records",
    "encode_stream",
    "frame_length_prefix",
]

PROTOCOL_VERSION: Final = 1
"""The version this codec writes."""

SUPPORTED_VERSIONS: Final[tuple[int, ...]] = (1,)
"""Every version this codec reads and writes, lowest first."""

DEFAULT_MAX_FRAME_SIZE: Final = 64 * 1024 * 1024
"""The default largest frame (bytes) :func:`encode` builds and :func:`decode` accepts."""

HEADER_SIZE: Final = 2
"""``u8 type, u8 version`` at the start of every frame."""

RECORD_FIXED_SIZE: Final = 36
"""Bytes of a Record before its data."""

RECORD_HEADER_SIZE: Final = 28
"""Bytes of a RecordHeader."""

_STREAM_PREFIX: Final = struct.Struct(">I")


def checksum(data: bytes | bytearray | memoryview) -> int:
    """CRC-32C (Castagnoli) of ``data``: the ``checksum`` of transaction data."""
    return _crc32c_module.crc32c(data)


_crc32c: Final = _crc32c_module.crc32c

# -- schema ------------------------------------------------------------------------------

# Field kinds. Fixed-width kinds map to a struct format; the others are composite or
# variable (see the module docstring).
_SCALARS: Final = {"i32": "i", "i64": "q", "u8": "B", "u32": "I"}


@dataclass(frozen=True)
class _Field:
    name: str
    kind: str
    enum_type: type[enum.IntEnum] | None = None


def _f(name: str, kind: str, enum_type: type[enum.IntEnum] | None = None) -> _Field:
    return _Field(name, kind, enum_type)


_S: Final = (_f("session_id", "i64"), _f("seq_num", "i64"), _f("partition_id", "i32"))

_SCHEMAS: Final[dict[type[Message], tuple[_Field, ...]]] = {
    Hello: (_f("versions", "versions"), _f("sender", "str")),
    HelloResponse: (_f("version", "u8"),),
    MountRequest: (
        _f("req_id", "reqid"),
        _f("client_high_water_mark", "i64"),
        _f("seq_num", "i32"),
    ),
    MountResponse: (
        _f("req_id", "reqid"),
        _f("status", "enum", MountStatus),
        _f("high_water_mark", "i64"),
    ),
    AppendRequest: (
        _f("req_id", "reqid"),
        _f("client_high_water_mark", "i64"),
        _f("locks", "locks"),
        _f("header", "i32"),
        _f("data", "bytes"),
        _f("checksum", "u32"),
    ),
    FeedRequest: (_f("req_id", "reqid"), _f("client_high_water_mark", "i64")),
    FeedData: (_f("req_id", "reqid"), _f("transaction_id", "i64"), _f("header", "i32")),
    TransactionDataRequest: (_f("req_id", "reqid"), _f("transaction_id", "i64")),
    TransactionDataResponse: (
        _f("req_id", "reqid"),
        _f("transaction_id", "i64"),
        _f("success", "bool"),
        _f("data", "bytes"),
        _f("checksum", "u32"),
        _f("error", "str"),
    ),
    FlushRequest: (_f("req_id", "reqid"),),
    FlushResponse: (_f("req_id", "reqid"), _f("transaction_id", "i64")),
    LockFailure: (_f("req_id", "reqid"), _f("transaction_id", "i64")),
    HighWaterMarkRequest: (_f("req_id", "reqid"),),
    HighWaterMarkResponse: (_f("req_id", "reqid"), _f("transaction_id", "i64")),
    RangeReadRequest: (
        _f("req_id", "reqid"),
        _f("start_transaction_id", "i64"),
        _f("max_records", "i32"),
        _f("max_bytes", "i64"),
    ),
    RangeReadResponse: (
        _f("req_id", "reqid"),
        _f("high_water_mark", "i64"),
        _f("records", "records"),
    ),
    ErrorResponse: (
        _f("req_id", "reqid"),
        _f("code", "enum", ErrorCode),
        _f("message", "str"),
    ),
    StorageOpenRequest: (*_S, _f("cluster_key", "uuid"), _f("num_partitions", "i32")),
    LastSessionInfoRequest: _S,
    LastSessionInfoResponse: (*_S, _f("session_info", "session_info")),
    MaxTransactionIdRequest: _S,
    MaxTransactionIdResponse: (*_S, _f("transaction_id", "i64")),
    TruncateRequest: (*_S, _f("transaction_id", "i64")),
    SetLowWaterMarkRequest: (*_S, _f("low_water_mark", "i64")),
    StorageAppendRequest: (*_S, _f("records", "records")),
    RecordHeaderRequest: (*_S, _f("transaction_id", "i64")),
    RecordHeaderResponse: (*_S, _f("record_header", "opt_header")),
    RecordRequest: (*_S, _f("transaction_id", "i64")),
    RecordResponse: (*_S, _f("record", "opt_record")),
    RecordHeaderListRequest: (*_S, _f("transaction_id", "i64"), _f("max_records", "i32")),
    RecordHeaderListResponse: (*_S, _f("record_headers", "headers")),
    RecordListRequest: (
        *_S,
        _f("transaction_id", "i64"),
        _f("max_records", "i32"),
        _f("max_bytes", "i64"),
    ),
    RecordListResponse: (*_S, _f("records", "records")),
    SuccessResponse: _S,
    FailureResponse: (
        *_S,
        _f("code", "enum", ErrorCode),
        _f("message", "str"),
        _f("highest_session_id", "i64"),
    ),
    MissingRangeRequest: _S,
    MissingRangeResponse: (*_S, _f("first", "i64"), _f("last", "i64")),
    RepairRequest: (*_S, _f("records", "records")),
    StorageAdminRequest: (
        _f("seq_num", "i64"),
        _f("command", "str"),
        _f("arguments", "bytes"),
    ),
    StorageAdminResponse: (
        _f("seq_num", "i64"),
        _f("success", "bool"),
        _f("result", "bytes"),
        _f("error", "str"),
    ),
}

# Messages whose ``data`` travels with its CRC-32C in ``checksum``.
_CHECKSUMMED: Final = frozenset({AppendRequest, TransactionDataResponse})

# -- construction of decoded values ---------------------------------------------------------
#
# Decoded messages are instances of the public frozen slots dataclasses. Their generated
# ``__init__`` sets each field through ``object.__setattr__`` (frozen), which costs about
# twice as much as calling each slot's member descriptor directly; the decoder does the
# latter: ``object.__new__`` plus one ``slot.__set__`` per field (bench/codec.py measures
# the alternatives; ReqId 400 -> 205 ns, AppendRequest 545 -> 297 ns on the dev machine).
# The result is indistinguishable from an instance built by ``__init__`` (same class,
# equality, hash, immutability);
# none of these classes has a ``__post_init__``.


def _check_plain_dataclass(cls: type) -> None:
    if hasattr(cls, "__post_init__") or "__slots__" not in cls.__dict__:
        raise TypeError(
            f"waltz_api.wire builds {cls.__name__} without __init__; it must be a slots "
            "dataclass without __post_init__ (update the wire codec's constructors)"
        )


def _make_constructor(cls: type) -> Callable[..., Any]:
    """A function building ``cls`` from its field values (positional, in field order)."""
    _check_plain_dataclass(cls)
    names = [f.name for f in fields(cls)]
    namespace: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    body = ["    o = _new(_cls)"]
    for name in names:
        namespace[f"_set_{name}"] = cls.__dict__[name].__set__
        body.append(f"    _set_{name}(o, {name})")
    source = f"def make({', '.join(names)}):\n" + "\n".join(body) + "\n    return o\n"
    exec(compile(source, f"<waltz_api.wire make {cls.__name__}>", "exec"), namespace)
    constructor: Callable[..., Any] = namespace["make"]
    return constructor


def _expect_fields(cls: type, names: tuple[str, ...]) -> None:
    actual = tuple(f.name for f in fields(cls))
    if actual != names:
        raise TypeError(
            f"waltz_api.wire encodes {cls.__name__} as {names} but it has fields {actual}; "
            "update the wire codec (and its layout documentation) with the type"
        )


_expect_fields(ReqId, ("client_id", "generation", "partition_id", "seq_num"))
_expect_fields(LockRequest, ("read", "write", "append"))
_expect_fields(Record, ("transaction_id", "req_id", "header", "data", "checksum"))
_expect_fields(RecordHeader, ("transaction_id", "req_id", "header"))
_SESSION_INFO_FIELDS: Final = (
    "session_id",
    "low_water_mark",
    "local_low_water_mark",
    "low_water_mark_session_id",
)
_expect_fields(SessionInfo, _SESSION_INFO_FIELDS)

_make_req_id: Final = _make_constructor(ReqId)
_REQ_ID_FIELDS: Final = tuple(f.name for f in fields(ReqId))
_LOCK_FIELDS: Final = tuple(f.name for f in fields(LockRequest))
_check_plain_dataclass(LockRequest)
_check_plain_dataclass(Record)
_REQ_ID_SETTERS: Final = tuple(
    ReqId.__dict__[name].__set__ for name in ("client_id", "generation", "partition_id", "seq_num")
)
_RECORD_SETTERS: Final = tuple(
    Record.__dict__[name].__set__
    for name in ("transaction_id", "req_id", "header", "data", "checksum")
)
_make_record_header: Final = _make_constructor(RecordHeader)
_make_session_info: Final = _make_constructor(SessionInfo)

# -- errors -----------------------------------------------------------------------------------


def _truncated(what: str, needed: int, got: int) -> ProtocolError:
    return ProtocolError(
        f"truncated {what}: needs {needed} bytes, the frame has {got}; "
        "the peer sent a malformed frame, close the connection"
    )


def _trailing(what: str, used: int, got: int) -> ProtocolError:
    return ProtocolError(
        f"{got - used} trailing bytes after a {what} of {used} bytes; "
        "the peer sent a malformed frame, close the connection"
    )


def _bad_checksum(what: str, transaction: str, expected: int, actual: int) -> ChecksumError:
    return ChecksumError(
        f"{what}{transaction}: data checksum {actual:#010x} does not match the declared "
        f"CRC-32C {expected:#010x}; the data was corrupted in transit or at its source"
    )


# -- records and lock hashes ----------------------------------------------------------------

_RECORD: Final = struct.Struct(">qiiiiiII")
_HEADER: Final = struct.Struct(">qiiiii")
_U64_ARRAYS: Final = [struct.Struct(f">{n}Q") for n in range(65)]


def _pack_u64s(values: tuple[int, ...]) -> bytes:
    n = len(values)
    if n <= 64:
        return _U64_ARRAYS[n].pack(*values)
    return struct.pack(f">{n}Q", *values)


def _unpack_u64s(count: int, frame: bytes, offset: int) -> tuple[int, ...]:
    if count <= 64:
        return _U64_ARRAYS[count].unpack_from(frame, offset)
    return struct.unpack_from(f">{count}Q", frame, offset)


def _record_parts(records: Iterable[Record]) -> list[bytes]:
    parts: list[bytes] = []
    append = parts.append
    pack = _RECORD.pack
    for r in records:
        q = r.req_id
        data = r.data
        append(
            pack(
                r.transaction_id,
                q.client_id,
                q.generation,
                q.partition_id,
                q.seq_num,
                r.header,
                r.checksum,
                len(data),
            )
        )
        append(data)
    return parts


def encode_records(records: Iterable[Record]) -> bytes:
    """The wire form of ``records`` back to back (one join): the tail of a record list.
    A :class:`RecordBlock` is that already (its bytes are used as they are)."""
    if type(records) is RecordBlock:
        return records.raw
    return b"".join(_record_parts(records))


def _encode_headers(headers: Iterable[RecordHeader]) -> bytes:
    pack = _HEADER.pack
    return b"".join(
        [
            pack(
                h.transaction_id,
                h.req_id.client_id,
                h.req_id.generation,
                h.req_id.partition_id,
                h.req_id.seq_num,
                h.header,
            )
            for h in headers
        ]
    )


def _encode_optional_record(record: Record | None) -> bytes:
    return b"" if record is None else encode_records((record,))


def _encode_optional_header(header: RecordHeader | None) -> bytes:
    return b"" if header is None else _encode_headers((header,))


def _decode_records(
    frame: bytes, offset: int, count: int, end: int, what: str
) -> tuple[tuple[Record, ...], int]:
    if count * RECORD_FIXED_SIZE > end - offset:
        raise _truncated(f"{what} with {count} records", offset + count * RECORD_FIXED_SIZE, end)
    unpack = _RECORD.unpack_from
    records: list[Record] = []
    append = records.append
    new = object.__new__
    set_cid, set_gen, set_pid, set_seq = _REQ_ID_SETTERS
    set_txid, set_req_id, set_header, set_data, set_crc = _RECORD_SETTERS
    for _ in range(count):
        if offset + RECORD_FIXED_SIZE > end:
            raise _truncated(f"record in a {what}", offset + RECORD_FIXED_SIZE, end)
        txid, cid, gen, pid, seq, header, crc, length = unpack(frame, offset)
        offset += RECORD_FIXED_SIZE
        data_end = offset + length
        if data_end > end:
            raise _truncated(f"data of record {txid} in a {what}", data_end, end)
        data = frame[offset:data_end]
        if _crc32c(data) != crc:
            raise _bad_checksum(f"record in a {what}", f" (transaction {txid})", crc, _crc32c(data))
        # Record(txid, ReqId(cid, gen, pid, seq), header, data, crc), built without __init__
        req_id = new(ReqId)
        set_cid(req_id, cid)
        set_gen(req_id, gen)
        set_pid(req_id, pid)
        set_seq(req_id, seq)
        record = new(Record)
        set_txid(record, txid)
        set_req_id(record, req_id)
        set_header(record, header)
        set_data(record, data)
        set_crc(record, crc)
        append(record)
        offset = data_end
    return tuple(records), offset


# -- record blocks ----------------------------------------------------------------------------

_TXID: Final = struct.Struct(">q")
_DATA_LEN: Final = struct.Struct(">I")
_ID_CRC_LEN: Final = struct.Struct(">q20xII")
_DATA_LEN_AT: Final = RECORD_FIXED_SIZE - 4


class RecordBlock(Sequence[Record]):
    """Records in their wire form, back to back (the tail of a record list), as one block.

    A range read moves records from a storage node's disk through the server to a
    reader: the storage node builds the block straight from its segment files, the
    server forwards it as it came (no :class:`~waltz_api.types.Record` is built on the
    way) and the reader decodes it once. A block is a ``Sequence[Record]``: indexing or
    iterating decodes it (once; the records are kept) and verifies every record's
    CRC-32C. :meth:`check` verifies the checksums without building records.

    Built by :meth:`of` (from records), by a storage engine (``read_block``), or by
    :func:`decode` with ``record_blocks=True`` (RangeReadResponse and
    RecordListResponse), which checks the block's structure (every record within the
    frame) but leaves the checksums to whoever reads the records. ``raw`` must hold
    exactly ``count`` well-formed records; the constructor trusts its caller (use
    :meth:`parse` for bytes from elsewhere).
    """

    __slots__ = ("_last_at", "_records", "raw", "record_count")

    def __init__(self, count: int, raw: bytes) -> None:
        self.record_count = count
        """How many records ``raw`` holds."""
        self.raw = raw
        self._records: tuple[Record, ...] | None = None
        self._last_at = -1  # where the last record starts, once known

    @classmethod
    def of(cls, records: Iterable[Record]) -> RecordBlock:
        """The block of ``records`` (encoded once)."""
        if type(records) is RecordBlock:
            return records
        chosen = records if isinstance(records, Sequence) else tuple(records)
        try:
            raw = b"".join(_record_parts(chosen))
        except _ENCODE_ERRORS as exc:
            raise ProtocolError(f"cannot encode a record: {exc}") from exc
        return cls(len(chosen), raw)

    @classmethod
    def parse(cls, count: int, raw: bytes, what: str = "record block") -> RecordBlock:
        """A block of ``count`` records in ``raw``; raises :class:`ProtocolError` when
        ``raw`` does not hold exactly that many records (checksums are not checked)."""
        block, used = _decode_block(raw, 0, count, len(raw), what)
        if used != len(raw):
            raise _trailing(what, used, len(raw))
        return block

    @property
    def first_transaction_id(self) -> int | None:
        """The first record's transaction id (None: an empty block)."""
        return _TXID.unpack_from(self.raw, 0)[0] if self.record_count else None

    @property
    def last_transaction_id(self) -> int | None:
        """The last record's transaction id (None: an empty block)."""
        if not self.record_count:
            return None
        if self._last_at < 0:
            self._last_at = self.offsets()[-2]
        return _TXID.unpack_from(self.raw, self._last_at)[0]  # type: ignore[no-any-return]

    def offsets(self) -> list[int]:
        """Where each record starts in ``raw``, and ``len(raw)`` last (``count + 1`` values)."""
        raw = self.raw
        unpack = _DATA_LEN.unpack_from
        at = 0
        starts = [0] * (self.record_count + 1)
        for i in range(self.record_count):
            at += RECORD_FIXED_SIZE + unpack(raw, at + _DATA_LEN_AT)[0]
            starts[i + 1] = at
        return starts

    def check(self, first_transaction_id: int | None = None) -> list[int]:
        """Verify every record's data checksum (and, given ``first_transaction_id``, that
        the ids are dense from it) without building records; returns :meth:`offsets`.

        Raises :class:`ChecksumError` for a corrupt record, :class:`ProtocolError` for
        ids out of sequence."""
        if self._records is not None:
            decoded = self._records  # checked when decoded
            if first_transaction_id is not None:
                _check_dense(decoded, first_transaction_id)
            return self.offsets()
        raw = self.raw
        unpack = _ID_CRC_LEN.unpack_from
        crc32c = _crc32c
        at = 0
        count = self.record_count
        expected = first_transaction_id
        starts = [0] * (count + 1)
        for i in range(count):
            txid, crc, length = unpack(raw, at)
            start = at + RECORD_FIXED_SIZE
            at = start + length
            data = raw[start:at]  # (a bytes slice: cheaper than a memoryview's here)
            if crc32c(data) != crc:
                raise _bad_checksum(
                    "record in a block", f" (transaction {txid})", crc, crc32c(data)
                )
            if expected is not None and txid != expected + i:
                raise _not_dense(txid, expected + i, expected)
            starts[i + 1] = at
        return starts

    def cut(self, count: int) -> RecordBlock:
        """The block of the first ``count`` records (at a record boundary)."""
        if count >= self.record_count:
            return self
        if count <= 0:
            return RecordBlock(0, b"")
        unpack = _DATA_LEN.unpack_from
        at = 0
        for _ in range(count):
            at += RECORD_FIXED_SIZE + unpack(self.raw, at + _DATA_LEN_AT)[0]
        return RecordBlock(count, self.raw[:at])

    def records(self) -> tuple[Record, ...]:
        """The decoded records (every checksum verified; decoded once)."""
        if self._records is None:
            decoded, used = _decode_records(
                self.raw, 0, self.record_count, len(self.raw), "record block"
            )
            if used != len(self.raw):
                raise _trailing("record block", used, len(self.raw))
            self._records = decoded
        return self._records

    def __len__(self) -> int:
        return self.record_count

    @overload
    def __getitem__(self, index: int) -> Record: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Record, ...]: ...

    def __getitem__(self, index: int | slice) -> Record | tuple[Record, ...]:
        return self.records()[index]

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RecordBlock):
            return self.record_count == other.record_count and self.raw == other.raw
        if isinstance(other, (tuple, list)):
            return len(other) == self.record_count and self.records() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.records())

    def __repr__(self) -> str:
        # short: an asyncio task or a log line may repr a response holding a large block
        first = self.first_transaction_id
        where = f", first transaction {first}" if first is not None else ""
        return f"RecordBlock({self.record_count} records, {len(self.raw)} bytes{where})"


def _check_dense(records: Sequence[Record], first: int) -> None:
    for i, record in enumerate(records):
        if record.transaction_id != first + i:
            raise _not_dense(record.transaction_id, first + i, first)


def _not_dense(found: int, expected: int, first: int) -> ProtocolError:
    return ProtocolError(
        f"a record block holds transaction {found} where {expected} was expected "
        f"(the records must be dense from {first})"
    )


def _decode_block(
    frame: bytes, offset: int, count: int, end: int, what: str
) -> tuple[RecordBlock, int]:
    """The ``count`` records at ``offset`` as a block: every record is checked to lie
    within the frame; the checksums are left to the block's reader."""
    if count * RECORD_FIXED_SIZE > end - offset:
        raise _truncated(f"{what} with {count} records", offset + count * RECORD_FIXED_SIZE, end)
    unpack = _DATA_LEN.unpack_from
    at = last = offset
    limit = end - RECORD_FIXED_SIZE
    for _ in range(count):
        if at > limit:
            raise _truncated(f"record in a {what}", at + RECORD_FIXED_SIZE, end)
        last = at
        at += RECORD_FIXED_SIZE + unpack(frame, at + _DATA_LEN_AT)[0]
    if at > end:
        raise _truncated(f"data of a record in a {what}", at, end)
    block = RecordBlock(count, frame[offset:at])
    block._last_at = last - offset
    return block, at


def _decode_headers(
    frame: bytes, offset: int, count: int, end: int, what: str
) -> tuple[tuple[RecordHeader, ...], int]:
    stop = offset + count * RECORD_HEADER_SIZE
    if stop > end:
        raise _truncated(f"{what} with {count} record headers", stop, end)
    headers = tuple(
        [
            _make_record_header(txid, _make_req_id(cid, gen, pid, seq), header)
            for txid, cid, gen, pid, seq, header in _HEADER.iter_unpack(frame[offset:stop])
        ]
    )
    return headers, stop


def _decode_optional_record(
    frame: bytes, offset: int, present: int, end: int, what: str
) -> tuple[Record | None, int]:
    if present == 0:
        return None, offset
    if present != 1:
        raise ProtocolError(f"bad presence byte {present} in a {what} (must be 0 or 1)")
    records, offset = _decode_records(frame, offset, 1, end, what)
    return records[0], offset


def _decode_optional_header(
    frame: bytes, offset: int, present: int, end: int, what: str
) -> tuple[RecordHeader | None, int]:
    if present == 0:
        return None, offset
    if present != 1:
        raise ProtocolError(f"bad presence byte {present} in a {what} (must be 0 or 1)")
    headers, offset = _decode_headers(frame, offset, 1, end, what)
    return headers[0], offset


def _enum_table(enum_type: type[enum.IntEnum]) -> tuple[enum.IntEnum, ...]:
    members = sorted(enum_type, key=int)
    if [int(m) for m in members] != list(range(len(members))):
        raise TypeError(f"{enum_type.__name__} values must be dense from 0 to fit the wire codec")
    return tuple(members)


# -- code generation ---------------------------------------------------------------------------
#
# One encoder and one decoder per message type, generated from the schema above as plain
# straight-line Python (as dataclasses does for __init__): one struct pack/unpack for the
# fixed part, no reflection or loops over fields at run time.


@dataclass
class _Generated:
    encoder: Callable[[Any], bytes]
    decoder: Callable[[bytes, int], Message]
    fixed_size: int
    source: str


def _generate(cls: type[Message], schema: tuple[_Field, ...], blocks: bool = False) -> _Generated:
    """``blocks``: decode ``records`` fields as :class:`RecordBlock` (checksums unchecked)."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    if [f.name for f in schema] != names:
        raise TypeError(
            f"the wire schema of {cls.__name__} lists {[f.name for f in schema]} but the "
            f"message has fields {names}; update waltz_api.wire._SCHEMAS"
        )
    _check_plain_dataclass(cls)
    what = cls.__name__
    ns: dict[str, Any] = {
        "_cls": cls,
        "_new": object.__new__,
        "_ReqId": ReqId,
        "_LockRequest": LockRequest,
        **{f"_set_rid_{a}": ReqId.__dict__[a].__set__ for a in _REQ_ID_FIELDS},
        **{f"_set_locks_{a}": LockRequest.__dict__[a].__set__ for a in _LOCK_FIELDS},
        "_make_session_info": _make_session_info,
        "_pack_u64s": _pack_u64s,
        "_unpack_u64s": _unpack_u64s,
        "_encode_records": encode_records,
        "_encode_headers": _encode_headers,
        "_encode_optional_record": _encode_optional_record,
        "_encode_optional_header": _encode_optional_header,
        "_decode_records": _decode_records,
        "_decode_block": _decode_block,
        "_decode_headers": _decode_headers,
        "_decode_optional_record": _decode_optional_record,
        "_decode_optional_header": _decode_optional_header,
        "_truncated": _truncated,
        "_trailing": _trailing,
        "_bad_checksum": _bad_checksum,
        "_crc32c": _crc32c,
        "_UUID": uuid.UUID,
        "_BOOLS": (False, True),
        "_what": what,
        "ProtocolError": ProtocolError,
    }
    enc_fmt = ">BB"  # encoder struct: packs bools with '?' (truth value -> 0/1)
    dec_fmt = ">"  # decoder struct: starts after type and version, bools as 'B'
    pre: list[str] = []  # encoder statements
    args: list[str] = [str(cls.TYPE), str(PROTOCOL_VERSION)]
    tails: list[str] = []
    unpacked: list[str] = []
    dec: list[str] = []  # decoder statements after the fixed part
    values: list[str] = []  # decoded field values, in field order
    for field in schema:
        name, kind = field.name, field.kind
        src = f"m.{name}"
        if kind in _SCALARS:
            enc_fmt += _SCALARS[kind]
            dec_fmt += _SCALARS[kind]
            args.append(src)
            unpacked.append(f"v_{name}")
            values.append(f"v_{name}")
        elif kind == "bool":
            enc_fmt += "?"
            dec_fmt += "B"
            args.append(src)
            unpacked.append(f"b_{name}")
            dec.append(f"    v_{name} = _BOOLS[b_{name}]")
            values.append(f"v_{name}")
        elif kind == "enum":
            assert field.enum_type is not None
            table = _enum_table(field.enum_type)
            ns[f"_E_{name}"] = table
            ns[f"_EV_{name}"] = {member: int(member) for member in table}
            enc_fmt += "B"
            dec_fmt += "B"
            args.append(f"_EV_{name}[{src}]")  # KeyError for a value outside the enum
            unpacked.append(f"e_{name}")
            dec.append(f"    v_{name} = _E_{name}[e_{name}]")
            values.append(f"v_{name}")
        elif kind == "reqid":
            enc_fmt += "iiii"
            dec_fmt += "iiii"
            pre.append(f"    r_{name} = {src}")
            args += [f"r_{name}.{a}" for a in _REQ_ID_FIELDS]
            parts = [f"r{i}_{name}" for i in range(4)]
            unpacked += parts
            # built inline (no call): the hot path of every client-server message
            dec.append(f"    v_{name} = _new(_ReqId)")
            dec += [
                f"    _set_rid_{a}(v_{name}, {part})"
                for a, part in zip(_REQ_ID_FIELDS, parts, strict=True)
            ]
            values.append(f"v_{name}")
        elif kind == "session_info":
            enc_fmt += "qqqq"
            dec_fmt += "qqqq"
            pre.append(f"    s_{name} = {src}")
            args += [f"s_{name}.{a}" for a in _SESSION_INFO_FIELDS]
            parts = [f"s{i}_{name}" for i in range(len(_SESSION_INFO_FIELDS))]
            unpacked += parts
            values.append(f"_make_session_info({', '.join(parts)})")
        elif kind == "uuid":
            enc_fmt += "16s"
            dec_fmt += "16s"
            args.append(f"{src}.bytes")
            unpacked.append(f"u_{name}")
            values.append(f"_UUID(bytes=u_{name})")
        elif kind in ("bytes", "str", "versions"):
            enc_fmt += "I"
            dec_fmt += "I"
            if kind == "str":
                pre.append(f"    t_{name} = {src}.encode()")
            elif kind == "versions":
                pre.append(f"    t_{name} = bytes({src})")
            else:
                pre.append(f"    t_{name} = {src}")
            args.append(f"len(t_{name})")
            tails.append(f"t_{name}")
            unpacked.append(f"n_{name}")
            dec += [
                f"    e = o + n_{name}",
                "    if e > n:",
                f"        raise _truncated(_what + '.{name}', e, n)",
            ]
            if kind == "str":
                dec.append(f"    v_{name} = f[o:e].decode()")
            elif kind == "versions":
                dec.append(f"    v_{name} = tuple(f[o:e])")
            else:
                dec.append(f"    v_{name} = f[o:e]")
            dec.append("    o = e")
            values.append(f"v_{name}")
        elif kind == "locks":
            enc_fmt += "III"
            dec_fmt += "III"
            pre += [
                f"    l_{name} = {src}",
                f"    lr_{name} = l_{name}.read",
                f"    lw_{name} = l_{name}.write",
                f"    la_{name} = l_{name}.append",
            ]
            args += [f"len(lr_{name})", f"len(lw_{name})", f"len(la_{name})"]
            tails.append(f"_pack_u64s(lr_{name} + lw_{name} + la_{name})")
            unpacked += [f"nr_{name}", f"nw_{name}", f"na_{name}"]
            dec += [
                f"    k = nr_{name} + nw_{name} + na_{name}",
                "    if k:",
                "        e = o + 8 * k",
                "        if e > n:",
                "            raise _truncated(_what + ' lock hashes', e, n)",
                "        h = _unpack_u64s(k, f, o)",
                "        o = e",
                f"        w = nr_{name} + nw_{name}",
                f"        v_{name} = _new(_LockRequest)",
                f"        _set_locks_read(v_{name}, h[:nr_{name}])",
                f"        _set_locks_write(v_{name}, h[nr_{name}:w])",
                f"        _set_locks_append(v_{name}, h[w:])",
                "    else:",
                f"        v_{name} = _EMPTY_LOCKS",
            ]
            ns["_EMPTY_LOCKS"] = LockRequest()
            values.append(f"v_{name}")
        elif kind in ("records", "headers", "opt_record", "opt_header"):
            enc_fmt += "I" if kind in ("records", "headers") else "?"
            dec_fmt += "I" if kind in ("records", "headers") else "B"
            pre.append(f"    c_{name} = {src}")
            if kind == "records":
                args.append(f"len(c_{name})")
                tails.append(f"_encode_records(c_{name})")
            elif kind == "headers":
                args.append(f"len(c_{name})")
                tails.append(f"_encode_headers(c_{name})")
            elif kind == "opt_record":
                args.append(f"c_{name} is not None")
                tails.append(f"_encode_optional_record(c_{name})")
            else:
                args.append(f"c_{name} is not None")
                tails.append(f"_encode_optional_header(c_{name})")
            unpacked.append(f"n_{name}")
            function = {
                "records": "_decode_block" if blocks else "_decode_records",
                "headers": "_decode_headers",
                "opt_record": "_decode_optional_record",
                "opt_header": "_decode_optional_header",
            }[kind]
            dec.append(f"    v_{name}, o = {function}(f, o, n_{name}, n, _what)")
            values.append(f"v_{name}")
        else:  # pragma: no cover - a schema typo
            raise TypeError(f"unknown wire field kind {kind!r} in {what}.{name}")

    enc_struct = struct.Struct(enc_fmt)
    dec_struct = struct.Struct(dec_fmt)
    fixed_size = enc_struct.size
    if dec_struct.size != fixed_size - HEADER_SIZE:  # pragma: no cover - generator bug
        raise AssertionError(f"{what}: encoder and decoder layouts differ")
    ns["_ENC"] = enc_struct
    ns["_unpack"] = dec_struct.unpack_from

    packed = f"_ENC.pack({', '.join(args)})"
    if not tails:
        ret = f"    return {packed}"
    elif len(tails) == 1:
        ret = f"    return {packed} + {tails[0]}"
    else:
        ret = f"    return b''.join(({packed}, {', '.join(tails)}))"
    encoder_source = "def encode(m):\n" + "".join(line + "\n" for line in pre) + ret + "\n"

    lines = ["def decode(f, n):"]
    if tails:
        lines += [
            f"    if n < {fixed_size}:",
            f"        raise _truncated(_what, {fixed_size}, n)",
        ]
    else:
        lines += [
            f"    if n != {fixed_size}:",
            f"        if n < {fixed_size}:",
            f"            raise _truncated(_what, {fixed_size}, n)",
            f"        raise _trailing(_what, {fixed_size}, n)",
        ]
    lines.append(f"    {', '.join(unpacked)}, = _unpack(f, {HEADER_SIZE})")
    if tails:
        lines.append(f"    o = {fixed_size}")
    lines += dec
    if tails:
        lines += ["    if o != n:", "        raise _trailing(_what, o, n)"]
    if cls in _CHECKSUMMED:
        lines += [
            "    if _crc32c(v_data) != v_checksum:",
            "        raise _bad_checksum(_what, '', v_checksum, _crc32c(v_data))",
        ]
    # Build the message inline (see "construction of decoded values").
    lines.append("    m = _new(_cls)")
    for name, value in zip(names, values, strict=True):
        ns[f"_set_{name}"] = cls.__dict__[name].__set__
        lines.append(f"    _set_{name}(m, {value})")
    lines.append("    return m")
    decoder_source = "\n".join(lines) + "\n"

    source = encoder_source + "\n" + decoder_source
    exec(compile(source, f"<waltz_api.wire {what}>", "exec"), ns)
    return _Generated(ns["encode"], ns["decode"], fixed_size, source)


_GENERATED: Final[dict[type[Message], _Generated]] = {
    cls: _generate(cls, schema) for cls, schema in _SCHEMAS.items()
}

_missing = set(ALL_MESSAGES) - set(_GENERATED)
if _missing:  # pragma: no cover - a message added without its wire schema
    raise TypeError(f"no wire schema for {sorted(c.__name__ for c in _missing)}")

_BLOCK_MESSAGES: Final = (RangeReadResponse, RecordListResponse)
"""The messages that :func:`decode` with ``record_blocks=True`` returns with a RecordBlock."""

_ENCODERS: Final[dict[type, Callable[[Any], bytes]]] = {
    cls: g.encoder for cls, g in _GENERATED.items()
}
_DECODERS: Final[list[Callable[[bytes, int], Message] | None]] = [None] * 256
_NAMES: Final[list[str]] = [""] * 256
for _cls, _gen in _GENERATED.items():
    if _DECODERS[_cls.TYPE] is not None:  # pragma: no cover - a duplicated type code
        raise TypeError(f"wire type code {_cls.TYPE} is used twice ({_cls.__name__})")
    _DECODERS[_cls.TYPE] = _gen.decoder
    _NAMES[_cls.TYPE] = _cls.__name__
_BLOCK_DECODERS: Final[list[Callable[[bytes, int], Message] | None]] = list(_DECODERS)
for _cls in _BLOCK_MESSAGES:
    _BLOCK_DECODERS[_cls.TYPE] = _generate(_cls, _SCHEMAS[_cls], blocks=True).decoder

_ENCODE_ERRORS: Final = (
    struct.error,
    LookupError,  # an enum field holding a value outside its enum
    TypeError,
    AttributeError,
    ValueError,  # includes UnicodeEncodeError and bytes(versions) out of range
    OverflowError,
)
_DECODE_ERRORS: Final = (
    struct.error,
    IndexError,  # enum and bool lookups
    ValueError,  # includes UnicodeDecodeError
)

# -- public codec ----------------------------------------------------------------------------------


def encode(message: Message, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """The frame of one message (protocol version :data:`PROTOCOL_VERSION`).

    Raises :class:`ProtocolError` when a field does not fit its wire type (e.g. a
    header outside ``i32``, a negative checksum) and :class:`FrameTooLargeError`
    when the frame would exceed ``max_frame_size``.
    """
    try:
        encoder = _ENCODERS[type(message)]
    except KeyError:
        raise TypeError(
            f"cannot encode {type(message).__name__}: not a waltz_api.messages message"
        ) from None
    try:
        frame = encoder(message)
    except _ENCODE_ERRORS as exc:
        raise ProtocolError(
            f"cannot encode {message!r:.200}: {exc}; a field has a value its wire type "
            "cannot hold (see the layout in waltz_api.wire)"
        ) from exc
    if len(frame) > max_frame_size:
        raise FrameTooLargeError(
            f"a {type(message).__name__} frame of {len(frame)} bytes exceeds the maximum "
            f"frame size of {max_frame_size} bytes; send less data per message or raise "
            "the maximum frame size on both peers"
        )
    return frame


def _frame_too_large(size: int, max_frame_size: int) -> FrameTooLargeError:
    return FrameTooLargeError(
        f"a frame of {size} bytes exceeds the maximum frame size of {max_frame_size} bytes; "
        "close the connection (or raise the maximum frame size on both peers)"
    )


def decode(
    frame: bytes | bytearray | memoryview,
    *,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    record_blocks: bool = False,
) -> Message:
    """The message in one frame.

    Raises :class:`ProtocolError` (or its subclasses :class:`ChecksumError`,
    :class:`FrameTooLargeError`) for anything but a well-formed frame of a supported
    version; never another exception for a byte string.

    ``record_blocks``: the records of a RangeReadResponse or RecordListResponse come as
    a :class:`RecordBlock` (no Record is built): the frame's structure is checked here,
    the records' checksums when the block is read (:meth:`RecordBlock.check`, or
    decoding its records, raise :class:`ChecksumError`).
    """
    if type(frame) is not bytes:
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise TypeError(f"decode() takes a byte string, not {type(frame).__name__}")
        size = frame.nbytes if isinstance(frame, memoryview) else len(frame)
        if size > max_frame_size:  # refused before copying it
            raise _frame_too_large(size, max_frame_size)
        frame = bytes(frame)
    n = len(frame)
    if n > max_frame_size:
        raise _frame_too_large(n, max_frame_size)
    if n < HEADER_SIZE:
        raise ProtocolError(
            f"a frame of {n} bytes is shorter than the 2-byte type and version header; "
            "the peer sent a malformed frame, close the connection"
        )
    type_code = frame[0]
    decoder = (_BLOCK_DECODERS if record_blocks else _DECODERS)[type_code]
    if decoder is None:
        raise ProtocolError(
            f"unknown message type {type_code}; the peer speaks another protocol or sent a "
            "corrupted frame, close the connection"
        )
    version = frame[1]
    if version != PROTOCOL_VERSION and version not in SUPPORTED_VERSIONS and type_code > 2:
        raise ProtocolError(
            f"{_NAMES[type_code]} frame of protocol version {version}; this codec speaks "
            f"{SUPPORTED_VERSIONS} (negotiate a version with Hello first)"
        )
    try:
        return decoder(frame, n)
    except _DECODE_ERRORS as exc:
        raise ProtocolError(
            f"malformed {_NAMES[type_code]} frame of {n} bytes: {exc}; "
            "the peer sent a malformed frame, close the connection"
        ) from None


# -- batch helpers ------------------------------------------------------------------------------

_FEED_DATA: Final = struct.Struct(">BBiiiiqi")


def encode_feed_data(feed: Iterable[FeedData]) -> list[bytes]:
    """The frames of many FeedData messages (the feed's hot path: one bound pack each)."""
    pack = _FEED_DATA.pack
    t = FeedData.TYPE
    v = PROTOCOL_VERSION
    try:
        return [
            pack(
                t,
                v,
                m.req_id.client_id,
                m.req_id.generation,
                m.req_id.partition_id,
                m.req_id.seq_num,
                m.transaction_id,
                m.header,
            )
            for m in feed
        ]
    except _ENCODE_ERRORS as exc:
        raise ProtocolError(f"cannot encode FeedData: {exc}") from exc


def frame_length_prefix(frame: bytes) -> bytes:
    """The ``u32`` length prefix of ``frame`` on a byte-stream transport."""
    return _STREAM_PREFIX.pack(len(frame))


def encode_stream(
    messages: Iterable[Message], *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
) -> bytes:
    """Many messages as one length-prefixed byte string for a stream transport (one join)."""
    parts: list[bytes] = []
    append = parts.append
    prefix = _STREAM_PREFIX.pack
    for message in messages:
        frame = encode(message, max_frame_size=max_frame_size)
        append(prefix(len(frame)))
        append(frame)
    return b"".join(parts)


# -- stream framing ------------------------------------------------------------------------------


class FrameBuffer:
    """Splits a byte stream into frames (each preceded by its ``u32`` length).

    Feed received bytes with :meth:`receive_data` (``b""`` means end of stream) and
    take complete frames with :meth:`next_frame`. A frame declaring more than
    ``max_frame_size`` bytes raises :class:`FrameTooLargeError` as soon as its length
    prefix arrives, before its body is buffered; afterwards the buffer is unusable
    (close the connection).
    """

    __slots__ = ("_buffer", "_checked", "_eof", "_error", "max_frame_size")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        if max_frame_size < 0 or max_frame_size > 0xFFFFFFFF:
            raise ValueError(f"max_frame_size must be within 0..2**32-1, not {max_frame_size}")
        self.max_frame_size = max_frame_size
        self._buffer = bytearray()
        # Offset of the first length prefix not yet checked against max_frame_size: every
        # prefix is checked as soon as its 4 bytes arrive, before the frame body is buffered.
        self._checked = 0
        self._eof = False
        self._error: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned as frames."""
        return len(self._buffer)

    @property
    def at_eof(self) -> bool:
        """True once the end of the stream was received and every frame was taken."""
        return self._eof and not self._buffer

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Add received bytes; ``b""`` marks the end of the stream."""
        if self._error is not None:
            raise self._error
        if not data:
            self._eof = True
            return
        if self._eof:
            raise ProtocolError("data received after the end of the stream")
        buffer = self._buffer
        buffer += data
        checked = self._checked
        limit = self.max_frame_size
        unpack = _STREAM_PREFIX.unpack_from
        while checked + 4 <= len(buffer):
            (length,) = unpack(buffer, checked)
            if length > limit:
                self._error = FrameTooLargeError(
                    f"the peer announced a frame of {length} bytes, more than the maximum "
                    f"frame size of {limit} bytes; close the connection"
                )
                buffer.clear()
                self._checked = 0
                raise self._error
            checked += 4 + length
        self._checked = checked

    def next_frame(self) -> bytes | None:
        """The next complete frame, or None until more bytes arrive.

        Raises :class:`ProtocolError` when the stream ended inside a frame.
        """
        if self._error is not None:
            raise self._error
        buffer = self._buffer
        if len(buffer) >= 4:
            # receive_data checked this length already
            end = 4 + _STREAM_PREFIX.unpack_from(buffer, 0)[0]
            if len(buffer) >= end:
                frame = bytes(buffer[4:end])
                del buffer[:end]  # cheap: bytearray drops a prefix by moving its start
                self._checked -= end
                return frame
        if self._eof and buffer:
            self._error = ProtocolError(
                f"the stream ended inside a frame ({len(buffer)} bytes left over)"
            )
            raise self._error
        return None

    def frames(self) -> Iterator[bytes]:
        """Every complete frame buffered now."""
        while (frame := self.next_frame()) is not None:
            yield frame


# -- handshake and connection state ----------------------------------------------------------


class Role(enum.Enum):
    """Which side of a connection: the INITIATOR sends Hello, the ACCEPTOR answers."""

    INITIATOR = "initiator"
    ACCEPTOR = "acceptor"


class ConnectionState(enum.Enum):
    """Where a :class:`ProtocolConnection` is in its life."""

    IDLE = "idle"
    """Initiator before :meth:`ProtocolConnection.start_handshake`."""
    AWAITING_HELLO = "awaiting-hello"
    """Acceptor waiting for the peer's Hello."""
    AWAITING_HELLO_RESPONSE = "awaiting-hello-response"
    """Initiator that sent Hello."""
    SENDING_HELLO_RESPONSE = "sending-hello-response"
    """Acceptor that received Hello and must send :meth:`ProtocolConnection.hello_response`."""
    OPEN = "open"
    """Handshake done: messages flow both ways in the negotiated version."""
    FAILED = "failed"
    """The handshake failed or the peer broke the protocol: close the connection."""


class ProtocolConnection:
    """The protocol state of one connection, sans-IO (h11 style).

    ``send(message) -> bytes`` builds the frame to transmit; ``receive_frame(bytes)
    -> message`` parses a received frame. The connection refuses other messages
    until the handshake is done, and any protocol error moves it to FAILED.

    Initiator::

        conn = ProtocolConnection(Role.INITIATOR, sender="client:17")
        transport.send(conn.start_handshake())
        conn.receive_frame(transport.receive())   # HelloResponse -> OPEN

    Acceptor::

        conn = ProtocolConnection(Role.ACCEPTOR, sender="server:3")
        conn.receive_frame(transport.receive())   # Hello
        transport.send(conn.send(conn.hello_response()))
        # OPEN, or FAILED when the peers share no version (the response tells the
        # peer so; close the connection after sending it).
    """

    def __init__(
        self,
        role: Role,
        *,
        sender: str = "",
        versions: Sequence[int] = SUPPORTED_VERSIONS,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        record_blocks: bool = False,
    ) -> None:
        """``record_blocks``: received record lists come as :class:`RecordBlock`
        (see :func:`decode`)."""
        unsupported = [v for v in versions if v not in SUPPORTED_VERSIONS]
        if not versions or unsupported:
            raise ValueError(
                f"versions must be a non-empty subset of {SUPPORTED_VERSIONS}, not {versions!r}"
            )
        self.role = role
        self.sender = sender
        self.versions: tuple[int, ...] = tuple(sorted(set(versions)))
        self.max_frame_size = max_frame_size
        self.record_blocks = record_blocks
        self.version: int | None = None
        """The negotiated version, once known."""
        self.peer: str | None = None
        """The peer's ``sender`` from its Hello (acceptor only)."""
        self.peer_versions: tuple[int, ...] = ()
        """The versions the peer offered in its Hello (acceptor only)."""
        self.state = (
            ConnectionState.IDLE if role is Role.INITIATOR else ConnectionState.AWAITING_HELLO
        )
        self._failure: ProtocolError | None = None

    def _fail(self, error: ProtocolError) -> ProtocolError:
        self.state = ConnectionState.FAILED
        self._failure = error
        return error

    @property
    def error(self) -> ProtocolError | None:
        """Why the connection FAILED (None while it has not)."""
        return self._failure

    def _check_not_failed(self) -> None:
        if self.state is ConnectionState.FAILED:
            failure = self._failure or ProtocolError("unknown")
            # the same class as the original failure (e.g. VersionMismatchError)
            raise type(failure)(f"the connection failed: {failure}; close it")

    def start_handshake(self) -> bytes:
        """Initiator: the Hello frame to send first."""
        return self.send(Hello(self.versions, self.sender))

    def hello_response(self) -> HelloResponse:
        """Acceptor: the HelloResponse to send after receiving Hello (version 0: none)."""
        if self.state is not ConnectionState.SENDING_HELLO_RESPONSE:
            raise ProtocolError(f"no Hello to answer (state {self.state.value})")
        return HelloResponse(self.version or 0)

    def send(self, message: Message) -> bytes:
        """The frame of ``message``, checked against the connection state."""
        self._check_not_failed()
        state = self.state
        if state is ConnectionState.OPEN:
            if isinstance(message, (Hello, HelloResponse)):
                raise ProtocolError(f"{type(message).__name__} after the handshake completed")
            return encode(message, max_frame_size=self.max_frame_size)
        if state is ConnectionState.IDLE and isinstance(message, Hello):
            frame = encode(message, max_frame_size=self.max_frame_size)
            self.state = ConnectionState.AWAITING_HELLO_RESPONSE
            return frame
        if state is ConnectionState.SENDING_HELLO_RESPONSE and isinstance(message, HelloResponse):
            expected = self.version or 0
            if message.version != expected:
                raise ProtocolError(
                    f"HelloResponse must carry the negotiated version {expected}, "
                    f"not {message.version}; use hello_response()"
                )
            frame = encode(message, max_frame_size=self.max_frame_size)
            if self.version is None:
                self._fail(self._mismatch())
            else:
                self.state = ConnectionState.OPEN
            return frame
        raise ProtocolError(
            f"cannot send {type(message).__name__} in state {self.state.value}: "
            "the version handshake must complete first"
        )

    def _mismatch(self) -> VersionMismatchError:
        if self.role is Role.ACCEPTOR:
            who = f" {self.peer!r}" if self.peer else ""
            theirs = f"speaks protocol versions {self.peer_versions}"
        else:
            who = ""
            theirs = "answered that it speaks none of them"
        return VersionMismatchError(
            f"no common protocol version: this side speaks {self.versions}, the peer{who} "
            f"{theirs}; upgrade the older side"
        )

    def receive_frame(self, frame: bytes | bytearray | memoryview) -> Message:
        """The message in a received frame, checked against the connection state."""
        self._check_not_failed()
        try:
            message = decode(
                frame, max_frame_size=self.max_frame_size, record_blocks=self.record_blocks
            )
        except ProtocolError as exc:
            raise self._fail(exc) from None
        state = self.state
        if state is ConnectionState.OPEN:
            if frame[1] != self.version:
                raise self._fail(
                    ProtocolError(
                        f"{type(message).__name__} frame of version {frame[1]} on a "
                        f"connection that negotiated version {self.version}"
                    )
                )
            if isinstance(message, (Hello, HelloResponse)):
                raise self._fail(
                    ProtocolError(f"{type(message).__name__} after the handshake completed")
                )
            return message
        if state is ConnectionState.AWAITING_HELLO and isinstance(message, Hello):
            self.peer = message.sender
            self.peer_versions = message.versions
            common = set(message.versions) & set(self.versions)
            self.version = max(common) if common else None
            self.state = ConnectionState.SENDING_HELLO_RESPONSE
            return message
        if state is ConnectionState.AWAITING_HELLO_RESPONSE and isinstance(message, HelloResponse):
            if message.version == 0:
                raise self._fail(self._mismatch())
            if message.version not in self.versions:
                raise self._fail(
                    ProtocolError(
                        f"the peer chose protocol version {message.version}, which this side "
                        f"did not offer ({self.versions})"
                    )
                )
            self.version = message.version
            self.state = ConnectionState.OPEN
            return message
        raise self._fail(
            ProtocolError(
                f"received {type(message).__name__} in state {state.value}: "
                "the peer did not follow the version handshake"
            )
        )


def _layout_source(cls: type[Message]) -> str:
    """The generated encoder and decoder of ``cls`` (for debugging the codec)."""
    return _GENERATED[cls].source
