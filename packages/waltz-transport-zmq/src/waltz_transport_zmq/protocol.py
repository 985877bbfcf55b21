"""The transport's own framing on the wire: one ZeroMQ frame per message.

Every ZeroMQ message is a single frame whose first byte is its kind:

- ``DATA``: kind, u32 sequence number, then one application frame.
- ``BATCH``: kind, u32 sequence number, then ``u32 length + frame`` repeated
  (several small application frames coalesced into one ZeroMQ send).
- ``CREDIT``: kind, u64 frames and u64 bytes the receiver has consumed so far
  (cumulative): the sender may have ``window`` frames/bytes beyond those in flight.
- ``HEARTBEAT``: kind, u32 count of DATA/BATCH messages sent so far; the
  receiver checks it against what it got, so a lost tail is noticed too.
- ``CLOSE``: kind, then a UTF-8 reason.
- ``HELLO`` / ``WELCOME``: kind, then a JSON object (connection setup; rare).

Sequence numbers count DATA and BATCH messages per connection and direction
(modulo 2**32); a gap closes the connection, so frames are delivered in
order, each exactly once, or the connection breaks.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from waltz_api.errors import ProtocolError

PROTOCOL_VERSION = 1

KIND_DATA = 1
KIND_BATCH = 2
KIND_CREDIT = 3
KIND_HEARTBEAT = 4
KIND_CLOSE = 5
KIND_HELLO = 16
KIND_WELCOME = 17

SEQ_MASK = 0xFFFFFFFF

DATA_HEADER = struct.Struct("<BI")
CREDIT = struct.Struct("<BQQ")
HEARTBEAT = struct.Struct("<BI")
LENGTH = struct.Struct("<I")

# Coalescing: frames up to BATCH_FRAME_LIMIT bytes are packed together, in
# batches up to BATCH_LIMIT bytes; larger frames go alone.
BATCH_LIMIT = 256 * 1024
BATCH_FRAME_LIMIT = 16 * 1024
# ZMQ_MAXMSGSIZE headroom over max_frame_size for the headers
HEADER_ROOM = 64

DATA_PREFIX = bytes([KIND_DATA])
BATCH_PREFIX = bytes([KIND_BATCH])


def control(kind: int, body: dict[str, Any]) -> bytes:
    return bytes([kind]) + json.dumps(body, separators=(",", ":")).encode()


def parse_control(message: bytes, what: str) -> dict[str, Any]:
    try:
        body = json.loads(message[1:])
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"malformed {what}: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"malformed {what}: not an object")
    return body


def close_message(reason: str) -> bytes:
    return bytes([KIND_CLOSE]) + reason.encode("utf-8", "replace")[:1000]


def unpack_batch(message: bytes, max_frame_size: int) -> list[bytes]:
    """The frames of a BATCH message; raises ProtocolError when it is malformed."""
    frames: list[bytes] = []
    view = memoryview(message)
    position = DATA_HEADER.size
    end = len(message)
    unpack = LENGTH.unpack_from
    while position < end:
        if position + 4 > end:
            raise ProtocolError("truncated batch: a length prefix is cut off")
        (size,) = unpack(view, position)
        position += 4
        if size > max_frame_size:
            raise ProtocolError(f"a frame of {size} bytes is above max_frame_size {max_frame_size}")
        if position + size > end:
            raise ProtocolError("truncated batch: a frame is cut off")
        frames.append(message[position : position + size])
        position += size
    if not frames:
        raise ProtocolError("empty batch")
    return frames


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ProtocolError(message)


def field_int(body: dict[str, Any], key: str, minimum: int = 0) -> int:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ProtocolError(f"field {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def field_str(body: dict[str, Any], key: str, optional: bool = False) -> str | None:
    value = body.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > 1000:
        raise ProtocolError(f"field {key!r} must be a string, got {value!r}")
    return value
