"""Running a server from its config file (``waltz server --config server.toml``).

The cluster manager registers the server, watches the other servers (pings over the
server's transport, :mod:`waltz_server.server.peers`) and follows the partition
assignment; every partition gained is opened at its generation (a new store
session, recovery), every partition lost is closed. Store metadata is read and
written through the cluster manager's current coordination client (it is
replaced when a session is LOST, and then every partition is lost anyway).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from waltz_api import __version__
from waltz_api.cluster import ClusterMetadata, ReplicaAssignments, coordination_from_uri
from waltz_api.contracts.coordination import (
    ChildrenCallback,
    Coordination,
    DataCallback,
    SessionListener,
    SessionState,
    Versioned,
    Watch,
)
from waltz_api.contracts.transport import Transport
from waltz_api.errors import ConfigError, CoordinationError, PluginError
from waltz_api.features import MAX_FEATURE_LEVEL
from waltz_api.plugins import get_registry
from waltz_api.process import run_until_signalled
from waltz_server.observability import Check, FeedPosition, HttpEndpoint, ServerMetrics
from waltz_server.server.access import AccessGate
from waltz_server.server.cluster_manager import (
    ClusterManager,
    PartitionEvent,
    PartitionGained,
    PartitionLost,
)
from waltz_server.server.config import ServerNodeConfig, load_server_config
from waltz_server.server.features import ClusterFeatures, check_supported
from waltz_server.server.peers import PeerMonitor
from waltz_server.server.server import WaltzServer
from waltz_server.server.storage_client import StorageConnectionPool, StorageReplica
from waltz_server.server.store import StorePartition
from waltz_server.server.voting import Outcome

log = logging.getLogger(__name__)


class CurrentCoordination(Coordination):
    """A Coordination that forwards to whatever client ``current()`` returns now."""

    def __init__(self, current: Callable[[], Coordination | None]) -> None:
        self._current = current

    def _client(self) -> Coordination:
        client = self._current()
        if client is None:
            raise CoordinationError("the server is not registered with the coordination service")
        return client

    async def start(self) -> None:
        """The owner (the cluster manager) starts its clients."""

    async def close(self) -> None:
        """The owner (the cluster manager) closes its clients."""

    @property
    def session_state(self) -> SessionState:
        client = self._current()
        return SessionState.LOST if client is None else client.session_state

    def add_session_listener(self, listener: SessionListener) -> None:
        self._client().add_session_listener(listener)

    @property
    def session_id(self) -> int:
        return self._client().session_id

    async def get(self, path: str) -> Versioned | None:
        return await self._client().get(path)

    async def create(
        self, path: str, value: bytes = b"", *, ephemeral: bool = False, make_parents: bool = True
    ) -> int:
        return await self._client().create(
            path, value, ephemeral=ephemeral, make_parents=make_parents
        )

    async def set(self, path: str, value: bytes, *, expected_version: int | None = None) -> int:
        return await self._client().set(path, value, expected_version=expected_version)

    async def delete(
        self, path: str, *, expected_version: int | None = None, recursive: bool = False
    ) -> None:
        await self._client().delete(path, expected_version=expected_version, recursive=recursive)

    async def children(self, path: str) -> list[str]:
        return await self._client().children(path)

    async def watch(self, path: str, callback: DataCallback) -> Watch:
        return await self._client().watch(path, callback)

    async def watch_children(self, path: str, callback: ChildrenCallback) -> Watch:
        return await self._client().watch_children(path, callback)

    async def increment(self, path: str) -> int:
        return await self._client().increment(path)


@dataclass
class RunningServer:
    server: WaltzServer
    manager: ClusterManager
    pool: StorageConnectionPool
    transport: Transport
    http: HttpEndpoint | None = None
    features: ClusterFeatures | None = None

    async def stop(self) -> None:
        if self.features is not None:
            await self.features.close()
        await self.manager.stop()
        await self.server.close()
        if self.server.access is not None:
            await self.server.access.close()
        await self.pool.close()
        await self.transport.close()
        if self.http is not None:
            await self.http.close()


def feed_positions(server: WaltzServer) -> list[FeedPosition]:
    """Every connected client's feed position on each partition served and ready here
    (the furthest behind when a client name has several connections)."""
    furthest: dict[tuple[int, str], FeedPosition] = {}
    for connection in server.connections:
        for partition_id, position in list(connection.feed_positions.items()):
            partition = server.partitions.get(partition_id)
            if partition is None or not partition.ready:
                continue
            found = FeedPosition(partition_id, connection.peer, position, partition.high_water_mark)
            key = (partition_id, connection.peer)
            if key not in furthest or found.position < furthest[key].position:
                furthest[key] = found
    return list(furthest.values())


def store_state(store: StorePartition) -> str:
    """``writable`` (recovered, taking appends), ``undecidable`` (the vote on the last
    session's closing mark waits for offline replicas), ``recovering`` (otherwise) or
    ``closed`` (a newer generation took the partition)."""
    if store.stale is not None:
        return "closed"
    session = store.session
    if session is None:
        return "recovering"
    if session.recovery.complete and store.ready:
        return "writable"
    if session.recovery.outcome is Outcome.UNDECIDABLE:
        return "undecidable"
    return "recovering"


def server_status(running: RunningServer) -> dict[str, Any]:
    """``GET /status``: this server and every partition it serves now, as JSON (read by
    ``waltz console``). Only public state of the partitions and their store sessions."""
    server, manager = running.server, running.manager
    feeds: dict[int, list[dict[str, Any]]] = {}
    for feed in feed_positions(server):
        feeds.setdefault(feed.partition_id, []).append(
            {"client": feed.client, "position": feed.position}
        )
    partitions = []
    for partition_id, partition in sorted(server.partitions.items()):
        session = partition.store.session
        partitions.append(
            {
                "partition": partition_id,
                "generation": partition.generation,
                "ready": partition.ready,
                "state": store_state(partition.store),
                "at_risk": None if session is None else session.recovery.at_risk,
                "high_water_mark": partition.high_water_mark,
                "session_id": None if session is None else session.session_id,
                "low_water_mark": None if session is None else session.low_water_mark,
                "replicas": partition.store.replica_nodes,
                "writable_replicas": [] if session is None else session.writable_replicas,
                "acknowledged": {} if session is None else session.acknowledged_marks(),
                "sessions_started": partition.store.sessions_started,
                "appends": partition.stats.appends,
                "lock_failures": partition.stats.lock_failures,
                "recoveries": partition.stats.recoveries,
                "clients": sorted(feeds.get(partition_id, []), key=lambda c: str(c["client"])),
            }
        )
    return {
        "role": "server",
        "version": __version__,
        "feature_level": running.features.level if running.features is not None else None,
        "max_feature_level": MAX_FEATURE_LEVEL,
        "server_id": manager.server_id if manager.registered else None,
        "endpoint": server.endpoint,
        "leader": manager.registered and manager.is_leader,
        "preferred_partitions": list(manager.preferred_partitions),
        "connected_clients": len(server.connections),
        "partitions": partitions,
    }


def server_endpoint(running: RunningServer, host: str, port: int) -> HttpEndpoint:
    """An (unstarted) /livez, /readyz and /metrics endpoint for ``running``.

    Ready: registered with the coordination service (so the leader can assign it
    partitions) and every partition it owns recovered and serving."""
    metrics = running.server.metrics or ServerMetrics()
    server = running.server
    metrics.watch_clients(lambda: len(server.connections), lambda: feed_positions(server))

    def registered() -> Check:
        manager = running.manager
        if not manager.registered:
            return Check(False, "not registered with the coordination service")
        return Check(True, f"server {manager.server_id}{' (leader)' if manager.is_leader else ''}")

    def partitions() -> Check:
        held = running.server.partitions
        not_ready = sorted(p for p, partition in held.items() if not partition.ready)
        detail = f"{len(held)} served"
        if not_ready:
            return Check(False, f"{detail}; recovering: {not_ready}")
        return Check(True, detail)

    return HttpEndpoint(
        metrics.registry,
        host=host,
        port=port,
        checks={"coordination": registered, "partitions": partitions},
        json_routes={"/status": lambda: server_status(running)},
    )


def create_transport(config: ServerNodeConfig) -> Transport:
    try:
        descriptor = get_registry().get("transport", config.transport.plugin)
    except PluginError as exc:
        raise ConfigError(f"config key 'transport.plugin': {exc}", "transport.plugin") from None
    transport: Transport = descriptor.factory(config.transport.options)
    return transport


async def start_server(
    config: ServerNodeConfig, *, rng: random.Random | None = None
) -> RunningServer:
    """Read the cluster, listen, register and follow the assignment."""
    uri, options = config.coordination.uri, dict(config.coordination.options)
    probe = coordination_from_uri(uri, options)
    await probe.start()
    try:
        cluster = ClusterMetadata(probe)
        cluster_config = await cluster.config()
        assignments: ReplicaAssignments = await cluster.replica_assignments()
        features = ClusterFeatures(check_supported((await cluster.feature_level()).value))
    finally:
        await probe.close()
    transport = create_transport(config)
    pool = StorageConnectionPool(
        transport,
        cluster_config.cluster_key,
        cluster_config.num_partitions,
        sender="server",
        feature_level=features,
    )
    features.on_raise(lambda _: pool.tell_level())
    template = config.transport.storage_endpoint

    async def connector(storage_node: str, partition_id: int, session_id: int) -> StorageReplica:
        return await pool.connect(template.format(storage_node), partition_id, session_id)

    metrics = ServerMetrics() if config.http.enabled else None
    manager_ref: list[ClusterManager] = []
    coordination = CurrentCoordination(lambda: manager_ref[0].coordination if manager_ref else None)
    archive = None
    if config.server.archive.enabled:
        from waltz_server.server.archiving import ServerArchive

        archive = ServerArchive(config.server.archive, coordination, metrics, rng)
    access = AccessGate(
        lambda: coordination_from_uri(uri, options),
        rng=None if rng is None else random.Random(rng.getrandbits(64)),
        followers=[features.follow],
    )
    await access.start()  # nothing is served before the ACL is known
    server = WaltzServer(
        transport=transport,
        endpoint=config.transport.endpoint,
        coordination=coordination,
        connector=connector,
        config=config.server.to_server_config(),
        rng=rng,
        metrics=metrics,
        archive=archive,
        access=access,
    )
    try:
        await server.start()
    except BaseException:
        await access.close()
        raise

    async def on_event(event: PartitionEvent) -> None:
        if isinstance(event, PartitionGained):
            replicas = assignments.replicas_of(event.partition_id)
            await server.add_partition(event.partition_id, event.generation, replicas)
        elif isinstance(event, PartitionLost):
            await server.remove_partition(event.partition_id, event.generation)

    manager = ClusterManager(
        lambda: coordination_from_uri(uri, options),
        config.transport.advertised_endpoint or server.endpoint,
        preferred_partitions=config.server.preferred_partitions,
        on_event=on_event,
        on_leader_write=None if metrics is None else lambda _: metrics.assignment_changes.inc(),
        peers=PeerMonitor(transport, config.server.liveness_config()),
        rng=None if rng is None else random.Random(rng.getrandbits(64)),
    )
    manager_ref.append(manager)
    server.identity = lambda: manager.server_id
    try:
        await manager.start()
    except BaseException:
        await server.close()
        await access.close()
        await pool.close()
        await transport.close()
        raise
    server.name = f"server:{manager.server_id}"
    running = RunningServer(server, manager, pool, transport, features=features)
    if config.http.enabled:
        running.http = server_endpoint(running, config.http.host, config.http.port)
        try:
            await running.http.start()
        except BaseException:
            running.http = None
            await running.stop()
            raise
    return running


async def serve(config: ServerNodeConfig, stop: asyncio.Event) -> None:
    running = await start_server(config)
    # A supervisor (or a test) waiting for the server reads this line on stderr.
    log.info(
        "server %d ready on %s (pid %d)",
        running.manager.server_id,
        running.server.endpoint,
        os.getpid(),
    )
    try:
        await stop.wait()
    finally:
        log.info("server shutting down")
        await running.stop()


def run_from_config(path: str | os.PathLike[str] | None) -> None:
    """Load the config and run the server until SIGINT or SIGTERM."""
    config = load_server_config(path)
    run_until_signalled(
        lambda stop: serve(config, stop),
        log_level=config.log_level,
        log_format=config.log_format,
        what="server",
    )
