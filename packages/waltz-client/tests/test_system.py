"""The client against the whole system as real processes: a real ZooKeeper, three
``waltz storage`` processes (fs engine, real fsync) and two ``waltz server``
processes over ZeroMQ.

One cluster serves every test of the module; each scenario (scenarios.py, the same
ones test_end_to_end.py runs in one process) uses its own partition. The clients
run in the test process, except the application process of the kill -9 scenario.
"""

from __future__ import annotations

import tomllib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
import scenarios
from scenarios import Target

from waltz_api.cluster import coordination_from_uri
from waltz_api.contracts.coordination import Coordination
from waltz_api.plugins import get_registry
from waltz_api.ports import free_port
from waltz_conformance.servers.zookeeper import ZooKeeperServer
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.server.testing import ServerProcess
from waltz_storage_node.testing import StorageNodeProcess

pytestmark = [
    pytest.mark.system,
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.asyncio(loop_scope="module"),
]
SESSION_TIMEOUT = 4
PARTITIONS = {
    "counter": 0,
    "withdrawals": 1,
    "client-kill": 2,
    "server-kill": 3,
    "server-term": 4,
    "counter-server-kill": 5,
}


@dataclass
class System:
    uri: str
    coordination: Coordination
    servers: list[ServerProcess]
    workdir: Path

    def target(self, scenario: str) -> Target:
        return Target(
            self.uri,
            self.coordination,
            PARTITIONS[scenario],
            coordination_options={"session_timeout": SESSION_TIMEOUT},
        )

    async def serving(self, partition: int) -> ServerProcess:
        """The server process the partition is assigned to now."""
        owner = (await ClusterAdmin(self.coordination).partition_assignment(partition)).value
        return next(
            s
            for s in self.servers
            if tomllib.loads(s.config_path.read_text())["transport"]["endpoint"] == owner.endpoint
        )

    def restarter(self, partition: int, *, crash: bool) -> Callable[[], Awaitable[None]]:
        """A coroutine function that stops the partition's server (SIGKILL when
        ``crash``, else SIGTERM) and starts it again (same config and endpoint)."""

        async def restart() -> None:
            server = await self.serving(partition)
            if crash:
                server.kill()
            else:
                assert server.terminate() == 0, server.output()[-3000:]
            # a new log file: the old one holds the previous run's ready line
            server.log_path = server.log_path.with_name(
                f"{uuid.uuid4().hex[:6]}-{server.log_path.name}"
            )
            server.start()
            await server.wait_ready()

        return restart


def storage_config(path: Path, data: Path, key: uuid.UUID, port: int) -> Path:
    path.write_text(
        "\n".join(
            [
                "[storage]",
                f'data_dir = "{data}"',
                'engine = "fs"',
                f'cluster_key = "{key}"',
                f"num_partitions = {len(PARTITIONS)}",
                f"partitions = {list(PARTITIONS.values())}",
                "[transport]",
                'plugin = "zmq"',
                f'endpoint = "tcp://127.0.0.1:{port}"',
            ]
        )
        + "\n"
    )
    return path


def server_config(path: Path, uri: str) -> Path:
    path.write_text(
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
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def system(
    zookeeper_server: ZooKeeperServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[System]:
    """ZooKeeper, 3 storage nodes and 2 servers, as processes; stopped by pid."""
    workdir = tmp_path_factory.mktemp("client-system")
    uri = zookeeper_server.uri(f"/waltz-client-{uuid.uuid4().hex[:8]}")
    key = uuid.uuid4()
    ports = [free_port() for _ in range(3)]
    coordination = coordination_from_uri(uri, {"session_timeout": SESSION_TIMEOUT})
    await coordination.start()
    storage: list[StorageNodeProcess] = []
    servers: list[ServerProcess] = []
    transport = get_registry().get("transport", "zmq").factory({})
    try:
        await ClusterAdmin(coordination).create_cluster(
            num_partitions=len(PARTITIONS),
            num_replicas=3,
            storage_nodes=[f"127.0.0.1:{p}" for p in ports],
            cluster_key=key,
        )
        for i, port in enumerate(ports):
            config = storage_config(workdir / f"storage{i}.toml", workdir / f"data{i}", key, port)
            storage.append(
                StorageNodeProcess(config, f"tcp://127.0.0.1:{port}", workdir / f"storage{i}.log")
            )
        for i in range(2):
            config = server_config(workdir / f"server{i}.toml", uri)
            servers.append(ServerProcess(config, workdir / f"server{i}.log"))
        for node in storage:
            node.start()
        for node in storage:
            await node.wait_ready(transport)
        for server in servers:
            server.start()
        for server in servers:
            await server.wait_ready()
        yield System(uri, coordination, servers, workdir)
    finally:
        for server in servers:
            server.kill()
        for node in storage:
            node.kill()
        await transport.close()
        await coordination.close()


async def test_counter_n_clients_m_increments_with_a_write_lock(system: System) -> None:
    """../shared/spec/waltz-announcement.txt: N clients x M increments with a WRITE lock
    give N x M."""
    await scenarios.counter(system.target("counter"), n_clients=3, increments=10)


async def test_concurrent_withdrawals_never_make_a_balance_negative(system: System) -> None:
    await scenarios.withdrawals(system.target("withdrawals"))


async def test_a_client_process_killed_and_restarted_applies_every_transaction_once(
    system: System,
) -> None:
    await scenarios.client_killed_and_restarted(
        system.target("client-kill"), system.workdir / "app.db"
    )


async def test_a_server_killed_and_restarted_under_load_loses_and_duplicates_nothing(
    system: System,
) -> None:
    target = system.target("server-kill")
    await scenarios.server_restarted_under_load(
        target, system.restarter(target.partition, crash=True)
    )


async def test_a_server_stopped_and_restarted_under_load_loses_and_duplicates_nothing(
    system: System,
) -> None:
    target = system.target("server-term")
    await scenarios.server_restarted_under_load(
        target, system.restarter(target.partition, crash=False)
    )


async def test_the_counter_survives_the_kill_of_its_server(system: System) -> None:
    """The counter while the server of its partition is killed -9 and restarted:
    lock conflicts across the move still give exactly N x M."""
    target = system.target("counter-server-kill")
    await scenarios.counter(
        target, n_clients=3, increments=15, disrupt=system.restarter(target.partition, crash=True)
    )
