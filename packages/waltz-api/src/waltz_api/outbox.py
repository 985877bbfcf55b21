"""A connection's outgoing messages, sent in order by one writer task: the one outbox.

Senders queue messages (encoded at once, so an unencodable message fails its sender,
not the connection); the writer takes everything queued as one batch and hands it to
the transport in one ``send_many``, so a burst costs one wake-up and one write.

Bounds: at most ``max_frames`` frames and ``max_bytes`` bytes wait in the queue (frames
already handed to the transport do not count; one frame is always accepted when the
queue is empty). :meth:`Outbox.put` waits for room (back pressure on the sender), and
:meth:`Outbox.put_frames` for frames encoded once for many connections (a feed);
:meth:`Outbox.post` never waits and answers False when it queued nothing (the caller
decides what a full queue means: a server closes a client that does not read); its
``slack`` lets replies already owed go beyond the bound, up to a multiple of it.

A connection that can send without waiting (a ``send_nowait(frames) -> bool`` method,
as the ZeroMQ transport's, which sends at the end of the loop iteration) is handed a
message at once while the writer is idle and nothing is queued: a reply costs no task
switch; what it cannot take at once (no credit, ...) is queued for the writer as
before, so the order never changes.

The writer ends when the outbox is aborted or closed, after :meth:`Outbox.flush_and_stop`
has sent everything queued, or when the transport fails (``on_failure`` is then called
with the error); every sender waiting for room is then woken and raises
:class:`~waltz_api.errors.ConnectionClosedError`. The outbox never closes the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence

from waltz_api.contracts.transport import Connection
from waltz_api.errors import ConnectionClosedError, WaltzError
from waltz_api.messages import Message

log = logging.getLogger(__name__)


class Outbox:
    """The outgoing queue and writer task of one connection (see the module docstring)."""

    def __init__(
        self,
        conn: Connection,
        encode: Callable[[Message], bytes],
        *,
        max_frames: int | None = None,
        max_bytes: int | None = None,
        on_failure: Callable[[WaltzError], None] | None = None,
        name: str = "",
    ) -> None:
        """``encode``: a message's frame (e.g. ``ProtocolConnection.send``); ``None``
        bounds: unbounded (the caller bounds what it queues)."""
        self.conn = conn
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self.failure: WaltzError | None = None
        """The transport error the writer ended with (None: it did not fail)."""
        self._encode = encode
        self._on_failure = on_failure
        self._frames: deque[bytes] = deque()
        self._bytes = 0
        self._in_flight = 0
        self._room = asyncio.Event()
        self._room.set()
        self._wakeup: asyncio.Future[None] | None = None
        """The idle writer's: resolved by the next frame queued, or an end."""
        self._send_now: Callable[[Sequence[bytes]], bool] | None = getattr(
            conn, "send_nowait", None
        )
        self._idle = False
        """The writer waits for frames (none queued, none being sent)."""
        self._draining = False
        self._ended = False
        self.task = asyncio.create_task(self._write(), name=name or f"outbox-{conn.connection_id}")

    @property
    def closed(self) -> bool:
        """True once the outbox takes no more messages."""
        return self._ended or self._draining or self.conn.closed

    @property
    def queued_frames(self) -> int:
        """Frames queued and being handed to the transport (at most twice the bound)."""
        return len(self._frames) + self._in_flight

    def full(self, slack: int = 1) -> bool:
        """Whether the queue is at its bounds (``slack`` times them)."""
        frames = self._frames
        return bool(frames) and (
            (self.max_frames is not None and len(frames) >= slack * self.max_frames)
            or (self.max_bytes is not None and self._bytes >= slack * self.max_bytes)
        )

    @property
    def queued_bytes(self) -> int:
        """Bytes queued (not those being handed to the transport)."""
        return self._bytes

    async def wait_room(self) -> None:
        """Until the queue is below its bounds, or the outbox is closed."""
        while self.full() and not self.closed:
            self._room.clear()
            await self._room.wait()

    def _closed_error(self) -> ConnectionClosedError:
        return ConnectionClosedError(f"connection to {self.conn.peer} is closed")

    async def put(self, message: Message) -> None:
        """Queue ``message``, waiting while the queue is full (the peer is not reading).

        Raises ConnectionClosedError when the outbox is closed (also while waiting), and
        whatever ``encode`` raises for a message that cannot be sent."""
        if self.closed:
            raise self._closed_error()
        frame = self._encode(message)
        while self.full():
            self._room.clear()
            await self._room.wait()
            if self._ended:
                raise self._closed_error()
        self._append(frame)

    async def put_frames(self, frames: Sequence[bytes]) -> None:
        """Queue frames already encoded (for every connection at once: a feed), in
        order, as many at a time as the bounds leave room for, waiting in between.

        Raises ConnectionClosedError when the outbox is closed (before or while
        waiting); the frames queued until then stay queued."""
        index, count = 0, len(frames)
        queue = self._frames
        while index < count:
            await self.wait_room()
            if self.closed:
                raise self._closed_error()
            room = count - index
            if self.max_frames is not None:
                room = min(room, max(1, self.max_frames - len(queue)))
            if self.max_bytes is not None:
                room = min(room, max(1, (self.max_bytes - self._bytes) // len(frames[index])))
            chunk = frames[index : index + room]
            index += len(chunk)
            if self._idle and not queue and self._send_now is not None and self._send_now(chunk):
                continue
            queue.extend(chunk)
            self._bytes += sum(map(len, chunk))
            self._wake()

    def post_frames(self, frames: Sequence[bytes]) -> bool:
        """Queue frames already encoded without waiting, when they all fit within the
        bounds now; False (nothing queued) otherwise, or when the outbox is closed
        (:meth:`put_frames` waits for room)."""
        if self.closed or not frames:
            return False
        queue = self._frames
        if self._idle and not queue and self._send_now is not None and self._send_now(frames):
            return True
        size = sum(map(len, frames))
        if (self.max_frames is not None and len(queue) + len(frames) > self.max_frames) or (
            self.max_bytes is not None and self._bytes + size > self.max_bytes
        ):
            return False
        queue.extend(frames)
        self._bytes += size
        self._wake()
        return True

    def post(self, message: Message, *, slack: int = 1) -> bool:
        """Queue ``message`` without waiting; False (nothing queued) when the outbox is
        closed or full: at ``slack`` times its bounds (a reply to a request already
        taken may go beyond the bound that stops taking new ones)."""
        if self.closed or self.full(slack):
            return False
        self._append(self._encode(message))
        return True

    def _append(self, frame: bytes) -> None:
        if (
            self._idle
            and not self._frames
            and self._send_now is not None
            and self._send_now((frame,))
        ):
            return
        self._frames.append(frame)
        self._bytes += len(frame)
        self._wake()

    def _wake(self) -> None:
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    async def _write(self) -> None:
        try:
            while not self._ended:
                if not self._frames:
                    if self._draining:
                        return
                    self._wakeup = asyncio.get_running_loop().create_future()
                    self._idle = True
                    try:
                        await self._wakeup
                    finally:
                        self._idle = False
                        self._wakeup = None
                    continue
                batch = list(self._frames)
                self._frames.clear()
                self._bytes = 0
                self._room.set()
                self._in_flight = len(batch)
                await self.conn.send_many(batch)
                self._in_flight = 0
        except WaltzError as exc:
            log.debug("connection %s: writer ends: %s", self.conn.peer, exc)
            # kept without its traceback: the traceback's frames would keep the batch
            # being sent (megabytes of frames) alive as long as the outbox lives
            self.failure = exc.with_traceback(None)
            if self._on_failure is not None:
                self._on_failure(exc)
        finally:
            # nobody will drain this outbox again: wake every waiting sender
            self._ended = True
            self._frames.clear()
            self._bytes = 0
            self._room.set()

    def abort(self) -> None:
        """Stop now; what is still queued is dropped."""
        self._ended = True
        self._wake()
        self._room.set()

    async def flush_and_stop(self, timeout: float) -> None:
        """Send everything queued, then stop (cancelled after ``timeout`` seconds)."""
        self._draining = True
        self._wake()
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout)
        except (TimeoutError, asyncio.CancelledError):
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task

    async def close(self) -> None:
        """Abort and wait for the writer to end."""
        self.abort()
        self.task.cancel()
        with contextlib.suppress(BaseException):
            await self.task
