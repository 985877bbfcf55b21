"""Batches: ``submit_many`` and ``submit_nowait`` against the scripted PROTOCOL TEST PEER.

Each transaction of a batch is answered on its own, exactly once, by the same rules as
``submit`` (lock failures, expiry, a server lost with appends in flight), while the
batch costs one build hop to the callback thread and one send per partition.
"""

from __future__ import annotations

import asyncio

import pytest
from client_protocol_peer import ProtocolTestPeer
from client_support import Cluster, Ctx, RecordingApp, committed, mount
from test_protocol import OTHER, running, serving, wait_for

from waltz_api.errors import ClientError
from waltz_api.messages import (
    AppendRequest,
    FeedData,
    FlushRequest,
    FlushResponse,
    LockFailure,
    Message,
    MountRequest,
    MountResponse,
    MountStatus,
)
from waltz_client import SubmissionResult, TransactionBuilder, TransactionExpiredError
from waltz_client.channel import Channel
from waltz_client.runner import CallbackRunner

pytestmark = pytest.mark.timeout(60)


class Counts:
    """How many build hops and stream sends the client made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.hops = 0
        self.sends: list[int] = []
        """Messages per stream send (a mount, a flush: 1)."""
        hop = CallbackRunner._send_builds
        send_many = Channel.send_stream_many
        send = Channel.send_stream

        def counted_hop(runner: CallbackRunner) -> None:
            self.hops += 1
            hop(runner)

        async def counted_many(channel: Channel, messages: list[Message]) -> None:
            self.sends.append(len(messages))
            await send_many(channel, messages)

        async def counted_send(channel: Channel, message: Message) -> None:
            self.sends.append(1)
            await send(channel, message)

        monkeypatch.setattr(CallbackRunner, "_send_builds", counted_hop)
        monkeypatch.setattr(Channel, "send_stream_many", counted_many)
        monkeypatch.setattr(Channel, "send_stream", counted_send)

    def reset(self) -> None:
        self.hops = 0
        self.sends.clear()


def declines(builder: TransactionBuilder) -> bool:
    return False


def raises(builder: TransactionBuilder) -> bool:
    raise ValueError("the application's execute failed")


async def test_a_batch_is_one_hop_and_one_send_and_each_transaction_is_answered_alone(
    cluster: Cluster, peer: ProtocolTestPeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = Counts(monkeypatch)
    app = RecordingApp()
    async with serving(cluster, peer, app) as client:
        conn, _ = await mount(peer, 0)
        contexts = [
            Ctx(header=1),
            Ctx(header=2),
            Ctx(header=3, build=declines),
            Ctx(header=4),
            Ctx(header=5, build=raises),
        ]
        counts.reset()
        batch = asyncio.ensure_future(client.submit_many(contexts))
        appends = [(await peer.expect(AppendRequest))[1] for _ in range(3)]
        # in the order given, in one build hop and one send of three appends
        assert [a.header for a in appends] == [1, 2, 4]
        assert [a.req_id.seq_num for a in appends] == sorted(a.req_id.seq_num for a in appends)
        assert counts.hops == 1 and counts.sends == [3]
        # the first commits, the second fails its lock on transaction 2 (another
        # client's, not in this client's feed yet), the fourth commits
        await conn.send(
            FeedData(appends[0].req_id, 0, 1),
            LockFailure(appends[1].req_id, 2),
            FeedData(appends[2].req_id, 1, 4),
        )
        await peer.nothing_more(AppendRequest, 0.3)  # executed again only on that state
        await conn.send(FeedData(OTHER, 2, 0))
        _, again = await peer.expect(AppendRequest)
        assert again.header == 2 and again.client_high_water_mark == 2
        assert counts.hops == 2 and counts.sends == [3, 1]  # the retry: its own round
        await peer.nothing_more(AppendRequest, 0.2)
        assert not batch.done()
        await conn.send(FeedData(again.req_id, 3, 2))
        results = await asyncio.wait_for(batch, 10)
        committed(results[0], 0)
        committed(results[1], 3)
        assert results[2] == SubmissionResult(False, 0, -1, 1)
        committed(results[3], 1)
        assert isinstance(results[4], ValueError)
        assert contexts[0].events == [("application", 0), ("completion", True)]
        assert contexts[1].events == [("lock_failure", 2), ("application", 3), ("completion", True)]
        assert contexts[1].hwms == [-1, 2] and contexts[1].attempts == 2
        assert contexts[2].events == [("completion", False)]
        assert [e for e, _ in contexts[4].events] == ["exception"]
        assert app.applied == [(0, 0, 1), (0, 1, 4), (0, 2, 0), (0, 3, 2)]
        await peer.nothing_more(AppendRequest, 0.2)


async def test_a_batch_over_two_partitions_sends_once_to_each(
    cluster: Cluster, peer: ProtocolTestPeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = Counts(monkeypatch)
    app = RecordingApp()
    await cluster.assign(0, peer)
    await cluster.assign(1, peer)
    async with running(cluster, app, transport=peer.transport_name) as client:
        conns = {}
        for _ in range(2):
            conn, request = await peer.expect(MountRequest)
            conns[request.req_id.partition_id] = conn
            await conn.send(MountResponse(request.req_id, MountStatus.READY, -1))
        await wait_for(lambda: all(p.mount.appends_allowed for p in client.partitions.values()))
        counts.reset()
        contexts = [Ctx(partition=p, header=10 * p + i) for i in range(3) for p in (0, 1)]
        batch = asyncio.ensure_future(client.submit_many(contexts))
        got: dict[int, list[AppendRequest]] = {0: [], 1: []}
        for _ in range(6):
            _, append = await peer.expect(AppendRequest)
            got[append.req_id.partition_id].append(append)
        assert counts.hops == 1 and sorted(counts.sends) == [3, 3]
        assert [a.header for a in got[0]] == [0, 1, 2] and [a.header for a in got[1]] == [
            10,
            11,
            12,
        ]
        for p, appends in got.items():
            await conns[p].send(*(FeedData(a.req_id, i, a.header) for i, a in enumerate(appends)))
        results = await asyncio.wait_for(batch, 10)
        for ctx, result in zip(contexts, results, strict=True):
            committed(result, ctx.header % 10)
            assert isinstance(result, SubmissionResult) and result.partition_id == ctx.partition


async def test_a_batch_expires_as_a_whole_only_where_nothing_of_it_is_in_flight(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp()
    async with running(cluster, app, partitions=[0], transaction_timeout=0.5) as client:
        # nobody serves partition 0: the batch waits, then each expires (nothing was sent)
        contexts = [Ctx(), Ctx()]
        results = await asyncio.wait_for(client.submit_many(contexts), 10)
        for ctx, result in zip(contexts, results, strict=True):
            assert isinstance(result, TransactionExpiredError), result
            assert "partition 0 had no server assigned" in str(result)
            assert ctx.events == [("expiration", None)] and ctx.attempts == 0
        await cluster.assign(0, peer)
        conn, _ = await mount(peer, 0)
        # in flight at the deadline: a flush decides them; one committed, one not
        contexts = [Ctx(header=1), Ctx(header=2), Ctx(header=3)]
        batch = asyncio.ensure_future(client.submit_many(contexts))
        appends = [(await peer.expect(AppendRequest))[1] for _ in range(3)]
        await conn.send(LockFailure(appends[2].req_id, 40))  # waits for 40: never comes
        _, flush = await peer.expect(FlushRequest)
        assert not batch.done()
        await conn.send(FeedData(appends[0].req_id, 0, 1), FlushResponse(flush.req_id, 0))
        results = await asyncio.wait_for(batch, 10)
        committed(results[0], 0)
        assert isinstance(results[1], TransactionExpiredError)
        assert "it was not in the log up to transaction 0" in str(results[1])
        assert isinstance(results[2], TransactionExpiredError)
        assert "transaction 40 changed a locked entity" in str(results[2])
        assert contexts[1].events == [("expiration", None)]
        assert contexts[2].events == [("lock_failure", 40), ("expiration", None)]
        await peer.nothing_more(AppendRequest, 0.3)  # nothing re-executed past its deadline


async def test_a_server_lost_in_the_middle_of_a_batch_commits_nothing_twice(
    cluster: Cluster, any_peer: ProtocolTestPeer
) -> None:
    peer = any_peer
    app = RecordingApp()
    async with serving(cluster, peer, app) as client:
        conn, _ = await mount(peer, 0)
        contexts = [Ctx(header=1), Ctx(header=2), Ctx(header=3)]
        batch = asyncio.ensure_future(client.submit_many(contexts))
        appends = [(await peer.expect(AppendRequest))[1] for _ in range(3)]
        await conn.send(FeedData(appends[0].req_id, 0, 1))
        await wait_for(lambda: app.hwm.get(0) == 0)
        await peer.drop_connections()  # the server "crashed" with two appends pending
        conn, request = await peer.expect(MountRequest)
        # the second did commit (the new owner's recovery kept it); the third did not
        await conn.send(
            FeedData(appends[1].req_id, 1, 2), MountResponse(request.req_id, MountStatus.READY, 1)
        )
        _, retried = await peer.expect(AppendRequest)
        assert retried.header == 3 and retried.req_id != appends[2].req_id
        assert retried.client_high_water_mark == 1
        await conn.send(FeedData(retried.req_id, 2, 3))
        results = await asyncio.wait_for(batch, 10)
        for i, result in enumerate(results):
            committed(result, i)
        assert [ctx.attempts for ctx in contexts] == [1, 1, 2]
        for ctx, tid in zip(contexts, range(3), strict=True):
            assert ctx.events == [("application", tid), ("completion", True)]
        assert app.applied == [(0, 0, 1), (0, 1, 2), (0, 2, 3)]
        await peer.nothing_more(AppendRequest, 0.3)


async def test_a_batch_larger_than_the_free_slots_runs_in_turns(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app, max_concurrent_transactions=2) as client:
        conn, _ = await mount(peer, 0)
        contexts = [Ctx(header=i) for i in range(5)]
        batch = asyncio.ensure_future(client.submit_many(contexts))
        tid = 0
        while tid < 5:
            first = (await peer.expect(AppendRequest))[1]
            pending = [first]
            if tid < 4:
                pending.append((await peer.expect(AppendRequest))[1])
            await peer.nothing_more(AppendRequest, 0.2)  # never more than 2 in flight
            assert client.partitions[0].limit.in_use == len(pending)
            for append in pending:
                await conn.send(FeedData(append.req_id, tid, append.header))
                tid += 1
        results = await asyncio.wait_for(batch, 10)
        for i, result in enumerate(results):
            committed(result, i)
        assert client.partitions[0].limit.in_use == 0


async def test_submit_nowait_answers_each_future_from_one_task_per_loop_turn(
    cluster: Cluster, peer: ProtocolTestPeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = Counts(monkeypatch)
    app = RecordingApp()
    async with serving(cluster, peer, app) as client:
        conn, _ = await mount(peer, 0)
        counts.reset()
        tasks_before = len(asyncio.all_tasks())
        contexts = [Ctx(header=i) for i in range(4)]
        futures = [client.submit_nowait(ctx) for ctx in contexts]
        futures[2].cancel()  # given up before it ran: never sent
        await asyncio.sleep(0)  # (the loop turn ends: the batch starts)
        assert len(asyncio.all_tasks()) <= tasks_before + 1
        appends = [(await peer.expect(AppendRequest))[1] for _ in range(3)]
        assert [a.header for a in appends] == [0, 1, 3]
        assert counts.hops == 1 and counts.sends == [3]
        await conn.send(FeedData(appends[1].req_id, 0, 1))
        committed(await asyncio.wait_for(futures[1], 10), 0)
        assert not futures[0].done()  # answered on its own, when decided
        await conn.send(FeedData(appends[0].req_id, 1, 0), FeedData(appends[2].req_id, 2, 3))
        # the first was not committed before the second: retried, then committed
        committed(await asyncio.wait_for(futures[3], 10), 2)
        _, again = await peer.expect(AppendRequest)
        assert again.header == 0
        await conn.send(FeedData(again.req_id, 3, 0))
        committed(await asyncio.wait_for(futures[0], 10), 3)
        assert futures[2].cancelled() and contexts[2].attempts == 0
        assert client.partitions[0].limit.in_use == 0
        with pytest.raises(ClientError, match="takes a TransactionContext"):
            client.submit_nowait(object())  # type: ignore[arg-type]
        # a flush covers what submit_nowait started: it returns once that one is decided
        future = client.submit_nowait(Ctx(header=9))
        _, append = await peer.expect(AppendRequest)
        flushing = asyncio.ensure_future(client.flush(0))
        _, flush = await peer.expect(FlushRequest)
        await conn.send(FlushResponse(flush.req_id, 3))  # not committed: executed again
        _, again = await peer.expect(AppendRequest)
        assert again.header == 9 and again.req_id != append.req_id
        assert not flushing.done()
        await conn.send(FeedData(again.req_id, 4, 9))
        assert await asyncio.wait_for(flushing, 10) == 4
        committed(future.result(), 4)


async def test_a_cancelled_batch_gives_its_slots_back(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app, max_concurrent_transactions=2) as client:
        conn, _ = await mount(peer, 0)
        partition = client.partitions[0]
        batch = asyncio.ensure_future(client.submit_many([Ctx(header=h) for h in range(3)]))
        appends = [(await peer.expect(AppendRequest))[1] for _ in range(2)]
        assert partition.limit.in_use == 2 and len(partition.submissions) == 2
        batch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await batch
        assert partition.limit.in_use == 0 and len(partition.submissions) == 0
        # what was sent may still commit: the feed delivers it like any transaction
        await conn.send(FeedData(appends[0].req_id, 0, 0))
        await wait_for(lambda: app.hwm.get(0) == 0)
        later = asyncio.ensure_future(client.submit(Ctx(header=5)))
        _, append = await peer.expect(AppendRequest)  # a slot was free for it
        await conn.send(FeedData(append.req_id, 1, 5))
        committed(await asyncio.wait_for(later, 10), 1)


class AsyncHwmApp(RecordingApp):
    async def client_high_water_mark(self, partition_id: int) -> int:  # type: ignore[override]
        return self.hwm.get(partition_id, -1)


class AsyncCtx(Ctx):
    async def execute(self, builder: TransactionBuilder) -> bool:  # type: ignore[override]
        return super().execute(builder)


@pytest.mark.parametrize(
    ("app_class", "ctx_class", "hops"),
    [(AsyncHwmApp, Ctx, 1), (AsyncHwmApp, AsyncCtx, 0), (RecordingApp, AsyncCtx, 0)],
)
async def test_a_batch_builds_on_the_high_water_mark_whichever_callbacks_are_async(
    cluster: Cluster,
    peer: ProtocolTestPeer,
    monkeypatch: pytest.MonkeyPatch,
    *,
    app_class: type[RecordingApp],
    ctx_class: type[Ctx],
    hops: int,
) -> None:
    counts = Counts(monkeypatch)
    app = app_class(hwm={0: 4})
    async with serving(cluster, peer, app) as client:
        conn, _ = await mount(peer, 0, hwm=4)
        contexts = [ctx_class(header=h) for h in range(3)]
        counts.reset()
        batch = asyncio.ensure_future(client.submit_many(contexts))
        appends = [(await peer.expect(AppendRequest))[1] for _ in range(3)]
        # plain execute methods: one build hop to the callback thread for all (an async
        # high-water mark read on the loop first); async ones run on the loop (a plain
        # high-water mark is then read on the thread, outside the build hops counted)
        assert counts.hops == hops and counts.sends == [3]
        assert [(a.header, a.client_high_water_mark) for a in appends] == [(0, 4), (1, 4), (2, 4)]
        await conn.send(*(FeedData(a.req_id, 5 + i, a.header) for i, a in enumerate(appends)))
        for i, result in enumerate(await asyncio.wait_for(batch, 10)):
            committed(result, 5 + i)
