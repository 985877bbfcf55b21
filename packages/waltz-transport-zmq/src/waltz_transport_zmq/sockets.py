"""The ZeroMQ sockets of the transport, driven from the event loop.

A :class:`Pump` reads one socket (``add_reader`` on its ZMQ_FD, then drains); a
:class:`Wire` sends one connection's messages through the socket's synchronous shadow
without blocking, queueing them in order while ZeroMQ cannot take them;
:func:`terminate` ends a context off the loop. What goes in the messages is
:mod:`waltz_transport_zmq.protocol`; the connections are
:mod:`waltz_transport_zmq.connection`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import zmq
import zmq.asyncio
import zmq.backend

from waltz_transport_zmq.logs import PeerLog

log = logging.getLogger(__name__)
_trouble = PeerLog(log)
"""Lines about failing message handlers, rate-limited."""

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


class Routed(Protocol):
    """What a ROUTER's pump hands a known identity's messages to (its connection)."""

    def on_message(self, message: bytes) -> None: ...


class Pump:
    """Reads one socket from the event loop: ``add_reader`` on its ZMQ_FD, then drains.

    The ZMQ_FD is edge-triggered and any operation on the socket (a send too) may
    consume its signal, so after sending, :meth:`poke` makes the loop look again.
    ``handle`` gets each message (a DEALER; it may be replaced as the connection
    moves on from its handshake) or ``handle_routed`` each identity and body (a
    ROUTER). A ROUTER message from an identity without a connection is read as a
    ``zmq.Frame``: its properties name the peer the security handshake accepted.
    """

    __slots__ = (
        "_fd",
        "_handle_routed",
        "_loop",
        "_routes",
        "_scheduled",
        "_socket",
        "closed",
        "handle",
    )

    def __init__(
        self,
        socket: zmq.Socket[bytes],
        handle: Callable[[bytes], None] | None = None,
        handle_routed: Callable[[bytes, zmq.Frame], None] | None = None,
        routes: Mapping[bytes, Routed] | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._socket = socket
        self.handle = handle
        # a ROUTER: messages of known identities go straight to their connection,
        # the others to handle_routed
        self._handle_routed = handle_routed
        self._routes: Mapping[bytes, Routed] = routes if routes is not None else {}
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
                        self.handle(message)  # type: ignore[misc]
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


class Wire:
    """Ordered, non-blocking sends of one connection's messages to its peer: ``broken``
    is told why the peer cannot be sent to (the connection breaks), ``stopped`` says
    whether the connection is closed; ``said`` is set by every send (the watchdog's
    "this side sent something since the last tick")."""

    __slots__ = (
        "_backoff_task",
        "_broken",
        "_identity",
        "_pending",
        "_pump",
        "_shadow",
        "_stopped",
        "cap",
        "said",
    )

    def __init__(
        self,
        socket: zmq.Socket[bytes],
        pump: Pump,
        identity: bytes | None,
        cap: int,
        *,
        broken: Callable[[str], None],
        stopped: Callable[[], bool],
    ) -> None:
        self._shadow = socket
        self._pump = pump
        self._identity = identity
        self._broken = broken
        self._stopped = stopped
        self.said = False
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
        self.said = True
        if self._pending:
            if len(self._pending) >= self.cap:
                self._broken("the peer stopped taking messages (send queue full)")
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
                self._broken(f"cannot send to the peer ({exc.strerror})")
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
        while self._pending and not self._stopped():
            try:
                self._send_now(self._pending[0])
            except zmq.ZMQError as exc:
                if exc.errno not in _RETRY:
                    self._broken(f"cannot send to the peer ({exc.strerror})")
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


async def terminate(context: zmq.asyncio.Context, timeout: float) -> None:
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
