"""The cluster metadata's admin and fencing changes: the server's and its CLI's alone.

:class:`ClusterAdmin` is :class:`waltz_api.cluster.ClusterMetadata` (the model, the
codec, the reads and watches every client uses) with every change a client never
makes: creating and deleting a cluster (the spec's CreateCluster utility),
storage-node membership and replica placement, server registration, partition
assignment (generations), leadership, and the partition store metadata (store
sessions). Whatever a fencing decision rests on is a compare-and-set on the
value's version here, never a read-then-write.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

from waltz_api.access import ACL_PATH, AccessControl, encode_access_control
from waltz_api.cluster import (
    ARCHIVE_PARTITION_DIR,
    CONFIG_PATH,
    DEFAULT_CAS_ATTEMPTS,
    FEATURES_PATH,
    LEADER_PATH,
    NO_SESSION,
    PARTITION_ASSIGNMENT_DIR,
    REPLICA_ASSIGNMENT_PATH,
    SERVER_ID_COUNTER,
    SERVERS_DIR,
    STORE_PARTITION_DIR,
    ArchiveMark,
    ClusterConfig,
    ClusterMetadata,
    LeaderRecord,
    PartitionAssignment,
    PartitionStoreMetadata,
    ReplicaAssignments,
    ServerInfo,
    Stored,
    decode_config,
    decode_feature_level,
    decode_partition_assignment,
    decode_replica_assignments,
    encode_archive_mark,
    encode_config,
    encode_feature_level,
    encode_leader,
    encode_partition_assignment,
    encode_replica_assignments,
    encode_server,
    encode_store_metadata,
    validate_storage_node,
)
from waltz_api.contracts.coordination import join_path
from waltz_api.errors import (
    BadVersionError,
    ClusterExistsError,
    ClusterNotFoundError,
    ConfigError,
    CoordinationError,
    NodeExistsError,
    WaltzError,
)
from waltz_api.faultpoints import point
from waltz_api.features import MAX_FEATURE_LEVEL, MIN_FEATURE_LEVEL, check_feature_level
from waltz_api.types import UNRESOLVED, ReplicaId, ReplicaState

log = logging.getLogger(__name__)


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


class ClusterAdmin(ClusterMetadata):
    """Reads, watches and changes the cluster metadata through a started Coordination
    client (a server, the ``waltz cluster`` and ``waltz server`` commands, tests)."""

    # -- the cluster ---------------------------------------------------------------------------

    async def create_cluster(
        self,
        *,
        num_partitions: int,
        num_replicas: int,
        storage_nodes: Sequence[str] = (),
        assignments: ReplicaAssignments | None = None,
        cluster_key: uuid.UUID | None = None,
        feature_level: int = MAX_FEATURE_LEVEL,
    ) -> ClusterConfig:
        """Write a new cluster (the spec's CreateCluster utility) at ``feature_level``
        (the highest this code supports by default; a lower one for a cluster that
        processes of an earlier release join: ``waltz_api.features``).

        Refused with ClusterExistsError when the root already holds a cluster
        (complete or not): the config is claimed first with a create, so of two
        concurrent creators exactly one proceeds."""
        check_feature_level(feature_level)
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
        await c.create(FEATURES_PATH, encode_feature_level(feature_level))
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
            "created cluster %s: %d partitions, %d replicas, feature level %d",
            config.cluster_key,
            num_partitions,
            num_replicas,
            feature_level,
        )
        return config

    async def raise_feature_level(
        self, level: int, check: Callable[[], Awaitable[None]] | None = None
    ) -> tuple[int, int]:
        """Record ``level`` as the cluster's feature level by compare-and-set (created
        when none is recorded); returns (the level before, the level now). Raising to the
        recorded level does nothing; lowering is refused (a process may have written a
        format of the higher level already).

        Each attempt reads the recorded level's version first, then checks that every
        live server supports ``level``, after ``check`` (the caller's look at the
        storage nodes: it raises to refuse), then writes on that version. A server
        confirms the level after it registers by writing the value back on the version
        it read (:meth:`register_server`), so a server registering meanwhile either
        changed the version (this write fails, and the next attempt's check sees it) or
        reads the new level and refuses to run: no window between check and write.
        A server of 0.1.0 does not confirm: one found registered after the write is
        reported (WaltzError: stop it), since the level cannot be taken back."""
        check_feature_level(level)
        for _ in range(DEFAULT_CAS_ATTEMPTS):
            current = await self.feature_level()  # its version before the checks
            if level < current.value:
                raise ConfigError(
                    f"the cluster is at feature level {current.value}; a feature level is "
                    f"never lowered (to {level}): processes may have written its formats "
                    "already. To go back, restore the storage nodes from copies taken before "
                    'the raise (docs/compatibility.md, "Feature levels")',
                    key="feature_level",
                )
            if check is not None:
                await check()
            below = await self._servers_below(level)
            if below:
                raise WaltzError(
                    f"the feature level stays {current.value}, not raised to {level}: "
                    + "; ".join(below)
                    + "; upgrade (or stop) them and run the command again"
                )
            if level == current.value:
                return current.value, level
            try:
                if current.version < 0:
                    await self.coordination.create(FEATURES_PATH, encode_feature_level(level))
                else:
                    await self.coordination.set(
                        FEATURES_PATH,
                        encode_feature_level(level),
                        expected_version=current.version,
                    )
            except (BadVersionError, NodeExistsError):
                continue  # a server registered (or another raise): check again
            log.info("cluster feature level raised from %d to %d", current.value, level)
            late = await self._servers_of_0_1_0()
            if late:
                raise WaltzError(
                    f"feature level {level} is recorded (was {current.value}), but "
                    + ", ".join(late)
                    + " of 0.1.0 registered during the raise (0.1.0 does not check the "
                    "level itself): stop it now and start it on this release (a level is "
                    "never lowered)"
                )
            return current.value, level
        raise CoordinationError(
            f"the feature level kept changing: no compare-and-set succeeded in "
            f"{DEFAULT_CAS_ATTEMPTS} attempts; try again"
        )

    async def _servers_of_0_1_0(self) -> list[str]:
        """The live servers whose registration carries no level (0.1.0's: they never
        confirm the level; a later release's does, see :meth:`register_server`)."""
        found = []
        for name in await self.coordination.children(SERVERS_DIR):
            value = await self.coordination.get(join_path(SERVERS_DIR, name))
            if value is not None and b'"max_feature_level"' not in value.value:
                found.append(f"server {name}")
        return found

    async def _servers_below(self, level: int) -> list[str]:
        """One phrase per live server that does not support ``level``."""
        return [
            f"server {s.server_id} ({s.endpoint}) supports feature level "
            f"{s.max_feature_level} at most"
            + (" (a release before levels: 0.1.0)" if s.max_feature_level == 1 else "")
            for s in await self.servers()
            if s.max_feature_level < level
        ]

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
        for top in ("/servers", "/assignment", "/store", "/ids", ACL_PATH):
            await self.coordination.delete(top, recursive=True)
        # The config goes last: until then a re-run sees the (partial) cluster.
        await self.coordination.delete("/cluster", recursive=True)
        log.info("deleted cluster %s", cluster_key)

    # -- membership changes (compare-and-set on /store/assignment) -----------------------------

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

    # -- servers -------------------------------------------------------------------------------

    async def allocate_server_id(self) -> int:
        """A server id never handed out before in this cluster."""
        return await self.coordination.increment(SERVER_ID_COUNTER)

    async def register_server(
        self,
        server_id: int,
        endpoint: str,
        *,
        preferred_partitions: Sequence[int] = (),
        max_feature_level: int = MAX_FEATURE_LEVEL,
    ) -> int:
        """Register a live server (ephemeral: gone when its session ends), with the
        highest feature level it supports (``max_feature_level``: this release's; a
        test plays an older release with a lower one), then confirm the cluster's
        recorded level (returned): when it is above what the server supports the
        registration is deleted again and ConfigError names both levels."""
        info = ServerInfo(server_id, endpoint, tuple(preferred_partitions), max_feature_level)
        path = join_path(SERVERS_DIR, server_id)
        try:
            await self.coordination.create(path, encode_server(info), ephemeral=True)
        except NodeExistsError:
            raise CoordinationError(
                f"server id {server_id} is registered by a live server already; "
                "allocate a new id with allocate_server_id()"
            ) from None
        try:
            return await self._confirm_feature_level(server_id, max_feature_level)
        except BaseException:
            with contextlib.suppress(WaltzError):
                await self.coordination.delete(path)
            raise

    async def _confirm_feature_level(self, server_id: int, supported: int) -> int:
        """The recorded level, once it is confirmed to be at most ``supported`` by writing
        its value back on the version read (the registration is made already): a raise
        that read an earlier version fails its write and checks again, so it sees this
        registration (:meth:`raise_feature_level`)."""
        for _ in range(DEFAULT_CAS_ATTEMPTS):
            found = await self.coordination.get(FEATURES_PATH)
            level = MIN_FEATURE_LEVEL if found is None else decode_feature_level(found.value)
            if level > supported:
                raise ConfigError(
                    f"server {server_id} supports feature level {supported} at most and the "
                    f"cluster is at feature level {level}: a newer release raised it, so this "
                    "server deregistered and does not run; run the release that raised it (a "
                    "level is never lowered)",
                    key="feature_level",
                )
            try:
                if found is None:  # a cluster of 0.1.0: record its level 1
                    await self.coordination.create(
                        FEATURES_PATH, encode_feature_level(MIN_FEATURE_LEVEL)
                    )
                else:  # the value as read (a newer release's fields kept)
                    await self.coordination.set(
                        FEATURES_PATH, found.value, expected_version=found.version
                    )
            except (BadVersionError, NodeExistsError):
                continue  # raised (or confirmed by another server) meanwhile: read again
            return level
        raise CoordinationError(
            f"the feature level kept changing while server {server_id} registered: no "
            f"compare-and-set succeeded in {DEFAULT_CAS_ATTEMPTS} attempts; start it again"
        )

    async def unregister_server(self, server_id: int) -> None:
        await self.coordination.delete(join_path(SERVERS_DIR, server_id))

    # -- partition assignment (generations, compare-and-set) -----------------------------------

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

    # -- leadership (compare-and-set only) -----------------------------------------------------

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
        point("leader.record_written", server=server_id, term=record.term)
        return Stored(record, version)

    async def set_leader(
        self, record: LeaderRecord, *, expected_version: int
    ) -> Stored[LeaderRecord]:
        """Replace the leader record (a takeover or a renewal) only if it is still at
        ``expected_version``; BadVersionError when it changed since it was read."""
        version = await self.coordination.set(
            LEADER_PATH, encode_leader(record), expected_version=expected_version
        )
        point("leader.record_written", server=record.server_id, term=record.term)
        return Stored(record, version)

    # -- the archive mark (compare-and-set only, forward only) ----------------------------------

    async def advance_archive_mark(
        self, current: Stored[ArchiveMark], new: ArchiveMark
    ) -> Stored[ArchiveMark]:
        """Replace ``current`` (as read, with its version; -1: absent) by ``new`` only if
        nothing changed it since, and only forward. BadVersionError on a lost race (the
        caller's archive round is void; docs/archive.md). The incarnation is set when
        the mark is created (`waltz archive restore --url`, which may create it with
        nothing archived yet: mark -1) and never changed."""
        partition_id = current.value.partition_id
        if new.partition_id != partition_id:
            raise CoordinationError(
                f"archive mark of partition {new.partition_id} written over partition "
                f"{partition_id}'s"
            )
        creating_incarnation = current.version < 0 and new.mark == -1 and bool(new.incarnation)
        if new.mark <= current.value.mark and not creating_incarnation:
            raise CoordinationError(
                f"partition {partition_id}: the archive mark only moves forward "
                f"({current.value.mark} -> {new.mark} refused)"
            )
        if current.version >= 0 and new.incarnation != current.value.incarnation:
            raise CoordinationError(
                f"partition {partition_id}: the archive incarnation never changes "
                f"({current.value.incarnation!r} -> {new.incarnation!r} refused)"
            )
        path = join_path(ARCHIVE_PARTITION_DIR, partition_id)
        raw = encode_archive_mark(new)
        if current.version < 0:
            try:
                version = await self.coordination.create(path, raw)
            except NodeExistsError:
                raise BadVersionError(
                    f"partition {partition_id}'s archive mark was created meanwhile"
                ) from None
        else:
            version = await self.coordination.set(path, raw, expected_version=current.version)
        return Stored(new, version)

    # -- access control (compare-and-set on /acl) -----------------------------------------------

    async def change_access_control(
        self,
        change: Callable[[AccessControl], AccessControl | None],
        *,
        max_attempts: int = DEFAULT_CAS_ATTEMPTS,
    ) -> AccessControl:
        """Read the ACL (an empty, not enforced one when there is none), apply ``change``
        and compare-and-set (creating it), retrying on a concurrent change (bounded).
        ``change`` returns None when there is nothing to do, or raises to refuse. Every
        server watching it applies the result within the watch's delay."""
        await self.config()  # no cluster: the clear error
        for _ in range(max_attempts):
            stored = await self.access_control()
            current = AccessControl() if stored is None else stored.value
            new = change(current)
            if new is None:
                return current
            raw = encode_access_control(new)
            try:
                if stored is None:
                    await self.coordination.create(ACL_PATH, raw)
                else:
                    await self.coordination.set(ACL_PATH, raw, expected_version=stored.version)
            except (BadVersionError, NodeExistsError):
                continue
            return new
        raise CoordinationError(
            f"the ACL kept changing: no compare-and-set succeeded in {max_attempts} attempts; "
            "try again"
        )

    # -- partition store metadata (compare-and-set only) ---------------------------------------

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
