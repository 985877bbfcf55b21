"""The arithmetic of recovery: which high-water mark a majority of replicas votes for.

Pure functions, no I/O (../shared/spec/waltz-server.txt, "Quorum Checking in the
Recovery Process").

A replica whose log ends at ``X`` votes for every high-water mark ``H <= X``:
it holds every record up to ``H``. The closing high-water mark of the last
store session is the highest mark that a quorum (a majority of the
replicas of the last session) votes for: every transaction above it lacked
a write quorum, so it was never acknowledged; every transaction at or below
it is held by a majority, so declaring it committed loses nothing.

Offline replicas may hold anything. The marks are examined in descending
order; when a mark lacks a quorum but would reach it with the offline
replicas' votes, the answer depends on what the offline replicas hold: it is
UNDECIDABLE, and recovery waits until enough replicas come back (or until a
lagging replica catches up and adds its vote).

A *floor* excludes marks that a quorum of logs may hold but that are known to
be too low (below the lowest voting replica, that is below the last session's
low-water mark): replicas under the floor must catch up before they count.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from waltz_api.errors import WaltzError
from waltz_api.types import LOST_SESSION, NO_SESSION, NO_TRANSACTION, UNRESOLVED


class Outcome(enum.Enum):
    DECIDED = "decided"
    """A quorum votes for ``high_water_mark`` whatever the offline replicas hold."""
    UNDECIDABLE = "undecidable"
    """The offline replicas could change the answer: wait for them."""
    WAITING = "waiting"
    """No mark at or above the floor has a quorum yet: lagging replicas must catch up."""


@dataclass(frozen=True, slots=True)
class Resolution:
    outcome: Outcome
    high_water_mark: int | None = None

    @property
    def decided(self) -> bool:
        return self.outcome is Outcome.DECIDED


UNDECIDABLE = Resolution(Outcome.UNDECIDABLE)
WAITING = Resolution(Outcome.WAITING)


def quorum_of(num_replicas: int) -> int:
    """The majority of ``num_replicas`` (1 of 1, 2 of 2 or 3, 3 of 4 or 5)."""
    if num_replicas < 1:
        raise WaltzError(
            f"a partition needs at least one replica, got {num_replicas}: "
            "check the replica assignment in the cluster metadata"
        )
    return num_replicas // 2 + 1


def resolve_high_water_mark(
    marks: Iterable[int], num_offline: int, quorum: int, floor: int | None = None
) -> Resolution:
    """The highest mark a quorum votes for, or why there is none yet.

    ``marks`` are the log ends (max transaction ids after any truncation) of
    the online replicas of the last session; ``num_offline`` counts its
    replicas that did not answer; ``quorum`` is the majority of the last
    session's replicas. Marks below ``floor`` are never chosen.
    """
    if quorum < 1:
        raise WaltzError(f"quorum must be at least 1, got {quorum}")
    if num_offline < 0:
        raise WaltzError(f"the number of offline replicas cannot be negative ({num_offline})")
    descending = sorted(marks, reverse=True)
    votes = 0
    index = 0
    while index < len(descending):
        mark = descending[index]
        if floor is not None and mark < floor:
            break
        if mark <= NO_TRANSACTION:
            # Every log holds the empty prefix, so a quorum votes for it. Only the
            # offline replicas could vote higher, and they cannot form a quorum
            # alone once a higher online mark was found short of one.
            if votes == 0 and num_offline >= quorum:
                return UNDECIDABLE
            return Resolution(Outcome.DECIDED, NO_TRANSACTION)
        # every replica whose log reaches ``mark`` votes for it
        while index < len(descending) and descending[index] == mark:
            votes += 1
            index += 1
        if votes >= quorum:
            return Resolution(Outcome.DECIDED, mark)
        if votes + num_offline >= quorum:
            return UNDECIDABLE
    if not descending and num_offline >= quorum:
        return UNDECIDABLE  # nobody online: whatever the offline replicas hold decides
    return WAITING


def votes_for(marks: Sequence[int], high_water_mark: int) -> int:
    """How many of ``marks`` vote for ``high_water_mark`` (logs reaching it)."""
    return sum(1 for mark in marks if mark >= high_water_mark)


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    """What recovery does first with one replica, before voting.

    - ``truncate_to``: truncate the log to this id first (None: leave it).
    - ``voting``: whether the replica's log end counts as a vote for the
      closing high-water mark (only a replica that was clean at the start of
      the last session, and so may hold its uncommitted tail, votes).
    - ``new``: the replica is not in the last session's metadata; it neither
      votes nor counts towards that session's quorum, and catches up.
    - ``suspect``: its storage lost records it may have acknowledged (restored
      from a backup, or a damaged tail its engine moved aside): it counts as an
      offline replica in the vote (it may have held anything), and catches up.
    """

    truncate_to: int | None
    voting: bool
    new: bool = False
    suspect: bool = False

    def mark_after(self, max_transaction_id: int) -> int:
        """The replica's log end once the plan's truncation is done."""
        if self.truncate_to is None:
            return max_transaction_id
        return min(max_transaction_id, self.truncate_to)


def plan_replica(
    *,
    known: bool,
    metadata_empty: bool,
    state_session_id: int,
    state_closing_high_water_mark: int,
    storage_session_id: int,
    storage_low_water_mark: int,
    max_transaction_id: int,
    storage_low_water_mark_session_id: int = NO_SESSION,
) -> ReplicaPlan:
    """Decide a replica's first recovery step (spec: Recovery Procedure, step 5).

    ``known``: the replica has a ReplicaState in the partition store metadata
    (``state_*``); ``metadata_empty``: the metadata has no replica at all (a
    brand-new partition, where every replica starts as a voter). The storage
    side reports its last session info (``storage_*``: the fence session id, the
    low-water mark and the session that wrote it) and log end.
    """
    if not known and not metadata_empty:
        # added to the partition: only its committed prefix is trustworthy
        return ReplicaPlan(truncate_to=storage_low_water_mark, voting=False, new=True)
    if known and storage_older_than_metadata(
        state_session_id, storage_session_id, storage_low_water_mark_session_id
    ):
        # the storage is older than the metadata says (restored from a backup,
        # replaced disk, a damaged tail moved aside): keep what it knows is clean and
        # catch up; what it lost may have counted in a quorum, so it counts as offline
        return ReplicaPlan(truncate_to=storage_low_water_mark, voting=False, suspect=True)
    if known and state_closing_high_water_mark != UNRESOLVED:
        # it missed the end of its last session; the closing mark was resolved without it
        return ReplicaPlan(truncate_to=state_closing_high_water_mark, voting=False)
    if max_transaction_id < storage_low_water_mark:
        # clean but behind the last session's start: it must catch up before it counts
        return ReplicaPlan(truncate_to=None, voting=False)
    return ReplicaPlan(truncate_to=None, voting=True)


def storage_older_than_metadata(
    state_session_id: int, storage_session_id: int, storage_low_water_mark_session_id: int
) -> bool:
    """Whether a replica's storage is older than its ReplicaState says: the metadata
    records it clean in ``state_session_id``, but its low-water marks were written by an
    older session (or its engine found it lost records: LOST_SESSION). A storage that
    does not keep the marks' session (NO_SESSION) is judged by its fence session id, as
    the original did (a session that raised the fence and died then hides a restore).

    A replica the metadata never recorded clean (``state_session_id`` -1: added to the
    partition, and no session recorded it clean yet) never joined a session's writers
    (a replica writes only once the metadata records it clean), so it acknowledged
    nothing and its storage cannot have lost anything that counted: it is never older.
    (A new partition whose fence a session raised before that session ended reads
    LOST_SESSION: taken for a suspect, the replica counted as offline, and with a
    replica of the last session removed (offline for good) as well, a recovery of a
    four-replica session could never decide.)"""
    if state_session_id < 0:
        return False
    if storage_low_water_mark_session_id == LOST_SESSION:
        return True
    if storage_low_water_mark_session_id == NO_SESSION:
        return storage_session_id < state_session_id
    return storage_low_water_mark_session_id < state_session_id
