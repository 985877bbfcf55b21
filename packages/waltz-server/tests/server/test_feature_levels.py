"""The cluster's feature level as servers follow it (waltz_api.features), in process:
memory coordination, real StorageNodes on the memory engine, servers started from their
config. At level 1 a server tells the storage nodes nothing and sends no
MarkReplicaRequest; a level raised while it runs reaches every storage node it is
connected to, and a server connecting to a node tells it the level."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from cluster_fixture import InProcessCluster
from test_server_main import server_config, wait_served, write

from waltz_api.cluster import FEATURES_PATH, ClusterMetadata, encode_feature_level
from waltz_api.errors import ConfigError
from waltz_api.features import MAX_FEATURE_LEVEL
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.server.main import RunningServer, start_server
from waltz_server.server.storage_client import StorageReplica

pytestmark = pytest.mark.timeout(120)
PARTITIONS = 4
DEADLINE = 30.0


async def until(check: Callable[[], bool], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + DEADLINE
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {DEADLINE} s: {what}")
        await asyncio.sleep(0.02)


def node_levels(cluster: InProcessCluster) -> list[int]:
    return [n.node.engine.feature_level for n in cluster.nodes if n.node is not None]


async def with_cluster(
    cluster_level: int, work: Callable[[InProcessCluster, str], Awaitable[None]]
) -> None:
    service = f"svc-{uuid.uuid4().hex[:8]}"
    made = await InProcessCluster.create(
        num_partitions=PARTITIONS,
        service=service,
        feature_level=cluster_level,
        node_feature_level=1,  # as a storage node creates its storage
    )
    try:
        await work(made, service)
    finally:
        await made.close()


async def test_level_1_until_raised_then_every_connected_node_is_told() -> None:
    async def work(made: InProcessCluster, service: str) -> None:
        meta = ClusterMetadata(made.coordination)
        server = await start_server(server_config(service, "a"))
        try:
            await wait_served([server], meta)
            assert await write(made, meta, b"one-", 1) == {p: 9 for p in range(PARTITIONS)}
            assert server.pool.feature_level() == 1
            assert node_levels(made) == [1, 1, 1]
            before, now = await ClusterAdmin(made.coordination).raise_feature_level(2)
            assert (before, now) == (1, 2)
            await until(lambda: node_levels(made) == [2, 2, 2], "every node at level 2")
            assert server.pool.feature_level() == 2
            assert await write(made, meta, b"two-", 2) == {p: 19 for p in range(PARTITIONS)}
        finally:
            await server.stop()

    await with_cluster(1, work)


async def test_a_server_tells_each_storage_node_the_level_when_it_connects() -> None:
    async def work(made: InProcessCluster, service: str) -> None:
        meta = ClusterMetadata(made.coordination)
        assert node_levels(made) == [1, 1, 1]
        server: RunningServer = await start_server(server_config(service, "a"))
        try:
            await wait_served([server], meta)
            assert node_levels(made) == [2, 2, 2]
        finally:
            await server.stop()

    await with_cluster(2, work)


async def test_a_server_refuses_a_cluster_above_the_levels_it_supports() -> None:
    async def work(made: InProcessCluster, service: str) -> None:
        found = await made.coordination.get(FEATURES_PATH)
        assert found is not None
        above = MAX_FEATURE_LEVEL + 1
        await made.coordination.set(
            FEATURES_PATH, encode_feature_level(above), expected_version=found.version
        )
        with pytest.raises(ConfigError, match=f"feature level {above}, above the highest"):
            await start_server(server_config(service, "a"))

    await with_cluster(2, work)


class Client:
    """A storage client that records the requests a replica makes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def set_low_water_mark(self, session_id: int, partition_id: int, mark: int) -> None:
        self.calls.append(("set_low_water_mark", mark))

    async def mark_replica(
        self, session_id: int, partition_id: int, mark: int, *, clean: bool, log_end: int
    ) -> None:
        self.calls.append(("mark_replica", (mark, clean, log_end)))


@pytest.mark.parametrize("level", [1, 2])
async def test_mark_replica_is_sent_from_level_2_only(level: int) -> None:
    client = Client()
    replica = StorageReplica(
        client,  # type: ignore[arg-type]
        "sn:1",
        0,
        7,
        feature_level=lambda: level,
    )
    await replica.mark_replica(41, clean=False)
    await replica.mark_replica(41, clean=True, log_end=60)
    if level == 1:  # as 0.1.0: the session's marks, and nothing to clear later
        assert client.calls == [("set_low_water_mark", 41)]
    else:
        assert client.calls == [
            ("mark_replica", (41, False, -1)),
            ("mark_replica", (41, True, 60)),
        ]
