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
from dataclasses import dataclass
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


# -- the handshake (HELLO / WELCOME) ---------------------------------------------------------
#
# Parsed with limits before anything else looks at them: a peer that has not proven
# anything yet sends them. A body is a flat JSON object of at most MAX_CONTROL_BYTES
# (UTF-8) and MAX_CONTROL_FIELDS fields whose values are strings, integers, booleans or
# null; every field Waltz reads is range-checked. Unknown fields are ignored (a newer
# peer may send more). Anything else is a ProtocolError, never another exception.

MAX_CONTROL_BYTES = 4096
"""The largest HELLO or WELCOME body (bytes after the kind)."""
MAX_CONTROL_FIELDS = 32
MAX_CLIENT_ID = 128
"""Characters of a HELLO's ``client`` (a transport's uid: 32 hex digits)."""
MAX_REPLACE_KEY = 256
"""Characters of a ``replace_key`` (printable ASCII)."""
MAX_WINDOW_FRAMES = 2**32 - 1
MAX_U63 = 2**63 - 1
MAX_CLOSE_REASON = 1000
"""Bytes of a CLOSE reason sent; a longer one received is cut there."""


@dataclass(frozen=True, slots=True)
class Hello:
    """A client's opening message."""

    version: int
    client: str
    seq: int
    replace_key: str | None
    window_frames: int
    window_bytes: int
    max_frame_size: int

    def encode(self) -> bytes:
        return control(
            KIND_HELLO,
            {
                "version": self.version,
                "client": self.client,
                "seq": self.seq,
                "replace_key": self.replace_key,
                "window_frames": self.window_frames,
                "window_bytes": self.window_bytes,
                "max_frame_size": self.max_frame_size,
            },
        )


@dataclass(frozen=True, slots=True)
class Welcome:
    """A listener's answer to an accepted hello."""

    version: int
    id: int
    window_frames: int
    window_bytes: int
    max_frame_size: int

    def encode(self) -> bytes:
        return control(
            KIND_WELCOME,
            {
                "version": self.version,
                "id": self.id,
                "window_frames": self.window_frames,
                "window_bytes": self.window_bytes,
                "max_frame_size": self.max_frame_size,
            },
        )


def control(kind: int, body: dict[str, Any]) -> bytes:
    return bytes([kind]) + json.dumps(body, separators=(",", ":")).encode()


def _nesting(text: str) -> int:
    """The deepest nesting of JSON arrays and objects in ``text`` (strings skipped), so
    that a deep body is refused before a recursive parser sees it."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def parse_control(message: bytes, what: str) -> dict[str, Any]:
    """The body of a HELLO or WELCOME: a flat JSON object within the limits above."""
    size = len(message) - 1
    if size > MAX_CONTROL_BYTES:
        raise ProtocolError(f"{what} of {size} bytes is above the limit of {MAX_CONTROL_BYTES}")
    try:
        text = message[1:].decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError(f"malformed {what}: not UTF-8") from None
    if _nesting(text) > 1:
        raise ProtocolError(f"malformed {what}: not a flat JSON object")
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"malformed {what}: {str(exc)[:100]}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"malformed {what}: not a JSON object")
    if len(body) > MAX_CONTROL_FIELDS:
        raise ProtocolError(f"malformed {what}: {len(body)} fields, at most {MAX_CONTROL_FIELDS}")
    return body


def parse_hello(message: bytes) -> Hello:
    body = parse_control(message, "hello")
    version = field_int(body, "version", 0, MAX_U63)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version} is not supported (this end speaks "
            f"{PROTOCOL_VERSION}); upgrade the older end"
        )
    client = field_text(body, "client", MAX_CLIENT_ID)
    if not client:
        raise ProtocolError("field 'client' must not be empty")
    return Hello(
        version=version,
        client=client,
        seq=field_int(body, "seq", 0, MAX_U63),
        replace_key=field_text(body, "replace_key", MAX_REPLACE_KEY, optional=True),
        window_frames=field_int(body, "window_frames", 1, MAX_WINDOW_FRAMES),
        window_bytes=field_int(body, "window_bytes", 1, MAX_U63),
        max_frame_size=field_int(body, "max_frame_size", 1, MAX_U63),
    )


def parse_welcome(message: bytes) -> Welcome:
    body = parse_control(message, "welcome")
    version = field_int(body, "version", 0, MAX_U63)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"the listener speaks protocol version {version}, this end {PROTOCOL_VERSION}; "
            "upgrade the older end"
        )
    return Welcome(
        version=version,
        id=field_int(body, "id", 0, MAX_U63),
        window_frames=field_int(body, "window_frames", 1, MAX_WINDOW_FRAMES),
        window_bytes=field_int(body, "window_bytes", 1, MAX_U63),
        max_frame_size=field_int(body, "max_frame_size", 1, MAX_U63),
    )


def parse_credit(message: bytes) -> tuple[int, int]:
    """A CREDIT's cumulative (frames, bytes) consumed."""
    require(len(message) == CREDIT.size, f"malformed credit: {len(message)} bytes")
    _, frames, nbytes = CREDIT.unpack(message)
    return frames, nbytes


def parse_heartbeat(message: bytes) -> int:
    """A HEARTBEAT's count of DATA/BATCH messages sent (modulo 2**32)."""
    require(len(message) == HEARTBEAT.size, f"malformed heartbeat: {len(message)} bytes")
    return int(HEARTBEAT.unpack(message)[1])


def parse_close(message: bytes) -> str:
    """A CLOSE's reason, cut to MAX_CLOSE_REASON bytes and made printable (it ends up
    in logs and error messages of this side)."""
    reason = message[1 : 1 + MAX_CLOSE_REASON].decode("utf-8", "replace")
    return "".join(c if c.isprintable() else "?" for c in reason)


def close_message(reason: str) -> bytes:
    return bytes([KIND_CLOSE]) + reason.encode("utf-8", "replace")[:MAX_CLOSE_REASON]


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


def field_int(body: dict[str, Any], key: str, minimum: int = 0, maximum: int = MAX_U63) -> int:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        shown = repr(value)[:40]
        raise ProtocolError(
            f"field {key!r} must be an integer in {minimum}..{maximum}, got {shown}"
        )
    return value


def field_text(
    body: dict[str, Any], key: str, max_length: int, *, optional: bool = False
) -> str | None:
    """A printable ASCII string of at most ``max_length`` characters."""
    value = body.get(key)
    if value is None and optional:
        return None
    if (
        not isinstance(value, str)
        or len(value) > max_length
        or not (value.isascii() and value.isprintable())
    ):
        shown = repr(value)[:40]
        raise ProtocolError(
            f"field {key!r} must be printable ASCII of at most {max_length} characters, got {shown}"
        )
    return value


def check_replace_key(key: str | None) -> None:
    """What a listener accepts as a ``replace_key``, checked where it is chosen."""
    field_text({"replace_key": key}, "replace_key", MAX_REPLACE_KEY, optional=True)


Decoded = Hello | Welcome | tuple[str, Any]


def decode(message: bytes, max_frame_size: int) -> Decoded:
    """Any message of this protocol, decoded as the transport checks it: a Hello, a
    Welcome, or (kind name, content). Raises only ProtocolError. (The transport's hot
    path inlines the DATA/BATCH/CREDIT checks; this is the same rules in one place, for
    the fuzzers and for tools.)"""
    if not message:
        raise ProtocolError("empty message")
    kind = message[0]
    if kind == KIND_HELLO:
        return parse_hello(message)
    if kind == KIND_WELCOME:
        return parse_welcome(message)
    if kind == KIND_CREDIT:
        return "credit", parse_credit(message)
    if kind == KIND_HEARTBEAT:
        return "heartbeat", parse_heartbeat(message)
    if kind == KIND_CLOSE:
        return "close", parse_close(message)
    if kind in (KIND_DATA, KIND_BATCH):
        require(len(message) >= DATA_HEADER.size, "truncated data header")
        seq = DATA_HEADER.unpack_from(message)[1]
        if kind == KIND_DATA:
            size = len(message) - DATA_HEADER.size
            require(size <= max_frame_size, f"a frame of {size} bytes is above max_frame_size")
            return "data", (seq, [message[DATA_HEADER.size :]])
        return "batch", (seq, unpack_batch(message, max_frame_size))
    raise ProtocolError(f"unknown message kind {kind}")
