"""Test and benchmark support: a real Waltz cluster (local coordination, 3 fs storage
nodes, ZeroMQ, the server) on its own event loop thread, and a bulk appender.

Needs the server packages (waltz-server, waltz-storage-fs, waltz-coord-local,
waltz-transport-zmq), as the workspace has them."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from waltz_api.cluster import ClusterMetadata, coordination_from_uri
from waltz_api.config import config_from_mapping
from waltz_api.plugins import get_registry
from waltz_api.ports import free_ports
from waltz_api.types import Record, ReqId
from waltz_api.wire import checksum
from waltz_client import ClientConfig, Transaction, TransactionContext, WaltzClientCallbacks
from waltz_client.api import TransactionBuilder
from waltz_server.server.config import ServerNodeConfig
from waltz_server.server.main import RunningServer, start_server
from waltz_server.storage_node import StorageNode
from waltz_storage_fs.engine import FsStorageEngine

T = TypeVar("T")
PARTITIONS = 2


class BackgroundCluster:
    """The cluster's components on a private event loop thread."""

    def __init__(
        self, root: Path, partitions: int = PARTITIONS, preload: int = 0, data_size: int = 100
    ) -> None:
        """``preload``: transactions per partition written straight to every storage
        node's engine before the server starts (a large log in seconds)."""
        self.root = root
        self.partitions = partitions
        self.preload = preload
        self.data_size = data_size
        self.uri = f"local://{root / 'coordination'}?root=/waltz"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="cluster", daemon=True)
        self.nodes: list[StorageNode] = []
        self.transports: list[Any] = []
        self.server: RunningServer | None = None
        self.coordination: Any = None

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> None:
        self.thread.start()
        self.run(self._start())

    async def _start(self) -> None:
        self.coordination = coordination_from_uri(self.uri)
        await self.coordination.start()
        key = uuid.uuid4()
        connects = [f"127.0.0.1:{p}" for p in free_ports(3)]
        metadata = ClusterMetadata(self.coordination)
        await metadata.create_cluster(
            num_partitions=self.partitions, num_replicas=3, storage_nodes=connects, cluster_key=key
        )
        for i, connect in enumerate(connects):
            engine = await FsStorageEngine.open(
                str(self.root / f"storage-{i}"), cluster_key=key, num_partitions=self.partitions
            )
            for p in range(self.partitions):
                stored = await engine.add_partition(p)
                await self._preload(stored, p)
            transport = get_registry().get("transport", "zmq").factory({})
            self.transports.append(transport)
            node = StorageNode(engine, transport, f"tcp://{connect}")
            await node.start()
            self.nodes.append(node)
        config = config_from_mapping(
            ServerNodeConfig,
            {
                "coordination": {"uri": self.uri},
                "transport": {
                    "plugin": "zmq",
                    "endpoint": f"tcp://127.0.0.1:{free_ports(1)[0]}",
                    "storage_endpoint": "tcp://{}",
                },
                "http": {"enabled": False},
            },
        )
        self.server = await start_server(config)
        async with asyncio.timeout(60):
            for p in range(self.partitions):
                while True:
                    owner = (await metadata.partition_assignment(p)).value
                    held = self.server.server.partitions.get(p)
                    if (
                        owner.server_id == self.server.manager.server_id
                        and held is not None
                        and held.generation == owner.generation
                        and held.ready
                    ):
                        break
                    await asyncio.sleep(0.05)

    async def _preload(self, stored: Any, partition: int) -> None:
        batch = 5_000
        for first in range(0, self.preload, batch):
            records = []
            for tid in range(first, min(first + batch, self.preload)):
                data = (b"%d:%d:" % (partition, tid)).ljust(self.data_size, b".")
                records.append(
                    Record(tid, ReqId(7, 0, partition, tid + 1), tid % 1000, data, checksum(data))
                )
            await stored.append(records)

    async def _stop(self) -> None:
        if self.server is not None:
            await self.server.stop()
        for node in self.nodes:
            with contextlib.suppress(Exception):
                await node.close()
                await node.engine.close()
        for transport in self.transports:
            with contextlib.suppress(Exception):
                await transport.close()
        if self.coordination is not None:
            await self.coordination.close()

    def stop(self) -> None:
        try:
            if self.thread.is_alive():
                self.run(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)
            if not self.thread.is_alive():
                self.loop.close()


class _Ignore(WaltzClientCallbacks):
    def __init__(self) -> None:
        self.marks: dict[int, int] = {}

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.marks.get(partition_id, -1)

    def apply_transaction(self, transaction: Transaction) -> None:
        self.marks[transaction.partition_id] = transaction.transaction_id


class _Put(TransactionContext):
    def __init__(self, partition: int, header: int, data: bytes) -> None:
        super().__init__()
        self.partition = partition
        self.header = header
        self.data = data

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_header(self.header)
        builder.set_data(self.data)
        return True


def append(uri: str, items: list[tuple[int, int, bytes]]) -> None:
    """Append (partition, header, data) transactions with the real client."""
    from waltz_client import WaltzClient

    with WaltzClient(_Ignore(), ClientConfig(uri, transport="zmq")) as client:
        futures = [client.submit(_Put(p, h, d)) for p, h, d in items]
        assert all(f.result(timeout=120) for f in futures)
