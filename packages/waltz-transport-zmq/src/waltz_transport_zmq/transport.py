"""The ZeroMQ transport: pyzmq asyncio sockets, one packed frame per message.

(Above 800 lines on purpose: the socket pumps, the connections, the listener and the
transport share one ZeroMQ context, its sockets and every connection's credit state, so
a frame is followed here from ``send`` to the peer's ``recv``; the wire protocol, the
options and the keys are modules of their own.)

Shape:

- A listener is one ROUTER socket; every connection a client makes is its own
  DEALER socket with a fresh random routing id, so a ROUTER identity is never
  reused and a connection's frames never mix with another's.
- A connection opens with HELLO/WELCOME (version, windows, limits, lineage).
- Flow control is credit based (:mod:`waltz_transport_zmq.protocol`): a
  sender has at most ``window_frames`` frames and about ``window_bytes`` bytes
  in flight beyond what the receiving application consumed, so receive buffers
  stay bounded per connection without blocking the shared ROUTER socket, and
  the ZeroMQ high-water marks (set above the window) never drop a frame.
- Heartbeats: each side sends one when it sent nothing else for
  ``heartbeat_interval``; a peer silent for ``heartbeat_timeout`` is dead.
- Sends go through the socket's synchronous shadow without blocking; when
  ZeroMQ cannot take a message, it and every later one of that connection
  wait in order in a queue the credit window bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import zmq
import zmq.asyncio
import zmq.backend
from zmq.utils.monitor import parse_monitor_message

from waltz_api.contracts.transport import Connection, ConnectionHandler, Listener, Transport
from waltz_api.errors import (
    AuthenticationError,
    ConfigError,
    ConnectError,
    ConnectionClosedError,
    FrameTooLargeError,
    ProtocolError,
    TransportError,
)
from waltz_transport_zmq import protocol as p
from waltz_transport_zmq.logs import PeerLog
from waltz_transport_zmq.options import ZmqOptions, is_local_endpoint

log = logging.getLogger(__name__)
_trouble = PeerLog(log)
"""Lines about misbehaving peers (malformed messages, refused handshakes), rate-limited."""
_refusals = PeerLog(log, repeat_after=60.0)
"""Lines about peers refused by the security handshake: each peer (or, where libzmq does
not say who it was, each kind of refusal) once a minute at most."""

ZAP_DOMAIN = "waltz"
# messages drained from a socket per wake-up before yielding to the event loop
DRAIN = 512
_RETRY = (zmq.EAGAIN, zmq.EHOSTUNREACH)
# the hot paths call pyzmq's Cython methods directly (the sugar layer's send adds ~1 us)
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv
_get = zmq.backend.Socket.get
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_SNDMORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
_pack_data = p.DATA_HEADER.pack
_unpack_data = p.DATA_HEADER.unpack_from
_HEADER = p.DATA_HEADER.size
_DATA = p.KIND_DATA
_BATCH = p.KIND_BATCH
_SEQ_MASK = p.SEQ_MASK
_BATCH_LIMIT = p.BATCH_LIMIT
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_MECHANISM_MISMATCH = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
_CRYPTOGRAPHIC = zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC


class _Pump:
    """Reads one socket from the event loop: ``add_reader`` on its ZMQ_FD, then drains.

    The ZMQ_FD is edge-triggered and any operation on the socket (a send too) may
    consume its signal, so after sending, :meth:`poke` makes the loop look again.
    ``handle`` gets each message (a DEALER) or ``handle_routed`` each identity and
    body (a ROUTER). A ROUTER message from an identity without a connection is read as a
    ``zmq.Frame``: its properties name the peer the security handshake accepted.
    """

    __slots__ = (
        "_fd",
        "_handle",
        "_handle_routed",
        "_loop",
        "_routes",
        "_scheduled",
        "_socket",
        "closed",
    )

    def __init__(
        self,
        socket: zmq.Socket[bytes],
        handle: Callable[[bytes], None] | None = None,
        handle_routed: Callable[[bytes, zmq.Frame], None] | None = None,
        routes: dict[bytes, ServerConnection] | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._socket = socket
        self._handle = handle
        # a ROUTER: messages of known identities go straight to their connection,
        # the others to handle_routed
        self._handle_routed = handle_routed
        self._routes: dict[bytes, ServerConnection] = routes if routes is not None else {}
        self._scheduled = False
        self.closed = False
        self._fd: int = socket.getsockopt(zmq.FD)  # type: ignore[assignment]
        self._loop.add_reader(self._fd, self._readable)
        self.poke()

    def poke(self) -> None:
        if not self._scheduled and not self.closed:
            self._scheduled = True
            self._loop.call_soon(self._readable)

    def _readable(self) -> None:
        self._scheduled = False
        if self.closed:
            return
        socket = self._socket
        recv = _recv
        try:
            if self._handle_routed is not None:
                stranger = self._handle_routed
                routes = self._routes
                for _ in range(DRAIN):
                    identity = recv(socket, _NOBLOCK)
                    conn = routes.get(identity)
                    # a message's parts arrive together; a stranger's (a hello) as a Frame
                    body: Any = recv(socket, _NOBLOCK, conn is not None)
                    if _get(socket, _RCVMORE):
                        extra = 0
                        while _get(socket, _RCVMORE) and extra < 1000:
                            recv(socket, _NOBLOCK)
                            extra += 1
                        log.warning(
                            "dropped a multipart message (this transport sends single frames)"
                        )
                        continue
                    try:
                        if conn is not None:
                            conn.on_message(body)
                        else:
                            stranger(identity, body)
                    except Exception as exc:  # a bug's last line of defence: keep reading
                        self._failed(exc)
                    if self.closed:
                        return
            else:
                for _ in range(DRAIN):
                    message = recv(socket, _NOBLOCK)
                    try:
                        self._handle(message)  # type: ignore[misc]
                    except Exception as exc:
                        self._failed(exc)
                    if self.closed:
                        return
        except zmq.Again:
            return
        except zmq.ZMQError as exc:
            if not self.closed:
                log.warning("reading a zmq socket failed: %s", exc)
            return
        # more may be waiting: go on after the other callbacks had their turn
        self.poke()

    def _failed(self, exc: Exception) -> None:
        _trouble.log(
            logging.ERROR,
            ("handler", type(exc).__name__),
            "a message handler failed (%s: %s); the message was dropped, reading goes on",
            type(exc).__name__,
            str(exc)[:200],
        )

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._loop.remove_reader(self._fd)


class _Wire:
    """Ordered, non-blocking sends of one connection's messages to its peer."""

    __slots__ = ("_backoff_task", "_conn", "_identity", "_pending", "_pump", "_shadow", "cap")

    def __init__(
        self,
        socket: zmq.Socket[bytes],
        pump: _Pump,
        identity: bytes | None,
        conn: ZmqConnection,
        cap: int,
    ) -> None:
        self._shadow = socket
        self._pump = pump
        self._identity = identity
        self._conn = conn
        self._pending: deque[bytes] = deque()
        self._backoff_task: asyncio.Task[None] | None = None
        self.cap = cap

    def _send_now(self, message: bytes) -> None:
        if self._identity is None:
            _send(self._shadow, message, _NOBLOCK)
        else:
            _send(self._shadow, self._identity, _NOBLOCK_SNDMORE)
            _send(self._shadow, message, _NOBLOCK)
        pump = self._pump
        if not pump._scheduled:
            pump.poke()

    def send(self, message: bytes) -> None:
        conn = self._conn
        conn._said = True
        if self._pending:
            if len(self._pending) >= self.cap:
                conn._break("the peer stopped taking messages (send queue full)")
                return
            self._pending.append(message)
            return
        try:
            # _send_now, inlined: this is the hot path of every frame
            if self._identity is None:
                _send(self._shadow, message, _NOBLOCK)
            else:
                _send(self._shadow, self._identity, _NOBLOCK_SNDMORE)
                _send(self._shadow, message, _NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno not in _RETRY:
                conn._break(f"cannot send to the peer ({exc.strerror})")
                return
            # ZeroMQ cannot take it now (a pipe momentarily full, or a ROUTER peer
            # reconnecting): keep it, and everything after it, in order; the watchdog ends
            # the wait if the peer is gone
            self._pending.append(message)
            self._backoff_task = asyncio.get_running_loop().create_task(self._drain())
            return
        pump = self._pump
        if not pump._scheduled:
            pump.poke()

    async def _drain(self) -> None:
        delay = 0.0005
        while self._pending and not self._conn._closed:
            try:
                self._send_now(self._pending[0])
            except zmq.ZMQError as exc:
                if exc.errno not in _RETRY:
                    self._conn._break(f"cannot send to the peer ({exc.strerror})")
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.02)
                continue
            self._pending.popleft()
            delay = 0.0005

    def send_best_effort(self, message: bytes) -> None:
        """For CLOSE: never queue, never fail."""
        if self._pending:
            return
        with contextlib.suppress(zmq.ZMQError):
            self._send_now(message)

    def stop(self) -> None:
        self._pending.clear()
        if self._backoff_task is not None:
            self._backoff_task.cancel()


class ZmqConnection(Connection):
    """One end of a connection (a DEALER socket on the client, a ROUTER identity on the server)."""

    def __init__(
        self,
        transport: ZmqTransport,
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
        self._wire: _Wire | None = None
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
        # liveness (see ZmqTransport._watchdog)
        self._heard = True
        self._said = False
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

    def _peer_limit(self, announced: int) -> None:
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
        self._transport._forget(self)
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
        self._transport._forget(self)
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


class ClientConnection(ZmqConnection):
    """A connection this transport opened: its own DEALER socket, read by its own pump."""

    socket: zmq.Socket[bytes]
    pump: _Pump
    # resolved by the listener's first answer (WELCOME, or CLOSE when it refuses)
    welcome: asyncio.Future[None] | None = None

    def on_first_message(self, message: bytes) -> None:
        """The listener's answer to the hello; every later message goes to on_message."""
        self.pump._handle = self.on_message
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
            self._peer_window_frames, self._peer_window_bytes = self._transport._clamp_window(
                welcome_message.window_frames, welcome_message.window_bytes
            )
            self._peer_limit(welcome_message.max_frame_size)
            self._heard = True
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


class ZmqListener(Listener):
    """A ROUTER socket accepting connections."""

    def __init__(
        self,
        transport: ZmqTransport,
        socket: zmq.Socket[bytes],
        endpoint: str,
        handler: ConnectionHandler,
    ) -> None:
        self._transport = transport
        self._socket = socket
        self._shadow = socket
        self._endpoint = endpoint
        self._handler = handler
        self._closed = False
        self._connections: dict[bytes, ServerConnection] = {}
        self._lineages: dict[tuple[str, str, str], ServerConnection] = {}
        """(client key, client transport, replace_key) -> the newest connection: only a
        peer with the same curve key can replace a connection."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._pump = _Pump(socket, handle_routed=self._on_stranger, routes=self._connections)
        self._monitor = self._watch_handshakes()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def _watch_handshakes(self) -> asyncio.Task[None] | None:
        """Log the peers the security handshake refused (one rate-limited line each)."""
        context = self._transport._context
        if context is None:
            return None
        address = f"inproc://waltz-listener-monitor-{uuid.uuid4().hex}"
        self._socket.monitor(
            address, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        monitor = context.socket(zmq.PAIR)
        monitor.connect(address)
        curve = self._transport.opts.curve_listen

        async def watch() -> None:
            try:
                while True:
                    event = parse_monitor_message(await monitor.recv_multipart())
                    kind, value = event["event"], event["value"]
                    if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                        key, line = "no-detail", _NO_DETAIL[curve]
                    else:
                        key, line = _handshake_refusal(value, curve)
                    _refusals.log(
                        logging.WARNING, (self._endpoint, key), "%s: %s", self._endpoint, line
                    )
            except (zmq.ZMQError, asyncio.CancelledError):
                pass
            finally:
                monitor.close(linger=0)

        return asyncio.get_running_loop().create_task(watch(), name=f"monitor-{self._endpoint}")

    def _reply(self, identity: bytes, message: bytes) -> None:
        """Best effort, never queued: to a peer that has no connection here."""
        with contextlib.suppress(zmq.ZMQError):
            self._shadow.send(identity, zmq.NOBLOCK | zmq.SNDMORE)
            self._shadow.send(message, zmq.NOBLOCK)
        self._pump.poke()

    def _on_stranger(self, identity: bytes, frame: zmq.Frame) -> None:
        message = frame.bytes
        if not message or message[0] != p.KIND_HELLO:
            if message and message[0] != p.KIND_CLOSE:
                self._reply(
                    identity, p.close_message("unknown connection (the listener restarted?)")
                )
            return
        try:
            self._accept(identity, message, self._authenticated(frame))
        except ProtocolError as exc:
            _trouble.log(
                logging.WARNING,
                identity,
                "%s: refused a connection: %s",
                self._endpoint,
                exc,
            )
            self._reply(identity, p.close_message(f"refused: {exc}"))

    def _authenticated(self, frame: zmq.Frame) -> str | None:
        """The public key (Z85) the ZAP handler accepted for the peer that sent ``frame``
        (its User-Id: pyzmq's authenticator answers with the Z85 key), None in plaintext."""
        if not self._transport.opts.curve_listen:
            return None
        try:
            user_id = frame.get("User-Id")
        except zmq.ZMQError as exc:
            # curve without the ZAP reply's user id: refuse rather than serve an unknown peer
            raise ProtocolError(f"the security handshake named no client key ({exc})") from None
        if not isinstance(user_id, str) or not user_id:
            raise ProtocolError("the security handshake named no client key")
        return user_id

    def _accept(self, identity: bytes, message: bytes, authenticated: str | None = None) -> None:
        transport = self._transport
        opts = transport.opts
        hello = p.parse_hello(message)
        client, seq, key = hello.client, hello.seq, hello.replace_key
        # the peer's window bounds what this side keeps in flight to it, and this side's
        # own window bounds it too: an absurd announced window buys nothing
        window_frames, window_bytes = transport._clamp_window(
            hello.window_frames, hello.window_bytes
        )
        lineage = (authenticated or "", client, key) if key is not None else None
        if lineage is not None:
            current = self._lineages.get(lineage)
            if current is not None:
                if current.client_seq >= seq:
                    raise ProtocolError(
                        f"connection {seq} was replaced by connection {current.client_seq} of "
                        "the same replace_key"
                    )
                # replaced: nothing of it is delivered from now on
                current._wire.send_best_effort(  # type: ignore[union-attr]
                    p.close_message("replaced by a newer connection of the same replace_key")
                )
                current._break("replaced by a newer connection of the same replace_key")
        conn = ServerConnection(
            transport,
            transport._next_id(),
            f"{self._endpoint}<-{client}#{seq}",
            peer_window_frames=window_frames,
            peer_window_bytes=window_bytes,
        )
        conn._peer_limit(hello.max_frame_size)
        conn.identity = identity
        conn.authenticated = authenticated
        conn.lineage = lineage
        conn.client_seq = seq
        conn._wire = _Wire(self._shadow, self._pump, identity, conn, opts.hwm)
        conn.on_closed = self._on_connection_closed
        self._connections[identity] = conn
        if lineage is not None:
            self._lineages[lineage] = conn
        transport._connections.add(conn)
        conn._wire.send(
            p.Welcome(
                version=p.PROTOCOL_VERSION,
                id=conn.connection_id,
                window_frames=opts.window_frames,
                window_bytes=opts.window_bytes,
                max_frame_size=opts.max_frame_size,
            ).encode()
        )
        task = asyncio.get_running_loop().create_task(self._run_handler(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_connection_closed(self, conn: ZmqConnection) -> None:
        assert isinstance(conn, ServerConnection)
        if self._connections.get(conn.identity) is conn:
            del self._connections[conn.identity]
        # a connection the peer closed may still hold frames for its handler: it stays in
        # its lineage until it is closed here, so a replacement still drops those frames
        if conn._closed and conn.lineage is not None and self._lineages.get(conn.lineage) is conn:
            del self._lineages[conn.lineage]

    async def _run_handler(self, conn: ServerConnection) -> None:
        try:
            await self._handler(conn)
        except ConnectionClosedError:
            log.debug("connection %d ended in its handler", conn.connection_id)
        except Exception:
            log.exception("the connection handler for %s failed", conn.peer)
        finally:
            await conn.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._transport._listeners.discard(self)
        for conn in list(self._connections.values()):
            await conn.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pump.close()
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.disable_monitor()
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
        self._socket.close(linger=int(self._transport.opts.linger * 1000))


class _AuthorizedKeys:
    """The ZAP credentials provider: the configured client public keys (Z85). ``peer``
    is the address of the request being decided (set by the authenticator)."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self._keys = keys
        self.peer = "an unknown address"

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key in self._keys
        if not allowed:
            shown = key.decode("ascii", "replace")
            _refusals.log(
                logging.WARNING,
                (self.peer, key),
                "refused a CurveZMQ client at %s: its public key %s is not in "
                "curve_authorized_keys",
                self.peer,
                shown,
            )
        return allowed


_NO_DETAIL = {
    # a plaintext peer that saw the mechanism mismatch and hung up before this side did
    # is reported this way too (a race in libzmq's handshake): say what the listener needs
    True: (
        "refused a peer whose ZeroMQ handshake ended without detail (this listener requires "
        "CurveZMQ: a plaintext peer that hung up first, or a broken one)"
    ),
    False: "a peer's ZeroMQ handshake ended without detail (a peer that hung up, or a broken one)",
}


def _handshake_refusal(value: int, curve: bool) -> tuple[str, str]:
    """What a failed handshake on a listener means: (kind, one line for the log)."""
    if value == _MECHANISM_MISMATCH:
        if curve:
            return "plaintext", (
                "refused a plaintext peer: this listener requires CurveZMQ (the peer needs "
                "curve_server_public_key and an authorized curve_client_key)"
            )
        return "curve", "refused a CurveZMQ peer: this listener is plaintext"
    if value == _CRYPTOGRAPHIC:
        return "crypto", (
            "refused a peer whose CurveZMQ handshake failed (it trusts another server "
            "public key, or its stream is corrupted)"
        )
    return f"protocol-{value:x}", (
        f"a peer's ZeroMQ handshake failed (protocol error 0x{value:x}: not a ZeroMQ peer, "
        "or a broken one)"
    )


class ZmqTransport(Transport):
    """The Transport contract on ZeroMQ (plugin ``zmq``)."""

    _instances = itertools.count(1)

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        self.opts = ZmqOptions.from_mapping(self.options)
        self.uid = uuid.uuid4().hex
        self._ids = itertools.count(1)
        self._context: zmq.asyncio.Context | None = None
        self._sync_context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._authenticator: Any = None
        self._connections: set[ZmqConnection] = set()
        self._client_connections: set[ClientConnection] = set()
        self._lineages: dict[tuple[str, str], ClientConnection] = {}
        self._listeners: set[ZmqListener] = set()
        self._watchdog_task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def max_frame_size(self) -> int:
        return self.opts.max_frame_size

    @property
    def failure_detection_bound(self) -> float:
        return self.opts.failure_detection_bound

    def _next_id(self) -> int:
        return next(self._ids)

    def _clamp_window(self, frames: int, nbytes: int) -> tuple[int, int]:
        """A peer's announced receive window, capped at this side's own: what one
        connection keeps in flight stays bounded whatever a peer announces."""
        return min(frames, self.opts.window_frames), min(nbytes, self.opts.window_bytes)

    def _forget(self, conn: ZmqConnection) -> None:
        self._connections.discard(conn)
        if isinstance(conn, ClientConnection):
            self._client_connections.discard(conn)

    def _ctx(self) -> zmq.asyncio.Context:
        if self._closed:
            raise TransportError("this zmq transport is closed; create a new one")
        if self._context is None:
            self._context = zmq.asyncio.Context(io_threads=self.opts.io_threads)
        if self._watchdog_task is None:
            self._watchdog_task = asyncio.get_running_loop().create_task(self._watchdog())
        return self._context

    def _sockets(self) -> zmq.Context[zmq.Socket[bytes]]:
        """The transport's context, for plain sockets (the pumps drive them from the loop)."""
        if self._sync_context is None:
            self._sync_context = zmq.Context.shadow(self._ctx().underlying)
        return self._sync_context

    def _check_endpoint(self, endpoint: str, curve: bool) -> None:
        if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://")):
            raise ConfigError(
                f"zmq endpoint {endpoint!r} is invalid: use tcp://HOST:PORT or ipc:///path",
                key="endpoint",
            )
        if not curve and self.opts.security == "auto" and not is_local_endpoint(endpoint):
            raise ConfigError(
                f"{endpoint} is not a loopback address and no curve keys are configured: "
                "configure curve keys (see `waltz keys generate`) or set the transport option "
                "security = 'plaintext' to send unencrypted on purpose",
                key="security",
            )

    def _configure(self, socket: zmq.Socket[Any]) -> None:
        opts = self.opts
        socket.setsockopt(zmq.LINGER, int(opts.linger * 1000))
        socket.setsockopt(zmq.SNDHWM, opts.hwm)
        socket.setsockopt(zmq.RCVHWM, opts.hwm)
        socket.setsockopt(zmq.MAXMSGSIZE, max(opts.max_frame_size, p.BATCH_LIMIT) + p.HEADER_ROOM)
        socket.setsockopt(zmq.RECONNECT_IVL, int(opts.reconnect_interval * 1000))
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, int(opts.reconnect_interval_max * 1000))

    async def _watchdog(self) -> None:
        """Heartbeats out, silence in: one timer for every connection of this transport."""
        loop = asyncio.get_running_loop()
        interval = self.opts.heartbeat_interval
        timeout = self.opts.heartbeat_timeout
        while not self._closed:
            await asyncio.sleep(interval)
            now = loop.time()
            for conn in list(self._connections):
                if conn._heard:
                    conn._heard = False
                    conn._last_heard = now
                elif now - conn._last_heard > timeout:
                    conn._break(f"the peer sent nothing for {timeout} s (dead or paused)")
                    continue
                if not conn._said:
                    conn._heartbeat()
                conn._said = False

    async def listen(self, endpoint: str, handler: ConnectionHandler) -> Listener:
        opts = self.opts
        self._check_endpoint(endpoint, opts.curve_listen)
        if opts.security == "curve" and not opts.curve_listen:
            raise ConfigError(
                "security = 'curve' but curve_server_key / curve_authorized_keys are not set, "
                "so this transport cannot listen securely",
                key="curve_server_key",
            )
        context = self._ctx()
        socket: zmq.Socket[bytes] = self._sockets().socket(zmq.ROUTER)
        self._configure(socket)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if opts.curve_server_key is not None:
            self._start_authenticator(context)
            socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
            socket.setsockopt(zmq.CURVE_SERVER, 1)
            socket.setsockopt(zmq.CURVE_SECRETKEY, opts.curve_server_key.secret)
            socket.setsockopt(zmq.CURVE_PUBLICKEY, opts.curve_server_key.public)
        bind_to = endpoint
        if bind_to.startswith("tcp://") and bind_to.endswith(":0"):
            bind_to = bind_to[:-2] + ":*"
        try:
            socket.bind(bind_to)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            raise TransportError(f"cannot listen on {endpoint}: {exc.strerror}") from exc
        resolved = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        listener = ZmqListener(self, socket, resolved, handler)
        self._listeners.add(listener)
        log.info("listening on %s%s", resolved, " (curve)" if opts.curve_listen else "")
        return listener

    def _start_authenticator(self, context: zmq.asyncio.Context) -> None:
        if self._authenticator is not None:
            return
        from zmq.auth.asyncio import AsyncioAuthenticator

        assert self.opts.curve_authorized_keys is not None
        provider = _AuthorizedKeys(self.opts.curve_authorized_keys)

        class Authenticator(AsyncioAuthenticator):
            async def handle_zap_message(self, msg: list[bytes]) -> None:
                # requests are decided one at a time: the provider logs who was refused
                if len(msg) > 3:
                    provider.peer = msg[3].decode("utf-8", "replace") or "an unknown address"
                await super().handle_zap_message(msg)

        authenticator = Authenticator(context, log=log.getChild("zap"))
        authenticator.start()
        authenticator.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=provider)
        self._authenticator = authenticator

    async def connect(
        self, endpoint: str, *, timeout: float = 10.0, replace_key: str | None = None
    ) -> Connection:
        opts = self.opts
        self._check_endpoint(endpoint, opts.curve_connect)
        try:
            p.check_replace_key(replace_key)
        except ProtocolError as exc:
            raise ConfigError(str(exc), key="replace_key") from None
        if opts.security == "curve" and not opts.curve_connect:
            raise ConfigError(
                "security = 'curve' but curve_server_public_key / curve_client_key are not set, "
                "so this transport cannot connect securely",
                key="curve_server_public_key",
            )
        context = self._ctx()
        if replace_key is not None:
            older = self._lineages.get((endpoint, replace_key))
            if older is not None:
                await older.close()
        socket: zmq.Socket[bytes] = self._sockets().socket(zmq.DEALER)
        self._configure(socket)
        socket.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
        if opts.curve_server_public_key is not None and opts.curve_client_key is not None:
            socket.setsockopt(zmq.CURVE_SERVERKEY, opts.curve_server_public_key)
            socket.setsockopt(zmq.CURVE_PUBLICKEY, opts.curve_client_key.public)
            socket.setsockopt(zmq.CURVE_SECRETKEY, opts.curve_client_key.secret)
        monitor_address = f"inproc://waltz-monitor-{uuid.uuid4().hex}"
        socket.monitor(monitor_address, _HANDSHAKE_FAILED)
        monitor = context.socket(zmq.PAIR)
        monitor.connect(monitor_address)
        connection_id = self._next_id()
        try:
            socket.connect(endpoint)
        except zmq.ZMQError as exc:
            monitor.close(linger=0)
            socket.close(linger=0)
            raise ConfigError(
                f"cannot connect to {endpoint!r}: {exc.strerror}", key="endpoint"
            ) from exc
        # the flow-control windows of the listener arrive in its welcome
        conn = ClientConnection(
            self, connection_id, endpoint, peer_window_frames=1, peer_window_bytes=1
        )
        conn.socket = socket
        conn.welcome = asyncio.get_running_loop().create_future()
        welcome = conn.welcome
        conn.pump = _Pump(socket, handle=conn.on_first_message)
        conn._wire = _Wire(socket, conn.pump, None, conn, opts.hwm)
        conn._wire.send(
            p.Hello(
                version=p.PROTOCOL_VERSION,
                client=self.uid,
                seq=connection_id,
                replace_key=replace_key,
                window_frames=opts.window_frames,
                window_bytes=opts.window_bytes,
                max_frame_size=opts.max_frame_size,
            ).encode()
        )
        try:
            await self._handshake(welcome, monitor, endpoint, timeout)
        except BaseException:
            conn._break("the connection could not be established", log_level=logging.DEBUG)
            raise
        finally:
            with contextlib.suppress(zmq.ZMQError):
                socket.monitor(None, 0)
            monitor.close(linger=0)
        conn._last_heard = asyncio.get_running_loop().time()
        self._connections.add(conn)
        self._client_connections.add(conn)
        if replace_key is not None:
            lineage = (endpoint, replace_key)
            self._lineages[lineage] = conn

            def forget_lineage(closed: ZmqConnection, lineage: tuple[str, str] = lineage) -> None:
                if self._lineages.get(lineage) is closed:
                    del self._lineages[lineage]

            conn.on_closed = forget_lineage
        return conn

    async def _handshake(
        self,
        welcome: asyncio.Future[None],
        monitor: zmq.asyncio.Socket,
        endpoint: str,
        timeout: float,
    ) -> None:
        curve = self.opts.curve_connect

        async def handshake_failure() -> str:
            # ZAP refusing the key is always an authentication failure, and so is a
            # security mechanism mismatch (plaintext against curve, either way); other
            # handshake failures only when curve is on (a wrong server key shows as one).
            # Without curve, libzmq retries and the timeout decides.
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                kind, value = event["event"], event["value"]
                if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _MECHANISM_MISMATCH:
                    if curve:
                        return (
                            "the listener does not use CurveZMQ (plaintext) while this "
                            "transport is configured for curve; use the same security on both"
                        )
                    return (
                        "the listener requires CurveZMQ and this transport connects in "
                        "plaintext: set curve_server_public_key (the listener's public key) "
                        "and curve_client_key (a key pair the listener authorizes)"
                    )
                if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    return (
                        "the listener refused this transport's curve client key: add its "
                        "public key to the listener's curve_authorized_keys"
                    )
                if curve and kind & _HANDSHAKE_FAILED:
                    return (
                        f"{zmq.Event(kind).name}: this side trusts another server public key "
                        "(curve_server_public_key), the listener refused this key, or it "
                        "does not use CurveZMQ"
                    )

        failure_task = asyncio.ensure_future(handshake_failure())
        try:
            done, _ = await asyncio.wait(
                {cast("asyncio.Future[Any]", welcome), failure_task},
                timeout=timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            failure_task.cancel()
            await asyncio.gather(failure_task, return_exceptions=True)
        if welcome.done():
            welcome.result()  # raises the ConnectError of a refusal
            return
        welcome.cancel()
        if (
            failure_task in done
            and not failure_task.cancelled()
            and failure_task.exception() is None
        ):
            raise AuthenticationError(
                f"the security handshake with {endpoint} failed: {failure_task.result()}"
            )
        raise ConnectError(
            f"no answer from {endpoint} within {timeout} s: is a listener running there, and do "
            "the security settings of both ends match (a listener that requires CurveZMQ "
            "refuses a plaintext peer)?"
        )

    async def close(self) -> None:
        if self._closed:
            return
        for listener in list(self._listeners):
            await listener.close()
        for conn in list(self._client_connections):
            await conn.close()
        self._closed = True
        if self._watchdog_task is not None:
            self._watchdog_task.cancel()
            await asyncio.gather(self._watchdog_task, return_exceptions=True)
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        context = self._context
        self._context = None
        self._sync_context = None
        if context is not None:
            await _terminate(context, self.opts.linger + TERM_TIMEOUT)


TERM_TIMEOUT = 5.0
"""Seconds beyond the linger that closing a transport waits for ZeroMQ's context to end."""


async def _terminate(context: zmq.asyncio.Context, timeout: float) -> None:
    """End ``context`` off the event loop (term waits out the sockets' linger), in a
    daemon thread awaited at most ``timeout`` seconds: a socket left open somewhere
    would block term forever, and with it the default executor's shutdown at the end
    of ``asyncio.run`` (a Ctrl-C that never finishes)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def term() -> None:
        try:
            context.term()
        finally:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_resolve, done)

    threading.Thread(target=term, name="waltz-zmq-term", daemon=True).start()
    try:
        async with asyncio.timeout(timeout):
            await asyncio.shield(done)
    except TimeoutError:
        log.warning(
            "the ZeroMQ context did not end within %.1f s (a socket still open); "
            "left to end in the background",
            timeout,
        )


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def create_zmq_transport(options: Mapping[str, Any] | None = None) -> ZmqTransport:
    """The plugin factory: ``(options) -> Transport``."""
    return ZmqTransport(options)
