"""An in-process cluster for server tests: memory coordination, real StorageNodes on the
memory engine and the memory transport, all in one event loop."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from waltz_api.features import MAX_FEATURE_LEVEL
from waltz_api.types import Record
from waltz_conformance.reference.coordination import MemoryCoordination, MemoryCoordinationService
from waltz_conformance.reference.storage import MemoryStorageEngine, forget
from waltz_conformance.reference.transport import MemoryTransport
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.server.storage_client import StorageConnectionPool, StorageReplica
from waltz_storage_node import StorageNode


@dataclass
class Node:
    connect: str
    location: str
    key: uuid.UUID
    num_partitions: int
    node: StorageNode | None = None
    server_transport: MemoryTransport | None = None
    feature_level: int | None = None
    """The level new storage is created at (None: the engine's highest)."""

    @property
    def endpoint(self) -> str:
        return f"memory://{self.connect}"

    async def start(self) -> None:
        engine = await MemoryStorageEngine.open(
            self.location,
            cluster_key=self.key,
            num_partitions=self.num_partitions,
            feature_level=self.feature_level,
        )
        for partition in range(self.num_partitions):
            if partition not in engine.partition_ids():
                await engine.add_partition(partition)
        self.server_transport = MemoryTransport({})
        self.node = StorageNode(engine, self.server_transport, self.endpoint)
        await self.node.start()

    async def crash(self) -> None:
        assert self.server_transport is not None and self.node is not None
        self.server_transport.simulate_crash()
        await self.node.close()
        await self.server_transport.close()
        self.node = None

    async def log(self, partition: int) -> list[Record]:
        if self.node is not None:
            stored = self.node.engine.partition(partition)
        else:
            engine = await MemoryStorageEngine.open(
                self.location, cluster_key=self.key, num_partitions=self.num_partitions
            )
            stored = engine.partition(partition)
        return await stored.read_records(0, 1_000_000, 1 << 30)


@dataclass
class InProcessCluster:
    coordination: MemoryCoordination
    nodes: list[Node]
    key: uuid.UUID
    client_transport: MemoryTransport
    pool: StorageConnectionPool
    extra: list[MemoryTransport] = field(default_factory=list)

    async def connector(self, node: str, partition_id: int, session_id: int) -> StorageReplica:
        return await self.pool.connect(f"memory://{node}", partition_id, session_id)

    @property
    def replica_nodes(self) -> list[str]:
        return [n.connect for n in self.nodes]

    @classmethod
    async def create(
        cls,
        num_partitions: int = 1,
        num_nodes: int = 3,
        service: str | None = None,
        feature_level: int = MAX_FEATURE_LEVEL,
        node_feature_level: int | None = None,
    ) -> InProcessCluster:
        """``service``: a named memory coordination service (``memory://<service>/waltz``);
        ``feature_level`` the cluster's, ``node_feature_level`` the level the storage nodes'
        new storage starts at (None: the engine's highest)."""
        tag = uuid.uuid4().hex[:8]
        key = uuid.uuid4()
        backend = (
            MemoryCoordinationService.named(service) if service else MemoryCoordinationService()
        )
        coordination = MemoryCoordination(backend, "/waltz")
        await coordination.start()
        nodes = [
            Node(
                f"sn-{tag}-{i}:{5500 + i}",
                f"mem-{tag}-{i}",
                key,
                num_partitions,
                feature_level=node_feature_level,
            )
            for i in range(num_nodes)
        ]
        await ClusterAdmin(coordination).create_cluster(
            num_partitions=num_partitions,
            num_replicas=num_nodes,
            storage_nodes=[n.connect for n in nodes],
            cluster_key=key,
            feature_level=feature_level,
        )
        for node in nodes:
            await node.start()
        transport = MemoryTransport({})
        return cls(
            coordination,
            nodes,
            key,
            transport,
            StorageConnectionPool(transport, key, num_partitions),
        )

    async def close(self) -> None:
        await self.pool.close()
        await self.client_transport.close()
        for transport in self.extra:
            await transport.close()
        for node in self.nodes:
            if node.node is not None:
                await node.crash()
        await self.coordination.close()
        for node in self.nodes:
            forget(node.location)
