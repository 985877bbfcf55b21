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


KNOWN_ISSUES: tuple[KnownIssue, ...] = ()
"""None open. Fixed ones (unanswered appends, STALE_GENERATION answers re-executed, a
rejoining replica not repaired, a dead usher, issue 27 and its unseen lost tail) have
their seeds as regression cases in ``tests/seeds/test_regressions.py``."""


def explained_by(violations: Iterable[Violation]) -> KnownIssue | None:
    found = list(violations)
    for issue in KNOWN_ISSUES:
        if issue.explains(found):
            return issue
    return None


__all__ = ["KNOWN_ISSUES", "KnownIssue", "explained_by"]
