"""The checker: the invariants of DESIGN.md section 5 over a recorded run.

:func:`check` takes a :class:`~waltz_sim.checker.model.History`, a
:class:`~waltz_sim.checker.model.ClusterSnapshot` and the workload's
:class:`~waltz_sim.checker.semantics.Semantics`, and returns every violation it
finds (it never stops at the first). Pure: no I/O, no clock, no event loop.

Safety (each a ``Violation.invariant`` name):

- ``dense-ids``: a replica's records are not the ids 0, 1, 2... in order;
- ``replica-fork``: two replicas (or the log the cluster served) hold different
  records at a committed id;
- ``under-replicated``: a committed record is held by fewer than a majority of
  the replicas (one more failure could lose it); ``committed-lost`` by none;
- ``acknowledged-lost``: an op reported committed at id *t* is not the record at
  *t* in the committed log (or *t* is beyond it);
- ``duplicate``: one op committed at two ids;
- ``false-failure``: an op reported failed (definitely not committed) is committed;
- ``phantom``: a committed transaction no client submitted;
- ``lock-safety``: a committed transaction whose READ or WRITE lock was changed
  (by a committed WRITE or APPEND lock) after the client high-water mark it was
  built on, and before it (:mod:`waltz_sim.checker.locks`);
- ``lock-precision``: a lock failure without a reason: its conflict not above the
  client's mark, or (with the ``exact`` or ``hwm-array`` table and the store sessions
  known) no committed transaction and no session reset that explains it;
- ``workload``: what the workload's replay rejects (a balance below zero, a write
  built on a value that had changed, an audit that saw wrong balances);
- ``feed-order``: a client applied transactions out of order, twice, or skipped one;
- ``feed-content``: a client applied a transaction that is not the committed one
  at that id (or not committed at all);
- ``client-state``: a client's database differs from the replay of the log up to
  its high-water mark (``client-ahead``: its mark is beyond the log);
- ``removed-written``: a replica removed from its partition (and not put back) had its
  fence raised by a store session over a replica set without it.

Liveness (:mod:`waltz_sim.checker.liveness`): ``undecided``, ``late-decision``,
``no-commit-after-heal`` and ``throughput``; and at the end:

- ``no-high-water-mark``: the cluster did not report a partition's high-water mark
  at the end;
- ``client-behind`` / ``replica-behind``: at the end a client's database or a replica
  lacks committed transactions.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import replace

from waltz_sim.checker.access import check_access
from waltz_sim.checker.liveness import OpLife, check_liveness
from waltz_sim.checker.locks import check_lock_precision, check_lock_safety
from waltz_sim.checker.model import (
    FAIL,
    INVOKE,
    OK,
    UNKNOWN,
    CheckResult,
    ClusterSnapshot,
    History,
    LivenessBounds,
    OpEvent,
    PartitionSnapshot,
    StoredRecord,
    Violation,
)
from waltz_sim.checker.semantics import Semantics, TxnInfo

SAFETY = (
    "dense-ids",
    "replica-fork",
    "under-replicated",
    "committed-lost",
    "acknowledged-lost",
    "duplicate",
    "false-failure",
    "phantom",
    "lock-safety",
    "lock-precision",
    "workload",
    "feed-order",
    "feed-content",
    "client-state",
    "client-ahead",
    "removed-written",
    "archive-unreadable",
    "acl-refused-committed",
    "acl-wrongly-refused",
)
LIVENESS = (
    "undecided",
    "late-decision",
    "no-commit-after-heal",
    "throughput",
    "no-high-water-mark",
    "client-behind",
    "replica-behind",
)


def check(
    history: History,
    cluster: ClusterSnapshot,
    semantics: Semantics,
    bounds: LivenessBounds | None = None,
) -> CheckResult:
    """Every violation of the invariants in ``history`` and ``cluster`` (see the module)."""
    bounds = bounds or LivenessBounds()
    result = CheckResult()
    out = result.violations
    ops = _index_ops(history.ops, out)
    logs: dict[int, list[StoredRecord]] = {}
    txns: dict[int, list[TxnInfo | None]] = {}
    for partition, snapshot in sorted(cluster.partitions.items()):
        logs[partition] = _committed_log(snapshot, out, bounds)
        txns[partition] = [semantics.decode(r.data) for r in logs[partition]]
        result.committed[partition] = len(logs[partition])
    _check_ops_against_log(ops, logs, txns, cluster, out)
    for partition in sorted(logs):
        check_lock_safety(partition, txns[partition], out)
        _check_workload(partition, txns[partition], semantics, out)
    _check_feed(history, logs, txns, out)
    _check_clients(history, logs, txns, semantics=semantics, bounds=bounds, out=out)
    check_lock_precision(history, txns, out)
    check_access(history, ops, txns, out)
    result.throughput = check_liveness(history, ops, bounds, out)
    for op in ops.values():
        kind = op.end.kind if op.end is not None else "pending"
        result.outcomes[kind] = result.outcomes.get(kind, 0) + 1
    result.violations = [_timed(v, ops) for v in out]
    return result


def _timed(violation: Violation, ops: dict[str, OpLife]) -> Violation:
    """A violation about an op, without a time of its own, takes the time the op ended
    (or was invoked): where its story is in a trace."""
    if violation.time is not None or violation.op_id is None or violation.op_id not in ops:
        return violation
    op = ops[violation.op_id]
    event = op.end or op.invoke
    return violation if event is None else replace(violation, time=event.time)


# -- the ops ------------------------------------------------------------------------------------


def _index_ops(events: Iterable[OpEvent], out: list[Violation]) -> dict[str, OpLife]:
    ops: dict[str, OpLife] = {}
    for event in events:
        op = ops.setdefault(event.op_id, OpLife(event.op_id))
        if event.kind == INVOKE:
            if op.invoke is not None:
                out.append(Violation("history", f"op {event.op_id} invoked twice", event.time))
            op.invoke = event
        elif event.kind in (OK, FAIL, UNKNOWN):
            if op.end is not None:
                out.append(
                    Violation(
                        "history",
                        f"op {event.op_id} ended twice ({op.end.kind} then {event.kind})",
                        event.time,
                        op_id=event.op_id,
                    )
                )
                continue
            op.end = event
        else:
            out.append(Violation("history", f"unknown op event kind {event.kind!r}", event.time))
    return ops


# -- replicas and the committed log -------------------------------------------------------------


def _committed_log(
    snapshot: PartitionSnapshot, out: list[Violation], bounds: LivenessBounds
) -> list[StoredRecord]:
    partition = snapshot.partition
    for node, (fence, since) in sorted(snapshot.removed.items()):
        if fence >= since:
            out.append(
                Violation(
                    "removed-written",
                    f"replica {node} was removed (store session {since} is the first over a "
                    f"set without it), but session {fence} raised its fence",
                    partition=partition,
                )
            )
    replicas = dict(sorted(snapshot.replicas.items()))
    archived = list(snapshot.archived)
    if snapshot.archive_error is not None:
        out.append(
            Violation(
                "archive-unreadable",
                f"the archive the archive mark names cannot be read: {snapshot.archive_error}",
                partition=partition,
            )
        )
    starts = {"archive": 0}
    for node, records in replicas.items():
        # a replica deleted what is archived: it may start anywhere up to the mark's next id
        starts[node] = records[0].transaction_id if records and archived else 0
    for node, records in [("archive", archived), *replicas.items()]:
        start = starts[node]
        if start > len(archived):
            out.append(
                Violation(
                    "dense-ids",
                    f"replica {node} starts at transaction {start}, after the archive's end "
                    f"{len(archived) - 1}: the ids between are nowhere",
                    partition=partition,
                    transaction_id=start,
                )
            )
        for index, record in enumerate(records):
            if record.transaction_id != start + index:
                out.append(
                    Violation(
                        "dense-ids",
                        f"{'the archive' if node == 'archive' else f'replica {node}'} holds "
                        f"transaction {record.transaction_id} at position {index}",
                        partition=partition,
                        transaction_id=record.transaction_id,
                    )
                )
                break
    quorum = len(replicas) // 2 + 1 if replicas else 1
    high = snapshot.high_water_mark
    if high is None:
        out.append(
            Violation(
                "no-high-water-mark",
                "the cluster did not report the high-water mark at the end; the checks use "
                "the longest prefix a majority of the replicas agree on",
                partition=partition,
            )
        )
        high = max(len(archived), _agreed_prefix(replicas, quorum)) - 1
    log: list[StoredRecord] = []
    forked = False
    for transaction_id in range(high + 1):
        held = [
            (node, records[transaction_id - starts[node]])
            for node, records in replicas.items()
            if 0 <= transaction_id - starts[node] < len(records)
        ]
        in_archive = transaction_id < len(archived)
        if in_archive:  # the archive holds it: the first copy, the one each replica must match
            held.insert(0, ("archive", archived[transaction_id]))
        if not held:
            out.append(
                Violation(
                    "committed-lost",
                    f"committed transaction {transaction_id} (high-water mark {high}) is on no "
                    "replica" + (" and not in the archive" if archived else ""),
                    partition=partition,
                    transaction_id=transaction_id,
                )
            )
            break
        first_node, first = held[0]
        if not forked:
            for node, record in held[1:]:
                if record != first:
                    out.append(
                        Violation(
                            "replica-fork",
                            f"replicas {first_node} and {node} differ at committed transaction "
                            f"{transaction_id}: {_describe(first)} vs {_describe(record)}",
                            partition=partition,
                            transaction_id=transaction_id,
                        )
                    )
                    forked = True
                    break
        if len(held) < quorum and not in_archive:
            out.append(
                Violation(
                    "under-replicated",
                    f"committed transaction {transaction_id} is held by {len(held)} of "
                    f"{len(replicas)} replicas ({', '.join(n for n, _ in held)})",
                    partition=partition,
                    transaction_id=transaction_id,
                )
            )
        log.append(first)
    if snapshot.served is not None:
        served = list(snapshot.served)
        for transaction_id, (mine, theirs) in enumerate(zip(log, served, strict=False)):
            if mine != theirs:
                out.append(
                    Violation(
                        "replica-fork",
                        f"the cluster served {_describe(theirs)} at {transaction_id}, the replicas "
                        f"hold {_describe(mine)}",
                        partition=partition,
                        transaction_id=transaction_id,
                    )
                )
                break
        if len(served) != len(log):
            out.append(
                Violation(
                    "replica-fork",
                    f"the cluster served {len(served)} committed transactions, the high-water "
                    f"mark says {len(log)}",
                    partition=partition,
                )
            )
    if bounds.catch_up and snapshot.high_water_mark is not None:
        for node, records in replicas.items():
            if starts[node] + len(records) < len(log):
                out.append(
                    Violation(
                        "replica-behind",
                        f"replica {node} holds {starts[node] + len(records)} of the {len(log)} "
                        "committed transactions at the end (the archive the ones it deleted)",
                        partition=partition,
                    )
                )
    return log


def _agreed_prefix(replicas: dict[str, Sequence[StoredRecord]], quorum: int) -> int:
    length = 0
    while True:
        held: dict[StoredRecord, int] = defaultdict(int)
        for records in replicas.values():
            if length < len(records):
                held[records[length]] += 1
        if not held or max(held.values()) < quorum:
            return length
        length += 1


def _describe(record: StoredRecord) -> str:
    return f"transaction {record.transaction_id} req {record.req_id} checksum {record.checksum:#x}"


def _check_ops_against_log(
    ops: dict[str, OpLife],
    logs: dict[int, list[StoredRecord]],
    txns: dict[int, list[TxnInfo | None]],
    cluster: ClusterSnapshot,
    out: list[Violation],
) -> None:
    committed_at: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for partition, infos in txns.items():
        for transaction_id, info in enumerate(infos):
            if info is None:
                out.append(
                    Violation(
                        "phantom",
                        f"committed transaction {transaction_id} carries data no workload wrote",
                        partition=partition,
                        transaction_id=transaction_id,
                    )
                )
                continue
            committed_at[info.op_id].append((partition, transaction_id))
    for op_id, places in committed_at.items():
        if len(places) > 1:
            out.append(
                Violation(
                    "duplicate",
                    f"op {op_id} committed {len(places)} times: at "
                    + ", ".join(f"{t} (partition {p})" for p, t in places),
                    partition=places[1][0],
                    transaction_id=places[1][1],
                    op_id=op_id,
                )
            )
        if op_id not in ops:
            out.append(
                Violation(
                    "phantom",
                    f"committed op {op_id} was never submitted",
                    partition=places[0][0],
                    transaction_id=places[0][1],
                    op_id=op_id,
                )
            )
    for op_id, op in ops.items():
        end = op.end
        if end is None:
            continue
        if end.kind == OK:
            log = logs.get(end.partition)
            infos = txns.get(end.partition, [])
            if log is None:
                continue
            transaction_id = end.transaction_id
            if transaction_id < 0:
                # committed, its id unknown to the client: it must be in the log somewhere
                if op_id not in committed_at:
                    out.append(
                        Violation(
                            "acknowledged-lost",
                            f"op {op_id} was acknowledged as committed, but no committed "
                            "transaction is it",
                            end.time,
                            partition=end.partition,
                            op_id=op_id,
                            client=end.client,
                        )
                    )
                continue
            found = infos[transaction_id] if 0 <= transaction_id < len(infos) else None
            if found is None or found.op_id != op_id:
                where = (
                    f"the committed log ends at {len(log) - 1}"
                    if transaction_id >= len(log)
                    else f"{transaction_id} holds op {found.op_id if found else '?'}"
                )
                out.append(
                    Violation(
                        "acknowledged-lost",
                        f"op {op_id} was acknowledged as committed at {transaction_id}, but "
                        f"{where}",
                        end.time,
                        partition=end.partition,
                        transaction_id=transaction_id,
                        op_id=op_id,
                        client=end.client,
                    )
                )
        elif end.kind == FAIL and op_id in committed_at:
            partition, transaction_id = committed_at[op_id][0]
            out.append(
                Violation(
                    "false-failure",
                    f"op {op_id} was reported failed ({end.detail}), but it committed at "
                    f"{transaction_id}",
                    end.time,
                    partition=partition,
                    transaction_id=transaction_id,
                    op_id=op_id,
                    client=end.client,
                )
            )


# -- locks and the workload -----------------------------------------------------------------------


def _check_workload(
    partition: int, infos: Sequence[TxnInfo | None], semantics: Semantics, out: list[Violation]
) -> None:
    state = semantics.initial_state(partition)
    for transaction_id, info in enumerate(infos):
        if info is None:
            continue
        for problem in semantics.apply(state, info):
            out.append(
                Violation(
                    "workload",
                    f"transaction {transaction_id} (op {info.op_id}): {problem}",
                    partition=partition,
                    transaction_id=transaction_id,
                    op_id=info.op_id,
                )
            )


# -- clients --------------------------------------------------------------------------------------


def _check_feed(
    history: History,
    logs: dict[int, list[StoredRecord]],
    txns: dict[int, list[TxnInfo | None]],
    out: list[Violation],
) -> None:
    last: dict[tuple[str, int], int] = {}
    reported: set[tuple[str, int, str]] = set()
    for event in history.feed:
        key = (event.client, event.partition)
        previous = last.get(key, -1)
        if (
            event.transaction_id != previous + 1
            and (event.client, event.partition, "order") not in reported
        ):
            reported.add((event.client, event.partition, "order"))
            what = "again" if event.transaction_id <= previous else "after a gap"
            out.append(
                Violation(
                    "feed-order",
                    f"applied transaction {event.transaction_id} {what}: the last one it applied "
                    f"was {previous}",
                    event.time,
                    partition=event.partition,
                    transaction_id=event.transaction_id,
                    client=event.client,
                )
            )
        last[key] = event.transaction_id
        infos = txns.get(event.partition)
        if infos is None or (event.client, event.partition, "content") in reported:
            continue
        committed = infos[event.transaction_id] if event.transaction_id < len(infos) else None
        if event.transaction_id >= len(infos):
            problem = (
                f"applied transaction {event.transaction_id} (op {event.op_id}), which is not "
                f"committed (the committed log ends at {len(infos) - 1})"
            )
        elif committed is None or committed.op_id != event.op_id:
            problem = (
                f"applied op {event.op_id} as transaction {event.transaction_id}, but the "
                f"committed transaction {event.transaction_id} is op "
                f"{committed.op_id if committed else '?'}"
            )
        else:
            continue
        reported.add((event.client, event.partition, "content"))
        out.append(
            Violation(
                "feed-content",
                problem,
                event.time,
                partition=event.partition,
                transaction_id=event.transaction_id,
                op_id=event.op_id,
                client=event.client,
            )
        )


def _check_clients(
    history: History,
    logs: dict[int, list[StoredRecord]],
    txns: dict[int, list[TxnInfo | None]],
    *,
    semantics: Semantics,
    bounds: LivenessBounds,
    out: list[Violation],
) -> None:
    wanted: dict[int, set[int]] = defaultdict(set)
    for snapshot in history.clients:
        if snapshot.partition in logs:
            wanted[snapshot.partition].add(
                min(snapshot.high_water_mark, len(logs[snapshot.partition]) - 1)
            )
    states = {
        partition: semantics.state_at(partition, txns[partition], marks)
        for partition, marks in wanted.items()
    }
    for snapshot in history.clients:
        log = logs.get(snapshot.partition)
        if log is None:
            continue
        mark = snapshot.high_water_mark
        if mark >= len(log):
            out.append(
                Violation(
                    "client-ahead",
                    f"the client's database is at {mark}, beyond the committed log "
                    f"(which ends at {len(log) - 1})",
                    partition=snapshot.partition,
                    client=snapshot.client,
                )
            )
            continue
        expected = states[snapshot.partition].get(mark)
        if expected is not None and dict(snapshot.state) != expected:
            out.append(
                Violation(
                    "client-state",
                    f"the client's database at {mark} is {dict(snapshot.state)}, the log gives "
                    f"{expected}",
                    partition=snapshot.partition,
                    client=snapshot.client,
                )
            )
        if bounds.catch_up and mark < len(log) - 1:
            out.append(
                Violation(
                    "client-behind",
                    f"the client's database is at {mark} at the end; the log ends at "
                    f"{len(log) - 1}",
                    partition=snapshot.partition,
                    client=snapshot.client,
                )
            )


__all__ = ["LIVENESS", "SAFETY", "check"]
