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
verifies it for AppendRequest, TransactionDataResponse and every Record (once per
hop: a storage node leaves the records of StorageAppendRequest and RepairRequest to its
storage engine, which verifies each as it stores it; :func:`decode`'s
``verify_record_checksums``).

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

Server-server messages (the cluster manager's failure detector, on a server's client
endpoint after the same handshake)::

    30 PeerPing                 seq_num:i64, server_id:i32
    31 PeerPong                 seq_num:i64, server_id:i32

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
    71 MarkReplicaRequest       S, low_water_mark:i64, clean:bool, log_end:i64
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

The package: :mod:`~waltz_api.wire.schema` (the constants, every message's fields in
wire order, the errors of a malformed frame), :mod:`~waltz_api.wire.codec` (the encoder
and decoder of each message, generated from its schema; :func:`encode`,
:func:`decode`), :mod:`~waltz_api.wire.blocks` (records, headers and
:class:`RecordBlock`), :mod:`~waltz_api.wire.construct` (decoded values built without
``__init__``), :mod:`~waltz_api.wire.connection` (stream framing and the handshake).
"""

from waltz_api.wire.blocks import RecordBlock, encode_records
from waltz_api.wire.codec import FeedItem, decode, encode, encode_feed_data
from waltz_api.wire.connection import (
    ConnectionState,
    FrameBuffer,
    ProtocolConnection,
    Role,
    encode_stream,
    frame_length_prefix,
)
from waltz_api.wire.schema import (
    DEFAULT_MAX_FRAME_SIZE,
    HEADER_SIZE,
    PROTOCOL_VERSION,
    RECORD_FIXED_SIZE,
    RECORD_HEADER_SIZE,
    SUPPORTED_VERSIONS,
    checksum,
)

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "HEADER_SIZE",
    "PROTOCOL_VERSION",
    "RECORD_FIXED_SIZE",
    "RECORD_HEADER_SIZE",
    "SUPPORTED_VERSIONS",
    "ConnectionState",
    "FeedItem",
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
