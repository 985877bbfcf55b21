"""The synchronous facade from plain threads, over real ZeroMQ sockets.

The far end is the scripted PROTOCOL TEST PEER (not a server), running on its
own event loop in a background thread, as a remote server would.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from client_protocol_peer import ProtocolTestPeer
from client_support import Cluster, Ctx, RecordingApp, committed, mount

from waltz_api.cluster import coordination_from_uri
from waltz_api.errors import ClientError
from waltz_api.messages import (
    AppendRequest,
    FeedData,
    FlushRequest,
    FlushResponse,
    LockFailure,
    RangeReadRequest,
    RangeReadResponse,
)
from waltz_api.types import Record, ReqId
from waltz_api.wire import checksum
from waltz_client import SubmissionResult, Transaction, TransactionBuilder, WaltzClient
from waltz_server.cluster_admin import ClusterAdmin

pytestmark = pytest.mark.timeout(90)
T = TypeVar("T")


class LoopThread:
    """An event loop on a background thread (the peer's and the metadata's side)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def remote(tmp_path: Path) -> Iterator[tuple[LoopThread, Cluster, ProtocolTestPeer]]:
    bg = LoopThread()
    uri = f"local://{tmp_path / 'coordination'}?root=/waltz"

    async def setup() -> tuple[Cluster, ProtocolTestPeer]:
        coordination = coordination_from_uri(uri, {"session_timeout": 5.0})
        await coordination.start()
        metadata = ClusterAdmin(coordination)
        await metadata.create_cluster(num_partitions=1, num_replicas=1, storage_nodes=["s:1"])
        peer = await ProtocolTestPeer(transport="zmq").start()
        cluster = Cluster(uri, coordination, metadata, 1)
        await cluster.assign(0, peer)
        return cluster, peer

    cluster, peer = bg.run(setup())
    try:
        yield bg, cluster, peer
    finally:
        bg.run(peer.close())
        bg.run(cluster.coordination.close())
        bg.close()


def test_threads_submit_with_futures_back_pressure_lazy_data_and_flush(
    remote: tuple[LoopThread, Cluster, ProtocolTestPeer],
) -> None:
    bg, cluster, peer = remote
    app = RecordingApp(fetch_data=True)  # get_data() blocks on the callback thread
    peer.data[(0, 0)] = b"first"
    config = cluster.config(transport="zmq", max_concurrent_transactions=1)
    with WaltzClient(app, config) as client:
        assert client.num_partitions == 1 and client.client_id >= 0
        conn, _ = bg.run(mount(peer, 0, feed=[(0, 5)]))
        deadline = time.monotonic() + 10
        while app.hwm.get(0) != 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert app.data[(0, 0)] == b"first"  # fetched lazily over the RPC connection

        first = client.submit(Ctx(header=1, data=b"one"))
        assert isinstance(first, concurrent.futures.Future)
        _, a1 = bg.run(peer.expect(AppendRequest))
        assert a1.data == b"one" and a1.client_high_water_mark == 0

        # back pressure: one transaction in flight at most, the next submit() waits
        second: list[concurrent.futures.Future[SubmissionResult]] = []
        blocked = threading.Thread(target=lambda: second.append(client.submit(Ctx(header=2))))
        blocked.start()
        blocked.join(0.3)
        assert blocked.is_alive() and not second

        peer.data[(0, 1)] = a1.data
        bg.run(conn.send(FeedData(a1.req_id, 1, 1)))
        committed(first.result(10), 1)
        blocked.join(10)
        assert not blocked.is_alive()
        _, a2 = bg.run(peer.expect(AppendRequest))
        peer.data[(0, 2)] = a2.data
        bg.run(conn.send(FeedData(a2.req_id, 2, 2)))
        committed(second[0].result(10), 2)
        assert app.data[(0, 1)] == b"one"

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            flushed = pool.submit(client.flush, 0)
            _, request = bg.run(peer.expect(FlushRequest))
            bg.run(conn.send(FlushResponse(request.req_id, 2)))
            assert flushed.result(10) == 2
        assert client.feed_position(0) == 2
    assert [t for _, t, _ in app.applied] == [0, 1, 2]
    with pytest.raises(ClientError, match="closed"):
        client.submit(Ctx())


def test_threads_abandoned_futures_free_their_slot_and_range_read(
    remote: tuple[LoopThread, Cluster, ProtocolTestPeer],
) -> None:
    bg, cluster, peer = remote
    app = RecordingApp()
    config = cluster.config(transport="zmq", max_concurrent_transactions=1)
    with WaltzClient(app, config) as client:
        conn, _ = bg.run(mount(peer, 0))
        first = client.submit(Ctx(header=1))
        _, a1 = bg.run(peer.expect(AppendRequest))
        # the slot is taken: a submit that cannot get one in time submits nothing
        with pytest.raises(TimeoutError):
            client.submit(Ctx(header=2), timeout=0.3)
        # the application gives up on the first: its slot is free at once
        assert first.cancel()
        third = client.submit(Ctx(header=3), timeout=10)
        _, a3 = bg.run(peer.expect(AppendRequest))
        assert a3.header == 3
        bg.run(conn.send(FeedData(a1.req_id, 0, 1), FeedData(a3.req_id, 1, 3)))
        committed(third.result(10), 1)
        bg.run(peer.nothing_more(AppendRequest, 0.3))  # the timed-out one never went out

        # the synchronous client reads ranges too
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reading = pool.submit(client.range_read, 0, 0, max_records=2)
            rconn, request = bg.run(peer.expect(RangeReadRequest))
            assert (request.start_transaction_id, request.max_records) == (0, 2)
            records = (Record(0, a1.req_id, 1, a1.data, checksum(a1.data)),)
            bg.run(rconn.send(RangeReadResponse(request.req_id, 1, records)))
            hwm, got = reading.result(10)
        assert hwm == 1 and [r.data for r in got] == [a1.data]
    assert [(t, h) for _, t, h in app.applied] == [(0, 1), (1, 3)]


def test_threads_submit_a_batch_and_futures_without_a_task_each(
    remote: tuple[LoopThread, Cluster, ProtocolTestPeer],
) -> None:
    bg, cluster, peer = remote
    app = RecordingApp()
    config = cluster.config(transport="zmq", max_concurrent_transactions=2)
    with WaltzClient(app, config) as client:
        conn, _ = bg.run(mount(peer, 0))
        # a batch from a thread: three transactions, two slots; each answered
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            batch = pool.submit(client.submit_many, [Ctx(header=h) for h in (1, 2, 3)])
            _, a1 = bg.run(peer.expect(AppendRequest))
            _, a2 = bg.run(peer.expect(AppendRequest))
            bg.run(peer.nothing_more(AppendRequest, 0.2))  # the third waits for a slot
            bg.run(conn.send(LockFailure(a1.req_id, 0), FeedData(a2.req_id, 0, 2)))
            _, a1b = bg.run(peer.expect(AppendRequest))
            _, a3 = bg.run(peer.expect(AppendRequest))
            assert (a1b.header, a3.header) == (1, 3)
            assert a1b.client_high_water_mark == 0
            bg.run(conn.send(FeedData(a1b.req_id, 1, 1), FeedData(a3.req_id, 2, 3)))
            results = batch.result(10)
        committed(results[0], 1)
        committed(results[1], 0)
        committed(results[2], 2)
        # futures from many threads: each answered; one given up before it ran
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = list(pool.map(client.submit_nowait, [Ctx(header=h) for h in (4, 5)]))
        assert all(isinstance(f, concurrent.futures.Future) for f in futures)
        appends = [bg.run(peer.expect(AppendRequest))[1] for _ in range(2)]
        assert sorted(a.header for a in appends) == [4, 5]
        bg.run(conn.send(*(FeedData(a.req_id, 3 + i, a.header) for i, a in enumerate(appends))))
        got = sorted((f.result(10).transaction_id, f.result(10).committed) for f in futures)
        assert got == [(3, True), (4, True)]
    assert [t for _, t, _ in app.applied] == [0, 1, 2, 3, 4]
    with pytest.raises(ClientError, match="closed"):
        client.submit_nowait(Ctx())


def test_get_data_on_the_event_loop_is_refused_with_a_clear_error() -> None:
    async def fetch(p: int, t: int) -> bytes:
        return b""

    txn = Transaction(0, 1, 0, ReqId(1, 1, 0, 1), fetch=fetch)
    with pytest.raises(ClientError, match=r"await transaction\.fetch_data"):
        txn.get_data()


def test_builder_validates_its_input() -> None:
    b = TransactionBuilder(0, 5)
    with pytest.raises(ClientError, match="signed 32-bit"):
        b.set_header(2**31)
    with pytest.raises(ClientError, match="pass a serializer"):
        b.set_data({"a": 1})  # type: ignore[call-overload]
    with pytest.raises(ClientError, match="Lock"):
        b.lock(("account", 1))  # type: ignore[arg-type]
    b.set_header(-(2**31)).set_data(bytearray(b"ab")).write_lock("a", 1).read_lock("a", 2)
    assert b.header == -(2**31) and b.data == b"ab" and len(b.locks) == 2
    assert b.lock_request().write and b.lock_request().read and not b.lock_request().append


def test_blocking_calls_from_a_callback_are_refused(
    remote: tuple[LoopThread, Cluster, ProtocolTestPeer],
) -> None:
    bg, cluster, peer = remote
    refused: list[BaseException] = []
    holder: list[WaltzClient] = []

    class Reentrant(RecordingApp):
        def apply_transaction(self, transaction: Transaction) -> None:
            try:
                holder[0].flush(0)  # would wait for the feed this thread is applying
            except ClientError as exc:
                refused.append(exc)
            super().apply_transaction(transaction)

    app = Reentrant()
    config = cluster.config(transport="zmq", partitions=[0])
    with WaltzClient(app, config, start_timeout=30) as client:
        holder.append(client)
        bg.run(mount(peer, 0, feed=[(0, 1)]))
        deadline = time.monotonic() + 10
        while app.hwm.get(0) != 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert len(refused) == 1 and "from the client's own threads" in str(refused[0])
