"""The client against the real Waltz server, in one process: real components.

Coordination: the ``local`` plugin (SQLite file). Storage: three StorageNodes on
the fs engine (real files, fsync). Transport: ZeroMQ over loopback TCP, for the
storage nodes, the server and the clients. Server: ``start_server`` (what
``waltz server --config`` runs), with the default lock table (hwm-array).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sqlite3
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from waltz_api.cluster import ClusterMetadata, coordination_from_uri
from waltz_api.config import config_from_mapping
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
from waltz_server.server.config import ServerNodeConfig
from waltz_server.server.main import RunningServer, start_server
from waltz_server.storage_node import StorageNode
from waltz_storage_fs.engine import FsStorageEngine

pytestmark = [pytest.mark.timeout(180), pytest.mark.system]


def free_ports(n: int) -> list[int]:
    sockets = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@dataclass
class RealCluster:
    uri: str
    coordination: Coordination
    nodes: list[StorageNode]
    server: RunningServer

    async def restart_server(self) -> None:
        """Stop the server, start a new one on another port (the partition moves)."""
        await self.server.stop()
        self.server = await start_server(server_config(self.uri))
        await wait_served(self.server, ClusterMetadata(self.coordination))


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


async def wait_served(server: RunningServer, metadata: ClusterMetadata) -> None:
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


@pytest.fixture
async def real_cluster(tmp_path: Path) -> AsyncIterator[RealCluster]:
    uri = f"local://{tmp_path / 'coordination'}?root=/waltz"
    coordination = coordination_from_uri(uri)
    await coordination.start()
    key = uuid.uuid4()
    connects = [f"127.0.0.1:{p}" for p in free_ports(3)]
    metadata = ClusterMetadata(coordination)
    await metadata.create_cluster(
        num_partitions=1, num_replicas=3, storage_nodes=connects, cluster_key=key
    )
    nodes: list[StorageNode] = []
    server: RunningServer | None = None
    cluster: RealCluster | None = None
    try:
        for i, connect in enumerate(connects):
            engine = await FsStorageEngine.open(
                str(tmp_path / f"storage-{i}"), cluster_key=key, num_partitions=1
            )
            await engine.add_partition(0)
            transport = get_registry().get("transport", "zmq").factory({})
            node = StorageNode(engine, transport, f"tcp://{connect}")
            await node.start()
            nodes.append(node)
        server = await start_server(server_config(uri))
        await wait_served(server, metadata)
        cluster = RealCluster(uri, coordination, nodes, server)
        yield cluster
    finally:
        if cluster is not None:
            await cluster.server.stop()
        elif server is not None:
            await server.stop()
        for node in nodes:
            with contextlib.suppress(Exception):
                await node.close()
                await node.engine.close()
        await coordination.close()


class Counter(WaltzClientCallbacks):
    """An application instance: a counter, rebuilt from the feed."""

    def __init__(self) -> None:
        self.value = 0
        self.hwm = -1
        self.applied: list[int] = []

    async def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwm

    async def apply_transaction(self, transaction: Transaction) -> None:
        change: dict[str, Any] = await transaction.fetch_data(JSON)
        self.value = change["value"]
        self.applied.append(transaction.transaction_id)
        self.hwm = transaction.transaction_id


class Increment(TransactionContext):
    def __init__(self, app: Counter) -> None:
        super().__init__()
        self.app = app
        self.lock_failures = 0

    def partition_id(self, num_partitions: int) -> int:
        return 0

    async def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_data({"value": self.app.value + 1}, JSON)
        builder.write_lock("counter", 0)
        return True

    def on_lock_failure(self, transaction_id: int) -> None:
        self.lock_failures += 1


async def test_counter_n_clients_m_increments_with_a_write_lock(real_cluster: RealCluster) -> None:
    """spec/waltz-announcement.txt: N clients x M increments with a WRITE lock give N x M."""
    n_clients, increments = 3, 10
    apps = [Counter() for _ in range(n_clients)]
    config = ClientConfig(real_cluster.uri, transport="zmq", request_timeout=30.0)
    clients = [AsyncWaltzClient(app, config) for app in apps]
    try:
        for client in clients:
            await client.start()

        async def run(client: AsyncWaltzClient, app: Counter) -> list[Increment]:
            contexts = []
            for _ in range(increments):
                ctx = Increment(app)
                assert await client.submit(ctx) is True
                contexts.append(ctx)
            return contexts

        done = await asyncio.wait_for(
            asyncio.gather(*(run(c, a) for c, a in zip(clients, apps, strict=True))), 150
        )
        total = n_clients * increments
        for client in clients:
            assert await client.flush(0) == total - 1
        for app in apps:
            assert app.value == total  # no lost update
            assert app.applied == list(range(total))  # each transaction once, in order
        contexts = [ctx for group in done for ctx in group]
        assert all(ctx.attempts >= 1 for ctx in contexts)
        # concurrent increments conflicted and were retried after the feed caught up
        assert sum(ctx.lock_failures for ctx in contexts) > 0
    finally:
        for client in clients:
            await client.close()


class Bank(WaltzClientCallbacks):
    def __init__(self) -> None:
        self.balance = 0
        self.hwm = -1
        self.history: list[int] = []

    async def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwm

    async def apply_transaction(self, transaction: Transaction) -> None:
        change: dict[str, int] = await transaction.fetch_data(JSON)
        self.balance += change["amount"]
        self.history.append(self.balance)
        self.hwm = transaction.transaction_id


class Move(TransactionContext):
    def __init__(self, bank: Bank, amount: int) -> None:
        super().__init__()
        self.bank = bank
        self.amount = amount

    def partition_id(self, num_partitions: int) -> int:
        return 0

    async def execute(self, builder: TransactionBuilder) -> bool:
        if self.bank.balance + self.amount < 0:
            return False  # insufficient funds, on the state the transaction is built on
        builder.set_data({"amount": self.amount}, JSON)
        builder.write_lock("account", 1)
        return True


async def test_concurrent_withdrawals_never_make_a_balance_negative(
    real_cluster: RealCluster,
) -> None:
    banks = [Bank() for _ in range(3)]
    config = ClientConfig(real_cluster.uri, transport="zmq")
    clients = [AsyncWaltzClient(bank, config) for bank in banks]
    try:
        for client in clients:
            await client.start()
        assert await clients[0].submit(Move(banks[0], 100)) is True
        for client in clients:
            await client.flush(0)

        async def withdraw(client: AsyncWaltzClient, bank: Bank) -> list[bool]:
            return [await client.submit(Move(bank, -30)) for _ in range(4)]

        outcomes = await asyncio.wait_for(
            asyncio.gather(*(withdraw(c, b) for c, b in zip(clients, banks, strict=True))), 150
        )
        for client in clients:
            await client.flush(0)
        granted = sum(o.count(True) for o in outcomes)
        assert granted == 3  # 100 covers three withdrawals of 30, never a fourth
        for bank in banks:
            assert bank.balance == 10
            assert min(bank.history) >= 0
    finally:
        for client in clients:
            await client.close()


class Tagged(WaltzClientCallbacks):
    def __init__(self) -> None:
        self.hwm = -1
        self.tags: list[str] = []

    async def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwm

    async def apply_transaction(self, transaction: Transaction) -> None:
        self.tags.append((await transaction.fetch_data(JSON))["tag"])
        assert transaction.transaction_id == self.hwm + 1
        self.hwm = transaction.transaction_id


class Put(TransactionContext):
    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag

    def partition_id(self, num_partitions: int) -> int:
        return 0

    async def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_data({"tag": self.tag}, JSON)
        return True


async def test_a_server_restarted_under_load_loses_and_duplicates_nothing(
    real_cluster: RealCluster,
) -> None:
    apps = [Tagged(), Tagged()]
    config = ClientConfig(real_cluster.uri, transport="zmq", retry_interval=0.05)
    clients = [AsyncWaltzClient(app, config) for app in apps]
    per_client = 60
    try:
        for client in clients:
            await client.start()
        submissions = [
            asyncio.ensure_future(client.submit(Put(f"c{i}-{k}")))
            for i, client in enumerate(clients)
            for k in range(per_client)
        ]
        async with asyncio.timeout(60):
            while apps[0].hwm < 10:  # noqa: ASYNC110 - polls application state
                await asyncio.sleep(0.005)
        generation = await ClusterMetadata(real_cluster.coordination).partition_assignment(0)
        in_flight = sum(not s.done() for s in submissions)
        await real_cluster.restart_server()
        moved = (await ClusterMetadata(real_cluster.coordination).partition_assignment(0)).value
        assert moved.generation > generation.value.generation
        results = await asyncio.wait_for(asyncio.gather(*submissions), 150)
        assert results == [True] * len(submissions)
        expected = sorted(f"c{i}-{k}" for i in range(len(clients)) for k in range(per_client))
        for client, app in zip(clients, apps, strict=True):
            top = await client.flush(0)
            assert top == len(expected) - 1
            assert sorted(app.tags) == expected  # nothing lost, nothing twice
            partition = client.partitions[0]
            assert (partition.mount.endpoint, partition.mount.generation) == (
                moved.endpoint,
                moved.generation,
            )  # it follows the partition to the new server
        assert in_flight > 0, "the restart was not under load"
    finally:
        for client in clients:
            await client.close()


WORKER = Path(__file__).with_name("e2e_client_worker.py")


def ledger_rows(database: Path) -> list[tuple[int, str]]:
    try:
        with sqlite3.connect(database, timeout=30) as conn:
            return list(conn.execute("SELECT transaction_id, tag FROM ledger"))
    except sqlite3.OperationalError:
        return []  # not created yet


async def test_a_client_process_killed_and_restarted_applies_every_transaction_once(
    real_cluster: RealCluster, tmp_path: Path
) -> None:
    database = tmp_path / "app.db"

    async def spawn(count: int, name: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            str(WORKER),
            real_cluster.uri,
            str(database),
            str(count),
            name,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )

    first = await spawn(300, "first")
    try:
        async with asyncio.timeout(90):
            while len(ledger_rows(database)) < 30:
                assert first.returncode is None, await first.communicate()
                await asyncio.sleep(0.02)
        first.kill()  # SIGKILL, mid-way through its submissions
        await first.wait()
        assert first.returncode == -signal.SIGKILL
        before = len(ledger_rows(database))
        second = await spawn(20, "second")  # the same application, same database
        out, err = await asyncio.wait_for(second.communicate(), 120)
        assert second.returncode == 0, err.decode()[-3000:]
    finally:
        if first.returncode is None:
            first.kill()
            await first.wait()
    top = int(out.decode().split(" done at ")[1])
    rows = ledger_rows(database)
    # every transaction of the log applied exactly once, in the database, across the crash
    assert sorted(t for t, _ in rows) == list(range(top + 1))
    tags = [tag for _, tag in rows]
    assert len(set(tags)) == len(tags)
    assert sum(tag.startswith("second-") for tag in tags) == 20
    assert before < len(rows)
