"""The cluster metadata layer (waltz_api.cluster) on the memory reference, a real ZooKeeper,
a real etcd and the embedded local service: it is built once on the Coordination contract,
so it must behave the same on each."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import pytest

from waltz_api.cluster import (
    CONFIG_PATH,
    FEATURES_PATH,
    SERVERS_DIR,
    STORE_PARTITION_DIR,
    PartitionAssignment,
    PartitionStoreMetadata,
    ReplicaAssignments,
    coordination_from_uri,
)
from waltz_api.contracts.coordination import Coordination, join_path
from waltz_api.errors import (
    BadVersionError,
    ClusterExistsError,
    ClusterNotFoundError,
    ConfigError,
    CoordinationError,
    WaltzError,
)
from waltz_api.types import UNRESOLVED, ReplicaState
from waltz_conformance.reference.coordination import MemoryCoordination, MemoryCoordinationService
from waltz_conformance.servers.zookeeper import ZooKeeperServer
from waltz_conformance.suites.coordination import eventually
from waltz_server.cluster_admin import ClusterAdmin, default_replica_assignments

MakeClient = Callable[[], Awaitable[Coordination]]
NODES = ["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"]


@pytest.fixture(params=["memory", "zk", "etcd", "local"])
async def make_client(
    request: pytest.FixtureRequest,
) -> AsyncIterator[MakeClient]:
    """Started clients of one backend, on a root unique to the test."""
    root = f"/cluster-tests/{uuid.uuid4().hex[:10]}"
    clients: list[Coordination] = []
    if request.param == "memory":
        service = MemoryCoordinationService()

        def new() -> Coordination:
            return MemoryCoordination(service, root)
    elif request.param == "zk":
        from waltz_coord_zk import ZooKeeperCoordination

        server: ZooKeeperServer = request.getfixturevalue("zookeeper_server")

        def new() -> Coordination:
            return ZooKeeperCoordination(server.connect_string, root, session_timeout=6.0)
    elif request.param == "etcd":
        cluster = request.getfixturevalue("etcd_cluster")
        cluster.ensure_all_running()

        def new() -> Coordination:
            return coordination_from_uri(cluster.uri(root), {"session_timeout": 10.0})
    else:
        directory = request.getfixturevalue("tmp_path")

        def new() -> Coordination:
            return coordination_from_uri(f"local://{directory}?root={root}")

    async def make() -> Coordination:
        client = new()
        clients.append(client)
        await client.start()
        return client

    yield make
    for client in clients:
        await client.close()


async def _cluster(make_client: MakeClient, partitions: int = 4) -> ClusterAdmin:
    meta = ClusterAdmin(await make_client())
    await meta.create_cluster(num_partitions=partitions, num_replicas=2, storage_nodes=NODES)
    return meta


async def test_create_and_read_back(make_client: MakeClient) -> None:
    meta = ClusterAdmin(await make_client())
    assert not await meta.exists()
    key = uuid.uuid4()
    config = await meta.create_cluster(
        num_partitions=5, num_replicas=2, storage_nodes=NODES, cluster_key=key
    )
    assert config.cluster_key == key
    reader = ClusterAdmin(await make_client())
    assert await reader.config() == config
    assignments = await reader.replica_assignments()
    assert assignments == default_replica_assignments(NODES, 5, 2)
    for partition in range(5):
        holders = assignments.replicas_of(partition)
        assert len(holders) == 2
        store = (await reader.store_metadata(partition)).value
        assert store.session_id == -1 and store.generation == 0
        assert [r.replica_id.storage_node for r in store.replicas] == holders
        assert all(r.closing_high_water_mark == UNRESOLVED for r in store.replicas)
        owner = (await reader.partition_assignment(partition)).value
        assert owner == PartitionAssignment(partition)
    summary = await reader.describe()
    assert summary["cluster_key"] == str(key)
    assert len(summary["partition_state"]) == 5
    # The stored form is JSON with a format version.
    raw = await reader.coordination.get(CONFIG_PATH)
    assert raw is not None
    doc = json.loads(raw.value)
    assert doc["format"] == 1 and doc["partitions"] == 5 and doc["state"] == "ready"


async def test_create_refused_on_existing_cluster(make_client: MakeClient) -> None:
    meta = await _cluster(make_client)
    before = await meta.config()
    with pytest.raises(ClusterExistsError, match="already exists"):
        await ClusterAdmin(await make_client()).create_cluster(
            num_partitions=9, num_replicas=1, storage_nodes=NODES
        )
    assert await meta.config() == before, "a refused create changes nothing"


async def test_concurrent_creates_exactly_one_wins(make_client: MakeClient) -> None:
    metas = [ClusterAdmin(await make_client()) for _ in range(3)]
    results = await asyncio.gather(
        *(m.create_cluster(num_partitions=2, num_replicas=1, storage_nodes=NODES) for m in metas),
        return_exceptions=True,
    )
    winners = [r for r in results if not isinstance(r, BaseException)]
    losers = [r for r in results if isinstance(r, BaseException)]
    assert len(winners) == 1
    assert all(isinstance(e, ClusterExistsError) for e in losers), losers
    assert await metas[2].config() == winners[0]


async def test_bad_input_is_refused_and_writes_nothing(make_client: MakeClient) -> None:
    meta = ClusterAdmin(await make_client())
    with pytest.raises(ConfigError, match="replicas"):
        await meta.create_cluster(num_partitions=2, num_replicas=4, storage_nodes=NODES)
    with pytest.raises(ConfigError, match="host:port"):
        await meta.create_cluster(num_partitions=2, num_replicas=1, storage_nodes=["nohost"])
    with pytest.raises(ConfigError, match="twice"):
        await meta.create_cluster(
            num_partitions=2, num_replicas=1, storage_nodes=[NODES[0], NODES[0]]
        )
    with pytest.raises(ConfigError, match="partition"):
        await meta.create_cluster(num_partitions=0, num_replicas=1, storage_nodes=NODES)
    with pytest.raises(ConfigError, match="replicas"):
        await meta.create_cluster(
            num_partitions=2,
            num_replicas=2,
            assignments=ReplicaAssignments(2, {NODES[0]: (0, 1)}),
        )
    assert not await meta.exists()
    with pytest.raises(ClusterNotFoundError, match="waltz cluster create"):
        await meta.config()


async def test_incomplete_creation_is_detected(make_client: MakeClient) -> None:
    client = await make_client()
    from waltz_api.cluster import ClusterConfig, encode_config

    await client.create(CONFIG_PATH, encode_config(ClusterConfig(uuid.uuid4(), 2, 1), ready=False))
    meta = ClusterAdmin(client)
    with pytest.raises(ClusterNotFoundError, match="did not complete"):
        await meta.config()
    with pytest.raises(ClusterExistsError, match="creation incomplete"):
        await meta.create_cluster(num_partitions=2, num_replicas=1, storage_nodes=NODES)


async def test_newer_or_corrupt_format_refused(make_client: MakeClient) -> None:
    meta = await _cluster(make_client)
    path = join_path(STORE_PARTITION_DIR, 0)
    current = await meta.coordination.get(path)
    assert current is not None
    doc = json.loads(current.value)
    doc["format"] = 99
    await meta.coordination.set(path, json.dumps(doc).encode())
    with pytest.raises(CoordinationError, match="upgrade Waltz"):
        await meta.store_metadata(0)
    await meta.coordination.set(path, b"\xff not json")
    with pytest.raises(CoordinationError, match="JSON"):
        await meta.store_metadata(0)


async def test_server_registration_is_ephemeral(make_client: MakeClient) -> None:
    meta = await _cluster(make_client)
    server_client = await make_client()
    server_meta = ClusterAdmin(server_client)
    server_id = await server_meta.allocate_server_id()
    seen: list[list[int]] = []
    await meta.watch_server_ids(seen.append)
    await server_meta.register_server(server_id, "tcp://127.0.0.1:9000")
    with pytest.raises(CoordinationError, match="registered"):
        await server_meta.register_server(server_id, "tcp://127.0.0.1:9001")
    servers = await meta.servers()
    assert [(s.server_id, s.endpoint) for s in servers] == [(server_id, "tcp://127.0.0.1:9000")]
    await eventually(lambda: bool(seen) and seen[-1] == [server_id], 10, "watch sees the server")
    await server_client.close()
    await eventually(lambda: seen[-1] == [], 15, "the registration vanishes with its session")
    assert await meta.servers() == []


async def test_ids_are_unique_under_concurrency(make_client: MakeClient) -> None:
    metas = [ClusterAdmin(await make_client()) for _ in range(3)]

    async def take(meta: ClusterAdmin) -> list[int]:
        return [await meta.allocate_client_id() for _ in range(15)]

    results = await asyncio.gather(*(take(m) for m in metas))
    ids = [i for r in results for i in r]
    assert len(set(ids)) == len(ids) and min(ids) >= 1
    server_ids = [await metas[0].allocate_server_id() for _ in range(3)]
    assert server_ids == sorted(set(server_ids))


async def test_partition_assignment_generations_by_cas(make_client: MakeClient) -> None:
    meta = await _cluster(make_client)
    other = ClusterAdmin(await make_client())
    first = await meta.partition_assignment(1)
    moved = await meta.assign_partition(1, 7, "tcp://a:1", expected_version=first.version)
    assert moved.value.generation == first.value.generation + 1
    assert (await other.partition_assignment(1)).value == moved.value
    with pytest.raises(BadVersionError):
        await other.assign_partition(1, 8, "tcp://b:1", expected_version=first.version)
    # Two managers race to move the partition from the same read: exactly one wins.
    current = await meta.partition_assignment(1)
    results = await asyncio.gather(
        meta.assign_partition(1, 10, "tcp://c:1", expected_version=current.version),
        other.assign_partition(1, 11, "tcp://d:1", expected_version=current.version),
        return_exceptions=True,
    )
    wins = [r for r in results if not isinstance(r, BaseException)]
    assert len(wins) == 1 and all(
        isinstance(r, BadVersionError) for r in results if isinstance(r, BaseException)
    )
    final = (await meta.partition_assignment(1)).value
    assert final.generation == moved.value.generation + 1
    assert final.server_id in (10, 11)
    seen: list[PartitionAssignment | None] = []
    await meta.watch_partition_assignment(1, seen.append)
    await eventually(lambda: bool(seen) and seen[-1] == final, 10, "the watched assignment")


async def test_store_sessions_are_fenced_by_cas(make_client: MakeClient) -> None:
    meta = await _cluster(make_client)
    rivals = [ClusterAdmin(await make_client()) for _ in range(3)]
    start = (await meta.store_metadata(2)).value.session_id
    sessions = await asyncio.gather(*(r.new_store_session(2, generation=1) for r in rivals))
    ids = sorted(s.value.session_id for s in sessions)
    assert ids == [start + 1, start + 2, start + 3], "racing servers get distinct session ids"
    latest = await meta.store_metadata(2)
    assert latest.value.session_id == start + 3 and latest.value.generation == 1
    # A decision built on an old read loses (fencing), and writes nothing.
    stale_version = sessions[0].version if sessions[0].version != latest.version else -5
    with pytest.raises(BadVersionError):
        await meta.cas_store_metadata(
            2, replace(latest.value, session_id=999), expected_version=stale_version
        )
    assert (await meta.store_metadata(2)).value == latest.value
    # An older generation cannot start a session once a newer one did.
    with pytest.raises(BadVersionError, match="generation"):
        await meta.new_store_session(2, generation=0)


async def test_update_store_metadata_retries_and_records_replica_state(
    make_client: MakeClient,
) -> None:
    meta = await _cluster(make_client)
    writers = [ClusterAdmin(await make_client()) for _ in range(3)]
    node = (await meta.store_metadata(3)).value.replicas[0].replica_id.storage_node

    async def close_replica(writer: ClusterAdmin, hwm: int) -> None:
        def update(current: PartitionStoreMetadata) -> PartitionStoreMetadata:
            state = current.replica(node)
            new_hwm = max(state.closing_high_water_mark, hwm)
            return current.with_replica(ReplicaState(state.replica_id, current.session_id, new_hwm))

        await writer.update_store_metadata(3, update)

    await asyncio.gather(*(close_replica(w, h) for w, h in zip(writers, (10, 30, 20), strict=True)))
    final = (await meta.store_metadata(3)).value
    assert final.replica(node).closing_high_water_mark == 30, "no update was lost"
    assert len(final.replicas) == 2
    with pytest.raises(CoordinationError, match="no replica"):
        final.replica("10.0.0.1:1")


async def test_store_metadata_without_format_fields_is_read(make_client: MakeClient) -> None:
    """Values written without "format"/"type" (older writers) read as format 1."""
    meta = await _cluster(make_client)
    path = join_path(STORE_PARTITION_DIR, 1)
    legacy = {
        "generation": 3,
        "session_id": 5,
        "replicas": {"127.0.0.1:7002": {"session_id": 4, "closing_high_water_mark": 17}},
    }
    await meta.coordination.set(path, json.dumps(legacy).encode())
    got = (await meta.store_metadata(1)).value
    assert (got.partition_id, got.generation, got.session_id) == (1, 3, 5)
    assert got.replica("127.0.0.1:7002").closing_high_water_mark == 17
    assert got.replica("127.0.0.1:7002").session_id == 4


async def test_delete_cluster_guarded_by_key_and_live_servers(make_client: MakeClient) -> None:
    meta = await _cluster(make_client)
    config = await meta.config()
    await meta.allocate_client_id()
    with pytest.raises(ConfigError, match="refusing"):
        await meta.delete_cluster(uuid.uuid4())
    server = ClusterAdmin(await make_client())
    await server.register_server(await server.allocate_server_id(), "tcp://127.0.0.1:1")
    with pytest.raises(CoordinationError, match="registered"):
        await meta.delete_cluster(config.cluster_key)
    assert await meta.config() == config, "a refused delete changes nothing"
    await meta.delete_cluster(config.cluster_key, force=True)
    assert not await meta.exists()
    for top in ("/cluster", "/store", "/assignment", "/servers", "/ids"):
        assert not await meta.coordination.exists(top), top
    with pytest.raises(ClusterNotFoundError):
        await meta.delete_cluster(config.cluster_key)
    fresh = await meta.create_cluster(num_partitions=1, num_replicas=1, storage_nodes=NODES)
    assert fresh.cluster_key != config.cluster_key
    assert await meta.allocate_client_id() >= 1


def _after_listing_servers(meta: ClusterAdmin, hook: Callable[[], Awaitable[None]]) -> None:
    """Run ``hook`` once, right after ``meta`` listed the servers (a raise's check)."""
    client = meta.coordination
    children = client.children
    done = False

    async def listing(path: str) -> list[str]:
        nonlocal done
        found = await children(path)
        if path == SERVERS_DIR and not done:
            done = True
            await hook()
        return found

    client.children = listing  # type: ignore[method-assign]


async def test_a_feature_level_raise_and_a_registration_never_miss_each_other(
    make_client: MakeClient,
) -> None:
    """Both interleavings of a raise's check-and-write with a registration of a server
    that supports a lower level (issue 32): registered and confirmed between the check
    and the write, the raise's write fails and its next check refuses; registered after
    the check but confirming after the write, the server sees the raise and deregisters."""
    operator = ClusterAdmin(await make_client())
    await operator.create_cluster(
        num_partitions=1, num_replicas=2, storage_nodes=NODES, feature_level=1
    )
    server = ClusterAdmin(await make_client())

    async def register_7() -> None:
        assert await server.register_server(7, "tcp://127.0.0.1:7", max_feature_level=1) == 1

    _after_listing_servers(operator, register_7)
    with pytest.raises(WaltzError, match="stays 1, not raised to 2: server 7"):
        await operator.raise_feature_level(2)
    assert (await operator.feature_level()).value == 1
    await server.unregister_server(7)

    # the second order: the server's confirmation is held until the raise wrote
    other = ClusterAdmin(await make_client())
    held, go_on = asyncio.Event(), asyncio.Event()
    write = other.coordination.set

    async def held_set(path: str, value: bytes, *, expected_version: int | None = None) -> int:
        if path == FEATURES_PATH:
            held.set()
            await go_on.wait()
        return await write(path, value, expected_version=expected_version)

    other.coordination.set = held_set  # type: ignore[method-assign]
    registering: list[asyncio.Task[int]] = []

    async def register_8_up_to_its_confirmation() -> None:
        registering.append(
            asyncio.create_task(other.register_server(8, "tcp://127.0.0.1:8", max_feature_level=1))
        )
        async with asyncio.timeout(30):
            await held.wait()

    raiser = ClusterAdmin(await make_client())
    _after_listing_servers(raiser, register_8_up_to_its_confirmation)
    assert await raiser.raise_feature_level(2) == (1, 2)
    go_on.set()
    with pytest.raises(ConfigError, match="supports feature level 1 at most and the cluster is"):
        async with asyncio.timeout(30):
            await registering[0]
    assert await operator.servers() == []
    assert (await operator.feature_level()).value == 2
