"""The cluster metadata, built once on the Coordination contract (for every plugin).

Layout under the coordination root (paths of the original where the spec
names them)::

    /cluster/config                  ClusterConfig: cluster key, partitions, replicas
    /cluster/features                the cluster's feature level (waltz_api.features;
                                     absent: level 1, a cluster of 0.1.0; CAS, raised only)
    /store/assignment                ReplicaAssignments: storage node -> partition ids
    /store/partition/<id>            PartitionStoreMetadata: generation, store session id,
                                     replica states (changed ONLY by CAS)
    /assignment/partition/<id>       PartitionAssignment: server, endpoint, generation (CAS)
    /assignment/leader               LeaderRecord: the server that assigns partitions (CAS)
    /servers/<server id>             ServerInfo, ephemeral (a live server's registration)
    /ids/server, /ids/client         counters: server and client id allocation
    /archive/partition/<id>          ArchiveMark: the partition's archive mark (CAS)
    /acl                             AccessControl: client keys' partition permissions
                                     (waltz_api.access; absent: not enforced; CAS)

Every value is JSON (UTF-8 bytes) with ``"format": 1`` and a ``"type"``; a
reader refuses a format newer than it knows, with a clear error.

Reading is here (the model, the codec, :class:`ClusterMetadata`'s reads and
watches: what a client and a tool need); writing is the server's
(``waltz_server.cluster_admin.ClusterAdmin``: creating and deleting a cluster,
membership, partition assignment, leadership, store sessions).

Fencing: the store session id and the generations are changed only by a
compare-and-set on the znode/key version (``ClusterAdmin.cas_store_metadata``,
``ClusterAdmin.assign_partition``). None of these paths is ever deleted while the
cluster exists, so their versions never restart (see
:class:`waltz_api.contracts.Versioned`).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from waltz_api.access import ACL_PATH, AccessControl, decode_access_control
from waltz_api.contracts.coordination import Coordination, Versioned, Watch, join_path
from waltz_api.errors import (
    ClusterNotFoundError,
    ConfigError,
    CoordinationError,
)
from waltz_api.features import MIN_FEATURE_LEVEL
from waltz_api.types import UNRESOLVED, ReplicaId, ReplicaState

log = logging.getLogger(__name__)

FORMAT_VERSION = 1

CONFIG_PATH = "/cluster/config"
FEATURES_PATH = "/cluster/features"
REPLICA_ASSIGNMENT_PATH = "/store/assignment"
STORE_PARTITION_DIR = "/store/partition"
PARTITION_ASSIGNMENT_DIR = "/assignment/partition"
LEADER_PATH = "/assignment/leader"
SERVERS_DIR = "/servers"
SERVER_ID_COUNTER = "/ids/server"
CLIENT_ID_COUNTER = "/ids/client"
ARCHIVE_PARTITION_DIR = "/archive/partition"
"""``<dir>/<p>``: partition p's archive mark (tiered storage, docs/archive.md)."""

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
    max_feature_level: int = MIN_FEATURE_LEVEL
    """The highest cluster feature level the server supports (a registration of 0.1.0
    has none: level 1)."""


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


@dataclass(frozen=True, slots=True)
class ArchiveMark:
    """A partition's archive mark (docs/archive.md): every id at or below ``mark`` is in
    the archive at ``url``, in the ranges listed by ``manifest`` (an object name under
    the partition's directory there), ``ranges`` of them, ``archived_bytes`` in all.
    Absent (mark -1) until the partition archives; changed only by compare-and-set,
    forward only (``waltz_server.cluster_admin.ClusterAdmin.advance_archive_mark``).

    ``incarnation``: "" for a partition never restored from an archive; a new token
    written by `waltz archive restore --url` (then never changed). Every object the
    partition's archivers write carries it with the cluster key, so an object of
    another incarnation (a dead cluster's) is never taken for this log's (docs/archive.md,
    "Incarnations")."""

    partition_id: int
    mark: int = -1
    manifest: str = ""
    ranges: int = 0
    archived_bytes: int = 0
    url: str = ""
    incarnation: str = ""


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


def encode_archive_mark(mark: ArchiveMark) -> bytes:
    body: dict[str, Any] = {
        "partition_id": mark.partition_id,
        "mark": mark.mark,
        "manifest": mark.manifest,
        "ranges": mark.ranges,
        "bytes": mark.archived_bytes,
        "url": mark.url,
    }
    if mark.incarnation:  # only a restored partition has one (earlier releases ignore it)
        body["incarnation"] = mark.incarnation
    return _encode("archive_mark", body)


def decode_archive_mark(raw: bytes, path: str, partition_id: int) -> ArchiveMark:
    doc = _decode("archive_mark", raw, path)
    try:
        found = ArchiveMark(
            int(doc["partition_id"]),
            int(doc["mark"]),
            str(doc.get("manifest", "")),
            int(doc.get("ranges", 0)),
            int(doc.get("bytes", 0)),
            str(doc.get("url", "")),
            str(doc.get("incarnation", "")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CoordinationError(f"{path} holds an invalid archive mark: {exc}") from None
    if found.partition_id != partition_id:
        raise CoordinationError(f"{path} holds partition {found.partition_id}'s archive mark")
    return found


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


def encode_feature_level(level: int) -> bytes:
    return _encode("feature_level", {"level": level})


def decode_feature_level(raw: bytes, path: str = FEATURES_PATH) -> int:
    """The recorded level (a number this code may not know: the caller checks it)."""
    doc = _decode("feature_level", raw, path)
    level = doc.get("level")
    if isinstance(level, bool) or not isinstance(level, int) or level < MIN_FEATURE_LEVEL:
        raise CoordinationError(f"{path} holds no valid feature level: {level!r}")
    return level


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
            "max_feature_level": info.max_feature_level,
        },
    )


def decode_server(raw: bytes, path: str) -> ServerInfo:
    doc = _decode("server", raw, path)
    try:
        preferred = tuple(int(p) for p in doc.get("preferred_partitions", ()))
        level = int(doc.get("max_feature_level", MIN_FEATURE_LEVEL))
        return ServerInfo(int(doc["server_id"]), str(doc["endpoint"]), preferred, level)
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


# -- the metadata API ---------------------------------------------------------------------------


class ClusterMetadata:
    """Reads and watches the cluster metadata through a started Coordination client.

    What a client needs (and the only write it makes: its own client id). Every
    admin and fencing change (creating a cluster, membership, partition assignment,
    leadership, store sessions) is the server's: ``waltz_server.cluster_admin``."""

    def __init__(self, coordination: Coordination) -> None:
        self.coordination = coordination

    # -- cluster config ------------------------------------------------------------------

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

    async def exists(self) -> bool:
        return await self.coordination.exists(CONFIG_PATH)

    async def feature_level(self) -> Stored[int]:
        """The cluster's recorded feature level and its version (level 1, version -1
        when none is recorded: a cluster created by 0.1.0). May be above what this code
        supports (a newer release raised it): the caller checks."""
        await self.config()  # no cluster: the clear error
        found = await self.coordination.get(FEATURES_PATH)
        if found is None:
            return Stored(MIN_FEATURE_LEVEL, -1)
        return Stored(decode_feature_level(found.value), found.version)

    async def watch_feature_level(self, callback: Callable[[int], Awaitable[None] | None]) -> Watch:
        """Call ``callback`` with the recorded feature level now and after every change
        (level 1 while none is recorded)."""

        def on_value(value: Versioned | None) -> Awaitable[None] | None:
            if value is None:
                return callback(MIN_FEATURE_LEVEL)
            return callback(decode_feature_level(value.value))

        return await self.coordination.watch(FEATURES_PATH, on_value)

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

    async def _require(self, path: str) -> Versioned:
        found = await self.coordination.get(path)
        if found is None:
            await self.config()  # the clearer error when there is no cluster at all
            raise ClusterNotFoundError(f"the cluster metadata has no {path}; is it complete?")
        return found

    # -- servers and client ids ---------------------------------------------------------------

    async def allocate_client_id(self) -> int:
        """A client id never handed out before in this cluster."""
        return await self.coordination.increment(CLIENT_ID_COUNTER)

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

    # -- the archive mark (tiered storage) ----------------------------------------------------

    async def archive_mark(self, partition_id: int) -> Stored[ArchiveMark]:
        """The partition's archive mark and its version (mark -1, version -1 when the
        partition never archived)."""
        path = join_path(ARCHIVE_PARTITION_DIR, partition_id)
        found = await self.coordination.get(path)
        if found is None:
            return Stored(ArchiveMark(partition_id), -1)
        return Stored(decode_archive_mark(found.value, path, partition_id), found.version)

    # -- access control (waltz acl) -------------------------------------------------------------

    async def access_control(self) -> Stored[AccessControl] | None:
        """The cluster's ACL and its version (None: there is none, nothing is enforced)."""
        found = await self.coordination.get(ACL_PATH)
        if found is None:
            return None
        return Stored(decode_access_control(found.value), found.version)

    async def watch_access_control(
        self, callback: Callable[[AccessControl | None], Awaitable[None] | None]
    ) -> Watch:
        """Call ``callback`` with the ACL now and after every change (None: none). An
        ACL this Waltz cannot read (damaged, or a newer format) is logged and passed as
        enforced with no grants: a server refuses every request rather than guess."""

        def on_value(value: Versioned | None) -> Awaitable[None] | None:
            if value is None:
                return callback(None)
            try:
                acl = decode_access_control(value.value)
            except CoordinationError as exc:
                log.error("%s; every client request is refused until it is fixed", exc)
                acl = AccessControl(enforced=True)
            return callback(acl)

        return await self.coordination.watch(ACL_PATH, on_value)

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
