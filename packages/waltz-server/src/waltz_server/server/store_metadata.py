"""The partition store metadata in coordination (spec: Partition Metadata).

At ``/store/partition/<partition id>``: the generation of the partition's
owner, the current store session id, and each replica's state. A new store
session id is taken with a compare-and-set, so two servers never both believe
they own the same session, and a server holding an older generation can
never start one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from waltz_api.contracts.coordination import Coordination, join_path
from waltz_api.errors import (
    BadVersionError,
    CoordinationError,
    NodeExistsError,
    SessionFencedError,
    StaleGenerationError,
)
from waltz_api.types import UNRESOLVED, ReplicaId, ReplicaState

log = logging.getLogger(__name__)

STORE_PARTITION_ROOT = "/store/partition"
MAX_CAS_ATTEMPTS = 64


def store_partition_path(partition_id: int) -> str:
    return join_path(STORE_PARTITION_ROOT, partition_id)


@dataclass(frozen=True)
class PartitionStoreMetadata:
    """Generation, store session id and replica states of one partition.

    ``replicas`` maps a storage node's connect string to its replica state.
    """

    partition_id: int
    generation: int = -1
    session_id: int = -1
    replicas: Mapping[str, ReplicaState] = field(default_factory=dict)

    def encode(self) -> bytes:
        body = {
            "generation": self.generation,
            "session_id": self.session_id,
            "replicas": {
                node: {
                    "session_id": state.session_id,
                    "closing_high_water_mark": state.closing_high_water_mark,
                }
                for node, state in sorted(self.replicas.items())
            },
        }
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def decode(cls, partition_id: int, data: bytes) -> PartitionStoreMetadata:
        try:
            body = json.loads(data.decode()) if data else {}
            replicas = {
                str(node): ReplicaState(
                    ReplicaId(partition_id, str(node)),
                    int(state["session_id"]),
                    int(state.get("closing_high_water_mark", UNRESOLVED)),
                )
                for node, state in dict(body.get("replicas", {})).items()
            }
            return cls(
                partition_id,
                int(body.get("generation", -1)),
                int(body.get("session_id", -1)),
                replicas,
            )
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CoordinationError(
                f"the store metadata of partition {partition_id} at "
                f"{store_partition_path(partition_id)} is not valid: {exc}; "
                "restore it or recreate the cluster metadata"
            ) from exc


@dataclass(frozen=True)
class VersionedMetadata:
    metadata: PartitionStoreMetadata
    version: int


async def load_metadata(coordination: Coordination, partition_id: int) -> VersionedMetadata | None:
    found = await coordination.get(store_partition_path(partition_id))
    if found is None:
        return None
    return VersionedMetadata(
        PartitionStoreMetadata.decode(partition_id, found.value), found.version
    )


async def begin_store_session(
    coordination: Coordination, partition_id: int, generation: int
) -> VersionedMetadata:
    """Take the next store session id for ``partition_id`` by compare-and-set.

    Raises StaleGenerationError when the metadata already names a newer
    generation (the partition moved): the caller must stop serving it.
    """
    path = store_partition_path(partition_id)
    for _ in range(MAX_CAS_ATTEMPTS):
        current = await load_metadata(coordination, partition_id)
        if current is None:
            fresh = PartitionStoreMetadata(partition_id, generation, 1, {})
            try:
                version = await coordination.create(path, fresh.encode())
            except NodeExistsError:
                continue
            return VersionedMetadata(fresh, version)
        metadata = current.metadata
        if metadata.generation > generation:
            raise StaleGenerationError(
                f"partition {partition_id} belongs to generation {metadata.generation}, "
                f"this server holds generation {generation}: it moved to another server",
                metadata.generation,
            )
        updated = replace(metadata, generation=generation, session_id=metadata.session_id + 1)
        try:
            version = await coordination.set(
                path, updated.encode(), expected_version=current.version
            )
        except BadVersionError:
            continue
        log.info(
            "partition %d: store session %d (generation %d)",
            partition_id,
            updated.session_id,
            generation,
        )
        return VersionedMetadata(updated, version)
    raise CoordinationError(
        f"could not take a store session id for partition {partition_id} after "
        f"{MAX_CAS_ATTEMPTS} compare-and-set attempts: another writer keeps changing "
        f"{path}; check that only one cluster manager assigns partitions"
    )


async def update_replica_states(
    coordination: Coordination,
    current: VersionedMetadata,
    states: Mapping[str, ReplicaState],
) -> VersionedMetadata:
    """Write ``states`` as the replica states of ``current``'s session, by CAS.

    Retries on a concurrent change that kept the session id; raises
    SessionFencedError when a newer store session took over.
    """
    partition_id = current.metadata.partition_id
    path = store_partition_path(partition_id)
    session_id = current.metadata.session_id
    for _ in range(MAX_CAS_ATTEMPTS):
        if current.metadata.session_id != session_id:
            raise SessionFencedError(
                f"store session {session_id} of partition {partition_id} was replaced by "
                f"session {current.metadata.session_id}",
                current.metadata.session_id,
            )
        updated = replace(current.metadata, replicas=dict(states))
        if updated == current.metadata:
            return current
        try:
            version = await coordination.set(
                path, updated.encode(), expected_version=current.version
            )
            return VersionedMetadata(updated, version)
        except BadVersionError:
            reloaded = await load_metadata(coordination, partition_id)
            if reloaded is None:
                raise SessionFencedError(
                    f"the store metadata of partition {partition_id} disappeared"
                ) from None
            current = reloaded
    raise CoordinationError(
        f"could not update the replica states of partition {partition_id} after "
        f"{MAX_CAS_ATTEMPTS} compare-and-set attempts"
    )
