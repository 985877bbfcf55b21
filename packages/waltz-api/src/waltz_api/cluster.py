"""The cluster metadata, built once on the Coordination contract (for every plugin).

Layout under the coordination root (paths of the original where the spec
names them)::

    /cluster/config                  ClusterConfig: cluster key, partitions, replicas
    /store/assignment                ReplicaAssignments: storage node -> partition ids
    /store/partition/<id>            PartitionStoreMetadata: generation, store session id,
                                     replica states (changed ONLY by CAS)
    /assignment/partition/<id>       PartitionAssignment: server, endpoint, generation (CAS)
    /assignment/leader               LeaderRecord: the server that assigns partitions (CAS)
    /servers/<server id>             ServerInfo, ephemeral (a live server's registration)
    /ids/server, /ids/client         counters: server and client id allocation

Every value is JSON (UTF-8 bytes) with ``"format": 1`` and a ``"type"``; a
reader refuses a format newer than it knows, with a clear error.

Fencing: the store session id and the generations are changed only by a
compare-and-set on the znode/key version (:meth:`ClusterMetadata.cas_store_metadata`,
:meth:`ClusterMetadata.assign_partition`). None of these paths is ever
deleted while the cluster exists, so their versions never restart (see
:class:`waltz_api.contracts.Versioned`).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from waltz_api.contracts.coordination import Coordination, Versioned, Watch, join_path
from waltz_api.errors import (
    BadVersionError,
    ClusterExistsError,
    ClusterNotFoundError,
    ConfigError,
    CoordinationError,
    NodeExistsError,
)
from waltz_api.types import UNRESOLVED, ReplicaId, ReplicaState

log = logging.getLogger(__name__)

FORMAT_VERSION = 1

CONFIG_PATH = "/cluster/config"
REPLICA_ASSIGNMENT_PATH = "/store/assignment"
STORE_PARTITION_DIR = "/store/partition"
PARTITION_ASSIGNMENT_DIR = "/assignment/partition"
LEADER_PATH = "/assignment/leader"
SERVERS_DIR = "/servers"
SERVER_ID_COUNTER = "/ids/server"
CLIENT_ID_COUNTER = "/ids/client"

NO_SERVER = -1
NO_SESSION = -1
DEFAULT_CAS_ATTEMPTS = 100

T = TypeVar("T")


# -- values ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stored(Generic[T]):
    """A decoded value and the coordination version it was read at (for a CAS)."""

    value: T
    version: int


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The cluster-wide configuration written once by ``waltz cluster create``."""

    cluster_key: uuid.UUID
    num_partitions: int
    num_replicas: int

    def __post_init__(self) -> None:
        if self.num_partitions < 1:
            raise ConfigError(
                f"a cluster needs at least one partition, got {self.num_partitions}",
                key="partitions",
            )
        if self.num_replicas < 1:
            raise ConfigError(
                f"a cluster needs at least one replica per partition, got {self.num_replicas}",
                key="replicas",
            )


@dataclass(frozen=True)
class ReplicaAssignments:
    """Which storage node (connect string ``host:port``) holds which partitions."""

    num_replicas: int
    storage: Mapping[str, tuple[int, ...]]
    groups: Mapping[str, int] = field(default_factory=dict)
    """The group of each storage node (0 when not set): a placement hint for operators."""

    def group_of(self, storage_node: str) -> int:
        return int(self.groups.get(storage_node, 0))

    def partitions_of(self, storage_node: str) -> tuple[int, ...]:
        return tuple(self.storage.get(storage_node, ()))

    def replicas_of(self, partition_id: int) -> list[str]:
        """The storage nodes holding ``partition_id``, sorted."""
        return sorted(node for node, parts in self.storage.items() if partition_id in parts)


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """A live server's registration (ephemeral).

    ``preferred_partitions``: partitions this server asks to serve; the cluster
    manager's leader gives them to it while it is alive (lowest id first when
    several live servers prefer the same partition)."""

    server_id: int
    endpoint: str
    preferred_partitions: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class PartitionAssignment:
    """Which server serves a partition, at which generation.

    The generation increases by one every time the partition is (re)assigned;
    servers and clients reject requests carrying another generation."""

    partition_id: int
    server_id: int = NO_SERVER
    endpoint: str = ""
    generation: int = 0


@dataclass(frozen=True, slots=True)
class LeaderRecord:
    """The server that leads the cluster manager (writes the partition assignment).

    ``term`` rises by one at every change of leader; ``renewals`` counts the holder's
    renewals within its term (a renewal tells the other servers the holder is alive).
    Changed only by compare-and-set; never deleted while the cluster exists."""

    server_id: int
    term: int = 1
    renewals: int = 0


@dataclass(frozen=True, slots=True)
class PartitionStoreMetadata:
    """The partition store metadata (spec: Partition Metadata).

    ``session_id`` is the current store session id (``-1`` before the first);
    ``replicas`` the states of the partition's replicas, sorted by storage node."""

    partition_id: int
    generation: int = 0
    session_id: int = NO_SESSION
    replicas: tuple[ReplicaState, ...] = field(default_factory=tuple)

    def replica(self, storage_node: str) -> ReplicaState:
        for state in self.replicas:
            if state.replica_id.storage_node == storage_node:
                return state
        raise CoordinationError(
            f"storage node {storage_node} holds no replica of partition {self.partition_id}"
        )

    def with_replica(self, state: ReplicaState) -> PartitionStoreMetadata:
        """A copy with ``state`` replacing the replica of the same storage node (or added)."""
        others = [
            r for r in self.replicas if r.replica_id.storage_node != state.replica_id.storage_node
        ]
        others.append(state)
        return replace(
            self, replicas=tuple(sorted(others, key=lambda r: r.replica_id.storage_node))
        )


# -- encoding --------------------------------------------------------------------------------


def _encode(kind: str, body: Mapping[str, Any]) -> bytes:
    return json.dumps(
        {"format": FORMAT_VERSION, "type": kind, **body}, sort_keys=True, separators=(",", ":")
    ).encode("utf-8")


def _decode(kind: str, raw: bytes, path: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CoordinationError(f"{path} does not hold Waltz metadata JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CoordinationError(f"{path} does not hold a Waltz metadata object")
    # A value without "format"/"type" is read as format 1 of the expected type (values
    # written by code that predates the field); a present field is always checked.
    found_format = doc.get("format", 1)
    if not isinstance(found_format, int) or found_format < 1:
        raise CoordinationError(f"{path} has no valid metadata format number")
    if found_format > FORMAT_VERSION:
        raise CoordinationError(
            f"{path} was written in metadata format {found_format}, newer than this Waltz "
            f"understands ({FORMAT_VERSION}); upgrade Waltz"
        )
    if doc.get("type", kind) != kind:
        raise CoordinationError(f"{path} holds {doc.get('type')!r} metadata, expected {kind!r}")
    return doc


def encode_config(config: ClusterConfig, *, ready: bool = True) -> bytes:
    return _encode(
        "cluster_config",
        {
            "cluster_key": str(config.cluster_key),
            "partitions": config.num_partitions,
            "replicas": config.num_replicas,
            "state": "ready" if ready else "creating",
        },
    )


def decode_config(raw: bytes, path: str = CONFIG_PATH) -> tuple[ClusterConfig, bool]:
    """The config and whether its creation completed."""
    doc = _decode("cluster_config", raw, path)
    config = ClusterConfig(
        uuid.UUID(doc["cluster_key"]), int(doc["partitions"]), int(doc["replicas"])
    )
    return config, doc.get("state") == "ready"


def encode_replica_assignments(assignments: ReplicaAssignments) -> bytes:
    return _encode(
        "replica_assignments",
        {
            "replicas": assignments.num_replicas,
            "storage": {node: list(parts) for node, parts in sorted(assignments.storage.items())},
            "groups": {
                node: group for node, group in sorted(assignments.groups.items()) if group != 0
            },
        },
    )


def decode_replica_assignments(
    raw: bytes, path: str = REPLICA_ASSIGNMENT_PATH
) -> ReplicaAssignments:
    doc = _decode("replica_assignments", raw, path)
    return ReplicaAssignments(
        int(doc["replicas"]),
        {str(node): tuple(int(p) for p in parts) for node, parts in doc["storage"].items()},
        {str(node): int(group) for node, group in dict(doc.get("groups", {})).items()},
    )


def encode_server(info: ServerInfo) -> bytes:
    return _encode(
        "server",
        {
            "server_id": info.server_id,
            "endpoint": info.endpoint,
            "preferred_partitions": list(info.preferred_partitions),
        },
    )


def decode_server(raw: bytes, path: str) -> ServerInfo:
    doc = _decode("server", raw, path)
    try:
        preferred = tuple(int(p) for p in doc.get("preferred_partitions", ()))
        return ServerInfo(int(doc["server_id"]), str(doc["endpoint"]), preferred)
    except (KeyError, TypeError, ValueError) as exc:
        raise CoordinationError(
            f"{path} does not hold a valid server registration: {exc}"
        ) from None


def encode_partition_assignment(assignment: PartitionAssignment) -> bytes:
    return _encode(
        "partition_assignment",
        {
            "partition": assignment.partition_id,
            "server_id": assignment.server_id,
            "endpoint": assignment.endpoint,
            "generation": assignment.generation,
        },
    )


def decode_partition_assignment(raw: bytes, path: str) -> PartitionAssignment:
    doc = _decode("partition_assignment", raw, path)
    return PartitionAssignment(
        int(doc["partition"]), int(doc["server_id"]), str(doc["endpoint"]), int(doc["generation"])
    )


def encode_leader(record: LeaderRecord) -> bytes:
    return _encode(
        "leader",
        {"server_id": record.server_id, "term": record.term, "renewals": record.renewals},
    )


def decode_leader(raw: bytes, path: str = LEADER_PATH) -> LeaderRecord:
    doc = _decode("leader", raw, path)
    try:
        return LeaderRecord(int(doc["server_id"]), int(doc["term"]), int(doc.get("renewals", 0)))
    except (KeyError, TypeError, ValueError) as exc:
        raise CoordinationError(f"{path} does not hold a valid leader record: {exc}") from None


def encode_store_metadata(meta: PartitionStoreMetadata) -> bytes:
    return _encode(
        "partition_store",
        {
            "partition": meta.partition_id,
            "generation": meta.generation,
            "session_id": meta.session_id,
            "replicas": {
                r.replica_id.storage_node: {
                    "session_id": r.session_id,
                    "closing_high_water_mark": r.closing_high_water_mark,
                }
                for r in meta.replicas
            },
        },
    )


def decode_store_metadata(
    raw: bytes, path: str, partition_id: int | None = None
) -> PartitionStoreMetadata:
    doc = _decode("partition_store", raw, path)
    raw_partition = doc.get("partition", partition_id)
    if raw_partition is None:
        raise CoordinationError(f"{path} does not say which partition it describes")
    try:
        partition = int(raw_partition)
        replicas = tuple(
            ReplicaState(
                ReplicaId(partition, str(node)),
                int(state["session_id"]),
                int(state.get("closing_high_water_mark", UNRESOLVED)),
            )
            for node, state in sorted(dict(doc.get("replicas", {})).items())
        )
        return PartitionStoreMetadata(
            partition, int(doc.get("generation", 0)), int(doc.get("session_id", -1)), replicas
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CoordinationError(f"{path} does not hold valid store metadata: {exc}") from None


# -- helpers ----------------------------------------------------------------------------------


def validate_storage_node(connect: str) -> str:
    """Check a storage node connect string ``host:port``; returns it stripped."""
    text = connect.strip()
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"storage node {connect!r} is not host:port (for example 127.0.0.1:5500)",
            key="storage",
        )
    return text


def default_replica_assignments(
    storage_nodes: Sequence[str], num_partitions: int, num_replicas: int
) -> ReplicaAssignments:
    """Spread ``num_replicas`` replicas of each partition over the storage nodes, round
    robin: partition p lives on nodes p, p+1, ... (mod the number of nodes)."""
    nodes = [validate_storage_node(n) for n in storage_nodes]
    if len(set(nodes)) != len(nodes):
        raise ConfigError(f"a storage node is listed twice: {', '.join(nodes)}", key="storage")
    if not nodes:
        raise ConfigError("a cluster needs at least one storage node (--storage)", key="storage")
    if num_replicas > len(nodes):
        raise ConfigError(
            f"{num_replicas} replicas per partition need at least {num_replicas} storage "
            f"nodes, got {len(nodes)}: add storage nodes or lower --replicas",
            key="replicas",
        )
    storage: dict[str, list[int]] = {node: [] for node in nodes}
    for partition in range(num_partitions):
        for i in range(num_replicas):
            storage[nodes[(partition + i) % len(nodes)]].append(partition)
    return ReplicaAssignments(num_replicas, {n: tuple(p) for n, p in storage.items()})


def _check_assignments(
    assignments: ReplicaAssignments, num_partitions: int, num_replicas: int
) -> None:
    for node in assignments.storage:
        validate_storage_node(node)
    for partition in range(num_partitions):
        holders = assignments.replicas_of(partition)
        if len(holders) != num_replicas:
            raise ConfigError(
                f"partition {partition} has {len(holders)} replicas in the assignment, "
                f"expected {num_replicas}",
                key="storage",
            )
    for node, parts in assignments.storage.items():
        bad = [p for p in parts if not 0 <= p < num_partitions]
        if bad:
            raise ConfigError(f"storage node {node} lists unknown partitions {bad}", key="storage")


# -- the metadata API ---------------------------------------------------------------------------


class ClusterMetadata:
    """Reads and writes the cluster metadata through a started Coordination client."""

    def __init__(self, coordination: Coordination) -> None:
        self.coordination = coordination

    # -- cluster config ------------------------------------------------------------------

    async def create_cluster(
        self,
        *,
        num_partitions: int,
        num_replicas: int,
        storage_nodes: Sequence[str] = (),
        assignments: ReplicaAssignments | None = None,
        cluster_key: uuid.UUID | None = None,
    ) -> ClusterConfig:
        """Write a new cluster (the spec's CreateCluster utility).

        Refused with ClusterExistsError when the root already holds a cluster
        (complete or not): the config is claimed first with a create, so of two
        concurrent creators exactly one proceeds."""
        config = ClusterConfig(cluster_key or uuid.uuid4(), num_partitions, num_replicas)
        if assignments is None:
            assignments = default_replica_assignments(storage_nodes, num_partitions, num_replicas)
        _check_assignments(assignments, num_partitions, num_replicas)
        c = self.coordination
        try:
            claimed = await c.create(CONFIG_PATH, encode_config(config, ready=False))
        except NodeExistsError:
            existing = await c.get(CONFIG_PATH)
            detail = ""
            if existing is not None:
                try:
                    found, ready = decode_config(existing.value)
                    detail = (
                        f" (cluster key {found.cluster_key}, {found.num_partitions} partitions"
                        f"{'' if ready else ', creation incomplete'})"
                    )
                except CoordinationError as exc:
                    detail = f" ({exc})"
            raise ClusterExistsError(
                f"a cluster already exists at this coordination root{detail}; refusing to "
                "overwrite it. Use another root, or delete the old cluster first "
                "(`waltz cluster delete --coordination URI --cluster-key KEY`)"
            ) from None
        await c.create(REPLICA_ASSIGNMENT_PATH, encode_replica_assignments(assignments))
        for partition in range(num_partitions):
            replicas = tuple(
                ReplicaState(ReplicaId(partition, node), NO_SESSION, UNRESOLVED)
                for node in assignments.replicas_of(partition)
            )
            await c.create(
                join_path(STORE_PARTITION_DIR, partition),
                encode_store_metadata(PartitionStoreMetadata(partition, 0, NO_SESSION, replicas)),
            )
            await c.create(
                join_path(PARTITION_ASSIGNMENT_DIR, partition),
                encode_partition_assignment(PartitionAssignment(partition)),
            )
        await c.set(CONFIG_PATH, encode_config(config, ready=True), expected_version=claimed)
        log.info(
            "created cluster %s: %d partitions, %d replicas",
            config.cluster_key,
            num_partitions,
            num_replicas,
        )
        return config

    async def config(self) -> ClusterConfig:
        """The cluster config; ClusterNotFoundError when there is no (complete) cluster."""
        found = await self.coordination.get(CONFIG_PATH)
        if found is None:
            raise ClusterNotFoundError(
                "no Waltz cluster at this coordination root; create one with "
                "`waltz cluster create --coordination URI --partitions N --replicas R "
                "--storage host:port ...`"
            )
        config, ready = decode_config(found.value)
        if not ready:
            raise ClusterNotFoundError(
                f"the creation of cluster {config.cluster_key} at this coordination root did "
                "not complete; delete it (`waltz cluster delete --cluster-key "
                f"{config.cluster_key}`) and run `waltz cluster create` again"
            )
        return config

    async def delete_cluster(self, cluster_key: uuid.UUID, *, force: bool = False) -> None:
        """Delete every piece of this cluster's metadata (the whole layout above).

        ``cluster_key`` must be the cluster's own key (a guard against deleting
        the wrong cluster). Refused while servers are registered, unless
        ``force``. The storage nodes' data is not touched: a new cluster gets a
        new key, and storage nodes refuse it until their data is reset."""
        found = await self.coordination.get(CONFIG_PATH)
        if found is None:
            raise ClusterNotFoundError("no Waltz cluster at this coordination root to delete")
        config, _ready = decode_config(found.value)
        if config.cluster_key != cluster_key:
            raise ConfigError(
                f"the cluster at this root has key {config.cluster_key}, not {cluster_key}; "
                "refusing to delete it",
                key="cluster_key",
            )
        live = await self.coordination.children(SERVERS_DIR)
        if live and not force:
            raise CoordinationError(
                f"{len(live)} server(s) are registered ({', '.join(live)}); stop them first "
                "(or force the deletion)"
            )
        for top in ("/servers", "/assignment", "/store", "/ids"):
            await self.coordination.delete(top, recursive=True)
        # The config goes last: until then a re-run sees the (partial) cluster.
        await self.coordination.delete("/cluster", recursive=True)
        log.info("deleted cluster %s", cluster_key)

    async def exists(self) -> bool:
        return await self.coordination.exists(CONFIG_PATH)

    async def replica_assignments(self) -> ReplicaAssignments:
        found = await self._require(REPLICA_ASSIGNMENT_PATH)
        return decode_replica_assignments(found.value)

    async def watch_replica_assignments(
        self, callback: Callable[[ReplicaAssignments | None], Awaitable[None] | None]
    ) -> Watch:
        """Call ``callback`` with the replica assignments now and after every change."""

        def on_value(value: Versioned | None) -> Awaitable[None] | None:
            return callback(None if value is None else decode_replica_assignments(value.value))

        return await self.coordination.watch(REPLICA_ASSIGNMENT_PATH, on_value)

    # -- membership changes (compare-and-set on /store/assignment) ------------------------------

    async def _change_assignments(
        self,
        change: Callable[[ReplicaAssignments], ReplicaAssignments | None],
        *,
        max_attempts: int = DEFAULT_CAS_ATTEMPTS,
    ) -> ReplicaAssignments:
        """Read the assignments, apply ``change`` and CAS, retrying on a concurrent change
        (bounded). ``change`` returns None when there is nothing to do (idempotent
        calls), or raises to refuse."""
        for _ in range(max_attempts):
            found = await self._require(REPLICA_ASSIGNMENT_PATH)
            current = decode_replica_assignments(found.value)
            new = change(current)
            if new is None:
                return current
            try:
                await self.coordination.set(
                    REPLICA_ASSIGNMENT_PATH,
                    encode_replica_assignments(new),
                    expected_version=found.version,
                )
            except BadVersionError:
                continue
            return new
        raise CoordinationError(
            f"the replica assignments kept changing: no compare-and-set succeeded in "
            f"{max_attempts} attempts; try again"
        )

    async def add_storage_node(self, connect: str, group: int = 0) -> ReplicaAssignments:
        """Make a storage node (``host:port``) known to the cluster, holding no replica
        yet (give it some with :meth:`add_replica`). Adding a node that is already
        known in the same group does nothing; in another group it is refused."""
        node = validate_storage_node(connect)
        if isinstance(group, bool) or not isinstance(group, int) or group < 0:
            raise ConfigError(
                f"storage node group must be a non-negative integer, got {group!r}", key="group"
            )
        await self.config()

        def change(current: ReplicaAssignments) -> ReplicaAssignments | None:
            if node in current.storage:
                if current.group_of(node) == group:
                    return None
                raise ConfigError(
                    f"storage node {node} is already in group {current.group_of(node)}, "
                    f"not {group}; remove it first to move it to another group",
                    key="group",
                )
            groups = dict(current.groups)
            if group:
                groups[node] = group
            return replace(current, storage={**current.storage, node: ()}, groups=groups)

        added = await self._change_assignments(change)
        log.info("storage node %s (group %d) is part of the cluster", node, group)
        return added

    async def remove_storage_node(self, connect: str, *, force: bool = False) -> ReplicaAssignments:
        """Forget a storage node. Refused while it still holds replicas, unless
        ``force``: then its replicas are dropped too, but never the last replica of
        a partition (move that one first with :meth:`add_replica`/:meth:`remove_replica`)."""
        node = validate_storage_node(connect)

        def change(current: ReplicaAssignments) -> ReplicaAssignments | None:
            if node not in current.storage:
                raise ConfigError(
                    f"storage node {node} is not part of the cluster (known: "
                    f"{', '.join(sorted(current.storage)) or 'none'})",
                    key="storage",
                )
            held = current.partitions_of(node)
            if held and not force:
                raise ConfigError(
                    f"storage node {node} still holds replicas of partitions "
                    f"{list(held)}; move them to other nodes first (add_replica, then "
                    "remove_replica), or force the removal",
                    key="storage",
                )
            alone = [p for p in held if current.replicas_of(p) == [node]]
            if alone:
                raise ConfigError(
                    f"storage node {node} holds the only replica of partitions {alone}; "
                    "add a replica on another node first (even a forced removal keeps "
                    "at least one replica per partition)",
                    key="storage",
                )
            storage = {n: p for n, p in current.storage.items() if n != node}
            groups = {n: g for n, g in current.groups.items() if n != node}
            return replace(current, storage=storage, groups=groups)

        removed = await self._change_assignments(change)
        log.info("storage node %s removed from the cluster", node)
        return removed

    async def _check_partition(self, partition_id: int) -> None:
        config = await self.config()
        if (
            isinstance(partition_id, bool)
            or not isinstance(partition_id, int)
            or not 0 <= partition_id < config.num_partitions
        ):
            raise ConfigError(
                f"partition {partition_id!r} does not exist: the cluster has partitions "
                f"0..{config.num_partitions - 1}",
                key="partition",
            )

    async def add_replica(self, partition_id: int, storage_node: str) -> ReplicaAssignments:
        """Place a replica of ``partition_id`` on ``storage_node`` (a node known through
        :meth:`add_storage_node`). The partition's owner starts a new store session
        over the new replica set; the new replica is caught up in the background and
        counts toward the quorum once caught up. Adding a replica the node already
        holds does nothing."""
        node = validate_storage_node(storage_node)
        await self._check_partition(partition_id)

        def change(current: ReplicaAssignments) -> ReplicaAssignments | None:
            if node not in current.storage:
                raise ConfigError(
                    f"storage node {node} is not part of the cluster; add it first "
                    "(add_storage_node / `waltz cluster add-storage-node`)",
                    key="storage",
                )
            held = current.partitions_of(node)
            if partition_id in held:
                return None
            storage = dict(current.storage)
            storage[node] = tuple(sorted((*held, partition_id)))
            return replace(current, storage=storage)

        added = await self._change_assignments(change)
        log.info("partition %d: replica added on %s", partition_id, node)
        return added

    async def remove_replica(self, partition_id: int, storage_node: str) -> ReplicaAssignments:
        """Drop the replica of ``partition_id`` on ``storage_node``: the partition's
        owner starts a new store session without it and no longer writes it (its
        data stays on the node). Refused for a replica the node does not hold and
        for the partition's last replica."""
        node = validate_storage_node(storage_node)
        await self._check_partition(partition_id)

        def change(current: ReplicaAssignments) -> ReplicaAssignments | None:
            holders = current.replicas_of(partition_id)
            if node not in holders:
                raise ConfigError(
                    f"storage node {node} holds no replica of partition {partition_id} "
                    f"(its replicas: {', '.join(holders) or 'none'})",
                    key="storage",
                )
            if len(holders) <= 1:
                raise ConfigError(
                    f"{node} holds the last replica of partition {partition_id}; add "
                    "another replica first (a partition keeps at least one)",
                    key="storage",
                )
            storage = dict(current.storage)
            storage[node] = tuple(p for p in current.partitions_of(node) if p != partition_id)
            return replace(current, storage=storage)

        removed = await self._change_assignments(change)
        log.info("partition %d: replica on %s removed", partition_id, node)
        return removed

    async def _require(self, path: str) -> Versioned:
        found = await self.coordination.get(path)
        if found is None:
            await self.config()  # the clearer error when there is no cluster at all
            raise ClusterNotFoundError(f"the cluster metadata has no {path}; is it complete?")
        return found

    # -- servers and ids ----------------------------------------------------------------------

    async def allocate_server_id(self) -> int:
        """A server id never handed out before in this cluster."""
        return await self.coordination.increment(SERVER_ID_COUNTER)

    async def allocate_client_id(self) -> int:
        """A client id never handed out before in this cluster."""
        return await self.coordination.increment(CLIENT_ID_COUNTER)

    async def register_server(
        self, server_id: int, endpoint: str, *, preferred_partitions: Sequence[int] = ()
    ) -> None:
        """Register a live server (ephemeral: gone when its session ends)."""
        try:
            await self.coordination.create(
                join_path(SERVERS_DIR, server_id),
                encode_server(ServerInfo(server_id, endpoint, tuple(preferred_partitions))),
                ephemeral=True,
            )
        except NodeExistsError:
            raise CoordinationError(
                f"server id {server_id} is registered by a live server already; "
                "allocate a new id with allocate_server_id()"
            ) from None

    async def unregister_server(self, server_id: int) -> None:
        await self.coordination.delete(join_path(SERVERS_DIR, server_id))

    async def servers(self) -> list[ServerInfo]:
        """The live servers, by id."""
        found: list[ServerInfo] = []
        for name in await self.coordination.children(SERVERS_DIR):
            path = join_path(SERVERS_DIR, name)
            value = await self.coordination.get(path)
            if value is not None:  # it may have gone since the listing
                found.append(decode_server(value.value, path))
        return sorted(found, key=lambda s: s.server_id)

    async def watch_server_ids(
        self, callback: Callable[[list[int]], Awaitable[None] | None]
    ) -> Watch:
        """Call ``callback`` with the sorted live server ids now and after every change."""

        def on_children(names: list[str]) -> Awaitable[None] | None:
            return callback(sorted(int(n) for n in names if n.isdigit()))

        return await self.coordination.watch_children(SERVERS_DIR, on_children)

    # -- partition assignment (generations) ------------------------------------------------------

    async def partition_assignment(self, partition_id: int) -> Stored[PartitionAssignment]:
        path = join_path(PARTITION_ASSIGNMENT_DIR, partition_id)
        found = await self._require(path)
        return Stored(decode_partition_assignment(found.value, path), found.version)

    async def partition_assignments(self) -> list[PartitionAssignment]:
        config = await self.config()
        return [(await self.partition_assignment(p)).value for p in range(config.num_partitions)]

    async def assign_partition(
        self, partition_id: int, server_id: int, endpoint: str, *, expected_version: int
    ) -> Stored[PartitionAssignment]:
        """Move the partition to ``server_id``, bumping its generation, by CAS on the
        version read with :meth:`partition_assignment`. BadVersionError when
        someone else changed it since: re-read and decide again."""
        path = join_path(PARTITION_ASSIGNMENT_DIR, partition_id)
        current = await self._require(path)
        before = decode_partition_assignment(current.value, path)
        if current.version != expected_version:
            raise BadVersionError(
                f"partition {partition_id}'s assignment is at version {current.version}, "
                f"not {expected_version}; re-read it"
            )
        new = PartitionAssignment(partition_id, server_id, endpoint, before.generation + 1)
        version = await self.coordination.set(
            path, encode_partition_assignment(new), expected_version=expected_version
        )
        return Stored(new, version)

    async def watch_partition_assignment(
        self,
        partition_id: int,
        callback: Callable[[PartitionAssignment | None], Awaitable[None] | None],
    ) -> Watch:
        path = join_path(PARTITION_ASSIGNMENT_DIR, partition_id)

        def on_value(value: Versioned | None) -> Awaitable[None] | None:
            return callback(
                None if value is None else decode_partition_assignment(value.value, path)
            )

        return await self.coordination.watch(path, on_value)

    # -- leadership (CAS only) -------------------------------------------------------------------

    async def leader(self) -> Stored[LeaderRecord] | None:
        """The leader record and its version (None before any server claimed it)."""
        found = await self.coordination.get(LEADER_PATH)
        return None if found is None else Stored(decode_leader(found.value), found.version)

    async def claim_leadership(self, server_id: int) -> Stored[LeaderRecord]:
        """Create the leader record naming ``server_id`` (term 1). BadVersionError when
        a record exists already: read it and decide again."""
        record = LeaderRecord(server_id)
        try:
            version = await self.coordination.create(LEADER_PATH, encode_leader(record))
        except NodeExistsError:
            raise BadVersionError(
                "the leader record exists already; read it and decide again"
            ) from None
        return Stored(record, version)

    async def set_leader(
        self, record: LeaderRecord, *, expected_version: int
    ) -> Stored[LeaderRecord]:
        """Replace the leader record (a takeover or a renewal) only if it is still at
        ``expected_version``; BadVersionError when it changed since it was read."""
        version = await self.coordination.set(
            LEADER_PATH, encode_leader(record), expected_version=expected_version
        )
        return Stored(record, version)

    async def watch_leader(
        self, callback: Callable[[Stored[LeaderRecord] | None], Awaitable[None] | None]
    ) -> Watch:
        """Call ``callback`` with the leader record now and after every change."""

        def on_value(value: Versioned | None) -> Awaitable[None] | None:
            if value is None:
                return callback(None)
            return callback(Stored(decode_leader(value.value), value.version))

        return await self.coordination.watch(LEADER_PATH, on_value)

    # -- partition store metadata (CAS only) ---------------------------------------------------

    async def store_metadata(self, partition_id: int) -> Stored[PartitionStoreMetadata]:
        path = join_path(STORE_PARTITION_DIR, partition_id)
        found = await self._require(path)
        return Stored(decode_store_metadata(found.value, path, partition_id), found.version)

    async def cas_store_metadata(
        self, partition_id: int, new: PartitionStoreMetadata, *, expected_version: int
    ) -> Stored[PartitionStoreMetadata]:
        """Replace the store metadata only if it is still at ``expected_version``.

        Raises BadVersionError on a lost race: a fencing decision built on the
        old read is void; re-read and decide again (or give up the partition)."""
        if new.partition_id != partition_id:
            raise CoordinationError(
                f"store metadata of partition {new.partition_id} written to {partition_id}"
            )
        path = join_path(STORE_PARTITION_DIR, partition_id)
        version = await self.coordination.set(
            path, encode_store_metadata(new), expected_version=expected_version
        )
        return Stored(new, version)

    async def update_store_metadata(
        self,
        partition_id: int,
        update: Callable[[PartitionStoreMetadata], PartitionStoreMetadata],
        *,
        max_attempts: int = DEFAULT_CAS_ATTEMPTS,
    ) -> Stored[PartitionStoreMetadata]:
        """Read, apply ``update`` and CAS, retrying on BadVersionError (bounded).

        ``update`` must be a pure function of the metadata it is given (it may run
        several times); it may raise to abort (e.g. on a newer generation)."""
        for _ in range(max_attempts):
            current = await self.store_metadata(partition_id)
            new = update(current.value)
            try:
                return await self.cas_store_metadata(
                    partition_id, new, expected_version=current.version
                )
            except BadVersionError:
                continue
        raise CoordinationError(
            f"partition {partition_id}'s store metadata kept changing: no CAS succeeded in "
            f"{max_attempts} attempts"
        )

    async def new_store_session(
        self, partition_id: int, generation: int
    ) -> Stored[PartitionStoreMetadata]:
        """Start a new store session: its id is one above the last, assigned by CAS (two
        servers racing never get the same id). Raises BadVersionError when the
        metadata already carries a newer generation (another server owns the
        partition: stop serving it)."""

        def next_session(meta: PartitionStoreMetadata) -> PartitionStoreMetadata:
            if meta.generation > generation:
                raise BadVersionError(
                    f"partition {partition_id} is at generation {meta.generation}, newer than "
                    f"{generation}: another server owns it"
                )
            return replace(meta, generation=generation, session_id=meta.session_id + 1)

        return await self.update_store_metadata(partition_id, next_session)

    # -- a summary --------------------------------------------------------------------------------

    async def describe(self) -> dict[str, Any]:
        """Everything, as a JSON-able dict (``waltz cluster show``)."""
        config = await self.config()
        assignments = await self.replica_assignments()
        partitions: list[dict[str, Any]] = []
        for partition in range(config.num_partitions):
            owner = (await self.partition_assignment(partition)).value
            store = (await self.store_metadata(partition)).value
            partitions.append(
                {
                    "partition": partition,
                    "server_id": owner.server_id,
                    "endpoint": owner.endpoint,
                    "generation": owner.generation,
                    "store_generation": store.generation,
                    "store_session_id": store.session_id,
                    "replicas": [
                        {
                            "storage": r.replica_id.storage_node,
                            "session_id": r.session_id,
                            "closing_high_water_mark": r.closing_high_water_mark,
                        }
                        for r in store.replicas
                    ],
                }
            )
        return {
            "cluster_key": str(config.cluster_key),
            "partitions": config.num_partitions,
            "replicas": config.num_replicas,
            "storage": {n: list(p) for n, p in sorted(assignments.storage.items())},
            "groups": {n: assignments.group_of(n) for n in sorted(assignments.storage)},
            "servers": [
                {"server_id": s.server_id, "endpoint": s.endpoint} for s in await self.servers()
            ],
            "partition_state": partitions,
        }


def coordination_from_uri(uri: str, options: Mapping[str, Any] | None = None) -> Coordination:
    """A (not yet started) Coordination client chosen by the URI's scheme through the
    plugin registry: ``zk://host:port/root``, ``etcd://...``, ``local:///path``..."""
    from waltz_api.plugins import get_registry

    descriptor = get_registry().resolve("coordination", uri)
    client = descriptor.factory(uri, dict(options or {}))
    if not isinstance(client, Coordination):
        raise CoordinationError(
            f"coordination plugin {descriptor.name!r} returned {type(client).__name__}, "
            "not a Coordination"
        )
    return client
