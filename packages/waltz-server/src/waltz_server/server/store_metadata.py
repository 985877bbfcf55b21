"""Store sessions in the partition store metadata (``waltz_api.cluster``).

At ``/store/partition/<partition id>``: the generation of the partition's
owner, the current store session id, and each replica's state. A new store
session id is taken with a compare-and-set, so two servers never both believe
they own the same session, and a server holding an older generation can
never start one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace

from waltz_api.cluster import PartitionStoreMetadata, Stored
from waltz_api.contracts.coordination import Coordination
from waltz_api.errors import (
    BadVersionError,
    CoordinationError,
    SessionFencedError,
    StaleGenerationError,
)
from waltz_api.types import ReplicaState
from waltz_server.cluster_admin import ClusterAdmin

log = logging.getLogger(__name__)

MAX_CAS_ATTEMPTS = 64

VersionedMetadata = Stored[PartitionStoreMetadata]


def replica_states(metadata: PartitionStoreMetadata) -> dict[str, ReplicaState]:
    """The replica states by storage node."""
    return {state.replica_id.storage_node: state for state in metadata.replicas}


async def begin_store_session(
    coordination: Coordination, partition_id: int, generation: int
) -> VersionedMetadata:
    """Take the next store session id for ``partition_id`` by compare-and-set.

    Raises StaleGenerationError when the metadata already names a newer
    generation (the partition moved): the caller must stop serving it.
    """

    def next_session(metadata: PartitionStoreMetadata) -> PartitionStoreMetadata:
        if metadata.generation > generation:
            raise StaleGenerationError(
                f"partition {partition_id} belongs to generation {metadata.generation}, "
                f"this server holds generation {generation}: it moved to another server",
                metadata.generation,
            )
        return replace(metadata, generation=generation, session_id=metadata.session_id + 1)

    stored = await ClusterAdmin(coordination).update_store_metadata(
        partition_id, next_session, max_attempts=MAX_CAS_ATTEMPTS
    )
    log.info(
        "partition %d: store session %d (generation %d)",
        partition_id,
        stored.value.session_id,
        generation,
    )
    return stored


async def update_replica_states(
    coordination: Coordination,
    current: VersionedMetadata,
    states: Mapping[str, ReplicaState],
) -> VersionedMetadata:
    """Write ``states`` as the replica states of ``current``'s session, by CAS.

    Retries on a concurrent change that kept the session id; raises
    SessionFencedError when a newer store session took over.
    """
    cluster = ClusterAdmin(coordination)
    partition_id = current.value.partition_id
    session_id = current.value.session_id
    replicas = tuple(states[node] for node in sorted(states))
    for _ in range(MAX_CAS_ATTEMPTS):
        if current.value.session_id != session_id:
            raise SessionFencedError(
                f"store session {session_id} of partition {partition_id} was replaced by "
                f"session {current.value.session_id}",
                current.value.session_id,
            )
        updated = replace(current.value, replicas=replicas)
        if updated == current.value:
            return current
        try:
            return await cluster.cas_store_metadata(
                partition_id, updated, expected_version=current.version
            )
        except BadVersionError:
            current = await cluster.store_metadata(partition_id)
    raise CoordinationError(
        f"could not update the replica states of partition {partition_id} after "
        f"{MAX_CAS_ATTEMPTS} compare-and-set attempts"
    )
