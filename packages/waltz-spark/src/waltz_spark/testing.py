"""Test and benchmark support: a real Waltz cluster (local coordination, 3 fs storage
nodes, ZeroMQ, the server) on its own event loop thread, and a bulk appender.

Needs the server packages (waltz-server, waltz-storage-fs, waltz-coord-local,
waltz-transport-zmq), as the workspace has them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from waltz_api.contracts.storage import StoragePartition
from waltz_api.types import Record, ReqId
from waltz_api.wire import checksum
from waltz_client import ClientConfig, Transaction, TransactionContext, WaltzClientCallbacks
from waltz_client.api import TransactionBuilder
from waltz_dev.inprocess import InProcessCluster
from waltz_server.server.main import RunningServer
from waltz_storage_node import StorageNode

T = TypeVar("T")
PARTITIONS = 2


class BackgroundCluster:
    """An :class:`~waltz_dev.inprocess.InProcessCluster` (local coordination, 3 fs
    storage nodes, ZeroMQ, one server) on a private event loop thread."""

    def __init__(
        self,
        root: Path,
        partitions: int = PARTITIONS,
        preload: int = 0,
        data_size: int = 100,
        *,
        server_settings: dict[str, Any] | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        """``preload``: transactions per partition written straight to every storage
        node's engine before the server starts (a large log in seconds);
        ``server_settings``: extra keys of the server's ``[server]`` table (an archive);
        ``storage_options``: the storage engine's options."""
        self.root = root
        self.partitions = partitions
        self.preload = preload
        self.data_size = data_size
        self.cluster = InProcessCluster(
            root,
            num_partitions=partitions,
            preload=self._preload if preload else None,
            server_settings=dict(server_settings or {}),
            storage_options=dict(storage_options or {}),
        )
        self.uri = self.cluster.coordination_uri
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="cluster", daemon=True)

    @property
    def server(self) -> RunningServer:
        return self.cluster.server()

    @property
    def nodes(self) -> list[StorageNode]:
        """The running storage nodes."""
        return [node for node in self.cluster.nodes if node is not None]

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> None:
        self.thread.start()
        self.run(self.cluster.start())

    async def _preload(self, stored: StoragePartition, partition: int) -> None:
        batch = 5_000
        for first in range(0, self.preload, batch):
            records = []
            for tid in range(first, min(first + batch, self.preload)):
                data = (b"%d:%d:" % (partition, tid)).ljust(self.data_size, b".")
                records.append(
                    Record(tid, ReqId(7, 0, partition, tid + 1), tid % 1000, data, checksum(data))
                )
            await stored.append(records)

    def stop(self) -> None:
        try:
            if self.thread.is_alive():
                self.run(self.cluster.close())
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
