"""Connections: length-prefixed framing for byte-stream transports
(:class:`FrameBuffer`, :func:`encode_stream`) and the version handshake with the
per-connection protocol state (:class:`ProtocolConnection`), both sans-IO."""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Final

from waltz_api.errors import (
    FrameTooLargeError,
    InvalidArgumentError,
    ProtocolError,
    VersionMismatchError,
)
from waltz_api.messages import (
    Hello,
    HelloResponse,
    Message,
)
from waltz_api.wire.codec import decode, encode
from waltz_api.wire.schema import DEFAULT_MAX_FRAME_SIZE, SUPPORTED_VERSIONS

_STREAM_PREFIX: Final = struct.Struct(">I")


# -- stream framing ------------------------------------------------------------------------------


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
            raise InvalidArgumentError(
                f"max_frame_size must be within 0..2**32-1, not {max_frame_size}"
            )
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
        verify_record_checksums: bool = True,
    ) -> None:
        """``record_blocks``: received record lists come as :class:`RecordBlock`;
        ``verify_record_checksums=False``: a storage node's, whose engine verifies the
        records it stores (both: see :func:`decode`)."""
        unsupported = [v for v in versions if v not in SUPPORTED_VERSIONS]
        if not versions or unsupported:
            raise InvalidArgumentError(
                f"versions must be a non-empty subset of {SUPPORTED_VERSIONS}, not {versions!r}"
            )
        self.role = role
        self.sender = sender
        self.versions: tuple[int, ...] = tuple(sorted(set(versions)))
        self.max_frame_size = max_frame_size
        self.record_blocks = record_blocks
        self.verify_record_checksums = verify_record_checksums
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
                frame,
                max_frame_size=self.max_frame_size,
                record_blocks=self.record_blocks,
                verify_record_checksums=self.verify_record_checksums,
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
