"""Every message of the Waltz protocol, as frozen dataclasses.

Client-server messages (../shared/spec/waltz-internals.txt "Client-Server
Communication") carry a :class:`~waltz_api.types.ReqId`; server-storage
messages ("Waltz Storage": the ten request/response patterns) carry the store
session id, a message sequence number and the partition id. The byte encoding
lives in :mod:`waltz_api.wire`; this module only defines the messages.

Each message class has a stable one-byte ``TYPE`` code used on the wire.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from waltz_api.types import LockRequest, Record, RecordHeader, ReqId, SessionInfo


class Message:
    """Base of every message. ``TYPE`` is the wire type code."""

    __slots__ = ()
    TYPE: ClassVar[int]


# -- handshake -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """First message on every connection: the protocol versions the sender speaks
    and who it is (e.g. ``client:17``, ``server:3``)."""

    TYPE: ClassVar[int] = 1
    versions: tuple[int, ...]
    sender: str


@dataclass(frozen=True, slots=True)
class HelloResponse(Message):
    """The version chosen by the receiver of Hello (the highest both speak)."""

    TYPE: ClassVar[int] = 2
    version: int


# -- client <-> server ---------------------------------------------------------------


class MountStatus(enum.IntEnum):
    READY = 0
    NOT_READY = 1
    CLIENT_AHEAD = 2


@dataclass(frozen=True, slots=True)
class MountRequest(Message):
    TYPE: ClassVar[int] = 10
    req_id: ReqId
    client_high_water_mark: int
    seq_num: int
    """The sequence number of the client's network client (stale connection detection)."""


@dataclass(frozen=True, slots=True)
class MountResponse(Message):
    TYPE: ClassVar[int] = 11
    req_id: ReqId
    status: MountStatus
    high_water_mark: int
    """The partition's high-water mark when the response was sent."""


@dataclass(frozen=True, slots=True)
class AppendRequest(Message):
    TYPE: ClassVar[int] = 12
    req_id: ReqId
    client_high_water_mark: int
    locks: LockRequest
    header: int
    data: bytes
    checksum: int
    """CRC-32C of ``data``."""


@dataclass(frozen=True, slots=True)
class FeedRequest(Message):
    TYPE: ClassVar[int] = 13
    req_id: ReqId
    client_high_water_mark: int


@dataclass(frozen=True, slots=True)
class FeedData(Message):
    """A committed transaction in the feed; ``req_id`` is the transaction's own ReqId
    (so the submitting client's transaction monitor recognises it)."""

    TYPE: ClassVar[int] = 14
    req_id: ReqId
    transaction_id: int
    header: int


@dataclass(frozen=True, slots=True)
class TransactionDataRequest(Message):
    TYPE: ClassVar[int] = 15
    req_id: ReqId
    transaction_id: int


@dataclass(frozen=True, slots=True)
class TransactionDataResponse(Message):
    """``data`` and ``checksum`` when ``success``; ``error`` otherwise."""

    TYPE: ClassVar[int] = 16
    req_id: ReqId
    transaction_id: int
    success: bool
    data: bytes = b""
    checksum: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class FlushRequest(Message):
    TYPE: ClassVar[int] = 17
    req_id: ReqId


@dataclass(frozen=True, slots=True)
class FlushResponse(Message):
    TYPE: ClassVar[int] = 18
    req_id: ReqId
    transaction_id: int
    """The partition's high-water mark once every earlier append completed."""


@dataclass(frozen=True, slots=True)
class LockFailure(Message):
    TYPE: ClassVar[int] = 19
    req_id: ReqId
    transaction_id: int
    """The (estimated) transaction id that made the lock check fail."""


@dataclass(frozen=True, slots=True)
class HighWaterMarkRequest(Message):
    TYPE: ClassVar[int] = 20
    req_id: ReqId


@dataclass(frozen=True, slots=True)
class HighWaterMarkResponse(Message):
    TYPE: ClassVar[int] = 21
    req_id: ReqId
    transaction_id: int


@dataclass(frozen=True, slots=True)
class RangeReadRequest(Message):
    """Bulk read of committed records with their data (catch-up consumers, Spark)."""

    TYPE: ClassVar[int] = 22
    req_id: ReqId
    start_transaction_id: int
    max_records: int
    max_bytes: int


@dataclass(frozen=True, slots=True)
class RangeReadResponse(Message):
    """Consecutive committed records from the requested start (possibly empty).

    ``records`` is a tuple, or a :class:`waltz_api.wire.RecordBlock` (the records still
    in their wire form) when the frame was decoded with ``record_blocks=True`` or the
    server forwards a storage node's block; both are sequences of records."""

    TYPE: ClassVar[int] = 23
    req_id: ReqId
    high_water_mark: int
    records: Sequence[Record]


class ErrorCode(enum.IntEnum):
    """Why a server or storage node refused a request."""

    GENERIC = 0
    PARTITION_NOT_ASSIGNED = 1
    STALE_GENERATION = 2
    FENCED = 3
    CLUSTER_KEY_MISMATCH = 4
    PARTITION_NOT_FOUND = 5
    PARTITION_CLOSED = 6
    APPEND_REFUSED = 7
    CORRUPTION = 8
    CHECKSUM = 9
    BAD_REQUEST = 10
    NOT_OPEN = 11
    SERVER_BUSY = 12
    NOT_COMMITTED = 13
    """An append that was given a transaction id in a store session that ended before a
    quorum of replicas acknowledged it, and that the next session's recovery left out of
    the log: it is decided, not committed (never committed later). Re-execute it."""
    ACCESS_DENIED = 14
    """The cluster's access control (``waltz acl``) does not grant the connection's
    client key the permission the request needs on its partition (read: mount, feed,
    data fetch, range read, high-water mark, flush; write: append). Nothing was done.
    Final: asking again changes nothing until an operator grants the permission."""


@dataclass(frozen=True, slots=True)
class ErrorResponse(Message):
    """A server's refusal of a client request (partition not here, stale generation...)."""

    TYPE: ClassVar[int] = 24
    req_id: ReqId
    code: ErrorCode
    message: str


# -- server <-> server ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PeerPing(Message):
    """A server's liveness probe of another server (the cluster manager's failure
    detector): the receiver answers :class:`PeerPong` with the same ``seq_num`` at once.

    ``server_id`` is the sender's id (for logs; -1 while it is not registered)."""

    TYPE: ClassVar[int] = 30
    seq_num: int
    server_id: int


@dataclass(frozen=True, slots=True)
class PeerPong(Message):
    """The answer to :class:`PeerPing`: ``server_id`` is the answering server's current
    id (-1 while it is not registered), so that a prober reaching a restarted server
    at the same endpoint does not take it for the old one."""

    TYPE: ClassVar[int] = 31
    seq_num: int
    server_id: int


# -- server <-> storage node ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StorageOpenRequest(Message):
    """First request on a server-to-storage connection: the cluster key check."""

    TYPE: ClassVar[int] = 50
    session_id: int
    seq_num: int
    partition_id: int
    cluster_key: uuid.UUID
    num_partitions: int


@dataclass(frozen=True, slots=True)
class LastSessionInfoRequest(Message):
    TYPE: ClassVar[int] = 51
    session_id: int
    seq_num: int
    partition_id: int


@dataclass(frozen=True, slots=True)
class LastSessionInfoResponse(Message):
    TYPE: ClassVar[int] = 52
    session_id: int
    seq_num: int
    partition_id: int
    session_info: SessionInfo


@dataclass(frozen=True, slots=True)
class MaxTransactionIdRequest(Message):
    TYPE: ClassVar[int] = 53
    session_id: int
    seq_num: int
    partition_id: int


@dataclass(frozen=True, slots=True)
class MaxTransactionIdResponse(Message):
    TYPE: ClassVar[int] = 54
    session_id: int
    seq_num: int
    partition_id: int
    transaction_id: int


@dataclass(frozen=True, slots=True)
class TruncateRequest(Message):
    TYPE: ClassVar[int] = 55
    session_id: int
    seq_num: int
    partition_id: int
    transaction_id: int
    """The highest transaction id to keep."""


@dataclass(frozen=True, slots=True)
class SetLowWaterMarkRequest(Message):
    TYPE: ClassVar[int] = 56
    session_id: int
    seq_num: int
    partition_id: int
    low_water_mark: int


@dataclass(frozen=True, slots=True)
class StorageAppendRequest(Message):
    TYPE: ClassVar[int] = 57
    session_id: int
    seq_num: int
    partition_id: int
    records: tuple[Record, ...]


@dataclass(frozen=True, slots=True)
class RecordHeaderRequest(Message):
    TYPE: ClassVar[int] = 58
    session_id: int
    seq_num: int
    partition_id: int
    transaction_id: int


@dataclass(frozen=True, slots=True)
class RecordHeaderResponse(Message):
    TYPE: ClassVar[int] = 59
    session_id: int
    seq_num: int
    partition_id: int
    record_header: RecordHeader | None


@dataclass(frozen=True, slots=True)
class RecordRequest(Message):
    TYPE: ClassVar[int] = 60
    session_id: int
    seq_num: int
    partition_id: int
    transaction_id: int


@dataclass(frozen=True, slots=True)
class RecordResponse(Message):
    TYPE: ClassVar[int] = 61
    session_id: int
    seq_num: int
    partition_id: int
    record: Record | None


@dataclass(frozen=True, slots=True)
class RecordHeaderListRequest(Message):
    TYPE: ClassVar[int] = 62
    session_id: int
    seq_num: int
    partition_id: int
    transaction_id: int
    max_records: int


@dataclass(frozen=True, slots=True)
class RecordHeaderListResponse(Message):
    TYPE: ClassVar[int] = 63
    session_id: int
    seq_num: int
    partition_id: int
    record_headers: tuple[RecordHeader, ...]


@dataclass(frozen=True, slots=True)
class RecordListRequest(Message):
    TYPE: ClassVar[int] = 64
    session_id: int
    seq_num: int
    partition_id: int
    transaction_id: int
    max_records: int
    max_bytes: int = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class RecordListResponse(Message):
    """``records``: a tuple, or a :class:`waltz_api.wire.RecordBlock` (see RangeReadResponse)."""

    TYPE: ClassVar[int] = 65
    session_id: int
    seq_num: int
    partition_id: int
    records: Sequence[Record]


@dataclass(frozen=True, slots=True)
class SuccessResponse(Message):
    TYPE: ClassVar[int] = 66
    session_id: int
    seq_num: int
    partition_id: int


@dataclass(frozen=True, slots=True)
class FailureResponse(Message):
    """A storage node's refusal; ``code`` says why (FENCED: a newer session exists,
    and ``highest_session_id`` is the newest the node has seen)."""

    TYPE: ClassVar[int] = 67
    session_id: int
    seq_num: int
    partition_id: int
    code: ErrorCode
    message: str
    highest_session_id: int = -1


@dataclass(frozen=True, slots=True)
class MissingRangeRequest(Message):
    """Which records the replica's storage lost to damage (and must get back from a peer)."""

    TYPE: ClassVar[int] = 68
    session_id: int
    seq_num: int
    partition_id: int


@dataclass(frozen=True, slots=True)
class MissingRangeResponse(Message):
    """The lowest range ``first..last`` (inclusive) of transaction ids at or below the
    replica's max transaction id that its storage lost to damage found at start-up (the
    damaged files were moved aside): reads there fail until a RepairRequest fills it.
    ``-1, -1`` when the log has no hole."""

    TYPE: ClassVar[int] = 69
    session_id: int
    seq_num: int
    partition_id: int
    first: int
    last: int


@dataclass(frozen=True, slots=True)
class RepairRequest(Message):
    """Records copied from a healthy replica into the lowest missing range: dense, from
    its first missing id, not past its end. Answered SuccessResponse once durable."""

    TYPE: ClassVar[int] = 70
    session_id: int
    seq_num: int
    partition_id: int
    records: tuple[Record, ...]


@dataclass(frozen=True, slots=True)
class MarkReplicaRequest(Message):
    """The store session's word on whether this replica holds what it acknowledged.

    ``clean=False`` (*suspect*): the replica came back to the session with storage that
    lost records it had acknowledged (a damaged tail, a wiped disk, a restore). Like
    SetLowWaterMark (the log must end at or below ``low_water_mark``), but the marks
    are recorded with ``low_water_mark_session_id = LOST_SESSION``: until the session
    says otherwise, a recovery counts this replica as one that may have held anything
    (an offline one), never as a voter.

    ``clean=True``: the replica caught up to the session's committed prefix again (its
    log reaches ``log_end``); its marks become this session's. Refused unless they are
    ``low_water_mark`` recorded as suspect (or already this session's), the log reaches
    ``log_end`` and no range is missing. Answered SuccessResponse once durable."""

    TYPE: ClassVar[int] = 71
    session_id: int
    seq_num: int
    partition_id: int
    low_water_mark: int
    clean: bool
    log_end: int = -1


@dataclass(frozen=True, slots=True)
class StorageAdminRequest(Message):
    """Administration of a storage node (list/add/remove partitions, availability...).

    ``command`` names the operation; ``arguments`` is UTF-8 JSON."""

    TYPE: ClassVar[int] = 80
    seq_num: int
    command: str
    arguments: bytes


@dataclass(frozen=True, slots=True)
class StorageAdminResponse(Message):
    """``result`` is UTF-8 JSON when ``success``; ``error`` otherwise."""

    TYPE: ClassVar[int] = 81
    seq_num: int
    success: bool
    result: bytes = b""
    error: str = ""


CLIENT_SERVER_MESSAGES: tuple[type[Message], ...] = (
    MountRequest,
    MountResponse,
    AppendRequest,
    FeedRequest,
    FeedData,
    TransactionDataRequest,
    TransactionDataResponse,
    FlushRequest,
    FlushResponse,
    LockFailure,
    HighWaterMarkRequest,
    HighWaterMarkResponse,
    RangeReadRequest,
    RangeReadResponse,
    ErrorResponse,
)

SERVER_SERVER_MESSAGES: tuple[type[Message], ...] = (PeerPing, PeerPong)

SERVER_STORAGE_MESSAGES: tuple[type[Message], ...] = (
    StorageOpenRequest,
    LastSessionInfoRequest,
    LastSessionInfoResponse,
    MaxTransactionIdRequest,
    MaxTransactionIdResponse,
    TruncateRequest,
    SetLowWaterMarkRequest,
    StorageAppendRequest,
    RecordHeaderRequest,
    RecordHeaderResponse,
    RecordRequest,
    RecordResponse,
    RecordHeaderListRequest,
    RecordHeaderListResponse,
    RecordListRequest,
    RecordListResponse,
    SuccessResponse,
    FailureResponse,
    MissingRangeRequest,
    MissingRangeResponse,
    RepairRequest,
    MarkReplicaRequest,
    StorageAdminRequest,
    StorageAdminResponse,
)

ALL_MESSAGES: tuple[type[Message], ...] = (
    Hello,
    HelloResponse,
    *CLIENT_SERVER_MESSAGES,
    *SERVER_SERVER_MESSAGES,
    *SERVER_STORAGE_MESSAGES,
)
