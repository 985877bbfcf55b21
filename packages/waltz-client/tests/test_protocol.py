"""The client's protocol behaviour against a scripted PROTOCOL TEST PEER.

Real pieces: the client, the wire codec, the ``memory`` transport, the ``local``
coordination plugin holding the cluster metadata. The peer is no server: each
test scripts what a server would answer and checks what the client does. These
are protocol tests, not end-to-end tests (those need the Waltz server).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from client_protocol_peer import ProtocolTestPeer
from client_support import Cluster, Ctx, RecordingApp, committed, mount, other

from waltz_api.errors import ClientAheadError, ClientError, ServerError
from waltz_api.messages import (
    AppendRequest,
    ErrorCode,
    ErrorResponse,
    FeedData,
    FlushRequest,
    FlushResponse,
    HighWaterMarkRequest,
    HighWaterMarkResponse,
    LockFailure,
    MountRequest,
    MountResponse,
    MountStatus,
    RangeReadRequest,
    RangeReadResponse,
    TransactionDataRequest,
    TransactionDataResponse,
)
from waltz_api.types import Lock, LockMode, Record, ReqId
from waltz_api.wire import checksum
from waltz_client import (
    JSON,
    AsyncWaltzClient,
    PoisonTransactionError,
    SubmissionResult,
    Transaction,
    TransactionBuilder,
    TransactionExpiredError,
    TransactionOutcomeUnknownError,
)

pytestmark = pytest.mark.timeout(60)

OTHER = ReqId(999, 1, 0, 1)
"""The ReqId of a transaction another client submitted."""


@contextlib.asynccontextmanager
async def running(
    cluster: Cluster, app: RecordingApp, **config: object
) -> AsyncIterator[AsyncWaltzClient]:
    client = AsyncWaltzClient(app, cluster.config(**config))
    await client.start()
    try:
        yield client
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def serving(
    cluster: Cluster, peer: ProtocolTestPeer, app: RecordingApp, **config: object
) -> AsyncIterator[AsyncWaltzClient]:
    """The running client of ``app`` for partition 0, which ``peer`` serves (on its
    transport)."""
    await cluster.assign(0, peer)
    async with running(
        cluster, app, transport=peer.transport_name, partitions=[0], **config
    ) as client:
        yield client


async def wait_for(predicate: object, timeout: float = 10.0) -> None:
    assert callable(predicate)
    async with asyncio.timeout(timeout):
        while not predicate():  # noqa: ASYNC110 - polls application state
            await asyncio.sleep(0.01)


async def test_mount_carries_ids_and_the_feed_is_applied_in_order_once(
    cluster: Cluster, any_peer: ProtocolTestPeer
) -> None:
    peer = any_peer
    generation = await cluster.assign(0, peer)
    await cluster.assign(1, peer)
    app = RecordingApp(hwm={1: 4})
    async with running(cluster, app, transport=peer.transport_name) as client:
        conn, request = await mount(peer, 0, feed=[(0, 10), (1, 11), (2, 12)])
        assert request.req_id.client_id == client.client_id >= 0
        assert request.req_id.generation == generation
        assert request.client_high_water_mark == -1
        assert request.seq_num == 1  # the first network client
        _, request1 = await mount(peer, 1, hwm=4)
        assert request1.client_high_water_mark == 4
        assert request1.seq_num == 1  # same server: same network client
        await wait_for(lambda: len(app.applied) == 3)
        # duplicates and replays are ignored; the next id is applied once
        await conn.send(
            FeedData(other(0, 9), 1, 11), FeedData(other(0, 10), 2, 12), FeedData(OTHER, 3, 13)
        )
        await wait_for(lambda: app.hwm.get(0) == 3)
        await asyncio.sleep(0.05)
        assert app.applied == [(0, 0, 10), (0, 1, 11), (0, 2, 12), (0, 3, 13)]
        assert client.feed_position(0) == 3
        assert client.feed_position(1) == 4


async def test_submit_sends_the_built_transaction_and_resolves_on_its_feed_item(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp(hwm={0: 5}, fetch_data=True)
    async with serving(cluster, peer, app) as client:
        conn, _ = await mount(peer, 0, hwm=5)

        def build(builder: TransactionBuilder) -> bool:
            builder.set_header(-3).set_data({"amount": 5}, JSON)
            builder.read_lock("account", 1).write_lock("account", 2).append_lock("user", 9)
            return True

        ctx = Ctx(build=build)
        submitted = asyncio.ensure_future(client.submit(ctx))
        _, append = await peer.expect(AppendRequest)
        assert append.client_high_water_mark == 5
        assert append.header == -3
        assert JSON.deserialize(append.data) == {"amount": 5}
        assert append.checksum == checksum(append.data)
        assert append.locks.read == (Lock("account", 1, LockMode.READ).hash,)
        assert append.locks.write == (Lock("account", 2).hash,)
        assert append.locks.append == (Lock("user", 9, LockMode.APPEND).hash,)
        assert append.req_id.partition_id == 0
        assert not submitted.done()
        peer.data[(0, 6)] = append.data
        await conn.send(FeedData(append.req_id, 6, append.header))
        committed(await asyncio.wait_for(submitted, 10), 6)
        assert ctx.events == [("application", 6), ("completion", True)]
        assert app.applied == [(0, 6, -3)]
        # the client's own append is in its cache: applying it asks the server nothing
        assert app.data[(0, 6)] == append.data
        assert peer.data_requests == []
        # another client's transaction: fetched lazily over the RPC connection, once;
        # then cached
        peer.data[(0, 7)] = b"theirs"
        await conn.send(FeedData(OTHER, 7, 0))
        await wait_for(lambda: app.hwm.get(0) == 7)
        assert app.data[(0, 7)] == b"theirs"
        assert [r.transaction_id for r in peer.data_requests] == [7]
        assert await client._fetch_data(0, 7) == b"theirs"
        assert await client._fetch_data(0, 6) == append.data
        assert len(peer.data_requests) == 1
        # appends travel on the stream connection, data requests on the RPC one
        (stream,) = [c for c in peer.connections if append in c.received]
        assert not any(r in stream.received for r in peer.data_requests)


async def test_an_older_pending_append_fails_when_a_newer_one_commits_and_is_retried(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app) as client:
        conn, _ = await mount(peer, 0)
        first, second = Ctx(header=1), Ctx(header=2)
        s1 = asyncio.ensure_future(client.submit(first))
        _, a1 = await peer.expect(AppendRequest)
        s2 = asyncio.ensure_future(client.submit(second))
        _, a2 = await peer.expect(AppendRequest)
        assert a1.req_id.seq_num < a2.req_id.seq_num
        await conn.send(FeedData(a2.req_id, 0, 2))
        committed(await asyncio.wait_for(s2, 10), 0)
        # the first one failed (the server handles appends in order): re-executed
        _, again = await peer.expect(AppendRequest)
        assert again.header == 1 and again.req_id != a1.req_id
        assert again.client_high_water_mark == 0  # built on the state after tx 0
        assert first.hwms == [-1, 0]
        await conn.send(FeedData(again.req_id, 1, 1))
        committed(await asyncio.wait_for(s1, 10), 1)
        assert first.attempts == 2 and second.attempts == 1
        assert app.applied == [(0, 0, 2), (0, 1, 1)]


async def test_reconnect_blocks_appends_until_the_mount_completes_then_fails_pending(
    cluster: Cluster, any_peer: ProtocolTestPeer
) -> None:
    peer = any_peer
    app = RecordingApp()
    async with serving(cluster, peer, app) as client:
        await mount(peer, 0, feed=[(0, 0)])
        ctx = Ctx()
        submitted = asyncio.ensure_future(client.submit(ctx))
        _, lost = await peer.expect(AppendRequest)
        await peer.drop_connections()  # the server "crashed" with the append pending
        conn, request = await peer.expect(MountRequest)
        assert request.seq_num == 2  # a new network client
        assert request.client_high_water_mark == 0
        # appends stay blocked while mounting
        await peer.nothing_more(AppendRequest, 0.3)
        assert not submitted.done()
        await conn.send(FeedData(OTHER, 1, 5), MountResponse(request.req_id, MountStatus.READY, 1))
        _, retried = await peer.expect(AppendRequest)
        assert retried.req_id != lost.req_id
        assert retried.client_high_water_mark == 1
        await conn.send(FeedData(retried.req_id, 2, 7))
        committed(await asyncio.wait_for(submitted, 10), 2)
        assert ctx.attempts == 2
        assert [t for _, t, _ in app.applied] == [0, 1, 2]


async def test_a_pending_append_committed_before_the_mount_response_is_not_retried(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app) as client:
        await mount(peer, 0)
        ctx = Ctx()
        submitted = asyncio.ensure_future(client.submit(ctx))
        _, append = await peer.expect(AppendRequest)
        await peer.drop_connections()
        conn, request = await peer.expect(MountRequest)
        # the append did commit: the remount's feed carries it before READY
        await conn.send(
            FeedData(append.req_id, 0, 7), MountResponse(request.req_id, MountStatus.READY, 0)
        )
        committed(await asyncio.wait_for(submitted, 10), 0)
        assert ctx.attempts == 1
        await peer.nothing_more(AppendRequest, 0.3)


async def test_lock_failure_waits_for_the_failing_transaction_then_re_executes(
    cluster: Cluster, any_peer: ProtocolTestPeer
) -> None:
    peer = any_peer
    app = RecordingApp()
    async with serving(cluster, peer, app) as client:
        conn, _ = await mount(peer, 0, feed=[(0, 0), (1, 0), (2, 0), (3, 0)])
        await wait_for(lambda: app.hwm.get(0) == 3)
        ctx = Ctx()
        submitted = asyncio.ensure_future(client.submit(ctx))
        _, append = await peer.expect(AppendRequest)
        assert append.client_high_water_mark == 3
        await conn.send(LockFailure(append.req_id, 5))
        await peer.nothing_more(AppendRequest, 0.3)  # transaction 5 is not applied yet
        await conn.send(FeedData(OTHER, 4, 0))
        await peer.nothing_more(AppendRequest, 0.3)  # nor yet
        await conn.send(FeedData(other(0, 5), 5, 0))
        _, retried = await peer.expect(AppendRequest)
        assert retried.client_high_water_mark == 5  # re-executed on the fresh state
        assert ctx.hwms == [3, 5]
        assert ("lock_failure", 5) in ctx.events
        await conn.send(FeedData(retried.req_id, 6, 7))
        committed(await asyncio.wait_for(submitted, 10), 6)
        assert ctx.events == [("lock_failure", 5), ("application", 6), ("completion", True)]


async def test_client_ahead_is_reported_and_fails_submissions(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp(hwm={0: 10})
    async with serving(cluster, peer, app) as client:
        ctx = Ctx()
        submitted = asyncio.ensure_future(client.submit(ctx))
        await mount(peer, 0, hwm=3, status=MountStatus.CLIENT_AHEAD)
        with pytest.raises(ClientAheadError, match="beyond the partition's high-water mark 3"):
            await asyncio.wait_for(submitted, 10)
        assert isinstance(app.errors[0][2], ClientAheadError)
        assert ctx.events and ctx.events[0][0] == "exception"
        with pytest.raises(ClientAheadError):
            await client.submit(Ctx())
        await peer.nothing_more(MountRequest, 0.3)  # no retry of a configuration error


async def test_not_ready_is_retried_until_ready(cluster: Cluster, peer: ProtocolTestPeer) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app) as client:
        _, first = await mount(peer, 0, status=MountStatus.NOT_READY)
        _, second = await mount(peer, 0)
        assert second.req_id != first.req_id
        conn = peer.connections[0]
        submitted = asyncio.ensure_future(client.submit(Ctx()))
        _, append = await peer.expect(AppendRequest)
        for c in peer.connections:
            if append in c.received:
                conn = c
        await conn.send(FeedData(append.req_id, 0, 7))
        committed(await asyncio.wait_for(submitted, 10), 0)


async def test_reassignment_moves_the_partition_to_the_new_server_and_generation(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    new_server = await ProtocolTestPeer().start()
    try:
        app = RecordingApp()
        async with serving(cluster, peer, app) as client:
            conn, _ = await mount(peer, 0, feed=[(0, 0)])
            ctx = Ctx()
            submitted = asyncio.ensure_future(client.submit(ctx))
            _, stranded = await peer.expect(AppendRequest)
            generation = await cluster.assign(0, new_server, server_id=2)
            conn2, request = await new_server.expect(MountRequest)
            assert request.req_id.generation == generation == 2
            assert request.seq_num == 2
            # late messages of the old assignment are ignored
            await conn.send(FeedData(OTHER, 1, 0))
            await new_server.nothing_more(AppendRequest, 0.2)
            await conn2.send(MountResponse(request.req_id, MountStatus.READY, 0))
            _, retried = await new_server.expect(AppendRequest)
            assert retried.req_id.generation == 2 and retried.req_id != stranded.req_id
            await conn2.send(FeedData(retried.req_id, 1, 7))
            committed(await asyncio.wait_for(submitted, 10), 1)
            assert [t for _, t, _ in app.applied] == [0, 1]
            assert app.applied[1][2] == 7  # the old server's item 1 was not applied
    finally:
        await new_server.close()


async def test_flush_and_high_water_mark(cluster: Cluster, peer: ProtocolTestPeer) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app) as client:
        conn, _ = await mount(peer, 0, feed=[(0, 0)])
        hwm = asyncio.ensure_future(client.high_water_mark(0))
        _, request = await peer.expect(HighWaterMarkRequest)
        await conn.send(HighWaterMarkResponse(request.req_id, 41))
        assert await asyncio.wait_for(hwm, 10) == 41

        flushed = asyncio.ensure_future(client.flush(0))
        _, flush = await peer.expect(FlushRequest)
        await conn.send(FlushResponse(flush.req_id, 2), FeedData(OTHER, 1, 0))
        await asyncio.sleep(0.1)
        assert not flushed.done()  # the feed has not reached 2 yet
        await conn.send(FeedData(other(0, 2), 2, 0))
        assert await asyncio.wait_for(flushed, 10) == 2
        assert app.hwm[0] == 2


async def test_a_failing_apply_is_reported_and_the_feed_restarts_from_the_application(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp(fail_once={1})
    async with serving(cluster, peer, app):
        await mount(peer, 0, feed=[(0, 0), (1, 1), (2, 2)])
        # apply(1) failed: reported, then a new mount from the application's mark
        _, request = await mount(peer, 0, feed=[(1, 1), (2, 2)])
        assert request.client_high_water_mark == 0
        assert app.errors[0][:2] == (0, 1)
        await wait_for(lambda: app.hwm.get(0) == 2)
        assert [t for _, t, _ in app.applied] == [0, 1, 2]


async def test_a_gap_in_the_feed_makes_the_client_mount_again(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app):
        conn, _ = await mount(peer, 0, feed=[(0, 0)])
        await conn.send(FeedData(OTHER, 2, 0))  # 1 is missing
        _, request = await mount(peer, 0, feed=[(1, 0), (2, 0)])
        assert request.client_high_water_mark == 0
        await wait_for(lambda: app.hwm.get(0) == 2)
        assert [t for _, t, _ in app.applied] == [0, 1, 2]


async def test_back_pressure_limits_transactions_in_flight_per_partition(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app, max_concurrent_transactions=2) as client:
        conn, _ = await mount(peer, 0)
        tasks = [await client.enqueue(Ctx(header=1)), await client.enqueue(Ctx(header=2))]
        third = asyncio.ensure_future(client.enqueue(Ctx(header=3)))
        _, a1 = await peer.expect(AppendRequest)
        _, a2 = await peer.expect(AppendRequest)
        await asyncio.sleep(0.2)
        assert not third.done()  # waits for a slot
        await peer.nothing_more(AppendRequest, 0.2)
        await conn.send(FeedData(a1.req_id, 0, 1))
        tasks.append(await asyncio.wait_for(third, 10))
        _, a3 = await peer.expect(AppendRequest)
        assert a3.header == 3
        await conn.send(FeedData(a2.req_id, 1, 2), FeedData(a3.req_id, 2, 3))
        assert [r.transaction_id for r in await asyncio.gather(*tasks) if r] == [0, 1, 2]


async def test_execute_declining_or_raising(cluster: Cluster, peer: ProtocolTestPeer) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app) as client:
        await mount(peer, 0)
        declined = Ctx(build=lambda b: False)
        assert await client.submit(declined) == SubmissionResult(False, 0, -1, attempts=1)
        assert declined.events == [("completion", False)]

        def boom(builder: TransactionBuilder) -> bool:
            raise ValueError("no such account")

        failing = Ctx(build=boom)
        with pytest.raises(ValueError, match="no such account"):
            await client.submit(failing)
        assert failing.events[0][0] == "exception"
        with pytest.raises(ClientError, match="partition 1 is not mounted"):
            await client.submit(Ctx(partition=1))
        with pytest.raises(ClientError, match=r"must be an int in 0\.\.1"):
            await client.submit(Ctx(partition=5))
        await peer.nothing_more(AppendRequest, 0.2)


async def test_close_fails_pending_submissions(cluster: Cluster, peer: ProtocolTestPeer) -> None:
    await cluster.assign(0, peer)
    app = RecordingApp()
    client = AsyncWaltzClient(app, cluster.config(partitions=[0], max_concurrent_transactions=1))
    await client.start()
    await mount(peer, 0)
    submitted = asyncio.ensure_future(client.submit(Ctx()))
    await peer.expect(AppendRequest)
    # a second submission waits for a slot (limit 1): closing releases it too
    waiting = asyncio.ensure_future(client.submit(Ctx()))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    await client.close()
    with pytest.raises(ClientError, match="closed"):
        await asyncio.wait_for(submitted, 10)
    with pytest.raises(ClientError, match="closed"):
        await asyncio.wait_for(waiting, 10)
    with pytest.raises(ClientError, match="not running"):
        await client.submit(Ctx())


class AsyncApp(RecordingApp):
    """Callbacks written as coroutines: run on the loop, data awaited."""

    async def client_high_water_mark(self, partition_id: int) -> int:  # type: ignore[override]
        return self.hwm.get(partition_id, -1)

    async def apply_transaction(self, transaction: Transaction) -> None:  # type: ignore[override]
        with pytest.raises(ClientError, match="cannot run on the client's event loop"):
            transaction.get_data()  # blocking on the loop would deadlock: refused
        data = await transaction.fetch_data(JSON)
        self.data[(transaction.partition_id, transaction.transaction_id)] = JSON.serialize(data)
        self.applied.append((transaction.partition_id, transaction.transaction_id, 0))
        self.hwm[transaction.partition_id] = transaction.transaction_id


async def test_async_callbacks_fetch_data_on_the_loop(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = AsyncApp(hwm={0: 1})
    peer.data[(0, 2)] = JSON.serialize({"n": 2})
    peer.data[(0, 3)] = JSON.serialize({"n": 3})
    async with serving(cluster, peer, app):
        _, request = await mount(peer, 0, feed=[(2, 0), (3, 0)])
        assert request.client_high_water_mark == 1
        await wait_for(lambda: app.hwm.get(0) == 3)
        assert JSON.deserialize(app.data[(0, 3)]) == {"n": 3}
        assert [r.transaction_id for r in peer.data_requests] == [2, 3]


async def test_a_data_fetch_the_server_cannot_answer_is_reported(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp(fetch_data=True)
    async with serving(cluster, peer, app):
        await mount(peer, 0, feed=[(0, 0)])  # the peer has no data for transaction 0
        _, again = await peer.expect(MountRequest)  # apply failed: reported, feed restarted
        assert again.client_high_water_mark == -1
        assert isinstance(app.errors[0][2], ServerError)
        assert "no such transaction" in str(app.errors[0][2])
        assert app.applied == []


async def test_an_append_refused_for_a_stale_generation_is_retried_after_a_new_mount(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app) as client:
        conn, _ = await mount(peer, 0)
        ctx = Ctx()
        submitted = asyncio.ensure_future(client.submit(ctx))
        _, append = await peer.expect(AppendRequest)
        await conn.send(ErrorResponse(append.req_id, ErrorCode.STALE_GENERATION, "moved"))
        # the client re-reads the assignment (unchanged here) and mounts again first
        conn, _ = await mount(peer, 0)
        _, retried = await peer.expect(AppendRequest)
        assert retried.req_id != append.req_id
        await conn.send(FeedData(retried.req_id, 0, 7))
        committed(await asyncio.wait_for(submitted, 10), 0)
        assert ctx.attempts == 2


async def test_an_append_refused_as_moved_that_did_commit_is_not_executed_again(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    """A server leaving a partition may refuse (STALE_GENERATION) an append it had given
    an id; the next owner's recovery can still commit it. The refusal decides nothing:
    the next mount does (here its feed carries the append: committed, once)."""
    app = RecordingApp()
    async with serving(cluster, peer, app) as client:
        conn, _ = await mount(peer, 0)
        ctx = Ctx()
        submitted = asyncio.ensure_future(client.submit(ctx))
        _, append = await peer.expect(AppendRequest)
        await conn.send(
            ErrorResponse(append.req_id, ErrorCode.STALE_GENERATION, "stopped before decided")
        )
        conn, request = await peer.expect(MountRequest)
        await conn.send(
            FeedData(append.req_id, 0, 7), MountResponse(request.req_id, MountStatus.READY, 0)
        )
        committed(await asyncio.wait_for(submitted, 10), 0)
        assert ctx.attempts == 1
        await peer.nothing_more(AppendRequest, 0.3)


async def test_range_read_over_rpc(cluster: Cluster, peer: ProtocolTestPeer) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app) as client:
        await mount(peer, 0)
        reading = asyncio.ensure_future(client.range_read(0, 3, max_records=2))
        conn, request = await peer.expect(RangeReadRequest)
        assert (request.start_transaction_id, request.max_records) == (3, 2)
        records = tuple(Record(t, other(0, t), 0, b"d%d" % t, checksum(b"d%d" % t)) for t in (3, 4))
        await conn.send(RangeReadResponse(request.req_id, 9, records))
        hwm, got = await asyncio.wait_for(reading, 10)
        assert hwm == 9 and [r.data for r in got] == [b"d3", b"d4"]
        stream = next(
            c for c in peer.connections if any(isinstance(m, MountRequest) for m in c.received)
        )
        assert conn is not stream  # RPC connection, not the stream


async def test_prefetch_fetches_each_transaction_once_before_the_callbacks_ask(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp(fetch_data=True)
    peer.answer_data = False  # the test answers, once every request is in
    async with serving(cluster, peer, app, prefetch_data=True) as client:
        await mount(peer, 0, feed=[(t, 0) for t in range(10)])
        # all ten requests are out before any answer: pipelined, not one per callback
        requests = [await peer.expect(TransactionDataRequest) for _ in range(10)]
        assert sorted(r.transaction_id for _, r in requests) == list(range(10))
        assert app.applied == []
        for conn, r in requests:
            data = b"data-%d" % r.transaction_id
            await conn.send(
                TransactionDataResponse(r.req_id, r.transaction_id, True, data, checksum(data))
            )
        await wait_for(lambda: app.hwm.get(0) == 9)
        assert [app.data[(0, t)] for t in range(10)] == [b"data-%d" % t for t in range(10)]
        await peer.nothing_more(TransactionDataRequest, 0.2)  # the callbacks hit the cache
        assert client.cache.hits >= 10


async def test_prefetch_does_not_fetch_back_the_data_of_the_clients_own_transactions(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    """The client sent its transactions' data: with prefetch_data the feed's run is
    prefetched, but only what others wrote is asked for (issue 30: its own was fetched
    back from the server before the feed's decision put it in the cache)."""
    app = RecordingApp(fetch_data=True)
    async with serving(cluster, peer, app, prefetch_data=True) as client:
        conn, _ = await mount(peer, 0)
        mine = [Ctx(data=b"mine-%d" % n) for n in range(3)]
        submitted = [asyncio.ensure_future(client.submit(ctx)) for ctx in mine]
        appends = [(await peer.expect(AppendRequest))[1] for _ in mine]
        for t, append in enumerate(appends):
            peer.data[(0, t)] = append.data  # (answered, should the client ask)
        peer.data[(0, 3)] = b"theirs"
        # one run of the feed: the client's three transactions, then another client's
        await conn.send(*(FeedData(a.req_id, t, 0) for t, a in enumerate(appends)))
        await conn.send(FeedData(OTHER, 3, 0))
        for t, future in enumerate(submitted):
            committed(await asyncio.wait_for(future, 10), t)
        await wait_for(lambda: app.hwm.get(0) == 3)
        assert [app.data[(0, t)] for t in range(4)] == [b"mine-0", b"mine-1", b"mine-2", b"theirs"]
        await peer.nothing_more(TransactionDataRequest, 0.2)
        assert [r.transaction_id for r in peer.data_requests] == [3]


async def test_a_lost_coordination_session_is_renewed_and_moves_are_still_followed(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    from waltz_coord_local.coordination import LocalCoordination

    new_server = await ProtocolTestPeer().start()
    try:
        app = RecordingApp()
        options = {"session_timeout": 1.5}
        async with serving(cluster, peer, app, coordination_options=options) as client:
            await mount(peer, 0)
            old = client._coordination
            assert isinstance(old, LocalCoordination)
            assert isinstance(cluster.coordination, LocalCoordination)
            await cluster.coordination.expire_session_of(old.session_id)
            await wait_for(lambda: client._coordination is not old, timeout=20)
            generation = await cluster.assign(0, new_server, server_id=2)
            _, request = await new_server.expect(MountRequest, timeout=20)
            assert request.req_id.generation == generation
    finally:
        await new_server.close()


async def test_a_submission_waiting_for_its_partition_or_a_retry_expires_at_its_deadline(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp()
    async with running(cluster, app, partitions=[0], transaction_timeout=0.5) as client:
        # partition 0 is served by nobody yet: the submission waits, then expires
        ctx = Ctx()
        started = asyncio.get_running_loop().time()
        with pytest.raises(TransactionExpiredError, match=r"not committed within 0\.5 s") as info:
            await client.submit(ctx)
        assert asyncio.get_running_loop().time() - started < 5
        assert "partition 0 had no server assigned" in str(info.value)
        assert ctx.events == [("expiration", None)] and ctx.attempts == 0
        await cluster.assign(0, peer)
        conn, _ = await mount(peer, 0)
        # a lock failure on a transaction the feed never reaches: expires while waiting
        ctx = Ctx()
        submitted = asyncio.ensure_future(client.submit(ctx))
        _, append = await peer.expect(AppendRequest)
        await conn.send(LockFailure(append.req_id, 50))
        with pytest.raises(TransactionExpiredError, match="had not reached transaction 50"):
            await asyncio.wait_for(submitted, 10)
        assert ctx.events == [("lock_failure", 50), ("expiration", None)]
        await peer.nothing_more(AppendRequest, 0.2)
    with pytest.raises(ClientError, match="transaction_timeout"):
        cluster.config(transaction_timeout=0)


async def test_at_the_deadline_a_flush_decides_an_append_in_flight_not_committed(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app, transaction_timeout=0.5) as client:
        conn, _ = await mount(peer, 0)
        contexts = [Ctx(header=1), Ctx(header=2)]
        submitted = []
        for ctx in contexts:
            submitted.append(asyncio.ensure_future(client.submit(ctx)))
            await peer.expect(AppendRequest)
        # both deadlines pass with the appends in flight: one flush asks for both
        _, flush = await peer.expect(FlushRequest)
        await peer.nothing_more(FlushRequest, 0.3)
        assert not any(s.done() for s in submitted)
        # the server settled its appends: neither is in the log up to its high-water mark
        await conn.send(FeedData(OTHER, 0, 0))
        await wait_for(lambda: app.hwm.get(0) == 0)
        assert not any(s.done() for s in submitted)  # the feed alone proves nothing
        await conn.send(FlushResponse(flush.req_id, 0))
        for s, ctx in zip(submitted, contexts, strict=True):
            with pytest.raises(TransactionExpiredError) as info:
                await asyncio.wait_for(s, 10)
            message = str(info.value)
            assert "not committed within 0.5 s (1 attempts)" in message
            assert "it was not in the log up to transaction 0" in message
            assert "It will not be committed" in message
            assert ctx.events == [("expiration", None)] and ctx.attempts == 1
        await peer.nothing_more(AppendRequest, 0.3)  # never re-executed past its deadline


async def test_at_the_deadline_an_append_in_flight_can_still_be_decided_committed(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app, transaction_timeout=0.3) as client:
        conn, _ = await mount(peer, 0)
        ctx = Ctx()
        submitted = asyncio.ensure_future(client.submit(ctx))
        _, append = await peer.expect(AppendRequest)
        _, flush = await peer.expect(FlushRequest)
        await conn.send(FeedData(append.req_id, 0, 7), FlushResponse(flush.req_id, 0))
        committed(await asyncio.wait_for(submitted, 10), 0)
        assert ctx.events == [("application", 0), ("completion", True)]
        assert app.applied == [(0, 0, 7)]


async def test_a_retried_append_is_decided_at_its_own_earlier_deadline(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    """The deadlines of appends in flight are kept by one timer per partition: an append
    sent again after a lock failure keeps its submission's (earlier) deadline."""
    app = RecordingApp()
    async with serving(cluster, peer, app, transaction_timeout=1.0) as client:
        conn, _ = await mount(peer, 0)
        loop = asyncio.get_running_loop()
        started = loop.time()
        first = asyncio.ensure_future(client.submit(Ctx(header=1)))
        _, a1 = await peer.expect(AppendRequest)
        await conn.send(LockFailure(a1.req_id, 0))  # retried once the feed reaches 0
        await asyncio.sleep(0.7)
        later = asyncio.ensure_future(client.submit(Ctx(header=2)))  # deadline ~1.7 s
        _, b1 = await peer.expect(AppendRequest)
        await conn.send(FeedData(OTHER, 0, 0))
        _, a2 = await peer.expect(AppendRequest)
        assert a2.header == 1
        _, flush = await peer.expect(FlushRequest)  # at the first submission's deadline
        assert loop.time() - started < 1.6  # not the later one's
        await conn.send(FeedData(b1.req_id, 1, 2), FlushResponse(flush.req_id, 1))
        with pytest.raises(TransactionExpiredError, match="not in the log up to transaction 1"):
            await asyncio.wait_for(first, 10)
        committed(await asyncio.wait_for(later, 10), 1)


async def test_a_later_commit_after_the_deadline_reports_why_the_earlier_append_failed(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    """The append was superseded: the error says so, not that the partition was not
    writable (it was)."""
    app = RecordingApp()
    async with serving(cluster, peer, app, transaction_timeout=0.3) as client:
        conn, _ = await mount(peer, 0)
        lost = asyncio.ensure_future(client.submit(Ctx(header=1)))
        await peer.expect(AppendRequest)
        await peer.expect(FlushRequest)  # never answered: the later commit decides it
        later = asyncio.ensure_future(client.submit(Ctx(header=2)))
        _, a2 = await peer.expect(AppendRequest)
        await conn.send(FeedData(a2.req_id, 0, 2))
        committed(await asyncio.wait_for(later, 10), 0)
        with pytest.raises(TransactionExpiredError, match=r"\(transaction 0\) committed first"):
            await asyncio.wait_for(lost, 10)


async def test_an_append_in_flight_whose_server_cannot_be_asked_has_an_unknown_outcome(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app, transaction_timeout=0.3, request_timeout=0.6) as client:
        conn, _ = await mount(peer, 0)
        ctx = Ctx()
        started = asyncio.get_running_loop().time()
        submitted = asyncio.ensure_future(client.submit(ctx))
        _, append = await peer.expect(AppendRequest)
        await peer.expect(FlushRequest)  # the server does not answer (it cannot decide)
        with pytest.raises(TransactionOutcomeUnknownError) as info:
            await asyncio.wait_for(submitted, 10)
        elapsed = asyncio.get_running_loop().time() - started
        assert 0.8 <= elapsed < 5  # the deadline, then request_timeout to ask
        assert info.value.req_id == append.req_id
        message = str(info.value)
        assert "could not be asked to decide it within 0.6 s" in message
        assert "It may be committed" in message
        assert ctx.events[0][0] == "exception" and ctx.attempts == 1
        await peer.nothing_more(AppendRequest, 0.3)
        # it did commit after all: the feed delivers it like any transaction, once
        await conn.send(FeedData(append.req_id, 0, 7))
        await wait_for(lambda: app.hwm.get(0) == 0)
        assert app.applied == [(0, 0, 7)] and app.errors == []


async def test_not_committed_is_decided_at_once_and_the_context_re_executed(
    cluster: Cluster, any_peer: ProtocolTestPeer
) -> None:
    peer = any_peer
    app = RecordingApp()
    async with serving(cluster, peer, app) as client:
        conn, _ = await mount(peer, 0, feed=[(0, 0)])
        ctx = Ctx()
        submitted = asyncio.ensure_future(client.submit(ctx))
        _, append = await peer.expect(AppendRequest)
        await conn.send(
            ErrorResponse(append.req_id, ErrorCode.NOT_COMMITTED, "store session 3 ended")
        )
        _, again = await peer.expect(AppendRequest)  # no remount needed: the server decided
        assert again.req_id != append.req_id and again.client_high_water_mark == 0
        await peer.nothing_more(MountRequest, 0.1)
        await conn.send(FeedData(again.req_id, 1, 7))
        committed(await asyncio.wait_for(submitted, 10), 1)
        assert ctx.attempts == 2


async def test_not_committed_past_the_deadline_says_so(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app, transaction_timeout=0.3) as client:
        conn, _ = await mount(peer, 0)
        submitted = asyncio.ensure_future(client.submit(Ctx()))
        _, append = await peer.expect(AppendRequest)
        await peer.expect(FlushRequest)
        await conn.send(ErrorResponse(append.req_id, ErrorCode.NOT_COMMITTED, "session ended"))
        with pytest.raises(TransactionExpiredError, match="NOT_COMMITTED: session ended"):
            await asyncio.wait_for(submitted, 10)


async def test_flush_returns_only_when_every_submission_it_covers_is_decided(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app) as client:
        conn, _ = await mount(peer, 0)
        ctx = Ctx()
        submitted = asyncio.ensure_future(client.submit(ctx))
        await peer.expect(AppendRequest)
        flushed = asyncio.ensure_future(client.flush(0))
        _, flush = await peer.expect(FlushRequest)
        # the server settled: the append is not in the log up to its mark
        await conn.send(FeedData(OTHER, 0, 0), FlushResponse(flush.req_id, 0))
        _, again = await peer.expect(AppendRequest)  # decided not committed: re-executed
        assert again.client_high_water_mark == 0
        await asyncio.sleep(0.2)
        assert not flushed.done()  # the submission it covers is not decided yet
        await conn.send(FeedData(again.req_id, 1, 7))
        assert await asyncio.wait_for(flushed, 10) == 1  # includes the covered commit
        committed(await asyncio.wait_for(submitted, 10), 1)
        assert ctx.attempts == 2


class SlowApp(RecordingApp):
    """An application whose apply_transaction takes ``delay`` seconds (on the loop)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    async def apply_transaction(self, transaction: Transaction) -> None:  # type: ignore[override]
        await asyncio.sleep(self.delay)
        super().apply_transaction(transaction)


async def test_flush_waits_for_a_mount_whose_catch_up_outlasts_its_timeout(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    """A new client mounts a partition with a long log and flushes: the server answers
    the mount at once, after the catch-up feed; the client applies the feed before the
    answer, for longer than the flush's timeout. The feed advancing is an answer: the
    flush waits (it gave up with "the mount was not answered" while the client was
    busy applying; a CI run under load failed so, a 806-transaction catch-up taking
    55 s)."""
    app = SlowApp(delay=0.05)
    feed = [(tid, tid) for tid in range(50)]  # 2.5 s of applying, flushed with 1 s
    async with serving(cluster, peer, app) as client:
        conn, _ = await mount(peer, 0, feed=feed)  # the feed, then READY
        flushed = asyncio.ensure_future(client.flush(0, timeout=1.0))
        expecting = asyncio.ensure_future(peer.expect(FlushRequest, timeout=30))
        await asyncio.wait({flushed, expecting}, return_when=asyncio.FIRST_COMPLETED)
        if flushed.done():
            expecting.cancel()
            flushed.result()  # it gave up before the mount completed: its error
        _, flush = await expecting
        assert app.hwm.get(0) == 49  # sent once the mount completed: after the catch-up
        await conn.send(FlushResponse(flush.req_id, 49))
        assert await asyncio.wait_for(flushed, 10) == 49
    # a server that does not answer still fails the flush after its timeout
    app = SlowApp(delay=0.0)
    async with serving(cluster, peer, app) as client:
        await peer.expect(MountRequest)  # never answered
        with pytest.raises(ServerError, match="was not answered yet"):
            await client.flush(0, timeout=0.5)


async def test_flush_gives_up_on_an_undecided_submission_after_its_timeout(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app, transaction_timeout=None) as client:
        conn, _ = await mount(peer, 0)
        submitted = asyncio.ensure_future(client.submit(Ctx()))
        _, append = await peer.expect(AppendRequest)
        await conn.send(LockFailure(append.req_id, 40))  # it waits for the feed to reach 40
        flushed = asyncio.ensure_future(client.flush(0, timeout=0.5))
        _, flush = await peer.expect(FlushRequest)
        await conn.send(FlushResponse(flush.req_id, -1))
        with pytest.raises(ClientError, match="1 of the 1 submissions it covers were still"):
            await asyncio.wait_for(flushed, 10)
        submitted.cancel()


async def test_an_abandoned_submission_releases_its_slot(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app, max_concurrent_transactions=1) as client:
        conn, _ = await mount(peer, 0)
        abandoned = await client.enqueue(Ctx(header=1))
        _, a1 = await peer.expect(AppendRequest)
        waiting = asyncio.ensure_future(client.enqueue(Ctx(header=2)))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        abandoned.cancel()  # the application gives up on it
        task = await asyncio.wait_for(waiting, 10)  # the slot is free
        _, a2 = await peer.expect(AppendRequest)
        # the abandoned append committed anyway: applied as any transaction
        await conn.send(FeedData(a1.req_id, 0, 1), FeedData(a2.req_id, 1, 2))
        committed(await asyncio.wait_for(task, 10), 1)
        assert [t for _, t, _ in app.applied] == [0, 1]
        assert abandoned.cancelled()


async def test_a_data_fetch_refused_as_busy_during_a_recovery_is_retried(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp(fetch_data=True)
    peer.answer_data = False  # the test answers
    async with serving(cluster, peer, app):
        await mount(peer, 0, feed=[(0, 0)])
        conn, request = await peer.expect(TransactionDataRequest)
        await conn.send(
            ErrorResponse(request.req_id, ErrorCode.SERVER_BUSY, "partition 0 is recovering")
        )
        conn, again = await peer.expect(TransactionDataRequest)
        assert again.transaction_id == 0 and again.req_id != request.req_id
        await conn.send(TransactionDataResponse(again.req_id, 0, True, b"d", checksum(b"d")))
        await wait_for(lambda: app.hwm.get(0) == 0)
        assert app.data[(0, 0)] == b"d" and app.errors == []


async def test_an_unanswered_mount_is_sent_again(cluster: Cluster, peer: ProtocolTestPeer) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app, request_timeout=0.5):
        _, first = await peer.expect(MountRequest)  # never answered
        conn, second = await mount(peer, 0)
        assert second.req_id != first.req_id
        # a late answer to the first mount changes nothing
        await conn.send(MountResponse(first.req_id, MountStatus.CLIENT_AHEAD, -1))
        await conn.send(FeedData(OTHER, 0, 3))
        await wait_for(lambda: app.hwm.get(0) == 0)
        assert app.errors == []


async def test_a_mount_streaming_a_long_catch_up_is_not_timed_out(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app, request_timeout=0.5):
        conn, request = await peer.expect(MountRequest)
        for t in range(6):  # 1.2 s of catch-up, longer than the timeout, progressing
            await conn.send(FeedData(other(0, t + 1), t, 0))
            await asyncio.sleep(0.2)
        await conn.send(MountResponse(request.req_id, MountStatus.READY, 5))
        await wait_for(lambda: app.hwm.get(0) == 5)
        await peer.nothing_more(MountRequest, 0.6)


async def test_a_feed_ended_by_a_move_makes_the_client_mount_again(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app):
        conn, first = await mount(peer, 0, feed=[(0, 0)])
        # what a server sends when the partition leaves it (no request of ours)
        await conn.send(
            ErrorResponse(ReqId(-1, 1, 0, -1), ErrorCode.STALE_GENERATION, "moved away")
        )
        _, again = await peer.expect(MountRequest)
        assert again.req_id != first.req_id and again.client_high_water_mark == 0


# -- poison transactions ----------------------------------------------------------------------


class PoisonedApp(RecordingApp):
    """An application that cannot apply some transactions; its dead_letter records them
    and advances its high-water mark past them (as apply_transaction would)."""

    def __init__(self, poison: set[int], *, dead_letter_fails: bool = False) -> None:
        super().__init__()
        self.poison = poison
        self.dead: list[tuple[int, BaseException]] = []
        self.dead_letter_fails = dead_letter_fails

    def apply_transaction(self, transaction: Transaction) -> None:
        if transaction.transaction_id in self.poison:
            raise ValueError(f"cannot apply {transaction.transaction_id}")
        super().apply_transaction(transaction)

    def dead_letter(self, transaction: Transaction, exception: BaseException) -> None:
        if self.dead_letter_fails:
            raise OSError("the dead-letter table is full")
        with self.lock:
            self.dead.append((transaction.transaction_id, exception))
            self.hwm[transaction.partition_id] = transaction.transaction_id


class AsyncPoisonedApp(PoisonedApp):
    """The same with async callbacks (each feed item applied on its own, on the loop)."""

    async def client_high_water_mark(self, partition_id: int) -> int:  # type: ignore[override]
        return self.hwm.get(partition_id, -1)

    async def apply_transaction(self, transaction: Transaction) -> None:  # type: ignore[override]
        PoisonedApp.apply_transaction(self, transaction)


@pytest.mark.parametrize("app_type", [PoisonedApp, AsyncPoisonedApp])
async def test_a_poison_transaction_is_retried_then_stops_its_partition(
    cluster: Cluster, peer: ProtocolTestPeer, app_type: type[PoisonedApp]
) -> None:
    app = app_type({1})
    async with serving(cluster, peer, app, apply_retries=2) as client:
        feed = [(0, 0), (1, 1), (2, 2)]
        await mount(peer, 0, feed=feed)
        for _ in range(2):  # offered again, twice, from the application's mark
            _, request = await mount(peer, 0, feed=feed[1:])
            assert request.client_high_water_mark == 0
        await wait_for(lambda: client.partitions[0].failure is not None)
        await peer.nothing_more(MountRequest, 0.5)  # stopped: no more mounts
        error = client.partitions[0].failure
        assert isinstance(error, PoisonTransactionError)
        assert (error.partition_id, error.transaction_id) == (0, 1)
        message = str(error)
        assert "partition 0 stopped at transaction 1" in message
        assert "failed on it 3 times" in message and "cannot apply 1" in message
        assert "restart the client" in message and "poison_policy='skip'" in message
        # each failure was reported, then the stop, once
        assert [(p, t) for p, t, _ in app.errors] == [(0, 1)] * 4
        assert [type(e) for _, _, e in app.errors] == [ValueError] * 3 + [PoisonTransactionError]
        assert app.applied == [(0, 0, 0)] and app.dead == []
        with pytest.raises(PoisonTransactionError):
            await client.submit(Ctx())
        with pytest.raises(PoisonTransactionError):
            await client.flush(0)


@pytest.mark.parametrize("app_type", [PoisonedApp, AsyncPoisonedApp])
async def test_a_poison_transaction_is_skipped_to_the_dead_letter_hook_when_asked(
    cluster: Cluster, peer: ProtocolTestPeer, app_type: type[PoisonedApp]
) -> None:
    app = app_type({1})
    async with serving(cluster, peer, app, apply_retries=1, poison_policy="skip") as client:
        feed = [(0, 0), (1, 1), (2, 2), (3, 3)]
        await mount(peer, 0, feed=feed)
        conn, request = await mount(peer, 0, feed=feed[1:])  # one retry
        assert request.client_high_water_mark == 0
        # then skipped: handed to dead_letter, and the feed goes on without a remount
        await wait_for(lambda: app.hwm.get(0) == 3)
        await peer.nothing_more(MountRequest, 0.3)
        assert [t for t, _ in app.dead] == [1]
        assert isinstance(app.dead[0][1], ValueError)
        assert [t for _, t, _ in app.applied] == [0, 2, 3]
        assert [(t, type(e)) for _, t, e in app.errors] == [(1, ValueError)] * 2
        # the partition keeps working
        submitted = asyncio.ensure_future(client.submit(Ctx()))
        _, append = await peer.expect(AppendRequest)
        assert append.client_high_water_mark == 3
        await conn.send(FeedData(append.req_id, 4, 7))
        committed(await asyncio.wait_for(submitted, 10), 4)


async def test_a_dead_letter_hook_that_raises_stops_the_partition(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = PoisonedApp({0}, dead_letter_fails=True)
    async with serving(cluster, peer, app, apply_retries=0, poison_policy="skip") as client:
        await mount(peer, 0, feed=[(0, 0), (1, 1)])
        await wait_for(lambda: client.partitions[0].failure is not None)
        message = str(client.partitions[0].failure)
        assert "dead_letter raised OSError('the dead-letter table is full')" in message
        assert app.applied == []


async def test_skipping_needs_a_dead_letter_hook(cluster: Cluster) -> None:
    with pytest.raises(
        ClientError, match=r"poison_policy='skip'\) needs RecordingApp\.dead_letter"
    ):
        AsyncWaltzClient(RecordingApp(), cluster.config(poison_policy="skip"))
    with pytest.raises(ClientError, match="poison_policy must be one of stop, skip"):
        cluster.config(poison_policy="ignore")
    with pytest.raises(ClientError, match="apply_retries must be an int >= 0"):
        cluster.config(apply_retries=-1)
