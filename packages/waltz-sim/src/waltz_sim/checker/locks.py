"""The lock invariants: what the committed log says about locks (``lock-safety``), and
what the lock failures the clients saw say about the server's lock check
(``lock-precision``).

Safety: a committed transaction's READ and WRITE locks were not changed (by a committed
WRITE or APPEND lock) after the client high-water mark it was built on.

Precision: a lock check fails only for a reason. The server rejects an attempt when its
lock table's estimate for the attempt's READ and WRITE locks is above the attempt's
client high-water mark, and reports that estimate. So, whatever the table:

- the reported conflict is above the attempt's client high-water mark (a client that
  has applied everything its locks saw change passes);
- an attempt without READ or WRITE locks never fails.

And, when the history says which lock table the servers ran and which store sessions
they opened (each resets the table: every lock estimates the session's opening mark),
the conflict must be one the table can hold:

- ``exact``: the last change of one of the attempt's locks, so the committed
  transaction at the conflict holds a WRITE or APPEND lock on one of them;
- ``hwm-array``: an id some WRITE or APPEND lock was recorded at, so the committed
  transaction at the conflict holds a WRITE or APPEND lock (on anything: its slots may
  collide with the attempt's locks);
- either: the mark a store session opened at (its reset), or an id a session gave an
  attempt that never committed (a session live when the attempt was checked opened
  below the conflict, and a later one also opened below it, dropping the ids above).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence

from waltz_sim.checker.model import History, LockFailure, SessionSpan, Violation
from waltz_sim.checker.semantics import APPEND, READ, WRITE, TxnInfo

PRECISE_TABLES = ("exact", "hwm-array")
"""The lock tables whose conflicts the checker can explain from the log."""


def check_lock_safety(
    partition: int, infos: Sequence[TxnInfo | None], out: list[Violation]
) -> None:
    changed: dict[tuple[str, int], list[int]] = defaultdict(list)
    for transaction_id, info in enumerate(infos):
        if info is None:
            continue
        for name, lock_id, mode in info.locks:
            if mode in (WRITE, APPEND):
                changed[(name, lock_id)].append(transaction_id)
    for transaction_id, info in enumerate(infos):
        if info is None:
            continue
        hwm = info.client_high_water_mark
        for name, lock_id, mode in info.locks:
            if mode not in (READ, WRITE):
                continue
            ids = changed.get((name, lock_id), [])
            i = bisect.bisect_right(ids, hwm)
            if i < len(ids) and ids[i] < transaction_id:
                out.append(
                    Violation(
                        "lock-safety",
                        f"transaction {transaction_id} (op {info.op_id}) holds a "
                        f"{'READ' if mode == READ else 'WRITE'} lock on {name}:{lock_id} built on "
                        f"high-water mark {hwm}, but transaction {ids[i]} changed it in between",
                        partition=partition,
                        transaction_id=transaction_id,
                        op_id=info.op_id,
                    )
                )


def check_lock_precision(
    history: History, txns: dict[int, list[TxnInfo | None]], out: list[Violation]
) -> None:
    """Every lock failure in the history has a reason (see the module docstring)."""
    sessions: dict[int, list[SessionSpan]] = defaultdict(list)
    for span in history.sessions or ():
        sessions[span.partition].append(span)
    table = history.lock_table if history.sessions is not None else None
    reported: set[str] = set()
    for failure in history.lock_failures:
        if failure.op_id in reported:
            continue  # one per op: a broken check fails every retry of it
        problem = _unexplained(failure, txns.get(failure.partition), sessions, table)
        if problem is not None:
            reported.add(failure.op_id)
            out.append(
                Violation(
                    "lock-precision",
                    f"an attempt of op {failure.op_id} built on high-water mark "
                    f"{failure.client_high_water_mark} with locks "
                    f"{_locks(failure.locks)} failed its lock check at {failure.conflict}: "
                    f"{problem}",
                    failure.time,
                    partition=failure.partition,
                    transaction_id=failure.conflict,
                    op_id=failure.op_id,
                    client=failure.client,
                )
            )


def _unexplained(
    failure: LockFailure,
    infos: Sequence[TxnInfo | None] | None,
    sessions: dict[int, list[SessionSpan]],
    table: str | None,
) -> str | None:
    """Why ``failure`` has no reason (None: it has one, or the history cannot tell)."""
    checked = {(name, lock_id) for name, lock_id, mode in failure.locks if mode in (READ, WRITE)}
    conflict = failure.conflict
    if not checked:
        return "it has no READ or WRITE lock, and APPEND locks are never checked"
    if conflict <= failure.client_high_water_mark:
        return (
            "the conflict is not above the client's high-water mark: a lock check fails only "
            "when a lock changed after the mark the client built on"
        )
    if table not in PRECISE_TABLES or infos is None:
        return None
    live = [s for s in sessions.get(failure.partition, []) if _live(s, failure)]
    if any(s.mark == conflict for s in live):
        return None  # the table was reset at the conflict
    if _dropped(conflict, live, sessions.get(failure.partition, [])):
        return None
    info = infos[conflict] if 0 <= conflict < len(infos) else None
    if info is None:
        where = "is not committed" if conflict >= len(infos) else "carries no envelope"
        return f"transaction {conflict} {where}, and no store session opened at it"
    changes = {(name, lock_id) for name, lock_id, mode in info.locks if mode in (WRITE, APPEND)}
    if table == "exact" and changes & checked:
        return None
    if table == "hwm-array" and changes:
        return None
    what = "changes none of its locks" if changes else "changes no lock"
    return (
        f"the committed transaction {conflict} (op {info.op_id}, locks "
        f"{_locks(info.locks)}) {what}, and no store session opened at {conflict} "
        f"(lock table {table})"
    )


def _live(span: SessionSpan, failure: LockFailure) -> bool:
    """``span`` may be the session whose lock table checked the failed attempt (the
    server checked it after it was built and before the client heard of it)."""
    return span.opened_at <= failure.time and (
        span.closed_at is None or span.closed_at >= failure.built_at
    )


def _dropped(conflict: int, live: Sequence[SessionSpan], spans: Sequence[SessionSpan]) -> bool:
    """The conflict may be an id a store session gave an attempt that never committed: a
    session live when the server checked the failed attempt opened below the conflict,
    and a later session also opened below it (its recovery dropped the ids above)."""
    return any(
        later.session_id > s.session_id and later.mark < conflict
        for s in live
        if s.mark < conflict
        for later in spans
    )


def _locks(locks: Sequence[tuple[str, int, str]]) -> str:
    return " ".join(f"{name}:{lock_id}/{mode}" for name, lock_id, mode in locks) or "none"


__all__ = ["PRECISE_TABLES", "check_lock_precision", "check_lock_safety"]
