"""A client's database as the checker sees it: written by ClientDatabase (what a chaos
client process writes), read back by load_client, judged by the simulation's check()."""

from __future__ import annotations

from pathlib import Path

from waltz_chaos.client import ClientDatabase
from waltz_chaos.cluster import ProcessEvent
from waltz_chaos.collect import load_client
from waltz_sim.checker import (
    FAIL,
    INVOKE,
    OK,
    UNKNOWN,
    BankSemantics,
    ClusterSnapshot,
    History,
    LivenessBounds,
    PartitionSnapshot,
    StoredRecord,
    check,
    encode_txn,
)

BANK = BankSemantics()


def deposit(op: str, acct: int, amount: int, hwm: int) -> bytes:
    return encode_txn(op, hwm, [("acct", acct, "a")], "deposit", {"acct": acct, "amount": amount})


def record(transaction_id: int, data: bytes) -> StoredRecord:
    return StoredRecord(transaction_id, (1, 1, 0, transaction_id), 0, 0, data)


def write_client(path: Path) -> list[bytes]:
    """Incarnation 1 commits two deposits and is killed with a third in flight;
    incarnation 2 applies the third (it committed) and a fourth of its own."""
    db = ClientDatabase(path, [0], BANK)
    log = [deposit("c0#1:1", 0, 10, -1), deposit("c0#1:2", 1, 5, 0), deposit("c0#1:3", 0, 1, 1)]
    for n, (tid, data) in enumerate(zip((0, 1), log[:2], strict=True), 1):
        db.op(1, INVOKE, f"c0#1:{n}", 0, detail="deposit")
        db.apply(1, 0, tid, data)
        db.op(1, OK, f"c0#1:{n}", 0, transaction_id=tid)
    db.op(1, INVOKE, "c0#1:3", 0, detail="deposit")
    db.close()
    # the restart finds the state and the mark the first incarnation left
    db = ClientDatabase(path, [0], BANK)
    assert db.high_water_marks == {0: 1}
    assert db.states[0]["balances"]["0"] == 10
    log.append(deposit("c0#2:1", 1, 2, 2))
    db.apply(2, 0, 2, log[2])
    db.op(2, INVOKE, "c0#2:1", 0, detail="deposit")
    db.apply(2, 0, 3, log[3])
    db.op(2, OK, "c0#2:1", 0, transaction_id=3)
    db.op(2, INVOKE, "c0#2:2", 0, detail="withdraw")
    db.op(2, FAIL, "c0#2:2", 0, detail="declined by execute")
    db.close()
    return log


def judge(path: Path, log: list[bytes], **history: object) -> list[str]:
    kill = ProcessEvent(3.0, "c0", "kill", 1)
    records = load_client("c0", path, [kill])
    replicas = {f"storage-{i}": [record(t, d) for t, d in enumerate(log)] for i in range(3)}
    snapshot = ClusterSnapshot(
        {0: PartitionSnapshot(0, len(log) - 1, replicas, [record(t, d) for t, d in enumerate(log)])}
    )
    base = History(
        ops=records.ops,
        feed=records.feed,
        clients=records.snapshots,
        start_time=0.0,
        end_time=1e12,
        healed_at=None,  # no fault: liveness from the start (times are CLOCK_MONOTONIC's)
    )
    for key, value in history.items():
        setattr(base, key, value)
    result = check(base, snapshot, BANK, LivenessBounds(decision_deadline=1e9))
    return [str(v) for v in result.violations]


def test_a_clients_database_is_a_history_the_checker_accepts(tmp_path: Path) -> None:
    path = tmp_path / "c0.sqlite3"
    log = write_client(path)
    records = load_client("c0", path, [ProcessEvent(3.0, "c0", "kill", 1)])
    kinds = [(op.op_id, op.kind) for op in records.ops]
    # the op the killed incarnation left in flight ends unknown at the kill
    assert ("c0#1:3", UNKNOWN) in kinds
    unknown = next(op for op in records.ops if op.kind == UNKNOWN)
    assert "killed" in unknown.detail
    assert [(e.incarnation, e.transaction_id) for e in records.feed] == [
        (1, 0),
        (1, 1),
        (2, 2),
        (2, 3),
    ]
    assert [(s.partition, s.high_water_mark) for s in records.snapshots] == [(0, 3)]
    assert records.snapshots[0].state == {
        "balances": {"0": 11, "1": 7, **{str(a): 0 for a in range(2, 6)}}
    }
    assert judge(path, log) == []


def test_the_checker_sees_what_a_database_gets_wrong(tmp_path: Path) -> None:
    path = tmp_path / "c0.sqlite3"
    log = write_client(path)
    # an acknowledgement the log does not hold
    lost = [*log[:3], deposit("someone-else", 1, 2, 2)]
    found = judge(path, lost)
    assert any(v.startswith("[acknowledged-lost] op c0#2:1") for v in found)
    assert any(v.startswith("[phantom]") for v in found)
    # a feed that skipped a transaction, and a database that is not the log's replay
    db_path = tmp_path / "c1.sqlite3"
    write_client(db_path)
    import sqlite3

    conn = sqlite3.connect(db_path)
    conn.execute("DELETE FROM feed WHERE txid = 2")
    conn.execute('UPDATE state SET state = \'{"balances": {"0": 999}}\'')
    conn.commit()
    conn.close()
    found = judge(db_path, log)
    assert any(v.startswith("[feed-order]") for v in found)
    assert any(v.startswith("[client-state]") for v in found)
