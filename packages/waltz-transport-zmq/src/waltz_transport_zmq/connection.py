"""The transport's connections: credit-based flow control, coalescing, ordering.

:class:`ZmqConnection` is one end of a connection: a DEALER socket of its own on the
side that connected (:class:`ClientConnection`), a ROUTER identity on the listener's
side (:class:`ServerConnection`). Its frames go out through its
:class:`~waltz_transport_zmq.sockets.Wire` packed as the transport's messages
(:mod:`waltz_transport_zmq.protocol`): a sender has at most the peer's window of frames
and bytes in flight beyond what the peer's application consumed (credit), the frames of
one loop iteration leave together (a batch), and each message carries a sequence number
(a gap breaks the connection). What it needs of its transport is a
:class:`ConnectionOwner`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import zmq

from waltz_api.contracts.transport import Connection
from waltz_api.errors import ConnectError, ConnectionClosedError, FrameTooLargeError, ProtocolError
from waltz_transport_zmq import protocol as p
from waltz_transport_zmq.logs import PeerLog
from waltz_transport_zmq.options import ZmqOptions
from waltz_transport_zmq.sockets import Pump, Wire

log = logging.getLogger(__name__)
_trouble = PeerLog(log)
"""Lines about misbehaving peers (malformed messages), rate-limited."""

_pack_data = p.DATA_HEADER.pack
_unpack_data = p.DATA_HEADER.unpack_from
_HEADER = p.DATA_HEADER.size
_DATA = p.KIND_DATA
_BATCH = p.KIND_BATCH
_SEQ_MASK = p.SEQ_MASK
_BATCH_LIMIT = p.BATCH_LIMIT


class ConnectionOwner(Protocol):
    """What a connection needs of its transport."""

    @property
    def opts(self) -> ZmqOptions: ...

    def forget(self, conn: ZmqConnection) -> None:
        """The connection ended: the transport no longer watches it."""
        ...

    def clamp_window(self, frames: int, nbytes: int) -> tuple[int, int]:
        """A peer's announced receive window, capped at this side's own."""
        ...


class ZmqConnection(Connection):
    """One end of a connection (a DEALER socket on the client, a ROUTER identity on the server)."""

    def __init__(
        self,
        transport: ConnectionOwner,
        connection_id: int,
        peer: str,
        *,
        peer_window_frames: int,
        peer_window_bytes: int,
    ) -> None:
        opts = transport.opts
        self._transport = transport
        self._loop = asyncio.get_running_loop()
        self._id = connection_id
        self._peer = peer
        self._max = opts.max_frame_size
        self._send_max = opts.max_frame_size
        """The largest frame sent: this side's limit, or the peer's announced one if smaller."""
        self._coalesce = opts.coalesce
        self._wire: Wire | None = None
        self._closed = False
        self._eof = False
        self._reason = "closed"
        # receiving
        self._inbox: deque[bytes] = deque()
        self._inbox_bytes = 0
        self._recv_waiters: list[asyncio.Future[None]] = []
        self._seq_in = 0
        self._consumed_frames = 0
        self._consumed_bytes = 0
        self._granted_frames = 0
        self._granted_bytes = 0
        self._window_frames = opts.window_frames
        self._window_bytes = opts.window_bytes
        self._grant_frames = max(1, opts.window_frames // 4)
        self._grant_bytes = max(1, opts.window_bytes // 4)
        # sending
        self._seq_out = 0
        self._sent_frames = 0
        self._sent_bytes = 0
        self._acked_frames = 0
        self._acked_bytes = 0
        self._peer_window_frames = peer_window_frames
        self._peer_window_bytes = peer_window_bytes
        self._credit_waiters: list[asyncio.Future[None]] = []
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._flush_scheduled = False
        # liveness (see tick)
        self._heard = True
        self._last_heard = self._loop.time()
        self.on_closed: Callable[[ZmqConnection], None] | None = None

    # -- Connection --------------------------------------------------------------------

    @property
    def connection_id(self) -> int:
        return self._id

    @property
    def peer(self) -> str:
        return self._peer

    @property
    def closed(self) -> bool:
        return self._closed or (self._eof and not self._inbox)

    @property
    def queued_bytes(self) -> int:
        """Bytes received and not yet taken by ``recv``."""
        return self._inbox_bytes

    def _closed_error(self) -> ConnectionClosedError:
        return ConnectionClosedError(
            f"connection {self._id} with {self._peer} is closed: {self._reason}"
        )

    @property
    def max_frame_size(self) -> int:
        return self._send_max

    def peer_limit(self, announced: int) -> None:
        """The peer's max_frame_size from its hello or welcome."""
        self._send_max = min(self._max, announced)

    def _too_large(self, size: int) -> FrameTooLargeError:
        if self._send_max < self._max:
            return FrameTooLargeError(
                f"frame of {size} bytes exceeds the peer's max_frame_size {self._send_max} "
                f"(this side's is {self._max}); split the payload, or raise max_frame_size "
                "on the peer"
            )
        return FrameTooLargeError(
            f"frame of {size} bytes exceeds max_frame_size {self._max}; split the payload "
            "or raise the transport's max_frame_size option"
        )

    async def send(self, frame: bytes) -> None:
        size = len(frame)
        if size > self._send_max:
            raise self._too_large(size)
        if self._closed or self._eof:
            raise self._closed_error()
        if (
            self._sent_frames - self._acked_frames >= self._peer_window_frames
            or self._sent_bytes - self._acked_bytes >= self._peer_window_bytes
        ):
            await self._wait_for_credit()
        self._sent_frames += 1
        self._sent_bytes += size
        if self._coalesce and self._flush_scheduled:
            # a frame already left in this loop iteration: the later ones wait for the
            # flush at the end of it, packed together
            self._out.append(frame)
            self._out_bytes += size
            if self._out_bytes >= _BATCH_LIMIT:
                self._flush()
        else:
            if self._coalesce:
                # the first frame of an iteration goes at once (no latency added to a lone
                # request); the iteration's later frames coalesce
                self._flush_scheduled = True
                self._loop.call_soon(self._flush)
            seq = self._seq_out
            self._seq_out = (seq + 1) & _SEQ_MASK
            self._wire.send(_pack_data(_DATA, seq) + frame)  # type: ignore[union-attr]

    async def send_many(self, frames: list[bytes]) -> None:
        for frame in frames:
            if len(frame) > self._send_max:
                raise self._too_large(len(frame))
        if self._closed or self._eof:
            raise self._closed_error()
        index, count = 0, len(frames)
        while index < count:
            if (
                self._sent_frames - self._acked_frames >= self._peer_window_frames
                or self._sent_bytes - self._acked_bytes >= self._peer_window_bytes
            ):
                self._flush()
                await self._wait_for_credit()
            # take as many frames as the credit allows at once
            room_frames = self._peer_window_frames - (self._sent_frames - self._acked_frames)
            room_bytes = self._peer_window_bytes - (self._sent_bytes - self._acked_bytes)
            out = self._out
            while index < count and room_frames > 0 and room_bytes > 0:
                frame = frames[index]
                size = len(frame)
                out.append(frame)
                self._out_bytes += size
                self._sent_frames += 1
                self._sent_bytes += size
                room_frames -= 1
                room_bytes -= size
                index += 1
            self._flush()

    def send_nowait(self, frames: Sequence[bytes]) -> bool:
        """Send ``frames``, in order, when the connection takes them all without
        waiting: open, each within max_frame_size, within the peer's credit. False:
        nothing was sent (``send_many`` waits, or raises what is wrong). They leave at
        the end of this loop iteration, packed with every other frame sent to the peer
        in it (one message for a burst, as an outbox writer's ``send_many`` of it
        would be), for the cost of one callback instead of a writer task's turn."""
        if self._closed or self._eof or not frames:
            return False
        size = 0
        limit = self._send_max
        for frame in frames:
            length = len(frame)
            if length > limit:
                return False
            size += length
        count = len(frames)
        if (
            self._sent_frames - self._acked_frames + count > self._peer_window_frames
            or self._sent_bytes - self._acked_bytes + size > self._peer_window_bytes
        ):
            return False
        self._sent_frames += count
        self._sent_bytes += size
        self._out.extend(frames)
        self._out_bytes += size
        if self._out_bytes >= _BATCH_LIMIT:
            self._flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)
        return True

    async def _wait_for_credit(self) -> None:
        while (
            self._sent_frames - self._acked_frames >= self._peer_window_frames
            or self._sent_bytes - self._acked_bytes >= self._peer_window_bytes
        ):
            if self._closed or self._eof:
                raise self._closed_error()
            waiter = self._loop.create_future()
            self._credit_waiters.append(waiter)
            try:
                await waiter
            finally:
                with contextlib.suppress(ValueError):
                    self._credit_waiters.remove(waiter)
        if self._closed or self._eof:
            raise self._closed_error()

    def _flush(self) -> None:
        self._flush_scheduled = False
        out = self._out
        if not out or self._closed:
            return
        self._out = []
        self._out_bytes = 0
        wire = self._wire
        assert wire is not None
        if len(out) == 1:
            wire.send(p.DATA_HEADER.pack(p.KIND_DATA, self._seq_out) + out[0])
            self._seq_out = (self._seq_out + 1) & p.SEQ_MASK
            return
        parts: list[bytes] = []
        batch_bytes = 0
        pack_length = p.LENGTH.pack
        for frame in out:
            size = len(frame)
            if size > p.BATCH_FRAME_LIMIT:
                self._emit_batch(parts)
                parts, batch_bytes = [], 0
                wire.send(p.DATA_HEADER.pack(p.KIND_DATA, self._seq_out) + frame)
                self._seq_out = (self._seq_out + 1) & p.SEQ_MASK
                continue
            if batch_bytes + size + 4 > p.BATCH_LIMIT:
                self._emit_batch(parts)
                parts, batch_bytes = [], 0
            parts.append(pack_length(size))
            parts.append(frame)
            batch_bytes += size + 4
        self._emit_batch(parts)

    def _emit_batch(self, parts: list[bytes]) -> None:
        if not parts:
            return
        wire = self._wire
        assert wire is not None
        if len(parts) == 2:
            message = p.DATA_HEADER.pack(p.KIND_DATA, self._seq_out) + parts[1]
        else:
            message = p.DATA_HEADER.pack(p.KIND_BATCH, self._seq_out) + b"".join(parts)
        wire.send(message)
        self._seq_out = (self._seq_out + 1) & p.SEQ_MASK

    async def recv(self) -> bytes:
        while True:
            inbox = self._inbox
            if inbox:
                frame = inbox.popleft()
                size = len(frame)
                self._inbox_bytes -= size
                self._consumed_frames += 1
                self._consumed_bytes += size
                if (
                    self._consumed_frames - self._granted_frames >= self._grant_frames
                    or self._consumed_bytes - self._granted_bytes >= self._grant_bytes
                ) and not self._closed:
                    self._granted_frames = self._consumed_frames
                    self._granted_bytes = self._consumed_bytes
                    assert self._wire is not None
                    self._wire.send(
                        p.CREDIT.pack(p.KIND_CREDIT, self._consumed_frames, self._consumed_bytes)
                    )
                return frame
            if self._closed or self._eof:
                raise self._closed_error()
            waiter = self._loop.create_future()
            self._recv_waiters.append(waiter)
            try:
                await waiter
            finally:
                with contextlib.suppress(ValueError):
                    self._recv_waiters.remove(waiter)

    async def close(self) -> None:
        if self._closed:
            return
        self._flush()
        if self._wire is not None and not self._eof:
            self._wire.send_best_effort(p.close_message("closed by the peer"))
        self._break("closed by this side", log_level=logging.DEBUG)

    # -- receiving from the wire -------------------------------------------------------

    def _wake_receivers(self) -> None:
        for waiter in self._recv_waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _wake_senders(self) -> None:
        for waiter in self._credit_waiters:
            if not waiter.done():
                waiter.set_result(None)

    def on_message(self, message: bytes) -> None:
        """One message from the peer (the reader calls this; never raises)."""
        self._heard = True
        if self._closed:
            return
        try:
            kind = message[0]
            if kind in (_DATA, _BATCH):
                if len(message) < _HEADER:
                    raise ProtocolError("truncated data header")
                seq = _unpack_data(message)[1]
                if seq != self._seq_in:
                    raise ProtocolError(
                        f"message {seq} arrived where {self._seq_in} was due: messages were lost "
                        "in transit (a frame above the receiver's max_frame_size, or a broken "
                        "link)"
                    )
                self._seq_in = (seq + 1) & _SEQ_MASK
                inbox = self._inbox
                if kind == _DATA:
                    frame = message[_HEADER:]
                    size = len(frame)
                    if size > self._max:
                        raise ProtocolError(
                            f"received a frame of {size} bytes, above max_frame_size {self._max}"
                        )
                    inbox.append(frame)
                    self._inbox_bytes += size
                else:
                    for frame in p.unpack_batch(message, self._max):
                        inbox.append(frame)
                        self._inbox_bytes += len(frame)
                if (
                    len(inbox) > self._window_frames
                    or self._inbox_bytes > self._window_bytes + self._max
                ):
                    raise ProtocolError("the peer sent beyond its flow-control window")
                if self._recv_waiters:
                    self._wake_receivers()
            elif kind == p.KIND_CREDIT:
                frames, nbytes = p.parse_credit(message)
                p.require(
                    frames <= self._sent_frames and nbytes <= self._sent_bytes,
                    "credit for frames never sent",
                )
                if frames > self._acked_frames or nbytes > self._acked_bytes:
                    self._acked_frames = max(self._acked_frames, frames)
                    self._acked_bytes = max(self._acked_bytes, nbytes)
                    if self._credit_waiters:
                        self._wake_senders()
            elif kind == p.KIND_HEARTBEAT:
                sent = p.parse_heartbeat(message)
                if sent != self._seq_in:
                    raise ProtocolError(
                        f"the peer sent {sent} messages but {self._seq_in} arrived: messages were "
                        "lost in transit (a frame above the receiver's max_frame_size, or a "
                        "broken link)"
                    )
            elif kind == p.KIND_CLOSE:
                self._peer_closed(p.parse_close(message) or "closed by the peer")
            elif kind in (p.KIND_WELCOME, p.KIND_HELLO):
                return  # a duplicate of the handshake: harmless
            else:
                raise ProtocolError(f"unknown message kind {kind}")
        except Exception as exc:  # ProtocolError, or anything a malformed message caused
            reason = str(exc) if isinstance(exc, ProtocolError) else f"{type(exc).__name__}: {exc}"
            reason = reason[:300]
            _trouble.log(
                logging.WARNING,
                self._peer,
                "closing connection %d with %s: protocol error: %s",
                self._id,
                self._peer,
                reason,
            )
            if self._wire is not None:
                self._wire.send_best_effort(p.close_message(f"protocol error: {reason}"))
            self._break(f"protocol error: {reason}", log_level=logging.DEBUG)

    def _peer_closed(self, reason: str) -> None:
        """The peer closed: what arrived before is still delivered, then recv raises."""
        self._eof = True
        self._reason = reason
        self._out.clear()
        self._transport.forget(self)
        if self.on_closed is not None:
            self.on_closed(self)
        self._wake_receivers()
        self._wake_senders()
        if self._wire is not None:
            self._wire.stop()

    def _break(self, reason: str, log_level: int = logging.INFO) -> None:
        """Closed now: drop what is queued, wake everyone waiting."""
        if self._closed:
            return
        log.log(log_level, "connection %d with %s closed: %s", self._id, self._peer, reason)
        self._closed = True
        if not self._eof:
            self._reason = reason
        self._inbox.clear()
        self._inbox_bytes = 0
        self._out.clear()
        self._transport.forget(self)
        if self.on_closed is not None:
            self.on_closed(self)
        self._wake_receivers()
        self._wake_senders()
        if self._wire is not None:
            self._wire.stop()

    def _heartbeat(self) -> None:
        if self._wire is not None and not self._closed:
            self._flush()
            self._wire.send(p.HEARTBEAT.pack(p.KIND_HEARTBEAT, self._seq_out))

    # -- for the transport and its listeners -------------------------------------------

    def attach(
        self, socket: zmq.Socket[bytes], pump: Pump, identity: bytes | None, cap: int
    ) -> Wire:
        """Send through ``socket`` (to ``identity`` on a ROUTER), at most ``cap`` messages
        queued while ZeroMQ cannot take them; returns the wire (for the handshake)."""
        self._wire = Wire(
            socket, pump, identity, cap, broken=self._break, stopped=lambda: self._closed
        )
        return self._wire

    def abort(self, reason: str, log_level: int = logging.INFO) -> None:
        """Closed now, for ``reason``: nothing queued is delivered."""
        self._break(reason, log_level)

    def replaced(self, reason: str) -> None:
        """A newer connection replaces this one: the peer is told, then it is closed."""
        if self._wire is not None:
            self._wire.send_best_effort(p.close_message(reason))
        self._break(reason)

    @property
    def closed_here(self) -> bool:
        """This side closed it (or it broke), rather than the peer closing it."""
        return self._closed

    def tick(self, now: float, timeout: float) -> None:
        """The transport's watchdog, every heartbeat interval: a heartbeat when this side
        sent nothing since the last tick; closed when the peer sent nothing for
        ``timeout`` seconds."""
        if self._heard:
            self._heard = False
            self._last_heard = now
        elif now - self._last_heard > timeout:
            self._break(f"the peer sent nothing for {timeout} s (dead or paused)")
            return
        wire = self._wire
        if wire is not None:
            if not wire.said:
                self._heartbeat()
            wire.said = False


class ClientConnection(ZmqConnection):
    """A connection this transport opened: its own DEALER socket, read by its own pump."""

    socket: zmq.Socket[bytes]
    pump: Pump
    # resolved by the listener's first answer (WELCOME, or CLOSE when it refuses)
    welcome: asyncio.Future[None] | None = None

    def on_first_message(self, message: bytes) -> None:
        """The listener's answer to the hello; every later message goes to on_message."""
        self.pump.handle = self.on_message
        welcome = self.welcome
        self.welcome = None
        if welcome is None or welcome.done():
            return
        kind = message[:1]
        if kind == bytes([p.KIND_WELCOME]):
            try:
                welcome_message = p.parse_welcome(message)
            except ProtocolError as exc:
                welcome.set_exception(
                    ConnectError(f"{self._peer} answered with a malformed welcome: {exc}")
                )
                return
            self._peer_window_frames, self._peer_window_bytes = self._transport.clamp_window(
                welcome_message.window_frames, welcome_message.window_bytes
            )
            self.peer_limit(welcome_message.max_frame_size)
            self._heard = True
            self._last_heard = self._loop.time()
            welcome.set_result(None)
        elif kind == bytes([p.KIND_CLOSE]):
            welcome.set_exception(
                ConnectError(f"{self._peer} refused the connection: {p.parse_close(message)}")
            )
        else:
            welcome.set_exception(
                ConnectError(
                    f"{self._peer} answered the hello with something else: not a Waltz listener?"
                )
            )

    def _break(self, reason: str, log_level: int = logging.INFO) -> None:
        was_closed = self._closed
        super()._break(reason, log_level)
        if not was_closed:
            self._release()

    def _peer_closed(self, reason: str) -> None:
        super()._peer_closed(reason)
        self._release()

    def _release(self) -> None:
        self.pump.close()
        if not self.socket.closed:
            self.socket.close(linger=int(self._transport.opts.linger * 1000))


class ServerConnection(ZmqConnection):
    identity: bytes
    lineage: tuple[str, str, str] | None = None
    client_seq: int = 0
    authenticated: str | None = None
    """The client's CurveZMQ public key (Z85) that the ZAP handler accepted."""

    @property
    def peer_identity(self) -> str | None:
        return self.authenticated
