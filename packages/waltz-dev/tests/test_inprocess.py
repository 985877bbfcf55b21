"""The in-process cluster builder: a cluster that serves, keeps what it committed across
storage node and server restarts, and stops everything it started."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from waltz_api.types import Record
from waltz_client import (
    AsyncWaltzClient,
    ClientConfig,
)
from waltz_client.simple import MemoryMarks, Put
from waltz_conformance.reference.storage import forget
from waltz_dev.inprocess import InProcessCluster

pytestmark = pytest.mark.timeout(120)


async def _put(cluster: InProcessCluster, items: list[tuple[int, bytes]]) -> list[int]:
    config = ClientConfig(cluster.coordination_uri, transport=cluster.transport)
    async with AsyncWaltzClient(MemoryMarks(), config) as client:
        return [(await client.submit(Put(data, p))).transaction_id for p, data in items]


async def _stored(cluster: InProcessCluster, partition: int) -> list[Record]:
    node = cluster.nodes[0]
    assert node is not None
    return await node.engine.partition(partition).read_records(0, 1000, 1 << 20)


async def test_a_memory_cluster_serves_and_survives_restarts(tmp_path: Path) -> None:
    cluster = InProcessCluster(
        tmp_path,
        num_partitions=2,
        storage_engine="memory",
        transport="memory",
        coordination_uri=f"memory://inprocess-{uuid.uuid4().hex[:8]}/waltz",
    )
    await cluster.start()
    try:
        assert await _put(cluster, [(0, b"a"), (1, b"b"), (0, b"c")]) == [0, 0, 1]
        await cluster.stop_storage()
        assert all(node is None for node in cluster.nodes)
        await cluster.start_storage()
        old = cluster.server().manager.server_id
        await cluster.restart_server(0)
        assert cluster.server().manager.server_id != old
        assert await _put(cluster, [(0, b"d")]) == [2]
        assert [r.data for r in await _stored(cluster, 0)] == [b"a", b"c", b"d"]
    finally:
        await cluster.close()
        for index in range(cluster.num_storage_nodes):
            forget(str(tmp_path / f"storage-{index}"))
    assert cluster.coordination is None
    assert cluster.servers == [None] and cluster.nodes == [None, None, None]
