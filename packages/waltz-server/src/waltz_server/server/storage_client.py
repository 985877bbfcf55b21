"""The server's side of the server-storage protocol: its replicas on storage nodes.

- :class:`StorageReplica`: one partition on one storage node for one store session, the
  server's :class:`~waltz_server.server.replica.ReplicaConnection` over a
  :class:`~waltz_api.storage_client.StorageClient` (the protocol's requesting side,
  shared with the storage node's admin commands).
- :class:`StorageConnectionPool`: one StorageClient per storage node, shared by the
  replicas of every partition and store session on it.
- :func:`replica_connector`: a ``ReplicaConnector`` with a connection of its own per
  replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence

from waltz_api.contracts.storage import LocalLog
from waltz_api.contracts.transport import Transport
from waltz_api.errors import ConnectionClosedError, StorageError, TransportError
from waltz_api.features import MAX_FEATURE_LEVEL, MIN_FEATURE_LEVEL
from waltz_api.storage_client import StorageAdminClient, StorageClient
from waltz_api.types import Record, RecordHeader, SessionInfo
from waltz_server.server.features import mark_at_level, tell_storage_node
from waltz_server.server.replica import REPLICA_CAPABILITIES

log = logging.getLogger(__name__)

__all__ = ["StorageConnectionPool", "StorageReplica", "replica_connector"]


class StorageReplica:
    """One partition on one storage node, for one store session (the server's
    ``waltz_server.server.replica.ReplicaConnection``), over a :class:`StorageClient`.

    Every request carries ``session_id``; a node that has seen a newer session
    raises SessionFencedError. Safe for concurrent calls (requests are pipelined).
    """

    def __init__(
        self,
        client: StorageClient,
        storage_node: str,
        partition_id: int,
        session_id: int,
        *,
        owns_client: bool = False,
        cluster_key: uuid.UUID | None = None,
        feature_level: Callable[[], int] = lambda: MAX_FEATURE_LEVEL,
    ) -> None:
        self.client = client
        self._storage_node = storage_node
        self.partition_id = partition_id
        self.session_id = session_id
        self._owns_client = owns_client
        self._cluster_key = cluster_key
        self._feature_level = feature_level

    @property
    def storage_node(self) -> str:
        return self._storage_node

    @property
    def capabilities(self) -> frozenset[str]:
        """Both optional features: the node refuses ``prune`` (StorageError) when its
        engine cannot delete a prefix."""
        return REPLICA_CAPABILITIES

    async def last_session_info(self) -> SessionInfo:
        return await self.client.last_session_info(self.session_id, self.partition_id)

    async def max_transaction_id(self) -> int:
        return await self.client.max_transaction_id(self.session_id, self.partition_id)

    async def truncate(self, transaction_id: int) -> None:
        await self.client.truncate(self.session_id, self.partition_id, transaction_id)

    async def set_low_water_mark(self, low_water_mark: int) -> None:
        await self.client.set_low_water_mark(self.session_id, self.partition_id, low_water_mark)

    async def mark_replica(self, low_water_mark: int, *, clean: bool, log_end: int = -1) -> None:
        """MarkReplicaRequest from feature level 2 on (see :func:`mark_at_level`)."""
        level, session, partition = self._feature_level(), self.session_id, self.partition_id
        await mark_at_level(
            self.client, level, session, partition, low_water_mark, clean=clean, log_end=log_end
        )

    async def append(self, records: Sequence[Record]) -> None:
        await self.client.append(self.session_id, self.partition_id, records)

    def start_append(self, records: Sequence[Record]) -> asyncio.Future[None]:
        """:meth:`append` as a future, the request posted now
        (:meth:`StorageClient.start_append`): the store session's write loop."""
        return self.client.start_append(self.session_id, self.partition_id, records)

    async def missing_range(self) -> tuple[int, int] | None:
        return await self.client.missing_range(self.session_id, self.partition_id)

    async def repair(self, records: Sequence[Record]) -> None:
        await self.client.repair(self.session_id, self.partition_id, records)

    async def read_records(self, start: int, max_records: int, max_bytes: int) -> list[Record]:
        return await self.client.records(
            self.session_id, self.partition_id, start, max_records, max_bytes
        )

    async def read_block(self, start: int, max_records: int, max_bytes: int) -> Sequence[Record]:
        """:meth:`read_records` as the storage node's block (see StorageClient.record_block)."""
        return await self.client.record_block(
            self.session_id, self.partition_id, start, max_records, max_bytes
        )

    async def read_headers(self, start: int, max_records: int) -> list[RecordHeader]:
        return await self.client.record_headers(
            self.session_id, self.partition_id, start, max_records
        )

    async def local_log(self) -> LocalLog:
        """The replica's local log (start, end, segments): an admin command."""
        return await StorageAdminClient(self.client).local_log(self.partition_id)

    async def prune(self, through: int) -> int:
        """Delete the replica's local records up to ``through`` (archived and verified),
        fenced by this session; the new log start."""
        if self._cluster_key is None:
            raise StorageError(
                f"replica {self._storage_node} of partition {self.partition_id} was connected "
                "without the cluster key: it cannot be pruned"
            )
        return await StorageAdminClient(self.client).prune(
            self.partition_id, through, self.session_id, self._cluster_key
        )

    async def close(self) -> None:
        if self._owns_client:
            await self.client.close()


def replica_connector(
    transport: Transport,
    cluster_key: uuid.UUID,
    num_partitions: int,
    *,
    sender: str = "server",
    timeout: float = 10.0,
) -> Callable[[str, int, int], Awaitable[StorageReplica]]:
    """A ``connector(storage_node, partition_id, session_id)`` that opens a new
    connection per replica (connect, handshake, cluster key check); the
    storage node string is the endpoint to connect to."""

    async def connect(storage_node: str, partition_id: int, session_id: int) -> StorageReplica:
        client = await StorageClient.connect(
            transport, storage_node, sender=sender, timeout=timeout
        )
        try:
            await client.open(cluster_key, num_partitions)
        except BaseException:
            await client.close()
            raise
        return StorageReplica(
            client,
            storage_node,
            partition_id,
            session_id,
            owns_client=True,
            cluster_key=cluster_key,
        )

    return connect


class StorageConnectionPool:
    """One pipelined, opened connection per storage node, shared by every replica
    on that node (a ``ReplicaConnector``: ``await pool.connect(node, partition, session)``).

    A replica stays bound to the connection it was given: when that connection
    breaks, the replica's calls raise ConnectionClosedError (the store session
    has lost the replica, as the spec wants), and the next ``connect`` for that
    node opens a new connection.
    """

    def __init__(
        self,
        transport: Transport,
        cluster_key: uuid.UUID,
        num_partitions: int,
        *,
        sender: str = "server",
        timeout: float = 10.0,
        feature_level: Callable[[], int] = lambda: MAX_FEATURE_LEVEL,
    ) -> None:
        self.transport = transport
        self.cluster_key = cluster_key
        self.num_partitions = num_partitions
        self.sender = sender
        self.timeout = timeout
        self.feature_level = feature_level  # from 2 on, told to each node connected
        self._clients: dict[str, StorageClient] = {}
        self._told: dict[str, int] = {}  # the level each node was told on its connection
        self._locks: dict[str, asyncio.Lock] = {}
        self._closed = False

    async def client(self, storage_node: str) -> StorageClient:
        """The live, opened connection to ``storage_node`` (made when needed)."""
        if self._closed:
            raise ConnectionClosedError("the storage connection pool is closed")
        async with self._locks.setdefault(storage_node, asyncio.Lock()):
            client = self._clients.get(storage_node)
            if client is not None and not client.closed and not client.conn.closed:
                return client
            if client is not None:
                await client.close()
            client = await StorageClient.connect(
                self.transport, storage_node, sender=self.sender, timeout=self.timeout
            )
            try:
                await client.open(self.cluster_key, self.num_partitions)
                self._told.pop(storage_node, None)
                await self._tell_level(storage_node, client)
            except BaseException:
                await client.close()
                raise
            self._clients[storage_node] = client
            return client

    async def _tell_level(self, storage_node: str, client: StorageClient) -> None:
        level = self.feature_level()
        if level > max(MIN_FEATURE_LEVEL, self._told.get(storage_node, 0)) and (
            await tell_storage_node(
                StorageAdminClient(client), storage_node, level, self.cluster_key
            )
        ):
            self._told[storage_node] = level

    async def tell_level(self) -> None:
        """Tell every connected storage node the feature level (after it rose)."""
        for storage_node, client in list(self._clients.items()):
            if client.closed or client.conn.closed:
                continue
            async with self._locks.setdefault(storage_node, asyncio.Lock()):
                if self._clients.get(storage_node) is client:
                    with contextlib.suppress(TransportError, OSError):
                        await self._tell_level(storage_node, client)

    async def connect(
        self, storage_node: str, partition_id: int, session_id: int
    ) -> StorageReplica:
        client = await self.client(storage_node)
        return StorageReplica(
            client,
            storage_node,
            partition_id,
            session_id,
            cluster_key=self.cluster_key,
            feature_level=self.feature_level,
        )

    async def close(self) -> None:
        self._closed = True
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()
