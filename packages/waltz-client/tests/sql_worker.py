"""An application instance for the exactly-once SQL tests, run as its own process.

``python sql_worker.py BACKEND DATABASE PARTITIONS COUNT NAME SLOW_MS GATE_DIR HANG_AT``

It plays the client's side of the feed without a server: like the client after a
mount, it reads each partition's high-water mark from the database, then hands
every transaction after it, in order, to ``apply_transaction`` (so it sees the
transactions other instances apply meanwhile, as a real feed does). The
application's changes: one row per applied transaction in ``applied`` and a
running ``total`` per partition. ``SLOW_MS`` sleeps inside the database
transaction (after the changes, before the commit) and again between transactions. It writes
``GATE_DIR/ready-NAME`` and starts once ``GATE_DIR/go-NAME`` exists. With ``HANG_AT`` > 0,
its HANG_AT-th applied transaction writes ``GATE_DIR/hanging-NAME`` before its
commit and hangs there: the test kills it -9 in the middle of that transaction.
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from waltz_api.types import ReqId
from waltz_client import JSON, Transaction
from waltz_client.sql import SQLAlchemyClientCallbacks, SqliteClientCallbacks

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS applied "
    "(partition_id INTEGER, transaction_id INTEGER, worker TEXT, amount INTEGER)",
    "CREATE TABLE IF NOT EXISTS total (partition_id INTEGER PRIMARY KEY, amount INTEGER)",
)


def amount(partition: int, transaction_id: int) -> int:
    return (transaction_id * 7 + partition * 3) % 11 + 1


def make_callbacks(
    backend: str, database: str, name: str, *, slow: float, gate: Path, hang_at: int
) -> Any:
    done = [0]

    def changes(execute: Callable[[str, dict[str, Any]], object], txn: Transaction) -> None:
        value = txn.get_data(JSON)["amount"]
        p, tid = txn.partition_id, txn.transaction_id
        execute(
            "INSERT INTO applied VALUES (:p, :t, :w, :a)", {"p": p, "t": tid, "w": name, "a": value}
        )
        execute("INSERT OR IGNORE INTO total VALUES (:p, 0)", {"p": p})
        execute(
            "UPDATE total SET amount = amount + :a WHERE partition_id = :p", {"a": value, "p": p}
        )
        if slow:
            time.sleep(slow)
        done[0] += 1
        if done[0] == hang_at:
            (gate / f"hanging-{name}").write_text(f"{p} {tid}")
            time.sleep(600)  # killed here, before the commit

    if backend == "sqlite3":

        class SqliteApp(SqliteClientCallbacks):
            def apply(self, connection: sqlite3.Connection, transaction: Transaction) -> None:
                changes(connection.execute, transaction)

        app: Any = SqliteApp(database)
        for statement in SCHEMA:
            app.connection().execute(statement)
        return app

    import sqlalchemy as sa

    engine = sa.create_engine(f"sqlite:///{database}", connect_args={"timeout": 30})
    with engine.begin() as conn:
        for statement in SCHEMA:
            conn.execute(sa.text(statement))

    class AlchemyApp(SQLAlchemyClientCallbacks):
        def apply(self, connection: sa.Connection, transaction: Transaction) -> None:
            changes(lambda sql, params: connection.execute(sa.text(sql), params), transaction)

    return AlchemyApp(engine)


def main() -> int:
    backend, database, partitions, count, name, slow_ms, gate_dir, hang_at = sys.argv[1:9]
    gate = Path(gate_dir)
    app = make_callbacks(
        backend, database, name, slow=int(slow_ms) / 1000, gate=gate, hang_at=int(hang_at)
    )
    (gate / f"ready-{name}").write_text("")
    deadline = time.monotonic() + 120
    while not (gate / f"go-{name}").exists():
        if time.monotonic() > deadline:
            sys.stderr.write("the test never opened the gate\n")
            return 2
        time.sleep(0.01)
    loop = asyncio.new_event_loop()

    async def fetch(p: int, tid: int) -> bytes:
        return JSON.serialize({"amount": amount(p, tid)})

    def blocking(p: int, tid: int) -> bytes:
        return loop.run_until_complete(fetch(p, tid))

    n = int(count)
    slow = int(slow_ms) / 1000
    position = {p: app.client_high_water_mark(p) for p in range(int(partitions))}
    for tid in range(n):
        for p, at in position.items():
            if tid <= at:
                continue
            txn = Transaction(p, tid, 0, ReqId(1, 1, p, tid + 1), fetch=fetch, blocking=blocking)
            app.apply_transaction(txn)
            time.sleep(slow)  # the feed's pace: other instances get the database too
    sys.stdout.write(f"{name} applied={app.applied} skipped={app.skipped}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
