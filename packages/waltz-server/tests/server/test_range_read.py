"""Range reads served from storage: the storage node's block is forwarded as it came
(no Record decoded or re-encoded by the server), cut at the high-water mark."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Sequence

import pytest
from cluster_fixture import InProcessCluster

from waltz_api import wire
from waltz_api.messages import (
    AppendRequest,
    ErrorCode,
    ErrorResponse,
    FlushRequest,
    FlushResponse,
    RangeReadRequest,
    RangeReadResponse,
)
from waltz_api.types import LockRequest, Record, ReqId
from waltz_conformance.reference.transport import MemoryTransport
from waltz_server.server import testing
from waltz_server.server.server import ServerConfig, WaltzServer
from waltz_server.server.store import StoreConfig, StorePartition

pytestmark = pytest.mark.timeout(120)
TIMEOUT = 20.0
COUNT = 300


@pytest.fixture
async def cluster() -> AsyncIterator[InProcessCluster]:
    made = await InProcessCluster.create(num_partitions=1)
    try:
        yield made
    finally:
        await made.close()


async def test_a_range_read_from_storage_forwards_the_block_cut_at_the_mark(
    cluster: InProcessCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    transport = MemoryTransport({"buffer_bytes": 1 << 20})
    cluster.extra.append(transport)
    # a window of 1 KiB: older records are read back from a replica's storage
    config = ServerConfig(store=StoreConfig(max_window_bytes=1024))
    server = WaltzServer(
        transport=transport,
        endpoint=f"memory://range-{cluster.key.hex[:8]}",
        coordination=cluster.coordination,
        connector=cluster.connector,
        name="range",
        config=config,
    )
    await server.start()
    seq = itertools.count(1)
    try:
        await server.add_partition(0, 1, cluster.replica_nodes)
        await server.partitions[0].store.wait_ready(TIMEOUT)
        client = await testing.RawClient.connect(transport, server.endpoint, "client:1")
        datas = [b"record %d " % i * (i % 7) for i in range(COUNT)]
        for data in datas:
            rid = ReqId(1, 1, 0, next(seq))
            await client.send(AppendRequest(rid, -1, LockRequest(), 0, data, wire.checksum(data)))
        await client.send(FlushRequest(ReqId(1, 1, 0, next(seq))))
        assert (await client.wait(FlushResponse, timeout=TIMEOUT))[0].transaction_id == COUNT - 1

        decoded: list[int] = []
        real = wire.RecordBlock.records

        def counting(block: wire.RecordBlock) -> tuple[Record, ...]:
            decoded.append(len(block))
            return real(block)

        monkeypatch.setattr(wire.RecordBlock, "records", counting)
        served: list[object] = []
        read_block = StorePartition.read_committed_block

        async def spy(store: StorePartition, *args: int) -> Sequence[Record]:
            served.append(await read_block(store, *args))
            return served[-1]  # type: ignore[return-value]

        monkeypatch.setattr(StorePartition, "read_committed_block", spy)
        reads = {next(seq): read for read in [(0, 100), (100, 1000), (COUNT - 5, 50), (COUNT, 10)]}
        for number, (start, count) in reads.items():
            await client.send(RangeReadRequest(ReqId(1, 1, 0, number), start, count, 1 << 20))
        answers = await client.wait(RangeReadResponse, len(reads), timeout=TIMEOUT)
        assert decoded == []  # the server decoded no block: it forwarded them
        blocks = [b for b in served if isinstance(b, wire.RecordBlock)]
        assert len(blocks) >= 2, served  # (0, 100) and (100, 1000) came from storage
        assert sorted(a.req_id.seq_num for a in answers) == sorted(reads)
        for answer in answers:  # (answered in any order)
            start, count = reads[answer.req_id.seq_num]
            assert answer.high_water_mark == COUNT - 1
            expected = list(range(start, min(start + count, COUNT)))
            assert [r.transaction_id for r in answer.records] == expected
            assert [r.data for r in answer.records] == [datas[i] for i in expected]
        # the byte budget still applies (at least one record)
        await client.send(RangeReadRequest(ReqId(1, 1, 0, next(seq)), 10, 100, 1))
        small = (await client.wait(RangeReadResponse, len(reads) + 1, timeout=TIMEOUT))[-1]
        assert [r.transaction_id for r in small.records] == [10]
        await client.close()
    finally:
        await server.close()


async def test_a_block_with_other_ids_than_asked_is_refused(
    cluster: InProcessCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    transport = MemoryTransport({"buffer_bytes": 1 << 20})
    cluster.extra.append(transport)
    server = WaltzServer(
        transport=transport,
        endpoint=f"memory://range-ids-{cluster.key.hex[:8]}",
        coordination=cluster.coordination,
        connector=cluster.connector,
        name="range-ids",
    )
    await server.start()
    try:
        await server.add_partition(0, 1, cluster.replica_nodes)
        await server.partitions[0].store.wait_ready(TIMEOUT)
        client = await testing.RawClient.connect(transport, server.endpoint, "client:1")
        for i in range(20):
            data = b"%d" % i
            rid = ReqId(1, 1, 0, i + 1)
            await client.send(AppendRequest(rid, -1, LockRequest(), 0, data, wire.checksum(data)))
        await client.send(FlushRequest(ReqId(1, 1, 0, 100)))
        assert (await client.wait(FlushResponse, timeout=TIMEOUT))[0].transaction_id == 19

        def shifted(first: int, count: int) -> wire.RecordBlock:
            ids = [first + i for i in range(count)]
            ids[-1] += 1  # a gap before the last one
            return wire.RecordBlock.of(
                [Record(t, ReqId(1, 1, 0, t), 0, b"x", wire.checksum(b"x")) for t in ids]
            )

        async def wrong(store: StorePartition, start: int, count: int, size: int) -> object:
            return shifted(start, count)

        monkeypatch.setattr(StorePartition, "read_committed_block", wrong)
        await client.send(RangeReadRequest(ReqId(1, 1, 0, 101), 5, 4, 1 << 20))
        refused = (await client.wait(ErrorResponse, timeout=TIMEOUT))[0]
        assert refused.req_id.seq_num == 101
        assert refused.code is ErrorCode.GENERIC
        assert "transactions 5..9" in refused.message
        assert not client.of(RangeReadResponse)
        await client.close()
    finally:
        await server.close()
