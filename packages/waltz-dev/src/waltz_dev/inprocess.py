"""A whole Waltz cluster in this event loop, built from the real components: the one
in-process cluster builder of tests, benchmarks and examples.

Storage nodes are :class:`~waltz_storage_node.StorageNode` objects over a storage
engine plugin, servers are :func:`~waltz_server.server.main.start_server` (the same code
``waltz server`` runs), on a coordination service chosen by URI and a transport plugin
chosen by name; every plugin comes from the registry, so the builder works with any
installed combination::

    cluster = InProcessCluster(tmp_path, num_partitions=2)   # local, fs, zmq
    await cluster.start()                  # returns once every partition is served
    client = WaltzClient(callbacks, ClientConfig(cluster.coordination_uri))
    ...
    await cluster.stop_storage()           # faults: storage nodes, servers
    await cluster.start_storage()
    await cluster.restart_server(0)
    await cluster.close()

The conformance suite's :class:`~waltz_conformance.suites.system.SystemHarness` is the
tool for fault tests across plugin combinations (members as real processes, kill -9,
wipes and backups); this is for a test or a benchmark that wants a working cluster in
its own loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from waltz_api.cluster import coordination_from_uri
from waltz_api.config import config_from_mapping
from waltz_api.contracts.coordination import Coordination
from waltz_api.contracts.storage import StoragePartition
from waltz_api.contracts.transport import Transport
from waltz_api.errors import ServerError
from waltz_api.features import MIN_FEATURE_LEVEL
from waltz_api.plugins import get_registry
from waltz_api.ports import free_port
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.server.config import ServerNodeConfig
from waltz_server.server.main import RunningServer, start_server
from waltz_storage_node import StorageNode

log = logging.getLogger(__name__)

Preload = Callable[[StoragePartition, int], Awaitable[None]]
"""Writes records straight into a storage node's partition before any server starts
(``partition``, its id): a large log in seconds."""


@dataclass
class InProcessCluster:
    """``num_storage_nodes`` storage nodes and ``num_servers`` servers of ``num_partitions``
    partitions, every partition replicated on every storage node (see the module
    docstring). Data under ``root``."""

    root: Path
    num_partitions: int = 1
    num_storage_nodes: int = 3
    num_servers: int = 1
    storage_engine: str = "fs"
    transport: str = "zmq"
    coordination_uri: str = ""
    """Default: a ``local`` coordination under ``root``."""
    log_level: str = "INFO"
    preload: Preload | None = None
    server_settings: dict[str, Any] = field(default_factory=dict)
    """Extra keys of every server's ``[server]`` table (e.g. its ``archive``)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Every storage node's engine options (e.g. the fs engine's ``segment_size``)."""
    cluster_key: uuid.UUID = field(default_factory=uuid.uuid4)
    coordination: Coordination | None = None
    """The builder's own client of the coordination service."""
    metadata: ClusterAdmin | None = None
    storage_connects: list[str] = field(default_factory=list)
    """Each storage node's host:port (its name in the cluster metadata)."""
    nodes: list[StorageNode | None] = field(default_factory=list)
    servers: list[RunningServer | None] = field(default_factory=list)
    _transports: list[Transport | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.coordination_uri:
            self.coordination_uri = f"local://{self.root / 'coordination'}?root=/waltz"

    @property
    def _scheme(self) -> str:
        return "memory" if self.transport == "memory" else "tcp"

    def _connect(self, index: int) -> str:
        if self.transport == "memory":
            return f"sn-{self.cluster_key.hex[:8]}-{index}:{5500 + index}"
        return f"127.0.0.1:{free_port()}"

    def _server_endpoint(self, index: int) -> str:
        if self.transport == "memory":
            return f"memory://server-{self.cluster_key.hex[:8]}-{index}-{uuid.uuid4().hex[:6]}"
        return f"tcp://127.0.0.1:{free_port()}"

    # -- the whole cluster --------------------------------------------------------------

    async def start(self, timeout: float = 60.0) -> None:
        """Create the cluster, start every storage node and server, and return once every
        partition is served (its owner's partition ready); on a failure, what started
        is stopped."""
        try:
            self.coordination = coordination_from_uri(self.coordination_uri)
            await self.coordination.start()
            self.metadata = ClusterAdmin(self.coordination)
            self.storage_connects = [self._connect(i) for i in range(self.num_storage_nodes)]
            await self.metadata.create_cluster(
                num_partitions=self.num_partitions,
                num_replicas=self.num_storage_nodes,
                storage_nodes=self.storage_connects,
                cluster_key=self.cluster_key,
            )
            self.nodes = [None] * self.num_storage_nodes
            self._transports = [None] * self.num_storage_nodes
            for index in range(self.num_storage_nodes):
                await self.start_storage_node(index, preload=self.preload)
            self.servers = [None] * self.num_servers
            for index in range(self.num_servers):
                await self.start_server(index)
            await self.wait_served(timeout)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Stop every server and storage node, then the builder's coordination client."""
        for index in range(len(self.servers)):
            with contextlib.suppress(Exception):
                await self.stop_server(index)
        await self.stop_storage()
        if self.coordination is not None:
            with contextlib.suppress(Exception):
                await self.coordination.close()
            self.coordination = None

    async def wait_served(self, timeout: float = 60.0) -> None:
        """Until every partition is owned by a running server of this cluster, at the
        assignment's generation, and ready there."""
        assert self.metadata is not None
        async with asyncio.timeout(timeout):
            for partition in range(self.num_partitions):
                while True:
                    if await self._served(partition):
                        break
                    await asyncio.sleep(0.05)  # the assignment and recovery run meanwhile

    async def _served(self, partition: int) -> bool:
        assert self.metadata is not None
        owner = (await self.metadata.partition_assignment(partition)).value
        for running in self.servers:
            if running is None or running.manager.server_id != owner.server_id:
                continue
            held = running.server.partitions.get(partition)
            return held is not None and held.generation == owner.generation and held.ready
        return False

    # -- storage nodes --------------------------------------------------------------------

    async def start_storage_node(self, index: int, *, preload: Preload | None = None) -> None:
        """Start storage node ``index`` on its data directory (kept across restarts)."""
        engine_class: Any = get_registry().get("storage", self.storage_engine).factory
        engine = await engine_class.open(
            str(self.root / f"storage-{index}"),
            cluster_key=self.cluster_key,
            num_partitions=self.num_partitions,
            options=self.storage_options or None,
            feature_level=MIN_FEATURE_LEVEL,  # as a storage node: the servers raise it
        )
        try:
            for partition in range(self.num_partitions):
                if partition not in engine.partition_ids():
                    stored = await engine.add_partition(partition)
                    if preload is not None:
                        await preload(stored, partition)
            transport: Transport = get_registry().get("transport", self.transport).factory({})
            node = StorageNode(
                engine, transport, f"{self._scheme}://{self.storage_connects[index]}"
            )
            await node.start()
        except BaseException:
            await engine.close()
            raise
        self.nodes[index] = node
        self._transports[index] = transport

    async def stop_storage_node(self, index: int) -> None:
        """Stop storage node ``index`` (its engine closes; its data stays)."""
        node, self.nodes[index] = self.nodes[index], None
        transport, self._transports[index] = self._transports[index], None
        if node is not None:
            with contextlib.suppress(Exception):
                await node.close()
            with contextlib.suppress(Exception):
                await node.engine.close()
        if transport is not None:
            with contextlib.suppress(Exception):
                await transport.close()

    async def stop_storage(self) -> None:
        """Stop every storage node: no store session can commit until they are back."""
        for index in range(len(self.nodes)):
            await self.stop_storage_node(index)

    async def start_storage(self) -> None:
        """Start every stopped storage node again, on its data and endpoint."""
        for index, node in enumerate(self.nodes):
            if node is None:
                await self.start_storage_node(index)

    # -- servers --------------------------------------------------------------------------

    def server_config(self, index: int) -> ServerNodeConfig:
        """The configuration server ``index`` starts with (a new endpoint each time)."""
        return config_from_mapping(
            ServerNodeConfig,
            {
                "coordination": {"uri": self.coordination_uri},
                "transport": {
                    "plugin": self.transport,
                    "endpoint": self._server_endpoint(index),
                    "storage_endpoint": f"{self._scheme}://{{}}",
                },
                "http": {"enabled": False},
                "log_level": self.log_level,
                **({"server": dict(self.server_settings)} if self.server_settings else {}),
            },
        )

    async def start_server(self, index: int) -> None:
        if self.servers[index] is not None:
            raise ServerError(f"server {index} of the in-process cluster is running")
        self.servers[index] = await start_server(self.server_config(index))

    async def stop_server(self, index: int) -> None:
        running, self.servers[index] = self.servers[index], None
        if running is not None:
            await running.stop()

    async def restart_server(self, index: int, timeout: float = 60.0) -> None:
        """Stop server ``index`` and start it again on a new endpoint; returns once every
        partition is served again."""
        await self.stop_server(index)
        await self.start_server(index)
        await self.wait_served(timeout)

    def server(self, index: int = 0) -> RunningServer:
        running = self.servers[index]
        if running is None:
            raise ServerError(f"server {index} of the in-process cluster is stopped")
        return running
