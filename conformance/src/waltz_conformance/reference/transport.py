"""The reference transport: connections inside one process, on bounded in-memory buffers.

Endpoints are ``memory://NAME``; a listener's name is unique per process. It
keeps every promise of the Transport contract (ordering, bounded buffers with
back pressure, maximum frame size on both ends, close semantics, connection
lineages with ``replace_key``) with the simplest possible mechanism, so the
conformance suite has a model to check real transports against and other
components can be tested without sockets.

A peer's death and pause cannot happen inside one process, so the harness
simulates them: :meth:`MemoryTransport.simulate_crash` breaks every
connection of a transport at once (as a kill -9 does), and
:meth:`MemoryTransport.simulate_pause` freezes it (as SIGSTOP does): its
connections stop reading and writing, and the other ends report the peer
dead once the failure-detection bound has passed.

Options (all optional):

- ``max_frame_size`` (int, 64 MiB): the largest frame sent or accepted.
- ``buffer_bytes`` (int, 1 MiB): bytes a connection's receive buffer holds
  before ``send`` on the other end waits (one frame is always accepted into an
  empty buffer, so the bound is ``buffer_bytes + max_frame_size``).
- ``failure_detection_bound`` (float, 3.0): seconds after which a paused peer
  is reported dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections import deque
from collections.abc import Mapping
from typing import Any

from waltz_api.contracts.transport import (
    DEFAULT_FAILURE_DETECTION_BOUND,
    Connection,
    ConnectionHandler,
    Listener,
    Transport,
)
from waltz_api.errors import (
    ConfigError,
    ConnectError,
    ConnectionClosedError,
    FrameTooLargeError,
    TransportError,
)

log = logging.getLogger(__name__)

SCHEME = "memory://"
DEFAULT_BUFFER_BYTES = 1024 * 1024

# Listeners of this process, by endpoint. A listener belongs to the event loop
# that created it; connecting from another loop is refused.
_LISTENERS: dict[str, MemoryListener] = {}


def _parse_endpoint(endpoint: str) -> str:
    if not isinstance(endpoint, str) or not endpoint.startswith(SCHEME):
        raise ConfigError(
            f"memory transport endpoint {endpoint!r} is invalid: use memory://NAME", key="endpoint"
        )
    name = endpoint[len(SCHEME) :]
    if not name:
        raise ConfigError(
            f"memory transport endpoint {endpoint!r} has no name: use memory://NAME",
            key="endpoint",
        )
    return name


class _Inbox:
    """One direction of a connection: a FIFO bounded in bytes."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.frames: deque[bytes] = deque()
        self.nbytes = 0
        self.eof = False  # the writer closed: deliver what is queued, then end
        self.changed = asyncio.Event()

    def has_room_for(self, size: int) -> bool:
        return not self.frames or self.nbytes + size <= self.limit_bytes

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class MemoryConnection(Connection):
    """One end of an in-process connection."""

    def __init__(self, transport: MemoryTransport, connection_id: int, peer: str) -> None:
        self._transport = transport
        self._id = connection_id
        self._peer = peer
        self._inbox = _Inbox(transport.buffer_bytes)
        self._remote: MemoryConnection | None = None
        self._closed = False
        self._reason = "closed"
        self._lineage: tuple[str, str] | None = None

    @property
    def connection_id(self) -> int:
        return self._id

    @property
    def peer(self) -> str:
        return self._peer

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def queued_bytes(self) -> int:
        """Bytes received and not yet taken by ``recv`` (for the conformance suite)."""
        return self._inbox.nbytes

    def _break(self, reason: str) -> None:
        """This end is closed now; what it had queued is dropped."""
        if self._closed:
            return
        self._closed = True
        self._reason = reason
        self._inbox.frames.clear()
        self._inbox.nbytes = 0
        self._inbox.notify()
        self._transport._forget(self)

    def _end_of_input(self) -> None:
        self._inbox.eof = True
        self._inbox.notify()

    def _closed_error(self) -> ConnectionClosedError:
        return ConnectionClosedError(
            f"connection {self._id} to {self._peer} is closed: {self._reason}"
        )

    async def _wait_running(self) -> None:
        """A paused (simulated SIGSTOP) transport makes no progress until resumed."""
        while self._transport._paused is not None and not self._closed:
            await self._transport._resumed.wait()

    async def send(self, frame: bytes) -> None:
        if not isinstance(frame, bytes | bytearray | memoryview):
            raise TypeError(f"a frame is bytes, not {type(frame).__name__}")
        size = len(frame)
        if size > self._transport.max_frame_size:
            raise FrameTooLargeError(
                f"frame of {size} bytes exceeds max_frame_size {self._transport.max_frame_size}; "
                "split the payload or raise the transport's max_frame_size option"
            )
        await self._wait_running()
        while True:
            remote = self._remote
            if self._closed or remote is None or remote._closed or remote._inbox.eof:
                if not self._closed:
                    self._break("the peer closed the connection")
                raise self._closed_error()
            if remote._inbox.has_room_for(size):
                break
            # back pressure: wait until the receiver takes frames (or something breaks)
            changed = remote._inbox.changed
            mine = self._inbox.changed
            waiters = [asyncio.ensure_future(changed.wait()), asyncio.ensure_future(mine.wait())]
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
            await self._wait_running()
        if size > remote._transport.max_frame_size:
            # the receiver refuses an oversized frame by closing this one connection
            log.warning(
                "memory connection %d: received a frame of %d bytes above max_frame_size %d; "
                "closing the connection",
                remote._id,
                size,
                remote._transport.max_frame_size,
            )
            remote._break(f"it received a frame of {size} bytes above max_frame_size")
            self._break("the peer refused a frame above its max_frame_size")
            raise self._closed_error()
        remote._inbox.frames.append(bytes(frame))
        remote._inbox.nbytes += size
        remote._inbox.notify()

    async def send_many(self, frames: list[bytes]) -> None:
        limit = self._transport.max_frame_size
        for frame in frames:
            if len(frame) > limit:
                raise FrameTooLargeError(
                    f"frame of {len(frame)} bytes exceeds max_frame_size {limit}; nothing of "
                    "this send_many was sent; split the payload or raise max_frame_size"
                )
        for frame in frames:
            await self.send(frame)

    async def recv(self) -> bytes:
        await self._wait_running()
        while True:
            inbox = self._inbox
            if self._closed:
                raise self._closed_error()
            if inbox.frames:
                await self._wait_running()
                if self._closed:
                    raise self._closed_error()
                frame = inbox.frames.popleft()
                inbox.nbytes -= len(frame)
                inbox.notify()
                return frame
            if inbox.eof:
                self._break("the peer closed the connection")
                raise self._closed_error()
            await inbox.changed.wait()

    async def close(self) -> None:
        if self._closed:
            return
        self._break("closed by this side")
        remote = self._remote
        if remote is not None:
            remote._end_of_input()


class MemoryListener(Listener):
    def __init__(self, transport: MemoryTransport, name: str, handler: ConnectionHandler) -> None:
        self._transport = transport
        self._name = name
        self._handler = handler
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._accepted: set[MemoryConnection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        # lineage (client transport uid, replace_key) -> (sequence, server-side connection)
        self._lineages: dict[tuple[str, str], tuple[int, MemoryConnection]] = {}

    @property
    def endpoint(self) -> str:
        return SCHEME + self._name

    def _accept(
        self, client: MemoryTransport, client_conn: MemoryConnection, replace_key: str | None
    ) -> MemoryConnection:
        server_conn = MemoryConnection(
            self._transport, self._transport._next_id(), f"{SCHEME}{self._name}<-{client.uid}"
        )
        if replace_key is not None:
            lineage = (client.uid, replace_key)
            older = self._lineages.get(lineage)
            if older is not None:
                older_seq, older_conn = older
                if older_seq >= client_conn.connection_id:
                    raise ConnectError(
                        f"connection {client_conn.connection_id} to {self.endpoint} is older than "
                        f"connection {older_seq} of the same replace_key; it was replaced"
                    )
                older_conn._break("replaced by a newer connection of the same replace_key")
                if older_conn._remote is not None:
                    older_conn._remote._break(
                        "replaced by a newer connection of the same replace_key"
                    )
            self._lineages[lineage] = (client_conn.connection_id, server_conn)
        server_conn._remote = client_conn
        client_conn._remote = server_conn
        self._transport._connections.add(server_conn)
        self._accepted.add(server_conn)
        task = self._loop.create_task(self._run_handler(server_conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return server_conn

    async def _run_handler(self, conn: MemoryConnection) -> None:
        try:
            await self._handler(conn)
        except ConnectionClosedError:
            log.debug("memory connection %d ended in its handler", conn.connection_id)
        except Exception:
            log.exception("connection handler for %s failed", conn.peer)
        finally:
            self._accepted.discard(conn)
            await conn.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if _LISTENERS.get(self._name) is self:
            del _LISTENERS[self._name]
        self._transport._listeners.discard(self)
        for conn in list(self._accepted):
            await conn.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


class MemoryTransport(Transport):
    """The in-process reference transport (plugin ``memory``)."""

    _uids = itertools.count(1)

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        self.uid = f"t{next(self._uids)}-{uuid.uuid4().hex[:8]}"
        self.buffer_bytes = _positive_int(self.options, "buffer_bytes", DEFAULT_BUFFER_BYTES)
        _positive_int(self.options, "max_frame_size", self.max_frame_size)
        self._bound = float(
            self.options.get("failure_detection_bound", DEFAULT_FAILURE_DETECTION_BOUND)
        )
        if self._bound <= 0:
            raise ConfigError(
                "failure_detection_bound must be > 0 seconds", key="failure_detection_bound"
            )
        self._ids = itertools.count(1)
        self._connections: set[MemoryConnection] = set()
        self._listeners: set[MemoryListener] = set()
        self._closed = False
        self._paused: float | None = None
        self._resumed = asyncio.Event()
        self._watchdog: asyncio.Task[None] | None = None

    @property
    def failure_detection_bound(self) -> float:
        return self._bound

    def _next_id(self) -> int:
        return next(self._ids)

    def _forget(self, conn: MemoryConnection) -> None:
        self._connections.discard(conn)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("this memory transport is closed; create a new one")

    def _start_watchdog(self) -> None:
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """Report connections whose peer transport is paused beyond the bound."""
        loop = asyncio.get_running_loop()
        while not self._closed:
            await asyncio.sleep(self._bound / 4)
            if self._paused is not None:
                continue
            now = loop.time()
            for conn in list(self._connections):
                remote = conn._remote
                if remote is None:
                    continue
                paused_since = remote._transport._paused
                if paused_since is not None and now - paused_since > self._bound:
                    log.info("memory connection %d: the peer stopped responding", conn._id)
                    conn._break(f"the peer did not respond for {self._bound} s")
                    remote._end_of_input()

    async def listen(self, endpoint: str, handler: ConnectionHandler) -> Listener:
        self._check_open()
        name = _parse_endpoint(endpoint)
        if name in _LISTENERS:
            raise TransportError(
                f"memory endpoint {endpoint!r} is already bound in this process; "
                "choose another name"
            )
        listener = MemoryListener(self, name, handler)
        _LISTENERS[name] = listener
        self._listeners.add(listener)
        self._start_watchdog()
        return listener

    async def connect(
        self, endpoint: str, *, timeout: float = 10.0, replace_key: str | None = None
    ) -> Connection:
        self._check_open()
        name = _parse_endpoint(endpoint)
        listener = _LISTENERS.get(name)
        if listener is None or listener._closed or listener._transport._paused is not None:
            # a paused listener accepts nothing; say so only after the timeout, as a real one would
            if listener is not None and not listener._closed:
                await asyncio.sleep(timeout)
            raise ConnectError(
                f"nothing listens on {endpoint!r} in this process; start a listener first"
            )
        if listener._loop is not asyncio.get_running_loop():
            raise ConnectError(
                f"the listener on {endpoint!r} runs on another event loop; memory connections "
                "stay within one loop"
            )
        self._start_watchdog()
        conn = MemoryConnection(self, self._next_id(), endpoint)
        listener._accept(self, conn, replace_key)
        self._connections.add(conn)
        if replace_key is not None:
            conn._lineage = (endpoint, replace_key)
            for other in list(self._connections):
                if other is not conn and other._lineage == conn._lineage:
                    other._break("replaced by a newer connection of the same replace_key")
        return conn

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for listener in list(self._listeners):
            await listener.close()
        for conn in list(self._connections):
            await conn.close()
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog

    # -- fault simulation for the conformance harness --------------------------------

    def simulate_crash(self) -> None:
        """Break every connection and listener at once, as a kill -9 of its process would."""
        for listener in list(self._listeners):
            listener._closed = True
            if _LISTENERS.get(listener._name) is listener:
                del _LISTENERS[listener._name]
            for task in listener._tasks:
                task.cancel()
        self._listeners.clear()
        for conn in list(self._connections):
            conn._break("the process crashed")
            if conn._remote is not None:
                conn._remote._break("the peer crashed")
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()

    def simulate_pause(self) -> None:
        """Freeze this transport (SIGSTOP): no frame moves until :meth:`simulate_resume`."""
        if self._paused is None:
            self._paused = asyncio.get_running_loop().time()
            self._resumed = asyncio.Event()

    def simulate_resume(self) -> None:
        if self._paused is not None:
            self._paused = None
            self._resumed.set()
            for conn in list(self._connections):
                conn._inbox.notify()


def _positive_int(options: Mapping[str, Any], key: str, default: int) -> int:
    value = options.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(
            f"transport option {key} must be a positive integer, got {value!r}", key=key
        )
    return value


def create_memory_transport(options: Mapping[str, Any] | None = None) -> MemoryTransport:
    """The plugin factory: ``(options) -> Transport``."""
    return MemoryTransport(options)
