"""The client-facing server end to end: a raw protocol client over the memory transport,
the server, real StorageNodes (memory engine), the memory coordination."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import TypeVar

import pytest
from cluster_fixture import InProcessCluster

from waltz_api import wire
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
    Message,
    MountRequest,
    MountResponse,
    MountStatus,
    RangeReadRequest,
    RangeReadResponse,
)
from waltz_api.types import Lock, LockRequest, ReqId
from waltz_conformance.reference.transport import MemoryTransport
from waltz_server.server import testing
from waltz_server.server.server import ServerConfig, WaltzServer

pytestmark = pytest.mark.timeout(120)
M = TypeVar("M", bound=Message)
TIMEOUT = 20.0


class RawClient(testing.RawClient):
    _seq = itertools.count(1)

    def rid(self, client: int, partition: int = 0, generation: int = 1) -> ReqId:
        return ReqId(client, generation, partition, next(self._seq))


@pytest.fixture
async def cluster() -> AsyncIterator[InProcessCluster]:
    made = await InProcessCluster.create(num_partitions=2)
    try:
        yield made
    finally:
        await made.close()


async def start_server(
    cluster: InProcessCluster, name: str = "s1", config: ServerConfig | None = None
) -> WaltzServer:
    transport = MemoryTransport({"buffer_bytes": 64 * 1024})
    cluster.extra.append(transport)
    server = WaltzServer(
        transport=transport,
        endpoint=f"memory://{name}-{cluster.key.hex[:8]}",
        coordination=cluster.coordination,
        connector=cluster.connector,
        name=name,
        config=config,
    )
    await server.start()
    return server


def append(
    client: RawClient, client_id: int, data: bytes, hwm: int = -1, **kw: object
) -> AppendRequest:
    locks = kw.get("locks", ())
    return AppendRequest(
        client.rid(client_id, int(kw.get("partition", 0))),  # type: ignore[call-overload]
        hwm,
        LockRequest.from_locks(locks),  # type: ignore[arg-type]
        0,
        data,
        wire.checksum(data),
    )


async def test_clients_append_mount_feed_and_read_through_the_server(
    cluster: InProcessCluster,
) -> None:
    server = await start_server(cluster)
    try:
        await server.add_partition(0, 1, cluster.replica_nodes)
        await server.add_partition(1, 1, cluster.replica_nodes)
        for partition in server.partitions.values():
            await partition.store.wait_ready(TIMEOUT)
        writer = await RawClient.connect(cluster.client_transport, server.endpoint, "client:1")
        reader = await RawClient.connect(cluster.client_transport, server.endpoint, "client:2")
        await reader.send(MountRequest(reader.rid(2), -1, 1))
        mounted = await reader.wait(MountResponse)
        assert mounted[0].status is MountStatus.READY and mounted[0].high_water_mark == -1
        sent = [append(writer, 1, b"w%d" % i) for i in range(100)]
        for request in sent:
            await writer.send(request)
        # two writers race a WRITE lock built on the same high-water mark
        lock = (Lock("acct", 1),)
        racers = [
            append(writer, 1, b"r1", 99, locks=lock),
            append(writer, 3, b"r2", 99, locks=lock),
        ]
        for request in racers:
            await writer.send(request)
        await writer.send(FlushRequest(writer.rid(1)))
        flushed = await writer.wait(FlushResponse)
        assert flushed[0].transaction_id == 100
        failures = writer.of(LockFailure)
        assert [f.req_id for f in failures] == [racers[1].req_id]
        feed = await reader.wait(FeedData, 101)
        assert [f.transaction_id for f in feed] == list(range(101))
        assert [f.req_id for f in feed] == [r.req_id for r in [*sent, racers[0]]]
        await reader.send(HighWaterMarkRequest(reader.rid(2)))
        assert (await reader.wait(HighWaterMarkResponse))[0].transaction_id == 100
        await reader.send(RangeReadRequest(reader.rid(2), 95, 10, 1 << 20))
        ranged = (await reader.wait(RangeReadResponse))[0]
        assert [r.data for r in ranged.records] == [b"w95", b"w96", b"w97", b"w98", b"w99", b"r1"]
        # partition 1 is independent: its ids start at 0
        await writer.send(append(writer, 1, b"p1", partition=1))
        await writer.send(FlushRequest(writer.rid(1, partition=1)))
        assert (await writer.wait(FlushResponse, 2))[1].transaction_id == 0
        # a partition this server does not hold, and a stale generation
        await writer.send(append(writer, 1, b"x", partition=7))
        await writer.send(
            AppendRequest(writer.rid(1, 0, 0), -1, LockRequest(), 0, b"s", wire.checksum(b"s"))
        )
        errors = await writer.wait(ErrorResponse, 2)
        assert {e.code for e in errors} == {
            ErrorCode.PARTITION_NOT_ASSIGNED,
            ErrorCode.STALE_GENERATION,
        }
        await writer.close()
        await reader.close()
    finally:
        await server.close()


async def test_partition_moves_to_a_new_server_and_the_old_one_is_fenced(
    cluster: InProcessCluster,
) -> None:
    old = await start_server(cluster, "old")
    new = await start_server(cluster, "new")
    try:
        await old.add_partition(0, 1, cluster.replica_nodes)
        await old.partitions[0].store.wait_ready(TIMEOUT)
        client = await RawClient.connect(cluster.client_transport, old.endpoint, "client:1")
        for i in range(20):
            await client.send(append(client, 1, b"a%d" % i))
        await client.send(FlushRequest(client.rid(1)))
        assert (await client.wait(FlushResponse))[0].transaction_id == 19
        # the cluster manager moves the partition: generation 2 on the new server
        await new.add_partition(0, 2, cluster.replica_nodes)
        await new.partitions[0].store.wait_ready(TIMEOUT)
        # the old server's appends can no longer reach storage
        for i in range(5):
            await client.send(append(client, 1, b"late%d" % i))
        other = await RawClient.connect(cluster.client_transport, new.endpoint, "client:2")
        for i in range(5):
            await other.send(
                AppendRequest(
                    other.rid(2, 0, 2), -1, LockRequest(), 0, b"n%d" % i, wire.checksum(b"n%d" % i)
                )
            )
        await other.send(FlushRequest(other.rid(2, 0, 2)))
        assert (await other.wait(FlushResponse))[0].transaction_id == 24
        for _ in range(500):
            if old.partitions[0].store.stale is not None:
                break
            await asyncio.sleep(0.01)
        assert old.partitions[0].store.stale is not None, "the old server never noticed"
        await client.send(append(client, 1, b"late-after"))
        errors = await client.wait(ErrorResponse)
        assert errors[-1].code is ErrorCode.STALE_GENERATION
        for node in cluster.nodes:
            log = await node.log(0)
            assert not any(r.data.startswith(b"late") for r in log)
            assert [r.data for r in log[20:25]] == [b"n%d" % i for i in range(5)]
        await client.close()
        await other.close()
    finally:
        await old.close()
        await new.close()


async def test_a_client_that_does_not_read_never_grows_server_memory(
    cluster: InProcessCluster,
) -> None:
    server = await start_server(cluster, "bp", ServerConfig(outbox_frames=50))
    try:
        await server.add_partition(0, 1, cluster.replica_nodes)
        await server.partitions[0].store.wait_ready(TIMEOUT)
        # a reader mounts, then stops reading its connection altogether
        small = MemoryTransport({"buffer_bytes": 4096})  # the stalled client's socket buffer
        cluster.extra.append(small)
        stalled_conn = await small.connect(server.endpoint)
        protocol = wire.ProtocolConnection(wire.Role.INITIATOR, sender="client:8")
        await stalled_conn.send(protocol.start_handshake())
        protocol.receive_frame(await stalled_conn.recv())
        await stalled_conn.send(protocol.send(MountRequest(ReqId(8, 1, 0, 1), -1, 1)))
        writer = await RawClient.connect(cluster.client_transport, server.endpoint, "client:1")
        for i in range(3000):
            await writer.send(append(writer, 1, b"%04d" % i + bytes(200)))
            if i % 500 == 0:
                await asyncio.sleep(0)
        await writer.send(FlushRequest(writer.rid(1)))
        # the writer is not held back by the stalled reader
        assert (await writer.wait(FlushResponse))[0].transaction_id == 2999
        connections = list(server.connections)
        assert connections
        for connection in connections:
            assert connection.queued_frames <= 2 * 50  # the outbox bound holds
        # the stalled reader's feed waits instead of queueing 3000 FeedData
        feed_tasks = list(server.partitions[0]._feeds.values())
        assert feed_tasks and not all(t.done() for t in feed_tasks)
        await writer.close()
        await stalled_conn.close()
    finally:
        await server.close()


async def test_reads_on_a_partition_not_yet_recovered_wait_for_its_real_mark(
    cluster: InProcessCluster,
) -> None:
    """Before its first recovery a partition's mark is unknown: a high-water mark or a
    range read is answered once recovered, never with -1 (an empty partition)."""
    first = await start_server(cluster, "first")
    try:
        await first.add_partition(0, 1, cluster.replica_nodes)
        await first.partitions[0].store.wait_ready(TIMEOUT)
        client = await RawClient.connect(cluster.client_transport, first.endpoint, "client:1")
        for i in range(10):
            await client.send(append(client, 1, b"t%d" % i))
        await client.send(FlushRequest(client.rid(1)))
        assert (await client.wait(FlushResponse))[0].transaction_id == 9
        await client.close()
    finally:
        await first.close()
    # a majority of the storage is down: the next owner cannot recover yet
    for node in cluster.nodes[:2]:
        await node.crash()
    second = await start_server(cluster, "second")
    try:
        await second.add_partition(0, 2, cluster.replica_nodes)
        reader = await RawClient.connect(cluster.client_transport, second.endpoint, "client:2")
        await reader.send(HighWaterMarkRequest(reader.rid(2, 0, 2)))
        await reader.send(RangeReadRequest(reader.rid(2, 0, 2), 0, 100, 1 << 20))
        await asyncio.sleep(0.5)
        assert not reader.of(HighWaterMarkResponse) and not reader.of(RangeReadResponse)
        for node in cluster.nodes[:2]:
            await node.start()
        assert (await reader.wait(HighWaterMarkResponse))[0].transaction_id == 9
        ranged = (await reader.wait(RangeReadResponse))[0]
        assert ranged.high_water_mark == 9
        assert [r.data for r in ranged.records] == [b"t%d" % i for i in range(10)]
        await reader.close()
    finally:
        await second.close()
