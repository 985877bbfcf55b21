"""Replica-set changes in the simulation (waltz_sim.membership): a spare storage node
replaces a replica during the run, the final set is judged, a removed replica is not
(except that no session over a set without it may raise its fence)."""

from __future__ import annotations

import re

from waltz_sim import SimConfig, run_seed
from waltz_sim.checker import BankSemantics, ClusterSnapshot, History, PartitionSnapshot, check

SEED = 3
"""A standard seed whose replacement runs to the end: added, removed, put back or not."""


def _snapshot(removed: dict[str, tuple[int, int]]) -> ClusterSnapshot:
    snapshot = ClusterSnapshot()
    snapshot.partitions[0] = PartitionSnapshot(
        0, -1, {"storage-0": [], "storage-2": [], "storage-3": []}, [], removed=removed
    )
    return snapshot


def test_a_removed_replica_fenced_by_a_later_session_is_a_violation() -> None:
    history = History(start_time=0.0, end_time=10.0)
    fenced_before = check(history, _snapshot({"storage-1": (4, 5)}), BankSemantics())
    assert not [v for v in fenced_before.violations if v.invariant == "removed-written"]
    fenced_after = check(history, _snapshot({"storage-1": (6, 5)}), BankSemantics())
    found = [v for v in fenced_after.violations if v.invariant == "removed-written"]
    assert len(found) == 1, [str(v) for v in fenced_after.violations]
    assert "storage-1" in found[0].message and "session 6" in found[0].message


def test_a_replica_is_replaced_during_the_run_and_the_final_set_is_caught_up() -> None:
    result = run_seed(SimConfig(seed=SEED, membership="replace"), keep_trace=True)
    assert result.ok, [str(v) for v in result.violations] + [result.error or ""]
    log = "\n".join(result.fault_log)
    added = re.search(r"replica of partition ([\d, ]+) added on (storage-3)", log)
    removed = re.search(r"remove the replica of partition ([\d, ]+) on (storage-\d)", log)
    assert added and removed, log
    assert added.group(1) == removed.group(1)
    # a store session over the set without the removed replica was opened and recorded
    assert re.search(rf"a store session over the set without {removed.group(2)}", log), log
    # the owner followed the assignment changes with new store sessions
    assert "replica assignment changed" in result.trace_text
    # and the run replays event for event
    assert run_seed(SimConfig(seed=SEED, membership="replace")).digest == result.digest


def test_without_membership_changes_there_is_no_spare_node() -> None:
    result = run_seed(SimConfig(seed=SEED, faults="mild", duration=20.0), keep_trace=True)
    assert result.ok, [str(v) for v in result.violations]
    assert "storage-3" not in result.trace_text
    assert "replica assignment changed" not in result.trace_text
