"""Bugs the simulation found in code under repair elsewhere, with the seeds that show them.

A seed that fails only with the violations of a known issue is reported as such;
``waltz simulate --allow-known`` then counts it as passed (CI uses it while the
issue is open, so an unrelated new failure still fails the run). Each entry names
the code at fault and the diagnosis; when it is fixed, its seeds must pass and the
entry goes (its seeds stay as regression cases in ``tests/seeds``).

Seeds are for the default configuration (``--duration 40 --faults standard
--workload bank``, 3 storage nodes, 2 servers, 4 clients, 2 partitions) on the code
of the commit that added the entry; a change to the code under test may move the
symptom to other seeds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from waltz_sim.checker import Violation


@dataclass(frozen=True)
class KnownIssue:
    id: str
    summary: str
    where: str
    diagnosis: str
    invariants: frozenset[str]
    """Every violation of a seed it explains is one of these."""
    seeds: tuple[int, ...]
    faults: str = "standard"
    """The fault profile of the seeds."""

    def explains(self, violations: Iterable[Violation]) -> bool:
        found = list(violations)
        return bool(found) and all(v.invariant in self.invariants for v in found)


KNOWN_ISSUES: tuple[KnownIssue, ...] = (
    KnownIssue(
        id="unanswered-appends",
        summary="an append whose store session ended before it committed is never answered",
        where="waltz_server/server/partition.py and store.py (the lead's rewrite answers it)",
        diagnosis=(
            "The store session ends (its replicas lost the quorum, or it was fenced) with "
            "appends pending; their store futures fail and Partition._append's _consume "
            "swallows the error: the client hears nothing, the next session's recovery "
            "decides the transaction but nobody tells the client, and the client waits "
            "forever (nothing in it bounds an append in flight). With max_inflight ops "
            "stuck, a client stops submitting: 'no-commit-after-heal' follows."
        ),
        invariants=frozenset({"undecided", "late-decision", "no-commit-after-heal"}),
        seeds=(9, 14, 15, 23, 25, 32, 43, 44, 49),
    ),
    KnownIssue(
        id="dead-usher",
        summary="a replica that dies after it voted keeps catching the others up: recovery "
        "never completes",
        where="waltz_server/server/store.py and recovery.py (also on the lead's rewrite)",
        diagnosis=(
            "In a new store session's recovery, a replica that has voted (and holds the "
            "highest log) crashes while it waits for the decision: nothing is in flight on "
            "its connection, so its own replica task never notices and RecoveryManager "
            "keeps it. Each other replica then reads its catch-up from it (_usher_for), "
            "gets ConnectionClosedError from the dead replica's connection, and "
            "StoreSession._leave drops and retries *that other* replica (the error is "
            "attributed to the reader, not to the usher): recovery loops until the end, "
            "the partition serves nothing ('left, retrying: ConnectionClosedError: "
            "connection N to storage-0 ...' for storage-1 and storage-2)."
        ),
        invariants=frozenset(
            {"no-high-water-mark", "undecided", "late-decision", "no-commit-after-heal"}
        ),
        seeds=(4,),
        faults="disk",
    ),
)


def explained_by(violations: Iterable[Violation]) -> KnownIssue | None:
    found = list(violations)
    for issue in KNOWN_ISSUES:
        if issue.explains(found):
            return issue
    return None


__all__ = ["KNOWN_ISSUES", "KnownIssue", "explained_by"]
