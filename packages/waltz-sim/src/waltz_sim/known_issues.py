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

An entry may also be a documented limit of a guarantee, which the faults reach now
and then: it is then recognised by what the run did as well (``within_unseen_cuts``:
every lost acknowledged transaction is one a replica lost where no check can see it),
so that a bug with the same symptoms still fails.
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
    within_unseen_cuts: bool = False
    """It explains a run only if every ``acknowledged-lost`` violation (one at least) is
    at an id that vanished from a replica where no check can see it (the run's
    ``unseen_cuts``: ``(partition, first, end)``)."""

    def explains(
        self, violations: Iterable[Violation], unseen_cuts: Iterable[tuple[int, int, int]] = ()
    ) -> bool:
        found = list(violations)
        if not found or any(v.invariant not in self.invariants for v in found):
            return False
        if not self.within_unseen_cuts:
            return True
        cuts = list(unseen_cuts)
        lost = [v for v in found if v.invariant == "acknowledged-lost"]
        return bool(lost) and all(
            any(
                v.partition == partition
                and v.transaction_id is not None
                and first <= v.transaction_id < end
                for partition, first, end in cuts
            )
            for v in lost
        )


_LOSS_AND_ITS_TRACES = frozenset(
    {
        "acknowledged-lost",
        "duplicate",
        "false-failure",
        "feed-content",
        "client-state",
        "client-ahead",
        "client-behind",
        "workload",
        "lock-safety",
    }
)

KNOWN_ISSUES: tuple[KnownIssue, ...] = (
    KnownIssue(
        "unseen-lost-tail",
        "a replica lost the end of its log where no check can see it, and a recovery "
        "decided before the intact copy answered (the one case beyond the storage-fault "
        "guarantee)",
        'docs/server.md, "Storage faults: the guarantee"; waltz_server.server.recovery',
        "A storage fault left a replica's log silently shorter: zeros where acknowledged "
        "writes never reached the disk (a lost or misdirected write), which the engine's "
        "start-up recovery cuts as a torn write, or a restore from a snapshot taken within "
        "the session. Its marks still read clean, so the next owner's recovery counts it as "
        "a voter; with a lagging replica caught up from it, a quorum agrees on the short "
        "log, and the intact copy answers only after the closing mark was decided. The "
        "nemesis stops no server that owns such a partition, but an owner also changes when "
        "a server comes back (its partitions return) or when the damage lands while a "
        "recovery is pending. Seen on the code with issue 27's fix; a recovery that "
        "remembered each replica's log end (storage seed 1025 before the per-seed "
        "configurations: one replica reported 25, then 23 after its restart, within one "
        "recovery) would catch some of them.",
        _LOSS_AND_ITS_TRACES,
        (1769, 1906),
        faults="storage",
        within_unseen_cuts=True,
    ),
)
"""Open: the limit above. Fixed ones (unanswered appends, STALE_GENERATION answers
re-executed, a rejoining replica not repaired, a dead usher, issue 27) have their seeds
as regression cases in ``tests/seeds/test_regressions.py``."""


def explained_by(
    violations: Iterable[Violation], unseen_cuts: Iterable[tuple[int, int, int]] = ()
) -> KnownIssue | None:
    found = list(violations)
    cuts = list(unseen_cuts)
    for issue in KNOWN_ISSUES:
        if issue.explains(found, cuts):
            return issue
    return None


__all__ = ["KNOWN_ISSUES", "KnownIssue", "explained_by"]
