"""The exactly-once SQL helper on real SQLite files, with real processes and kill -9."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sql_worker import amount

from waltz_api.errors import ClientError
from waltz_api.types import ReqId
from waltz_client import Transaction
from waltz_client.sql import SQLAlchemyClientCallbacks, SqliteClientCallbacks

WORKER = Path(__file__).with_name("sql_worker.py")
PARTITIONS = 2
COUNT = 100

pytestmark = pytest.mark.timeout(240)


def txn(p: int, tid: int, data: bytes = b"x") -> Transaction:
    async def fetch(partition: int, transaction_id: int) -> bytes:
        return data

    loop = asyncio.new_event_loop()

    def blocking(partition: int, transaction_id: int) -> bytes:
        try:
            return loop.run_until_complete(fetch(partition, transaction_id))
        finally:
            loop.close()

    return Transaction(p, tid, 0, ReqId(1, 1, p, tid), fetch=fetch, blocking=blocking)


class Notes(SqliteClientCallbacks):
    """Appends each transaction's data to a table; fails on demand mid-way."""

    fail_on: int | None = None

    def __init__(self, database: Path) -> None:
        super().__init__(database)
        self.connection().execute("CREATE TABLE IF NOT EXISTS note (tid INTEGER, body BLOB)")

    def apply(self, connection: sqlite3.Connection, transaction: Transaction) -> None:
        connection.execute(
            "INSERT INTO note VALUES (?, ?)", (transaction.transaction_id, transaction.get_data())
        )
        if transaction.transaction_id == self.fail_on:
            raise RuntimeError("the application crashed mid-transaction")


class AlchemyNotes(SQLAlchemyClientCallbacks):
    fail_on: int | None = None

    def __init__(self, engine: sa.Engine) -> None:
        super().__init__(engine)
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE IF NOT EXISTS note (tid INTEGER, body BLOB)"))

    def apply(self, connection: sa.Connection, transaction: Transaction) -> None:
        connection.execute(
            sa.text("INSERT INTO note VALUES (:t, :b)"),
            {"t": transaction.transaction_id, "b": transaction.get_data()},
        )
        if transaction.transaction_id == self.fail_on:
            raise RuntimeError("the application crashed mid-transaction")


def notes_of(database: Path) -> list[int]:
    with sqlite3.connect(database) as conn:
        return [r[0] for r in conn.execute("SELECT tid FROM note ORDER BY rowid")]


@pytest.fixture(params=["sqlite3", "sqlalchemy"])
def make_app(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[[], Notes | AlchemyNotes]]:
    database = tmp_path / "app.db"
    engines: list[sa.Engine] = []

    def make() -> Notes | AlchemyNotes:
        if request.param == "sqlite3":
            return Notes(database)
        engine = sa.create_engine(f"sqlite:///{database}")
        engines.append(engine)
        return AlchemyNotes(engine)

    yield make
    for engine in engines:
        engine.dispose()


def test_dead_letter_records_the_skip_and_advances_the_mark_atomically(
    make_app: Callable[[], Notes | AlchemyNotes], tmp_path: Path
) -> None:
    app = make_app()
    app.apply_transaction(txn(0, 0, b"a"))
    app.fail_on = 1
    with pytest.raises(RuntimeError):
        app.apply_transaction(txn(0, 1, b"b"))
    skipped: list[int] = []

    def skip(connection: object, transaction: Transaction, exception: BaseException) -> None:
        skipped.append(transaction.transaction_id)
        assert isinstance(exception, RuntimeError)

    app.skip = skip  # type: ignore[method-assign,assignment]
    app.dead_letter(txn(0, 1, b"b"), RuntimeError("poison"))
    assert app.client_high_water_mark(0) == 1 and skipped == [1]
    assert app.dead_lettered == 1
    app.fail_on = None
    app.apply_transaction(txn(0, 2, b"c"))
    assert notes_of(tmp_path / "app.db") == [0, 2]  # the skipped one changed nothing
    # a skip that fails rolls back: the mark stays
    app.fail_on = 3

    def failing(connection: object, transaction: Transaction, exception: BaseException) -> None:
        raise OSError("no room for the dead letter")

    app.skip = failing  # type: ignore[method-assign,assignment]
    with pytest.raises(OSError, match="no room"):
        app.dead_letter(txn(0, 3, b"d"), RuntimeError("poison"))
    assert app.client_high_water_mark(0) == 2 and app.dead_lettered == 1


def test_the_high_water_mark_advances_with_the_changes_atomically(
    make_app: Callable[[], Notes | AlchemyNotes], tmp_path: Path
) -> None:
    app = make_app()
    assert app.client_high_water_mark(0) == -1
    app.apply_transaction(txn(0, 0, b"a"))
    app.apply_transaction(txn(0, 1, b"b"))
    assert app.client_high_water_mark(0) == 1
    assert app.client_high_water_mark(1) == -1  # partitions are independent
    # a failure inside apply rolls the changes and the mark back together
    app.fail_on = 2
    with pytest.raises(RuntimeError, match="mid-transaction"):
        app.apply_transaction(txn(0, 2, b"c"))
    assert app.client_high_water_mark(0) == 1
    assert notes_of(tmp_path / "app.db") == [0, 1]
    app.fail_on = None
    # a replay (another instance, or a re-fed transaction) is skipped
    app.apply_transaction(txn(0, 1, b"b"))
    assert (app.applied, app.skipped) == (2, 1)
    app.apply_transaction(txn(0, 2, b"c"))
    assert notes_of(tmp_path / "app.db") == [0, 1, 2]
    # the database cannot jump ahead
    with pytest.raises(ClientError, match="cannot be applied before 3"):
        app.apply_transaction(txn(0, 5))
    # a second instance on the same database sees the same marks and skips what is done
    other = make_app()
    assert other.client_high_water_mark(0) == 2
    other.apply_transaction(txn(0, 2, b"c"))
    assert other.skipped == 1 and notes_of(tmp_path / "app.db") == [0, 1, 2]


def test_a_bad_table_name_is_refused(tmp_path: Path) -> None:
    class Bare(SqliteClientCallbacks):
        def apply(self, connection: sqlite3.Connection, transaction: Transaction) -> None:
            raise AssertionError("never applied")

    with pytest.raises(ClientError, match="plain SQL identifier"):
        Bare(tmp_path / "x.db", table="hwm; DROP TABLE x")
    assert not (tmp_path / "x.db").exists()


def _spawn(
    backend: str, database: Path, name: str, *, slow_ms: int, gate: Path, hang_at: int = 0
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            str(WORKER),
            backend,
            str(database),
            str(PARTITIONS),
            str(COUNT),
            name,
            str(slow_ms),
            str(gate),
            str(hang_at),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _applied_by(database: Path, worker: str) -> int:
    try:
        with sqlite3.connect(database, timeout=30) as conn:
            return int(
                conn.execute("SELECT count(*) FROM applied WHERE worker = ?", (worker,)).fetchone()[
                    0
                ]
            )
    except sqlite3.OperationalError:
        return 0  # the tables are not created yet


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite3", "sqlalchemy"])
def test_processes_sharing_a_database_apply_each_transaction_once_despite_kill_9(
    backend: str, tmp_path: Path
) -> None:
    database = tmp_path / "shared.db"
    procs: dict[str, subprocess.Popen[str]] = {}
    reports: dict[str, tuple[int, int]] = {}
    try:
        gate = tmp_path / "gate"
        gate.mkdir()
        deadline = time.monotonic() + 120

        def wait_for_file(path: Path, proc: subprocess.Popen[str]) -> None:
            while not path.exists():
                assert time.monotonic() < deadline, f"{path.name} never appeared"
                assert proc.poll() is None, proc.communicate()
                time.sleep(0.02)

        # the victim runs first and hangs inside its 5th database transaction (its
        # changes made, not committed, the write lock held)
        procs["victim"] = _spawn(backend, database, "victim", slow_ms=1, gate=gate, hang_at=5)
        wait_for_file(gate / "ready-victim", procs["victim"])
        (gate / "go-victim").write_text("")
        wait_for_file(gate / "hanging-victim", procs["victim"])
        # two more instances start and wait for the victim's lock; kill -9 the victim
        for name in ("a", "b"):
            procs[name] = _spawn(backend, database, name, slow_ms=1, gate=gate)
        for name in ("a", "b"):
            wait_for_file(gate / f"ready-{name}", procs[name])
            (gate / f"go-{name}").write_text("")
        time.sleep(0.3)
        os.kill(procs["victim"].pid, signal.SIGKILL)
        assert procs["victim"].wait(30) == -signal.SIGKILL
        procs["restarted"] = _spawn(backend, database, "restarted", slow_ms=1, gate=gate)
        wait_for_file(gate / "ready-restarted", procs["restarted"])
        (gate / "go-restarted").write_text("")
        for name, proc in procs.items():
            if name == "victim":
                continue
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, f"{name} failed:\n{err}"
            match = re.search(rf"{name} applied=(\d+) skipped=(\d+)", out)
            assert match, out
            reports[name] = (int(match[1]), int(match[2]))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(30)

    with sqlite3.connect(database) as conn:
        rows = conn.execute(
            "SELECT partition_id, transaction_id, count(*) FROM applied "
            "GROUP BY partition_id, transaction_id"
        ).fetchall()
        counts = {(p, t): c for p, t, c in rows}
        expected = {(p, t) for p in range(PARTITIONS) for t in range(COUNT)}
        assert set(counts) == expected, "a transaction was skipped"
        assert set(counts.values()) == {1}, "a transaction was applied twice"
        totals = dict(conn.execute("SELECT partition_id, amount FROM total").fetchall())
        for p in range(PARTITIONS):
            assert totals[p] == sum(amount(p, t) for t in range(COUNT))
        marks = dict(conn.execute("SELECT partition_id, high_water_mark FROM waltz_client_hwm"))
        assert marks == {p: COUNT - 1 for p in range(PARTITIONS)}
        workers = dict(conn.execute("SELECT worker, count(*) FROM applied GROUP BY worker"))
    # the work was shared: several instances applied transactions, the victim's fifth
    # (killed before its commit) is not among them
    assert workers["victim"] == 4, workers
    assert {w: n for w, n in workers.items() if w != "victim"} == {
        w: applied for w, (applied, _) in reports.items() if applied
    }
    # instances met transactions another one had applied, and skipped them
    assert sum(skipped for _, skipped in reports.values()) > 0, reports
    assert len([w for w, n in workers.items() if n > 0]) >= 2, workers
