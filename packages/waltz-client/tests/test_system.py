"""The client against the whole system as real processes: a real ZooKeeper, three
``waltz storage`` processes (fs engine, real fsync) and two ``waltz server``
processes over ZeroMQ. The clients run in the test process."""

from __future__ import annotations

import asyncio
import socket
import tomllib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from waltz_api.cluster import ClusterMetadata, coordination_from_uri
from waltz_api.contracts.coordination import Coordination
from waltz_api.plugins import get_registry
from waltz_client import (
    JSON,
    AsyncWaltzClient,
    ClientConfig,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClientCallbacks,
)
from waltz_conformance.servers.zookeeper import ZooKeeperServer
from waltz_server.server.testing import ServerProcess
from waltz_server.storage_node.testing import StorageNodeProcess

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.timeout(300)]
SESSION_TIMEOUT = 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class System:
    uri: str
    coordination: Coordination
    servers: list[ServerProcess]


@pytest.fixture
async def system(zookeeper_server: ZooKeeperServer, tmp_path: Path) -> AsyncIterator[System]:
    uri = zookeeper_server.uri(f"/waltz-client-{uuid.uuid4().hex[:8]}")
    key = uuid.uuid4()
    ports = [free_port() for _ in range(3)]
    coordination = coordination_from_uri(uri, {"session_timeout": SESSION_TIMEOUT})
    await coordination.start()
    await ClusterMetadata(coordination).create_cluster(
        num_partitions=1,
        num_replicas=3,
        storage_nodes=[f"127.0.0.1:{p}" for p in ports],
        cluster_key=key,
    )
    storage: list[StorageNodeProcess] = []
    for i, port in enumerate(ports):
        config = tmp_path / f"storage{i}.toml"
        config.write_text(
            "\n".join(
                [
                    "[storage]",
                    f'data_dir = "{tmp_path / f"data{i}"}"',
                    'engine = "fs"',
                    f'cluster_key = "{key}"',
                    "num_partitions = 1",
                    "partitions = [0]",
                    "[transport]",
                    'plugin = "zmq"',
                    f'endpoint = "tcp://127.0.0.1:{port}"',
                ]
            )
            + "\n"
        )
        storage.append(
            StorageNodeProcess(config, f"tcp://127.0.0.1:{port}", tmp_path / f"storage{i}.log")
        )
    servers: list[ServerProcess] = []
    for i in range(2):
        config = tmp_path / f"server{i}.toml"
        config.write_text(
            "\n".join(
                [
                    'log_level = "INFO"',
                    "[coordination]",
                    f'uri = "{uri}"',
                    "[coordination.options]",
                    f"session_timeout = {SESSION_TIMEOUT}",
                    "[transport]",
                    'plugin = "zmq"',
                    f'endpoint = "tcp://127.0.0.1:{free_port()}"',
                    'storage_endpoint = "tcp://{}"',
                ]
            )
            + "\n"
        )
        servers.append(ServerProcess(config, tmp_path / f"server{i}.log"))
    transport = get_registry().get("transport", "zmq").factory({})
    try:
        for node in storage:
            node.start()
        for node in storage:
            await node.wait_ready(transport)
        for server in servers:
            server.start()
        for server in servers:
            await server.wait_ready()
        yield System(uri, coordination, servers)
    finally:
        for server in servers:
            server.kill()
        for node in storage:
            node.kill()
        await transport.close()
        await coordination.close()


class Counter(WaltzClientCallbacks):
    def __init__(self) -> None:
        self.value = 0
        self.hwm = -1
        self.tags: list[str] = []

    async def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwm

    async def apply_transaction(self, transaction: Transaction) -> None:
        assert transaction.transaction_id == self.hwm + 1, "out of order"
        change: dict[str, Any] = await transaction.fetch_data(JSON)
        self.value = change["value"]
        self.tags.append(change["tag"])
        self.hwm = transaction.transaction_id


class Increment(TransactionContext):
    def __init__(self, app: Counter, tag: str) -> None:
        super().__init__()
        self.app = app
        self.tag = tag

    def partition_id(self, num_partitions: int) -> int:
        return 0

    async def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_data({"value": self.app.value + 1, "tag": self.tag}, JSON)
        builder.write_lock("counter", 0)
        return True


async def test_counter_survives_the_kill_of_the_serving_server(system: System) -> None:
    """N clients x M increments with a WRITE lock give N x M, while the server that
    serves the partition is killed -9 mid-way (the partition moves to the other)."""
    n_clients, increments = 3, 20
    apps = [Counter() for _ in range(n_clients)]
    config = ClientConfig(
        system.uri,
        coordination_options={"session_timeout": SESSION_TIMEOUT},
        transport="zmq",
        retry_interval=0.1,
        request_timeout=60.0,
    )
    clients = [AsyncWaltzClient(app, config) for app in apps]
    metadata = ClusterMetadata(system.coordination)
    try:
        for client in clients:
            await client.start()

        async def run(i: int, client: AsyncWaltzClient, app: Counter) -> None:
            for k in range(increments):
                assert await client.submit(Increment(app, f"c{i}-{k}")) is True

        work = asyncio.gather(
            *(run(i, c, a) for i, (c, a) in enumerate(zip(clients, apps, strict=True)))
        )
        async with asyncio.timeout(120):
            while apps[0].hwm < 10:  # noqa: ASYNC110 - polls application state
                await asyncio.sleep(0.01)
        before = (await metadata.partition_assignment(0)).value
        victim = next(
            s
            for s in system.servers
            if tomllib.loads(s.config_path.read_text())["transport"]["endpoint"] == before.endpoint
        )
        victim.kill()
        await asyncio.wait_for(work, 240)
        after = (await metadata.partition_assignment(0)).value
        assert after.generation > before.generation and after.endpoint != before.endpoint
        total = n_clients * increments
        expected = sorted(f"c{i}-{k}" for i in range(n_clients) for k in range(increments))
        for client, app in zip(clients, apps, strict=True):
            assert await client.flush(0) == total - 1
            assert app.value == total  # no lost update
            assert sorted(app.tags) == expected  # each increment exactly once
    finally:
        for client in clients:
            await client.close()
