"""An append waiting to be sent is never decided by a message that overtook it.

The client decides its appends by what comes back on the stream: a flush answered,
a later append of its own committed, a mount answered READY each decide "not
committed" for the appends sent before them. "Before" must mean before on the wire.
A transport that waits for room makes senders wait at the same time, and the
Transport contract orders frames only as their sends complete: the simulated network
lets a small frame pass a large one that waits for room, and the ZeroMQ transport lets
a sender that finds credit go ahead of one woken for it. If a flush, an append or a
mount overtakes an append of the same partition that was counted as sent before it,
the client decides that append "not committed" and executes it again while its first
copy still reaches the server and commits: a duplicate (or, past its deadline, an
error saying it "will not be committed" about a transaction that is committed).

Here the client's stream connection holds large frames back while it lets small ones
pass (what the simulated network does when its buffer is full), and a scripted
server handles what arrives in arrival order, as a Waltz server does. Real pieces:
the client, the wire codec, the ``memory`` transport, the ``local`` coordination.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest
from client_protocol_peer import ProtocolTestPeer
from client_support import Cluster, Ctx, RecordingApp, committed, mount

from waltz_api.contracts.transport import Connection
from waltz_api.messages import (
    AppendRequest,
    ErrorCode,
    ErrorResponse,
    FeedData,
    FlushRequest,
    FlushResponse,
    MountRequest,
    MountResponse,
    MountStatus,
)
from waltz_api.types import ReqId
from waltz_client import AsyncWaltzClient, TransactionBuilder, TransactionExpiredError
from waltz_client.state import MountState

pytestmark = pytest.mark.timeout(60)

LARGE = 64 * 1024
"""Frames above this many bytes wait while the connection is held back."""


class HeldBack(Connection):
    """The client's stream connection, with a transport's back pressure played by the
    test: until :meth:`release`, a frame above ``LARGE`` bytes waits in ``send`` while
    smaller frames pass, as the simulated network's frames do when one does not fit
    its buffer (the Transport contract orders frames as their sends complete)."""

    def __init__(self, inner: Connection) -> None:
        self.inner = inner
        self.waiting = 0
        """Large frames waiting in ``send``."""
        self.small_sent = 0
        """Small frames sent while the connection was held back."""
        self._released = asyncio.Event()

    def release(self) -> None:
        self._released.set()

    @property
    def connection_id(self) -> int:
        return self.inner.connection_id

    @property
    def peer(self) -> str:
        return self.inner.peer

    @property
    def closed(self) -> bool:
        return self.inner.closed

    @property
    def max_frame_size(self) -> int | None:
        return self.inner.max_frame_size

    async def send(self, frame: bytes) -> None:
        if not self._released.is_set():
            if len(frame) > LARGE:
                self.waiting += 1
                await self._released.wait()
            else:
                self.small_sent += 1
        await self.inner.send(frame)

    async def recv(self) -> bytes:
        return await self.inner.recv()

    async def close(self) -> None:
        await self.inner.close()


def hold_back(client: AsyncWaltzClient) -> HeldBack:
    """Hold back large frames on partition 0's stream connection (it is mounted)."""
    channel = client.partitions[0].channel
    assert channel is not None and channel.stream is not None
    held = HeldBack(channel.stream)
    channel.stream = held
    return held


class OrderedServer:
    """What a Waltz server does with partition 0's appends, flushes and mounts, in the
    order they arrive: an append commits at the next id (the contexts here take no
    locks, so no lock check fails), a flush is answered with the high-water mark of what
    arrived before it, a mount streams the log after the client's mark, then READY."""

    def __init__(self, peer: ProtocolTestPeer) -> None:
        self.peer = peer
        self.log: list[AppendRequest] = []
        self.arrived: list[str] = []

    async def run(self) -> None:
        while True:
            conn, message = await self.peer.next_message(timeout=60)
            self.arrived.append(type(message).__name__)
            top = len(self.log) - 1
            if isinstance(message, AppendRequest):
                self.log.append(message)
                await conn.send(FeedData(message.req_id, top + 1, message.header))
            elif isinstance(message, FlushRequest):
                await conn.send(FlushResponse(message.req_id, top))
            elif isinstance(message, MountRequest):
                start = message.client_high_water_mark + 1
                feed = [FeedData(a.req_id, i, a.header) for i, a in enumerate(self.log)][start:]
                await conn.send(*feed, MountResponse(message.req_id, MountStatus.READY, top))

    def headers(self) -> list[int]:
        return [append.header for append in self.log]


@contextlib.asynccontextmanager
async def serving(
    cluster: Cluster, peer: ProtocolTestPeer, app: RecordingApp, **config: object
) -> AsyncIterator[AsyncWaltzClient]:
    await cluster.assign(0, peer)
    client = AsyncWaltzClient(app, cluster.config(partitions=[0], **config))
    await client.start()
    try:
        yield client
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def ordered_server(peer: ProtocolTestPeer) -> AsyncIterator[OrderedServer]:
    server = OrderedServer(peer)
    task = asyncio.ensure_future(server.run())
    try:
        yield server
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class App(RecordingApp):
    """The application, its high-water mark read on the event loop (with ``Unlocked``'s
    async ``execute``, a build runs on the loop: no callback thread, so counting loop
    turns is deterministic)."""

    async def client_high_water_mark(self, partition_id: int) -> int:  # type: ignore[override]
        return self.hwm.get(partition_id, -1)


class Unlocked(Ctx):
    """A context without locks (nothing at the server refuses its second copy)."""

    def __init__(self, header: int, size: int) -> None:
        super().__init__(header=header, data=bytes(size))

    async def execute(self, builder: TransactionBuilder) -> bool:  # type: ignore[override]
        self.hwms.append(builder.client_high_water_mark)
        builder.set_header(self.header).set_data(self.payload)
        return True


async def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():  # noqa: ASYNC110 - polls the client's state
            await asyncio.sleep(0.01)


async def loop_turns(until: Callable[[], bool], turns: int = 200) -> None:
    """Let the event loop turn until ``until()``, at most ``turns`` times. No time
    passes: the client and the in-process peer have nothing to wait for but each other,
    so whatever the client sends next without waiting has been sent by then."""
    for _ in range(turns):
        if until():
            return
        await asyncio.sleep(0)


async def test_the_flush_at_a_deadline_never_overtakes_an_append_waiting_to_be_sent(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    """The deadline of a large append waiting for room passes: the flush that asks the
    server to decide it goes after it, so the server decides it (here: commits it), and
    the submission never hears "it will not be committed" about a committed transaction."""
    app = App()
    async with serving(cluster, peer, app, transaction_timeout=0.5) as client:
        await mount(peer, 0)
        held = hold_back(client)
        ctx = Unlocked(1, 2 * LARGE)
        submitted = asyncio.ensure_future(client.submit(ctx))
        await wait_for(lambda: held.waiting == 1)
        await asyncio.sleep(0.6)  # its deadline passes while it waits to be sent
        await loop_turns(lambda: held.small_sent > 0)  # a flush that could pass, did
        async with ordered_server(peer) as server:
            held.release()
            committed(await asyncio.wait_for(submitted, 10), 0)
            assert server.arrived[:2] == ["AppendRequest", "FlushRequest"]
        assert server.headers() == [1] and ctx.attempts == 1
        assert ctx.events == [("application", 0), ("completion", True)]
        assert app.applied == [(0, 0, 1)]


async def test_a_flush_never_overtakes_an_append_waiting_to_be_sent(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    """A caller's flush while a large append waits for room: the append is not decided
    "not committed" and executed again while its first copy commits."""
    app = App()
    async with serving(cluster, peer, app, transaction_timeout=None) as client:
        await mount(peer, 0)
        held = hold_back(client)
        ctx = Unlocked(1, 2 * LARGE)
        submitted = asyncio.ensure_future(client.submit(ctx))
        await wait_for(lambda: held.waiting == 1)
        flushed = asyncio.ensure_future(client.flush(0))
        await loop_turns(lambda: held.small_sent > 0)
        async with ordered_server(peer) as server:
            held.release()
            committed(await asyncio.wait_for(submitted, 10), 0)
            assert await asyncio.wait_for(flushed, 10) == 0
        assert server.arrived == ["AppendRequest", "FlushRequest"]
        assert server.headers() == [1] and ctx.attempts == 1  # once in the log
        assert app.applied == [(0, 0, 1)]


async def test_a_later_append_never_overtakes_an_append_waiting_to_be_sent(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    """A small append submitted after a large one that waits for room: it is sent after
    it, so its commit does not decide the large one "superseded" while it still commits."""
    app = App()
    async with serving(cluster, peer, app, transaction_timeout=None) as client:
        await mount(peer, 0)
        held = hold_back(client)
        large, small = Unlocked(1, 2 * LARGE), Unlocked(2, 10)
        first = asyncio.ensure_future(client.submit(large))
        await wait_for(lambda: held.waiting == 1)
        second = asyncio.ensure_future(client.submit(small))
        await loop_turns(lambda: held.small_sent > 0)
        async with ordered_server(peer) as server:
            held.release()
            committed(await asyncio.wait_for(first, 10), 0)
            committed(await asyncio.wait_for(second, 10), 1)
        assert server.headers() == [1, 2]  # each once, in the order submitted
        assert large.attempts == small.attempts == 1
        assert app.applied == [(0, 0, 1), (0, 1, 2)]


async def test_a_mount_never_overtakes_an_append_waiting_to_be_sent(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    """The partition is mounted again on the same connection while a large append waits
    for room: the mount goes after it, so the server decides the append before it
    answers the mount, and READY does not fail an append that then commits."""
    app = App()
    async with serving(cluster, peer, app, transaction_timeout=None) as client:
        conn, request = await mount(peer, 0)
        held = hold_back(client)
        ctx = Unlocked(1, 2 * LARGE)
        submitted = asyncio.ensure_future(client.submit(ctx))
        await wait_for(lambda: held.waiting == 1)
        # the server says the partition is not assigned to it: the client re-reads the
        # assignment (unchanged) and mounts again, on the same connection
        generation = request.req_id.generation
        await conn.send(
            ErrorResponse(ReqId(-1, generation, 0, -1), ErrorCode.PARTITION_NOT_ASSIGNED, "moving")
        )
        partition = client.partitions[0]
        await wait_for(lambda: partition.mount.state is MountState.MOUNTING)
        await loop_turns(lambda: held.small_sent > 0)
        async with ordered_server(peer) as server:
            held.release()
            committed(await asyncio.wait_for(submitted, 10), 0)
            await wait_for(lambda: partition.mount.state is MountState.MOUNTED)
        assert server.arrived == ["AppendRequest", "MountRequest"]
        assert server.headers() == [1] and ctx.attempts == 1
        assert app.applied == [(0, 0, 1)]


async def test_a_submission_that_expires_waiting_to_be_sent_says_it_was_never_sent(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    """A small append waits for its turn behind a large one that waits for room, past
    its deadline: it expires, and "it will not be committed" is true (it was never sent:
    the server never receives it). The large one, sent once there is room, is decided
    by the server as usual."""
    app = App()
    async with serving(cluster, peer, app, transaction_timeout=0.5) as client:
        await mount(peer, 0)
        held = hold_back(client)
        large, small = Unlocked(1, 2 * LARGE), Unlocked(2, 10)
        first = asyncio.ensure_future(client.submit(large))
        await wait_for(lambda: held.waiting == 1)
        second = asyncio.ensure_future(client.submit(small))
        with pytest.raises(TransactionExpiredError) as info:
            await asyncio.wait_for(second, 10)
        message = str(info.value)
        assert "it was never sent" in message and "It will not be committed" in message
        assert small.events == [("expiration", None)]
        async with ordered_server(peer) as server:
            held.release()
            committed(await asyncio.wait_for(first, 10), 0)
            await wait_for(lambda: "FlushRequest" in server.arrived)  # large's deadline's
        assert server.headers() == [1]  # the expired one never reached the server
        assert app.applied == [(0, 0, 1)]
