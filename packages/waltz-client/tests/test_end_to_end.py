"""The client against the real Waltz server, in one process: real components. The
scenarios (scenarios.py) are the same as test_system.py runs on real processes.

Coordination: the ``local`` plugin (SQLite file). Storage: three StorageNodes on
the fs engine (real files, fsync). Transport: ZeroMQ over loopback TCP, for the
storage nodes, the server and the clients. Server: ``start_server`` (what
``waltz server --config`` runs), with the default lock table (hwm-array).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import scenarios
from scenarios import Target

from waltz_api.cluster import coordination_from_uri
from waltz_api.config import config_from_mapping
from waltz_api.contracts.coordination import Coordination
from waltz_api.plugins import get_registry
from waltz_api.ports import free_ports
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.server.config import ServerNodeConfig
from waltz_server.server.main import RunningServer, start_server
from waltz_storage_fs.engine import FsStorageEngine
from waltz_storage_node import StorageNode

pytestmark = [pytest.mark.timeout(180), pytest.mark.system]


@dataclass
class RealCluster:
    uri: str
    coordination: Coordination
    nodes: list[StorageNode]
    server: RunningServer
    storage: list[tuple[Path, str]]
    """Each storage node's directory and endpoint (to restart it)."""
    key: uuid.UUID

    async def stop_storage(self) -> None:
        """Every storage node stops (its engine closes): no store session can commit."""
        for node in self.nodes:
            await node.close()
        self.nodes.clear()

    async def start_storage(self) -> None:
        """The storage nodes again, on their files and endpoints."""
        for directory, connect in self.storage:
            self.nodes.append(await start_storage_node(directory, self.key, connect))

    async def restart_server(self) -> None:
        """Stop the server, start a new one on another port (the partition moves)."""
        await self.server.stop()
        self.server = await start_server(server_config(self.uri))
        await wait_served(self.server, ClusterAdmin(self.coordination))


def server_config(uri: str) -> ServerNodeConfig:
    return config_from_mapping(
        ServerNodeConfig,
        {
            "coordination": {"uri": uri},
            "transport": {
                "plugin": "zmq",
                "endpoint": f"tcp://127.0.0.1:{free_ports(1)[0]}",
                "storage_endpoint": "tcp://{}",
            },
            "http": {"enabled": False},
        },
    )


async def wait_served(server: RunningServer, metadata: ClusterAdmin) -> None:
    async with asyncio.timeout(60):
        while True:
            owner = (await metadata.partition_assignment(0)).value
            held = server.server.partitions.get(0)
            if (
                owner.server_id == server.manager.server_id
                and held is not None
                and held.generation == owner.generation
                and held.ready
            ):
                return
            await asyncio.sleep(0.05)


async def start_storage_node(directory: Path, key: uuid.UUID, connect: str) -> StorageNode:
    engine = await FsStorageEngine.open(str(directory), cluster_key=key, num_partitions=1)
    if 0 not in engine.partition_ids():
        await engine.add_partition(0)
    transport = get_registry().get("transport", "zmq").factory({})
    node = StorageNode(engine, transport, f"tcp://{connect}")
    await node.start()
    return node


@pytest.fixture
async def real_cluster(tmp_path: Path) -> AsyncIterator[RealCluster]:
    uri = f"local://{tmp_path / 'coordination'}?root=/waltz"
    coordination = coordination_from_uri(uri)
    await coordination.start()
    key = uuid.uuid4()
    connects = [f"127.0.0.1:{p}" for p in free_ports(3)]
    metadata = ClusterAdmin(coordination)
    await metadata.create_cluster(
        num_partitions=1, num_replicas=3, storage_nodes=connects, cluster_key=key
    )
    nodes: list[StorageNode] = []
    server: RunningServer | None = None
    cluster: RealCluster | None = None
    try:
        storage = [(tmp_path / f"storage-{i}", connect) for i, connect in enumerate(connects)]
        for directory, connect in storage:
            nodes.append(await start_storage_node(directory, key, connect))
        server = await start_server(server_config(uri))
        await wait_served(server, metadata)
        cluster = RealCluster(uri, coordination, nodes, server, storage, key)
        yield cluster
    finally:
        if cluster is not None:
            await cluster.server.stop()
        elif server is not None:
            await server.stop()
        for node in cluster.nodes if cluster is not None else nodes:
            with contextlib.suppress(Exception):
                await node.close()
                await node.engine.close()
        await coordination.close()


def target(cluster: RealCluster) -> Target:
    return Target(cluster.uri, cluster.coordination, partition=0)


async def test_counter_n_clients_m_increments_with_a_write_lock(real_cluster: RealCluster) -> None:
    """../shared/spec/waltz-announcement.txt: N clients x M increments with a WRITE lock
    give N x M."""
    await scenarios.counter(target(real_cluster), n_clients=3, increments=10)


async def test_counter_increments_submitted_in_batches(real_cluster: RealCluster) -> None:
    """The same through ``submit_many``: every transaction of a batch is retried on its
    own lock failures, each commits once."""
    await scenarios.counter(target(real_cluster), n_clients=3, increments=12, batch=4)


async def test_concurrent_withdrawals_never_make_a_balance_negative(
    real_cluster: RealCluster,
) -> None:
    await scenarios.withdrawals(target(real_cluster))


async def test_a_server_restarted_under_load_loses_and_duplicates_nothing(
    real_cluster: RealCluster,
) -> None:
    await scenarios.server_restarted_under_load(target(real_cluster), real_cluster.restart_server)


async def test_a_server_restarted_under_submit_nowait_batches_loses_and_duplicates_nothing(
    real_cluster: RealCluster,
) -> None:
    await scenarios.server_restarted_under_load(
        target(real_cluster), real_cluster.restart_server, nowait=True
    )


async def test_a_client_process_killed_and_restarted_applies_every_transaction_once(
    real_cluster: RealCluster, tmp_path: Path
) -> None:
    await scenarios.client_killed_and_restarted(target(real_cluster), tmp_path / "app.db")


async def test_an_append_in_flight_while_storage_restarts_is_decided_truthfully(
    real_cluster: RealCluster,
) -> None:
    """Every storage node stops with an append in flight; its deadline passes; the
    client asks the server (a flush), which can decide only once storage is back: the
    answer then comes, and it is the truth (committed at the id that holds it, or not
    committed and not in the log), within the deadline plus the time to ask."""
    await scenarios.append_in_flight_while_storage_restarts(
        target(real_cluster), real_cluster.stop_storage, real_cluster.start_storage
    )
