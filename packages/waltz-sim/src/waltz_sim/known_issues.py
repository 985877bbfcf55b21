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
        id="rejoin-skips-repair",
        summary="a replica that rejoins its store session with records lost to damage is "
        "never repaired",
        where="waltz_server/server/store.py (StoreSession._rejoin, plan_rejoin)",
        diagnosis=(
            "A storage node restarts and its start-up recovery finds a range of records lost "
            "to damage below intact ones (missing_ranges). Recovery repairs such a range from "
            "a peer before the replica votes, but a replica that comes back while its store "
            "session goes on rejoins the same session (plan_rejoin) without asking for its "
            "missing ranges: it acknowledges new appends and counts toward the quorum with a "
            "hole in its log, which nothing repairs until another session starts (and reads "
            "there fail with CorruptionError). At the end the replica lacks committed records "
            "('replica storage-2 holds 17 of the 155 committed transactions'); one more disk "
            "failure could leave a committed record on one intact replica."
        ),
        invariants=frozenset({"replica-behind"}),
        seeds=(17, 29),
    ),
    KnownIssue(
        id="dead-usher",
        summary="a replica that dies after it voted keeps catching the others up: recovery "
        "never completes",
        where="waltz_server/server/store.py and recovery.py",
        diagnosis=(
            "In a new store session's recovery, a replica that has voted (and holds the "
            "highest log) crashes while it waits for the decision: nothing is in flight on "
            "its connection, so its own replica task never notices and RecoveryManager "
            "keeps it. Each other replica then reads its catch-up from it (_usher_for), "
            "gets ConnectionClosedError from the dead replica's connection, and "
            "StoreSession._leave drops and retries *that other* replica (the error is "
            "attributed to the reader, not to the usher): recovery loops until the end, "
            "the partition serves nothing ('replica storage-1 left, retrying: "
            "ConnectionClosedError: connection 18 to sim://storage-0 is closed: the peer "
            "storage-0 crashed', again and again)."
        ),
        invariants=frozenset(
            {"no-high-water-mark", "undecided", "late-decision", "no-commit-after-heal"}
        ),
        seeds=(16,),
        faults="chaos",
    ),
)


def explained_by(violations: Iterable[Violation]) -> KnownIssue | None:
    found = list(violations)
    for issue in KNOWN_ISSUES:
        if issue.explains(found):
            return issue
    return None


__all__ = ["KNOWN_ISSUES", "KnownIssue", "explained_by"]
