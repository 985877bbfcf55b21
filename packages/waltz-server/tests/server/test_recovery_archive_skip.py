"""Recovery's fast-forward of a replica to the archive mark (``_skip_archived``): a
replica whose kept log ends below the mark drops its archived prefix and continues
after the mark; its dirty tail is truncated first, so no uncommitted record of an old
session survives above the mark (the mutation run found no test building that case:
docs/simulation.md, "Mutation score", recovery.py:358)."""

from __future__ import annotations

from typing import cast

from waltz_api.capabilities import PREFIX
from waltz_api.cluster import PartitionStoreMetadata, Stored
from waltz_api.types import ReplicaId, ReplicaState
from waltz_conformance.reference.coordination import MemoryCoordination, MemoryCoordinationService
from waltz_server.server.recovery import RecoveryManager
from waltz_server.server.replica import ReplicaConnection
from waltz_server.server.voting import ReplicaPlan

P = 0


class PrefixReplica:
    """The log of one replica as the ids it holds (``start..end``), and the calls made."""

    capabilities = frozenset({PREFIX})

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.calls: list[tuple[str, int]] = []

    async def truncate(self, transaction_id: int) -> None:
        self.calls.append(("truncate", transaction_id))
        self.end = min(self.end, transaction_id)

    async def prune(self, through: int) -> int:
        """Delete every id through ``through``; a log ending below it continues after it."""
        self.calls.append(("prune", through))
        self.start = max(self.start, through + 1)
        self.end = max(self.end, through)
        return self.start

    async def max_transaction_id(self) -> int:
        return self.end


def manager(archive_mark: int, session_id: int = 4) -> RecoveryManager:
    metadata = PartitionStoreMetadata(P, 0, session_id, (ReplicaState(ReplicaId(P, "a"), 1, 100),))
    return RecoveryManager(
        coordination=MemoryCoordination(MemoryCoordinationService(), "/waltz"),
        metadata=Stored(metadata, 0),
        replica_nodes=["a"],
        archive_mark=archive_mark,
    )


async def test_a_dirty_tail_across_the_archive_mark_is_truncated_before_the_fast_forward() -> None:
    # recorded valid up to closing mark 100; an old owner's uncommitted records 101..290
    # are its dirty tail; the cluster has since committed and archived through 279
    replica = PrefixReplica(0, 290)
    plan = ReplicaPlan(truncate_to=100, voting=False)
    max_id, left = await manager(279)._skip_archived(
        "a", cast(ReplicaConnection, replica), plan, 290
    )
    assert replica.calls == [("truncate", 100), ("prune", 279)]
    assert (replica.start, replica.end) == (280, 279)  # nothing of the dirty tail left
    assert max_id == 279 and left.truncate_to is None


async def test_a_replica_whose_log_ends_below_its_truncation_is_not_truncated() -> None:
    replica = PrefixReplica(0, 90)
    plan = ReplicaPlan(truncate_to=100, voting=False)
    max_id, left = await manager(279)._skip_archived(
        "a", cast(ReplicaConnection, replica), plan, 90
    )
    assert replica.calls == [("prune", 279)]
    assert max_id == 279 and left.truncate_to is None


async def test_a_replica_reaching_past_the_mark_is_not_fast_forwarded() -> None:
    replica = PrefixReplica(0, 290)
    plan = ReplicaPlan(truncate_to=285, voting=False)
    max_id, left = await manager(279)._skip_archived(
        "a", cast(ReplicaConnection, replica), plan, 290
    )
    assert replica.calls == []
    assert max_id == 290 and left == plan
