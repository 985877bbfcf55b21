"""Membership changes in the cluster metadata (ClusterAdmin.add_storage_node,
remove_storage_node, add_replica, remove_replica): compare-and-set on the replica
assignments, built on the Coordination contract; checked on the memory reference and
the embedded local service (files), which need no server process."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from waltz_api.cluster import ReplicaAssignments, coordination_from_uri
from waltz_api.contracts.coordination import Coordination
from waltz_api.errors import ClusterNotFoundError, ConfigError
from waltz_conformance.reference.coordination import MemoryCoordination, MemoryCoordinationService
from waltz_server.cluster_admin import ClusterAdmin

MakeClient = Callable[[], Awaitable[Coordination]]
NODES = ["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"]
NEW = "127.0.0.1:7004"

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["memory", "local"])
async def make_client(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[MakeClient]:
    root = f"/membership/{uuid.uuid4().hex[:10]}"
    clients: list[Coordination] = []
    service = MemoryCoordinationService()

    def new() -> Coordination:
        if request.param == "memory":
            return MemoryCoordination(service, root)
        return coordination_from_uri(f"local://{tmp_path}?root={root}")

    async def make() -> Coordination:
        client = new()
        clients.append(client)
        await client.start()
        return client

    yield make
    for client in clients:
        await client.close()


async def _cluster(make_client: MakeClient) -> ClusterAdmin:
    meta = ClusterAdmin(await make_client())
    await meta.create_cluster(num_partitions=3, num_replicas=2, storage_nodes=NODES)
    return meta


async def test_add_storage_node_is_idempotent_and_keeps_its_group(
    make_client: MakeClient,
) -> None:
    meta = await _cluster(make_client)
    added = await meta.add_storage_node(NEW, group=2)
    assert added.partitions_of(NEW) == () and added.group_of(NEW) == 2
    again = await meta.add_storage_node(f" {NEW} ", group=2)
    assert again == added == await meta.replica_assignments()
    with pytest.raises(ConfigError, match="already in group 2"):
        await meta.add_storage_node(NEW, group=1)
    with pytest.raises(ConfigError, match="host:port"):
        await meta.add_storage_node("no-port")
    with pytest.raises(ConfigError, match="non-negative"):
        await meta.add_storage_node("127.0.0.1:7005", group=-1)
    # a reader in another client sees the group (it is stored, not cached)
    other = ClusterAdmin(await make_client())
    assert (await other.replica_assignments()).group_of(NEW) == 2
    assert (await other.replica_assignments()).group_of(NODES[0]) == 0


async def test_add_and_remove_replica(make_client: MakeClient) -> None:
    meta = await _cluster(make_client)
    before = await meta.replica_assignments()
    assert before.replicas_of(0) == NODES[:2]
    with pytest.raises(ConfigError, match="not part of the cluster; add it first"):
        await meta.add_replica(0, NEW)
    await meta.add_storage_node(NEW)
    added = await meta.add_replica(0, NEW)
    assert added.replicas_of(0) == [*NODES[:2], NEW]
    assert await meta.add_replica(0, NEW) == added  # idempotent
    assert (await meta.replica_assignments()).replicas_of(1) == before.replicas_of(1)
    removed = await meta.remove_replica(0, NODES[0])
    assert removed.replicas_of(0) == [NODES[1], NEW]
    assert NODES[0] in removed.storage  # the node itself stays known
    with pytest.raises(ConfigError, match="holds no replica of partition 0"):
        await meta.remove_replica(0, NODES[0])
    await meta.remove_replica(0, NODES[1])
    with pytest.raises(ConfigError, match="last replica of partition 0"):
        await meta.remove_replica(0, NEW)
    assert (await meta.replica_assignments()).replicas_of(0) == [NEW]
    with pytest.raises(ConfigError, match="does not exist"):
        await meta.add_replica(3, NEW)
    with pytest.raises(ConfigError, match="does not exist"):
        await meta.remove_replica(-1, NEW)


async def test_remove_storage_node_refused_while_it_holds_replicas(
    make_client: MakeClient,
) -> None:
    meta = await _cluster(make_client)
    with pytest.raises(ConfigError, match="still holds replicas of partitions"):
        await meta.remove_storage_node(NODES[0])
    with pytest.raises(ConfigError, match="not part of the cluster"):
        await meta.remove_storage_node(NEW)
    await meta.add_storage_node(NEW)
    after = await meta.remove_storage_node(NEW)  # holds nothing: no force needed
    assert NEW not in after.storage
    forced = await meta.remove_storage_node(NODES[0], force=True)
    assert NODES[0] not in forced.storage
    for partition in range(3):
        assert NODES[0] not in forced.replicas_of(partition)
        assert forced.replicas_of(partition)
    # partition 1 lives on NODES[1] and NODES[2]; drop NODES[2]'s replicas to leave
    # NODES[1] alone with partition 1 (and partition 0)
    await meta.remove_replica(1, NODES[2])
    with pytest.raises(ConfigError, match="only replica of partitions"):
        await meta.remove_storage_node(NODES[1], force=True)
    assert NODES[1] in (await meta.replica_assignments()).storage


async def test_concurrent_changes_all_apply(make_client: MakeClient) -> None:
    """Each change is a compare-and-set: concurrent ones from separate clients retry,
    and none is lost."""
    meta = await _cluster(make_client)
    nodes = [f"127.0.0.1:{7100 + i}" for i in range(6)]
    clients = [ClusterAdmin(await make_client()) for _ in nodes]
    await asyncio.gather(*(c.add_storage_node(n) for c, n in zip(clients, nodes, strict=True)))
    await asyncio.gather(
        *(c.add_replica(i % 3, n) for i, (c, n) in enumerate(zip(clients, nodes, strict=True)))
    )
    found = await meta.replica_assignments()
    for i, node in enumerate(nodes):
        assert found.partitions_of(node) == (i % 3,)
    assert len(found.replicas_of(0)) == 4


async def test_no_cluster_is_a_clear_error(make_client: MakeClient) -> None:
    meta = ClusterAdmin(await make_client())
    with pytest.raises(ClusterNotFoundError):
        await meta.add_storage_node(NEW)
    with pytest.raises(ClusterNotFoundError):
        await meta.add_replica(0, NEW)


async def test_watch_replica_assignments_reports_changes(make_client: MakeClient) -> None:
    meta = await _cluster(make_client)
    seen: list[list[str]] = []
    changed = asyncio.Event()

    def on_change(found: ReplicaAssignments | None) -> None:
        if found is not None:
            seen.append(found.replicas_of(0))
            changed.set()

    watch = await meta.watch_replica_assignments(on_change)
    try:
        await asyncio.wait_for(changed.wait(), 10)
        await meta.add_storage_node(NEW)
        await meta.add_replica(0, NEW)
        for _ in range(100):
            if seen and NEW in seen[-1]:
                break
            await asyncio.sleep(0.05)
        assert seen[0] == NODES[:2] and seen[-1] == [*NODES[:2], NEW]
    finally:
        watch.cancel()
