"""One server as the client sees it: a stream connection and an RPC connection.

:class:`Channel` opens both with the Hello handshake; its *network sequence
number* increases with every channel the client creates (a MountRequest carries
it, so a server can drop messages of an older connection). It routes stream
messages to their partition's inbox (:class:`~waltz_client.partition.Partition`
processes them in order) and matches RPC answers to their callers by ReqId. What it
needs of its client is a :class:`ChannelHost`, of a partition a :class:`Carried`: it
imports neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, Generic, Protocol, TypeVar

from waltz_api.contracts.transport import Connection, Transport
from waltz_api.errors import (
    ConnectionClosedError,
    ProtocolError,
    TransportError,
    WaltzError,
)
from waltz_api.messages import (
    Message,
)
from waltz_api.types import ReqId
from waltz_api.wire import ProtocolConnection, Role

log = logging.getLogger(__name__)

T = TypeVar("T")


class ChannelLost(WaltzError):
    """A request's connection broke before its answer came (retried)."""


class Inbox(Generic[T]):
    """A bounded FIFO queue of one partition's stream messages: :class:`asyncio.Queue`'s
    ``get``/``put`` (``QueueFull``/``QueueEmpty`` included; getters and putters served
    first come, first served) without the task accounting (``task_done``/``join``) the
    client does not use, so that a message costs a few calls instead of a dozen."""

    __slots__ = ("_getters", "_items", "_putters", "maxsize")

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: deque[T] = deque()
        self._getters: deque[asyncio.Future[None]] = deque()
        self._putters: deque[asyncio.Future[None]] = deque()

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def full(self) -> bool:
        return len(self._items) >= self.maxsize

    def put_nowait(self, item: T) -> None:
        if len(self._items) >= self.maxsize:
            raise asyncio.QueueFull
        self._items.append(item)
        if self._getters:
            _wake_next(self._getters)

    def get_nowait(self) -> T:
        if not self._items:
            raise asyncio.QueueEmpty
        item = self._items.popleft()
        if self._putters:
            _wake_next(self._putters)
        return item

    async def put(self, item: T) -> None:
        while len(self._items) >= self.maxsize:
            await self._wait(self._putters, lambda: len(self._items) < self.maxsize)
        self.put_nowait(item)

    async def get(self) -> T:
        while not self._items:
            await self._wait(self._getters, lambda: bool(self._items))
        return self.get_nowait()

    @staticmethod
    async def _wait(waiters: deque[asyncio.Future[None]], ready: Callable[[], bool]) -> None:
        waiter = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            waiter.cancel()  # just in case it was not cancelled already
            with contextlib.suppress(ValueError):
                waiters.remove(waiter)
            if ready() and not waiter.cancelled():
                _wake_next(waiters)  # it was woken as it was cancelled: wake the next one
            raise


def _wake_next(waiters: deque[asyncio.Future[None]]) -> None:
    while waiters:
        waiter = waiters.popleft()
        if not waiter.done():
            waiter.set_result(None)
            return


class Carried(Protocol):
    """What a channel needs of a partition whose stream messages it carries."""

    @property
    def id(self) -> int: ...

    @property
    def inbox(self) -> Inbox[tuple[Channel, Message]]: ...

    def channel_lost(self, channel: Channel) -> None:
        """The channel broke: mount elsewhere, or anew."""
        ...


class ChannelHost(Protocol):
    """What a channel is told by its client."""

    @property
    def transport(self) -> Transport: ...

    @property
    def client_id(self) -> int: ...

    @property
    def connect_timeout(self) -> float: ...

    @property
    def closing(self) -> bool: ...

    def partition(self, partition_id: int) -> Carried | None:
        """The mounted partition a stream message is for (None: not one of ours)."""
        ...

    def channel_lost(self, channel: Channel) -> None:
        """The channel broke: the client forgets it (the next connect opens a new one)."""
        ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task the client cancels when it closes."""
        ...


class Channel:
    def __init__(self, host: ChannelHost, endpoint: str, seq_num: int) -> None:
        self.host = host
        self.endpoint = endpoint
        self.seq_num = seq_num
        self.stream: Connection | None = None
        self.rpc: Connection | None = None
        self._stream_proto: ProtocolConnection | None = None
        self._rpc_proto: ProtocolConnection | None = None
        self.rpc_waiters: dict[ReqId, asyncio.Future[Message]] = {}
        self.partitions: set[Carried] = set()
        self.closed = False
        self._tasks: list[asyncio.Task[None]] = []
        self._turns: dict[int, asyncio.Lock] = {}

    def turn(self, partition_id: int) -> asyncio.Lock:
        """The partition's turn to send on the stream connection: held from the moment a
        message is counted as sent (an append registered, a flush's or a mount's mark
        taken) until the transport took its frame.

        The client decides an append by what comes back after it: a flush answered, a
        later append of its own committed, a mount answered READY. That is sound only if
        "after" on the wire is "after" in the order the client counts them, and the
        Transport contract orders frames as their sends complete: sends that wait for room
        at the same time may complete in any order (the simulated network lets a small
        frame pass a large one that does not fit; the ZeroMQ transport lets a sender that
        finds credit go before one woken for it). One send of a partition at a time, in
        the order they took their turn (asyncio.Lock is first come, first served), makes
        the two orders the same. Other partitions' sends on the connection do not wait."""
        lock = self._turns.get(partition_id)
        if lock is None:
            lock = self._turns[partition_id] = asyncio.Lock()
        return lock

    @property
    def max_frame_size(self) -> int:
        """The largest frame the stream connection takes: the transport's, or the
        server's if it announced a smaller one."""
        own = self.host.transport.max_frame_size
        announced = None if self.stream is None else self.stream.max_frame_size
        return own if announced is None else min(own, announced)

    async def _connect(self, kind: str) -> tuple[Connection, ProtocolConnection]:
        host = self.host
        conn = await host.transport.connect(
            self.endpoint,
            timeout=host.connect_timeout,
            replace_key=f"waltz-client-{host.client_id}-{kind}",
        )
        try:
            proto = ProtocolConnection(Role.INITIATOR, sender=f"client:{host.client_id}")
            await conn.send(proto.start_handshake())
            frame = await asyncio.wait_for(conn.recv(), host.connect_timeout)
            proto.receive_frame(frame)
        except BaseException:
            await conn.close()
            raise
        return conn, proto

    async def open(self) -> None:
        self.stream, self._stream_proto = await self._connect("stream")
        try:
            self.rpc, self._rpc_proto = await self._connect("rpc")
        except BaseException:
            await self.stream.close()
            raise
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._read_stream(), name=f"waltz-client-stream-{self.endpoint}"),
            loop.create_task(self._read_rpc(), name=f"waltz-client-rpc-{self.endpoint}"),
        ]

    async def send_stream(self, message: Message) -> None:
        if self.closed or self.stream is None or self._stream_proto is None:
            raise ChannelLost(f"the stream connection to {self.endpoint} is closed")
        try:
            await self.stream.send(self._stream_proto.send(message))
        except (TransportError, ProtocolError) as exc:
            self.lost(exc)
            raise ChannelLost(f"the stream connection to {self.endpoint} broke: {exc}") from exc

    async def send_stream_many(self, messages: list[Message]) -> None:
        """Several messages on the stream connection in one send (the transport may
        carry them in one frame), in order."""
        if self.closed or self.stream is None or self._stream_proto is None:
            raise ChannelLost(f"the stream connection to {self.endpoint} is closed")
        try:
            encode = self._stream_proto.send
            await self.stream.send_many([encode(message) for message in messages])
        except (TransportError, ProtocolError) as exc:
            self.lost(exc)
            raise ChannelLost(f"the stream connection to {self.endpoint} broke: {exc}") from exc

    async def call(self, message: Message, req_id: ReqId, timeout: float) -> Message:
        if self.closed or self.rpc is None or self._rpc_proto is None:
            raise ChannelLost(f"the RPC connection to {self.endpoint} is closed")
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self.rpc_waiters[req_id] = future
        try:
            try:
                await self.rpc.send(self._rpc_proto.send(message))
            except (TransportError, ProtocolError) as exc:
                self.lost(exc)
                raise ChannelLost(f"the RPC connection to {self.endpoint} broke: {exc}") from exc
            return await asyncio.wait_for(future, timeout)
        finally:
            self.rpc_waiters.pop(req_id, None)

    async def _read_stream(self) -> None:
        assert self.stream is not None and self._stream_proto is not None
        try:
            while True:
                message = self._stream_proto.receive_frame(await self.stream.recv())
                req_id: ReqId | None = getattr(message, "req_id", None)
                partition = None if req_id is None else self.host.partition(req_id.partition_id)
                if partition is None:
                    log.warning("dropping %s for a partition this client does not mount", message)
                    continue
                try:
                    partition.inbox.put_nowait((self, message))
                except asyncio.QueueFull:  # the partition is behind: wait (back pressure)
                    await partition.inbox.put((self, message))
        except (TransportError, ProtocolError) as exc:
            self.lost(exc)

    async def _read_rpc(self) -> None:
        assert self.rpc is not None and self._rpc_proto is not None
        try:
            while True:
                message = self._rpc_proto.receive_frame(await self.rpc.recv())
                req_id = getattr(message, "req_id", None)
                future = self.rpc_waiters.get(req_id) if isinstance(req_id, ReqId) else None
                if future is None or future.done():
                    log.debug("dropping unexpected RPC answer %s", type(message).__name__)
                    continue
                future.set_result(message)
        except (TransportError, ProtocolError) as exc:
            self.lost(exc)

    def lost(self, reason: BaseException | str) -> None:
        """Close the channel after a failure; its partitions mount again elsewhere/anew."""
        if self.closed:
            return
        self.closed = True
        if not isinstance(reason, ConnectionClosedError) or not self.host.closing:
            log.warning("connection to server %s lost: %s", self.endpoint, reason)
        for future in self.rpc_waiters.values():
            if not future.done():
                future.set_exception(ChannelLost(f"the connection to {self.endpoint} broke"))
        self.host.channel_lost(self)
        # by id, not set order (object addresses): the same run replays the same (simulation)
        for partition in sorted(self.partitions, key=lambda p: p.id):
            partition.channel_lost(self)
        self.partitions.clear()
        self.host.spawn(self.close())

    async def close(self) -> None:
        self.closed = True
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        for conn in (self.stream, self.rpc):
            if conn is not None:
                with contextlib.suppress(WaltzError, OSError):
                    await conn.close()
        for task in self._tasks:
            if task is not current:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
