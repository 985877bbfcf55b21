"""The checker on hand-made histories: each invariant holds on a clean run and is
reported, with where to look, when broken."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import crc32c
import pytest

from waltz_sim.checker import (
    FAIL,
    INVOKE,
    OK,
    UNKNOWN,
    BankSemantics,
    ClientSnapshot,
    ClusterSnapshot,
    FeedEvent,
    History,
    LivenessBounds,
    OpEvent,
    PartitionSnapshot,
    RegisterSemantics,
    StoredRecord,
    check,
    encode_txn,
)

BANK = BankSemantics(accounts=2)
NODES = ("storage-0", "storage-1", "storage-2")


def record(
    tid: int, op: str, hwm: int, locks: Sequence[Any], *, kind: str, body: dict[str, Any]
) -> StoredRecord:
    data = encode_txn(op, hwm, locks, kind, body)
    return StoredRecord(tid, (1, 1, 0, tid + 1), 0, crc32c.crc32c(data), data)


def deposit(tid: int, op: str, acct: int, amount: int, hwm: int = -1) -> StoredRecord:
    return record(
        tid, op, hwm, [("acct", acct, "a")], kind="deposit", body={"acct": acct, "amount": amount}
    )


def withdraw(tid: int, op: str, acct: int, amount: int, *, seen: int, hwm: int) -> StoredRecord:
    body = {"acct": acct, "amount": amount, "seen": seen}
    return record(tid, op, hwm, [("acct", acct, "w")], kind="withdraw", body=body)


def clean_log() -> list[StoredRecord]:
    return [
        deposit(0, "c0:1", 0, 100),
        deposit(1, "c1:1", 1, 50),
        withdraw(2, "c0:2", 0, 30, seen=100, hwm=1),
    ]


def ops_for(log: Sequence[StoredRecord], client: str = "c0") -> list[OpEvent]:
    events: list[OpEvent] = []
    for r in log:
        op = BANK.decode(r.data)
        assert op is not None
        events.append(OpEvent(INVOKE, op.op_id, client, 1.0 + r.transaction_id, 0, detail=op.kind))
        events.append(OpEvent(OK, op.op_id, client, 1.5 + r.transaction_id, 0, r.transaction_id))
    return events


def snapshot(log: Sequence[StoredRecord], **replicas: Sequence[StoredRecord]) -> ClusterSnapshot:
    stored = {node: list(replicas.get(node.replace("-", "_"), log)) for node in NODES}
    partition = PartitionSnapshot(0, len(log) - 1, stored, list(log))
    return ClusterSnapshot({0: partition})


def history(log: Sequence[StoredRecord], **changes: Any) -> History:
    base = History(
        ops=ops_for(log),
        feed=[
            FeedEvent("c0", 1, 0, r.transaction_id, BANK.decode(r.data).op_id, 5.0)  # type: ignore[union-attr]
            for r in log
        ],
        clients=[ClientSnapshot("c0", 0, len(log) - 1, {"balances": {"0": 70, "1": 50}})],
        start_time=0.0,
        end_time=100.0,
        healed_at=50.0,
    )
    return replace(base, **changes)


def kinds(result: Any) -> set[str]:
    return {v.invariant for v in result.violations}


def test_a_clean_run_has_no_violation() -> None:
    log = clean_log()
    result = check(history(log), snapshot(log), BANK)
    assert result.violations == []
    assert result.committed == {0: 3}
    assert result.outcomes == {"ok": 3}


def test_an_acknowledged_transaction_missing_from_the_log_is_lost() -> None:
    log = clean_log()
    ops = [
        *ops_for(log),
        OpEvent(INVOKE, "c0:9", "c0", 9.0, 0),
        OpEvent(OK, "c0:9", "c0", 9.5, 0, 3),
    ]
    result = check(history(log, ops=ops), snapshot(log), BANK)
    [lost] = [v for v in result.violations if v.invariant == "acknowledged-lost"]
    assert lost.op_id == "c0:9" and lost.transaction_id == 3
    assert "committed log ends at 2" in lost.message


def test_an_acknowledgement_without_an_id_needs_the_op_somewhere_in_the_log() -> None:
    log = clean_log()
    ops = ops_for(log)
    ops[-1] = replace(ops[-1], transaction_id=-1)  # c0:2 committed, id unknown: it is at 2
    assert check(history(log, ops=ops), snapshot(log), BANK).violations == []
    ops += [OpEvent(INVOKE, "c0:9", "c0", 9.0, 0), OpEvent(OK, "c0:9", "c0", 9.5, 0, -1)]
    result = check(history(log, ops=ops), snapshot(log), BANK)
    assert kinds(result) == {"acknowledged-lost"}


def test_an_acknowledgement_at_another_ops_id_is_a_loss() -> None:
    log = clean_log()
    ops = ops_for(log)
    ops[-1] = replace(ops[-1], transaction_id=1)  # c0:2 acknowledged as 1, which is c1:1
    result = check(history(log, ops=ops), snapshot(log), BANK)
    assert kinds(result) == {"acknowledged-lost"}


def test_a_replica_fork_at_a_committed_id() -> None:
    log = clean_log()
    other = [log[0], deposit(1, "c1:1", 1, 51), log[2]]
    result = check(history(log), snapshot(log, storage_2=other), BANK)
    [fork] = [v for v in result.violations if v.invariant == "replica-fork"]
    assert fork.transaction_id == 1 and "storage-2" in fork.message


def test_a_dirty_tail_beyond_the_high_water_mark_is_allowed() -> None:
    log = clean_log()
    tail = [*log, deposit(3, "c9:1", 0, 5)]
    result = check(history(log), snapshot(log, storage_1=tail), BANK)
    assert result.violations == []


def test_a_committed_record_on_a_minority_is_under_replicated() -> None:
    log = clean_log()
    short = log[:2]
    result = check(history(log), snapshot(log, storage_1=short, storage_2=short), BANK)
    assert "under-replicated" in kinds(result)
    assert "replica-behind" in kinds(result)


def test_ids_that_are_not_dense() -> None:
    log = clean_log()
    holey = [log[0], log[2]]
    result = check(history(log), snapshot(log, storage_0=holey), BANK)
    assert "dense-ids" in kinds(result)


def test_the_served_log_must_be_the_replicas() -> None:
    log = clean_log()
    snap = snapshot(log)
    snap.partitions[0].served = [log[0], log[1]]
    result = check(history(log), snap, BANK)
    assert "replica-fork" in kinds(result)


def test_an_op_committed_twice_is_a_duplicate() -> None:
    log = [*clean_log(), deposit(3, "c0:1", 0, 100, hwm=2)]
    result = check(history(log, clients=[]), snapshot(log), BANK)
    [dup] = [v for v in result.violations if v.invariant == "duplicate"]
    assert dup.op_id == "c0:1" and dup.transaction_id == 3


def test_a_failed_op_that_committed_is_a_false_failure() -> None:
    log = clean_log()
    ops = ops_for(log)
    ops[-1] = OpEvent(FAIL, "c0:2", "c0", 3.5, 0, detail="expired")
    result = check(history(log, ops=ops), snapshot(log), BANK)
    assert kinds(result) == {"false-failure"}


def test_a_transaction_nobody_submitted_is_a_phantom() -> None:
    log = clean_log()
    ops = ops_for(log)[:-2]  # c0:2 never invoked
    result = check(history(log, ops=ops), snapshot(log), BANK)
    assert kinds(result) == {"phantom"}


def test_a_write_lock_built_before_a_concurrent_append_breaks_lock_safety() -> None:
    # the withdrawal was built on mark 0, and the deposit at 1 changed account 0 after it
    log = [
        deposit(0, "c0:1", 0, 100),
        deposit(1, "c1:1", 0, 5),
        withdraw(2, "c0:2", 0, 30, seen=100, hwm=0),
    ]
    client = ClientSnapshot("c0", 0, 2, {"balances": {"0": 75, "1": 0}})
    result = check(history(log, clients=[client]), snapshot(log), BANK)
    [lock] = [v for v in result.violations if v.invariant == "lock-safety"]
    assert lock.transaction_id == 2 and "transaction 1 changed it" in lock.message
    assert "workload" in kinds(result)  # the withdrawal saw 100, the balance was 105


def test_a_read_lock_on_an_unchanged_entity_is_safe() -> None:
    registers = RegisterSemantics(registers=1, counters=1)
    read = record(1, "c1:1", 0, [("reg", 0, "r")], kind="read", body={"reg": 0, "seen": 7})
    log = [
        record(
            0, "c0:1", -1, [("reg", 0, "w")], kind="write", body={"reg": 0, "seen": 0, "value": 7}
        ),
        read,
    ]
    ops = ops_for(log)
    state = {"registers": {"0": 7}, "counters": {"0": 0}}
    hist = history(log, ops=ops, feed=[], clients=[ClientSnapshot("c0", 0, 1, state)])
    assert check(hist, snapshot(log), registers).violations == []


def test_a_balance_below_zero_is_a_workload_violation() -> None:
    log = [deposit(0, "c0:1", 0, 10), withdraw(1, "c0:2", 0, 30, seen=10, hwm=0)]
    client = ClientSnapshot("c0", 0, 1, {"balances": {"0": -20, "1": 0}})
    result = check(history(log, clients=[client]), snapshot(log), BANK)
    assert kinds(result) == {"workload"}
    assert "went negative" in result.violations[0].message


def test_a_feed_applying_a_transaction_twice() -> None:
    log = clean_log()
    feed = history(log).feed
    feed.insert(2, feed[1])
    result = check(history(log, feed=feed), snapshot(log), BANK)
    [order] = [v for v in result.violations if v.invariant == "feed-order"]
    assert "again" in order.message and order.client == "c0"


def test_a_feed_skipping_a_transaction() -> None:
    log = clean_log()
    feed = history(log).feed
    del feed[1]
    result = check(history(log, feed=feed), snapshot(log), BANK)
    assert "feed-order" in kinds(result)


def test_a_feed_delivering_an_uncommitted_transaction() -> None:
    log = clean_log()
    feed = [*history(log).feed, FeedEvent("c0", 1, 0, 3, "c9:9", 6.0)]
    result = check(history(log, feed=feed), snapshot(log), BANK)
    assert "feed-content" in kinds(result)


def test_a_client_database_that_differs_from_the_log() -> None:
    log = clean_log()
    client = ClientSnapshot("c0", 0, 2, {"balances": {"0": 100, "1": 50}})
    result = check(history(log, clients=[client]), snapshot(log), BANK)
    assert kinds(result) == {"client-state"}


def test_a_client_database_ahead_of_the_log() -> None:
    log = clean_log()
    client = ClientSnapshot("c0", 0, 7, {"balances": {"0": 70, "1": 50}})
    result = check(history(log, clients=[client]), snapshot(log), BANK)
    assert "client-ahead" in kinds(result)


def test_a_client_that_did_not_catch_up_is_behind() -> None:
    log = clean_log()
    client = ClientSnapshot("c0", 0, 1, {"balances": {"0": 100, "1": 50}})
    result = check(history(log, clients=[client]), snapshot(log), BANK)
    assert kinds(result) == {"client-behind"}
    relaxed = LivenessBounds(catch_up=False)
    assert check(history(log, clients=[client]), snapshot(log), BANK, relaxed).violations == []


def test_a_submission_without_an_answer_after_its_deadline() -> None:
    log = clean_log()
    ops = [*ops_for(log), OpEvent(INVOKE, "c0:9", "c0", 40.0, 0, detail="deposit")]
    result = check(history(log, ops=ops), snapshot(log), BANK)
    [undecided] = result.violations
    assert undecided.invariant == "undecided" and undecided.op_id == "c0:9"
    # one invoked too late to be held to the deadline is not
    late = [*ops_for(log), OpEvent(INVOKE, "c0:9", "c0", 95.0, 0)]
    assert check(history(log, ops=late), snapshot(log), BANK).violations == []


def test_an_op_lost_in_a_crash_is_not_held_to_its_deadline() -> None:
    log = clean_log()
    ops = [
        *ops_for(log),
        OpEvent(INVOKE, "c0:9", "c0", 40.0, 0),
        OpEvent(UNKNOWN, "c0:9", "c0", 41.0, 0),
    ]
    result = check(history(log, ops=ops), snapshot(log), BANK)
    assert result.violations == []
    assert result.outcomes["unknown"] == 1


def test_an_answer_after_the_deadline_is_late() -> None:
    log = clean_log()
    ops = ops_for(log)
    ops[-1] = replace(ops[-1], time=70.0)  # c0:2, invoked at 3.0 (before the heal at 50)
    result = check(history(log, ops=ops), snapshot(log), BANK)
    # and the first commit after the heal came 20 s after it
    assert kinds(result) == {"late-decision", "no-commit-after-heal"}


def test_no_commit_after_the_heal() -> None:
    log = clean_log()
    ops = [
        *ops_for(log),
        OpEvent(INVOKE, "c0:9", "c0", 60.0, 0),
        OpEvent(FAIL, "c0:9", "c0", 61.0, 0),
    ]
    result = check(history(log, ops=ops), snapshot(log), BANK)
    assert kinds(result) == {"no-commit-after-heal"}


def test_fault_free_periods_before_the_last_heal_are_held_to_the_bounds() -> None:
    log = clean_log()
    stuck = [*ops_for(log), OpEvent(INVOKE, "c0:9", "c0", 12.0, 0, detail="deposit")]
    stuck_ended = [*stuck, OpEvent(FAIL, "c0:9", "c0", 45.0, 0)]
    # c0:9 waited 33 s, 30 of them in the fault-free period from 15 to 45
    result = check(history(log, ops=stuck_ended, quiet=[(15.0, 45.0)]), snapshot(log), BANK)
    late = [v for v in result.violations if v.invariant == "late-decision"]
    assert [v.op_id for v in late] == ["c0:9"]
    assert "the heal at 15.0" in late[0].message
    # and the period had ops in flight but no commit
    assert kinds(result) == {"late-decision", "no-commit-after-heal"}
    # a period shorter than the deadline and the bound holds nothing
    short = check(history(log, ops=stuck_ended, quiet=[(15.0, 20.0)]), snapshot(log), BANK)
    assert short.violations == []
    # without an answer at all (and the run goes on past the heal)
    result = check(history(log, ops=stuck, quiet=[(15.0, 45.0)]), snapshot(log), BANK)
    assert "undecided" in kinds(result)
    # a commit soon after the period began
    ok = [
        *stuck,
        OpEvent(INVOKE, "c0:10", "c0", 14.0, 0),
        OpEvent(OK, "c0:10", "c0", 17.0, 0, 3),
        OpEvent(FAIL, "c0:9", "c0", 20.0, 0),
    ]
    log4 = [*log, deposit(3, "c0:10", 1, 5)]
    clean = history(
        log4,
        ops=ok,
        quiet=[(15.0, 45.0)],
        feed=[FeedEvent("c0", 1, 0, t, BANK.decode(r.data).op_id, 5.0) for t, r in enumerate(log4)],  # type: ignore[union-attr]
        clients=[ClientSnapshot("c0", 0, 3, {"balances": {"0": 70, "1": 55}})],
    )
    assert check(clean, snapshot(log4), BANK).violations == []


def test_a_missing_high_water_mark_falls_back_to_the_majority_prefix() -> None:
    log = clean_log()
    snap = snapshot(log, storage_2=log[:1])
    snap.partitions[0].high_water_mark = None
    snap.partitions[0].served = None
    result = check(history(log), snap, BANK)
    assert kinds(result) == {"no-high-water-mark"}
    assert result.committed == {0: 3}


@pytest.mark.parametrize("kind", ["invoke", "ok"])
def test_a_malformed_history_is_reported(kind: str) -> None:
    log = clean_log()
    ops = ops_for(log)
    ops.append(next(e for e in ops if e.kind == kind))
    result = check(history(log, ops=ops), snapshot(log), BANK)
    assert "history" in kinds(result)
