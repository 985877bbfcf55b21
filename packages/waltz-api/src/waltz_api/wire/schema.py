"""The wire schema: protocol constants, the fields of every message in wire order, the
layout checks of the composite types, and the errors a malformed frame raises.

The module docstring of :mod:`waltz_api.wire` is the byte layout in prose; this is the
same layout as data, from which :mod:`waltz_api.wire.codec` builds each message's
encoder and decoder."""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, fields
from typing import Final

import crc32c as _crc32c_module

from waltz_api.errors import ChecksumError, FrameTooLargeError, ProtocolError
from waltz_api.messages import (
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
    MarkReplicaRequest,
    MaxTransactionIdRequest,
    MaxTransactionIdResponse,
    Message,
    MissingRangeRequest,
    MissingRangeResponse,
    MountRequest,
    MountResponse,
    MountStatus,
    PeerPing,
    PeerPong,
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


def checksum(data: bytes | bytearray | memoryview) -> int:
    """CRC-32C (Castagnoli) of ``data``: the ``checksum`` of transaction data."""
    return _crc32c_module.crc32c(data)


crc32c: Final = _crc32c_module.crc32c


# -- the messages -------------------------------------------------------------------------

KINDS: Final = frozenset(
    {"i32", "i64", "u8", "u32", "bool", "enum", "reqid", "session_info", "uuid"}
    | {"bytes", "str", "versions", "locks", "records", "headers", "opt_record", "opt_header"}
)
"""Every field kind: fixed-width integers, bool, enum (``u8``) and the composite and
variable kinds of the module docstring (``record*`` is ``records``, ``header?`` is
``opt_header``, ...)."""


@dataclass(frozen=True)
class Field:
    """One field of a message on the wire: its name (the message's attribute) and kind."""

    name: str
    kind: str
    enum_type: type[enum.IntEnum] | None = None
    """The enum of an ``enum`` field."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise TypeError(f"unknown wire field kind {self.kind!r} of field {self.name!r}")


def _f(name: str, kind: str, enum_type: type[enum.IntEnum] | None = None) -> Field:
    return Field(name, kind, enum_type)


_S: Final = (_f("session_id", "i64"), _f("seq_num", "i64"), _f("partition_id", "i32"))

SCHEMAS: Final[dict[type[Message], tuple[Field, ...]]] = {
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
    PeerPing: (_f("seq_num", "i64"), _f("server_id", "i32")),
    PeerPong: (_f("seq_num", "i64"), _f("server_id", "i32")),
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
    MarkReplicaRequest: (
        *_S,
        _f("low_water_mark", "i64"),
        _f("clean", "bool"),
        _f("log_end", "i64"),
    ),
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
CHECKSUMMED: Final = frozenset({AppendRequest, TransactionDataResponse})


# -- the composite types ---------------------------------------------------------------


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
SESSION_INFO_FIELDS: Final = (
    "session_id",
    "low_water_mark",
    "local_low_water_mark",
    "low_water_mark_session_id",
)
_expect_fields(SessionInfo, SESSION_INFO_FIELDS)


# -- malformed frames -----------------------------------------------------------------------


def truncated(what: str, needed: int, got: int) -> ProtocolError:
    return ProtocolError(
        f"truncated {what}: needs {needed} bytes, the frame has {got}; "
        "the peer sent a malformed frame, close the connection"
    )


def trailing(what: str, used: int, got: int) -> ProtocolError:
    return ProtocolError(
        f"{got - used} trailing bytes after a {what} of {used} bytes; "
        "the peer sent a malformed frame, close the connection"
    )


def bad_checksum(what: str, transaction: str, expected: int, actual: int) -> ChecksumError:
    return ChecksumError(
        f"{what}{transaction}: data checksum {actual:#010x} does not match the declared "
        f"CRC-32C {expected:#010x}; the data was corrupted in transit or at its source"
    )


def frame_too_large(size: int, max_frame_size: int) -> FrameTooLargeError:
    return FrameTooLargeError(
        f"a frame of {size} bytes exceeds the maximum frame size of {max_frame_size} bytes; "
        "close the connection (or raise the maximum frame size on both peers)"
    )


ENCODE_ERRORS: Final = (
    struct.error,
    LookupError,  # an enum field holding a value outside its enum
    TypeError,
    AttributeError,
    ValueError,  # includes UnicodeEncodeError and bytes(versions) out of range
    OverflowError,
)
"""What an encoder raises for a field value its wire type cannot hold."""

DECODE_ERRORS: Final = (
    struct.error,
    IndexError,  # enum and bool lookups
    ValueError,  # includes UnicodeDecodeError
)
"""What a decoder raises for malformed bytes (turned into ProtocolError by ``decode``)."""
