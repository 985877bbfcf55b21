"""Test support: a real cluster metadata store (the ``local`` coordination plugin on a
SQLite file) that points partitions at protocol test peers."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from client_protocol_peer import PeerConnection, ProtocolTestPeer

from waltz_api.cluster import coordination_from_uri
from waltz_api.contracts.coordination import Coordination
from waltz_api.messages import FeedData, MountRequest, MountResponse, MountStatus
from waltz_api.types import ReqId
from waltz_client import (
    ClientConfig,
    SubmissionResult,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClientCallbacks,
)
from waltz_server.cluster_admin import ClusterAdmin

SERVER_ID = 1


@dataclass
class Cluster:
    uri: str
    coordination: Coordination
    metadata: ClusterAdmin
    num_partitions: int

    async def assign(
        self, partition: int, peer: ProtocolTestPeer, server_id: int = SERVER_ID
    ) -> int:
        """Point ``partition`` at ``peer``; returns the new generation."""
        current = await self.metadata.partition_assignment(partition)
        stored = await self.metadata.assign_partition(
            partition, server_id, peer.endpoint, expected_version=current.version
        )
        return stored.value.generation

    def config(self, **overrides: object) -> ClientConfig:
        options: dict[str, object] = {
            "coordination": self.uri,
            "transport": "memory",
            "retry_interval": 0.05,
            "request_timeout": 10.0,
        }
        options.update(overrides)
        return ClientConfig(**options)  # type: ignore[arg-type]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    uri = f"local://{tmp_path / 'coordination'}?root=/waltz"
    coordination = coordination_from_uri(uri, {"session_timeout": 5.0})
    await coordination.start()
    metadata = ClusterAdmin(coordination)
    await metadata.create_cluster(num_partitions=2, num_replicas=1, storage_nodes=["storage:1"])
    try:
        yield Cluster(uri, coordination, metadata, 2)
    finally:
        await coordination.close()


@pytest.fixture
async def peer() -> AsyncIterator[ProtocolTestPeer]:
    p = await ProtocolTestPeer().start()
    try:
        yield p
    finally:
        await p.close()


@pytest.fixture(params=["memory", "zmq"])
async def any_peer(request: pytest.FixtureRequest) -> AsyncIterator[ProtocolTestPeer]:
    """A protocol test peer on the ``memory`` transport, then on real ZeroMQ sockets."""
    p = await ProtocolTestPeer(transport=request.param).start()
    try:
        yield p
    finally:
        await p.close()


@dataclass
class RecordingApp(WaltzClientCallbacks):
    """An application keeping its state in memory: high-water marks and applied transactions."""

    hwm: dict[int, int] = field(default_factory=dict)
    applied: list[tuple[int, int, int]] = field(default_factory=list)
    """(partition, transaction id, header) in the order applied."""
    data: dict[tuple[int, int], bytes] = field(default_factory=dict)
    errors: list[tuple[int, int, BaseException]] = field(default_factory=list)
    fetch_data: bool = False
    fail_once: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client_high_water_mark(self, partition_id: int) -> int:
        with self.lock:
            return self.hwm.get(partition_id, -1)

    def apply_transaction(self, transaction: Transaction) -> None:
        if transaction.transaction_id in self.fail_once:
            self.fail_once.discard(transaction.transaction_id)
            raise RuntimeError(f"the application failed on {transaction.transaction_id}")
        data = transaction.get_data() if self.fetch_data else None
        with self.lock:
            p = transaction.partition_id
            assert transaction.transaction_id == self.hwm.get(p, -1) + 1, "out of order"
            self.applied.append((p, transaction.transaction_id, transaction.header))
            if data is not None:
                self.data[(p, transaction.transaction_id)] = data
            self.hwm[p] = transaction.transaction_id

    def uncaught_exception(
        self, partition_id: int, transaction_id: int, exception: BaseException
    ) -> None:
        self.errors.append((partition_id, transaction_id, exception))


class Ctx(TransactionContext):
    """A context that records its hook calls."""

    def __init__(
        self,
        partition: int = 0,
        header: int = 7,
        data: bytes = b"payload",
        build: Callable[[TransactionBuilder], bool] | None = None,
    ) -> None:
        super().__init__()
        self.partition = partition
        self.header = header
        self.payload = data
        self.build = build
        self.events: list[tuple[str, object]] = []
        self.hwms: list[int] = []

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    def execute(self, builder: TransactionBuilder) -> bool:
        self.hwms.append(builder.client_high_water_mark)
        if self.build is not None:
            return self.build(builder)
        builder.set_header(self.header).set_data(self.payload).write_lock("account", 1)
        return True

    def on_completion(self, committed: bool) -> None:
        self.events.append(("completion", committed))

    def on_exception(self, exception: BaseException) -> None:
        self.events.append(("exception", exception))

    def on_lock_failure(self, transaction_id: int) -> None:
        self.events.append(("lock_failure", transaction_id))

    def on_application(self, transaction_id: int) -> None:
        self.events.append(("application", transaction_id))

    def on_expiration(self) -> None:
        self.events.append(("expiration", None))


def committed(result: object, transaction_id: int) -> None:
    """Assert that a submission's result is "committed as ``transaction_id``"."""
    assert isinstance(result, SubmissionResult), result
    assert result, result  # true when committed
    assert (result.committed, result.transaction_id) == (True, transaction_id), result


def other(partition: int, n: int) -> ReqId:
    """The ReqId of a transaction another client submitted."""
    return ReqId(999, 1, partition, n)


async def mount(
    peer: ProtocolTestPeer,
    partition: int,
    feed: Sequence[tuple[int, int]] = (),
    hwm: int | None = None,
    status: MountStatus = MountStatus.READY,
) -> tuple[PeerConnection, MountRequest]:
    """Answer the client's next MountRequest of ``partition``: stream ``feed``
    (transaction id, header) from other clients, then the MountResponse."""
    conn, request = await peer.expect(MountRequest, partition=partition)
    messages = [FeedData(other(partition, tid + 1), tid, header) for tid, header in feed]
    top = hwm if hwm is not None else (feed[-1][0] if feed else request.client_high_water_mark)
    await conn.send(*messages, MountResponse(request.req_id, status, top))
    return conn, request
