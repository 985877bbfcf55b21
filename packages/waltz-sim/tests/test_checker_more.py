"""The checker's newer invariants on hand-made histories: every submission answered in a
drained run, a throughput floor over the fault-free windows, and lock failures that
have a reason (``lock-precision``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from test_checker import BANK, clean_log, deposit, history, kinds, ops_for, record, snapshot

from waltz_sim.checker import (
    INVOKE,
    OK,
    LivenessBounds,
    LockFailure,
    OpEvent,
    SessionSpan,
    StoredRecord,
    check,
)

# -- the drain ---------------------------------------------------------------------------------


def test_a_drained_run_holds_every_submission_to_an_answer() -> None:
    log = clean_log()
    late = [*ops_for(log), OpEvent(INVOKE, "c0:9", "c0", 95.0, 0, detail="deposit")]
    # without a drain, an op invoked less than the deadline before the end escapes
    assert check(history(log, ops=late, healed_at=None), snapshot(log), BANK).violations == []
    # a drained run waited for it: no answer is a violation, whenever it was invoked
    result = check(history(log, ops=late, healed_at=None, drained=True), snapshot(log), BANK)
    [undecided] = result.violations
    assert undecided.invariant == "undecided" and undecided.op_id == "c0:9"
    assert "waited for every open submission" in undecided.message
    assert result.outcomes["pending"] == 1
    # answered (committed or not): nothing to say
    answered = [*late, OpEvent("fail", "c0:9", "c0", 99.0, 0, detail="expired")]
    drained = history(log, ops=answered, healed_at=None, drained=True)
    assert check(drained, snapshot(log), BANK).violations == []


# -- the throughput floor ----------------------------------------------------------------------

FLOOR = LivenessBounds(catch_up=False, throughput_floor=0.4)


def busy_log(commits: int) -> tuple[list[StoredRecord], list[OpEvent]]:
    """``commits`` deposits, committed one per 0.1 s from 1.0."""
    log = [deposit(t, f"c0:{t + 1}", t % 2, 10) for t in range(commits)]
    ops: list[OpEvent] = []
    for t in range(commits):
        ops.append(OpEvent(INVOKE, f"c0:{t + 1}", "c0", 1.0 + t / 10, 0, detail="deposit"))
        ops.append(OpEvent(OK, f"c0:{t + 1}", "c0", 1.05 + t / 10, 0, t))
    return log, ops


def throughput(commits: int, **changes: Any) -> set[str]:
    log, ops = busy_log(commits)
    base = {
        "ops": ops,
        "feed": [],
        "clients": [],
        "healed_at": None,
        "end_time": 20.0,
        "baseline": [(1.0, 11.0)],
        "offered_rate": 10.0,
    }
    result = check(history(log, **{**base, **changes}), snapshot(log), BANK, FLOOR)
    return kinds(result)


def test_a_fault_free_window_commits_at_the_floor_at_least() -> None:
    assert throughput(100) == set()  # 10 per second: all that was offered
    assert throughput(41) == set()  # 4.1 per second, above 40% of 10
    assert throughput(30) == {"throughput"}  # 3 per second
    # the windows count together: 30 commits in 1..4 and 8 s more without a commit
    assert throughput(30, baseline=[(1.0, 4.0), (12.0, 20.0)]) == {"throughput"}
    assert throughput(30, baseline=[(1.0, 4.0), (12.0, 13.0)]) == set()
    # too short a baseline (5 s at least) is not judged; no offered rate: no floor
    assert throughput(10, baseline=[(1.0, 3.0), (12.0, 14.0)]) == set()
    assert throughput(10, offered_rate=None) == set()


def test_the_throughput_violation_says_what_was_offered() -> None:
    log, ops = busy_log(20)
    h = history(log, ops=ops, feed=[], clients=[], baseline=[(1.0, 11.0)], offered_rate=10.0)
    [violation] = check(h, snapshot(log), BANK, FLOOR).violations
    assert violation.invariant == "throughput"
    assert "20 ops committed in the 10.0 s without faults" in violation.message
    assert "40% of the 10 ops per second" in violation.message


# -- lock precision ----------------------------------------------------------------------------


def transfer(tid: int, op: str, source: int, target: int, *, hwm: int) -> StoredRecord:
    body = {"from": source, "to": target, "amount": 1, "seen": [1, 0]}
    locks = [("acct", source, "w"), ("acct", target, "w")]
    return record(tid, op, hwm, locks, kind="transfer", body=body)


def audit(tid: int, op: str, *, hwm: int, seen: dict[str, int]) -> StoredRecord:
    locks = [("acct", 0, "r"), ("acct", 1, "r")]
    return record(tid, op, hwm, locks, kind="audit", body={"seen": seen})


def failure(
    conflict: int, hwm: int, locks: Any = (("acct", 0, "w"),), *, at: float = 30.0
) -> LockFailure:
    return LockFailure("c0:2", "c0", at, 0, hwm, tuple(locks), conflict, at - 0.01)


def precision(
    failures: list[LockFailure],
    *,
    table: str | None = "exact",
    sessions: list[SessionSpan] | None = None,
) -> list[str]:
    log = clean_log()  # 0: deposit to 0, 1: deposit to 1, 2: withdraw from 0 (built on 1)
    opened = [SessionSpan(0, 1, 0.5, -1)] if sessions is None else sessions
    h = history(log, lock_failures=failures, lock_table=table, sessions=opened)

    result = check(h, snapshot(log), BANK)
    return [v.message for v in result.violations if v.invariant == "lock-precision"]


def test_a_conflict_not_above_the_clients_mark_is_never_right() -> None:
    # the over-strict check (>= for >): the client had applied the last change, 0
    for table in ("exact", "hwm-array", None, "custom"):
        [message] = precision([failure(0, 0)], table=table)
        assert "not above the client's high-water mark" in message
    # a failure without READ or WRITE locks: APPEND locks are never checked
    [message] = precision([failure(2, 0, [("acct", 1, "a")])])
    assert "APPEND locks are never checked" in message
    # reported once per op: a broken check fails every retry the same way
    assert len(precision([failure(0, 0), failure(1, 1), failure(0, 0)])) == 1


def test_an_exact_table_fails_only_on_a_change_of_the_attempts_locks() -> None:
    # transaction 2 (the withdrawal) changed acct 0: a WRITE on acct 0 built on 1 fails
    assert precision([failure(2, 1)]) == []
    # transaction 1 changed acct 1 only: a conflict at 1 on acct 0 has no reason
    [message] = precision([failure(1, 0)])
    assert "changes none of its locks" in message
    # the hwm-array table may collide: any WRITE or APPEND at the conflict explains it
    assert precision([failure(1, 0)], table="hwm-array") == []
    # a conflict beyond the committed log, with no session dropping ids
    [message] = precision([failure(5, 1)])
    assert "transaction 5 is not committed" in message


def test_a_session_reset_explains_its_mark() -> None:
    # a recovery reset the table at 1: every lock estimates 1 for a client behind it
    reset = [SessionSpan(0, 1, 0.5, -1, 10.0), SessionSpan(0, 2, 10.0, 1)]
    assert precision([failure(1, 0)], sessions=reset) == []
    # the reset is that of a session that may have checked the attempt: one closed before
    # the attempt was built explains nothing
    gone = [SessionSpan(0, 1, 0.5, -1), SessionSpan(0, 2, 10.0, 1, 20.0)]
    assert len(precision([failure(1, 0)], sessions=gone)) == 1


def test_an_id_a_session_gave_and_lost_explains_a_conflict() -> None:
    # session 1 (open from -1) may have given 5 to an attempt that never committed:
    # session 2 opened at 2 after it, dropping everything above
    sessions = [SessionSpan(0, 1, 0.5, -1, 31.0), SessionSpan(0, 2, 31.0, 2)]
    assert precision([failure(5, 1)], sessions=sessions) == []
    # with one session only (nothing dropped), the conflict has no reason
    assert len(precision([failure(5, 1)], sessions=sessions[:1])) == 1


def test_without_the_sessions_only_the_failure_itself_is_judged() -> None:
    # the conflict at 1 has no committed reason, but an unseen reset could explain it
    log = clean_log()
    h = history(log, lock_failures=[failure(1, 0)], lock_table="exact", sessions=None)
    assert "lock-precision" not in kinds(check(h, snapshot(log), BANK))
    h = replace(h, lock_failures=[failure(0, 0)])
    assert "lock-precision" in kinds(check(h, snapshot(log), BANK))


@pytest.mark.parametrize("hwm", [-1, 0, 1])
def test_an_audit_behind_a_change_of_any_account_fails_for_a_reason(hwm: int) -> None:
    log = [*clean_log(), transfer(3, "c1:2", 1, 0, hwm=2), audit(4, "c0:3", hwm=3, seen={})]
    locks = (("acct", 0, "r"), ("acct", 1, "r"))
    h = history(
        log,
        lock_failures=[failure(3, hwm, locks)],
        lock_table="exact",
        sessions=[SessionSpan(0, 1, 0.5, -1)],
    )
    assert "lock-precision" not in kinds(check(h, snapshot(log), BANK))
