"""Exactly-once application of the feed to a SQL database (the original's
AbstractClientCallbacksForJDBC).

Each partition's client high-water mark is a row of the application's own
database, advanced in the SAME database transaction as the changes the
transaction makes. The row is claimed first, with a conditional update::

    UPDATE waltz_client_hwm SET high_water_mark = :id
     WHERE partition_id = :p AND high_water_mark = :id - 1

One row updated: this instance applies the transaction (it holds the row's
write lock until commit). None: another instance sharing the database applied
it already (skipped), or the database is behind (an error: the feed restarts
from the database's high-water mark). A crash before the commit rolls back the
changes and the high-water mark together, so a transaction is never applied
twice nor skipped, and several application instances sharing one database
apply each transaction once.

::

    class Accounts(SqliteClientCallbacks):
        def apply(self, connection: sqlite3.Connection, transaction: Transaction) -> None:
            change = transaction.get_data(JSON)
            connection.execute(
                "UPDATE account SET balance = balance + ? WHERE id = ?",
                (change["amount"], change["account"]),
            )

    callbacks = Accounts("bank.db")
"""

from __future__ import annotations

import logging
import re
import sqlite3
import threading
from abc import abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from waltz_api.errors import ClientError
from waltz_api.types import NO_TRANSACTION
from waltz_client.api import Transaction, WaltzClientCallbacks

if TYPE_CHECKING:
    from sqlalchemy import Connection as SAConnection
    from sqlalchemy import Engine

log = logging.getLogger(__name__)

DEFAULT_TABLE = "waltz_client_hwm"
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def _check_table(name: str) -> str:
    if not isinstance(name, str) or not _IDENTIFIER.match(name):
        raise ClientError(
            f"high-water mark table name {name!r} is not a plain SQL identifier "
            "(letters, digits, underscores; not starting with a digit)"
        )
    return name


def _behind(partition_id: int, current: int, transaction_id: int) -> ClientError:
    return ClientError(
        f"partition {partition_id}: the database's high-water mark is {current}, so "
        f"transaction {transaction_id} cannot be applied before {current + 1}; the client "
        "restarts the feed from the database's high-water mark"
    )


class _Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.applied = 0
        """Transactions this instance applied."""
        self.skipped = 0
        """Transactions found applied already (by another instance sharing the database)."""
        self.dead_lettered = 0
        """Transactions given up and skipped (poison_policy="skip"); counted in
        ``applied`` too (their high-water mark was advanced)."""

    def count(self, applied: bool) -> None:
        with self._lock:
            if applied:
                self.applied += 1
            else:
                self.skipped += 1

    def count_dead_letter(self) -> None:
        with self._lock:
            self.dead_lettered += 1


def _log_skipped(transaction: Transaction, exception: BaseException) -> None:
    log.warning(
        "partition %d: transaction %d skipped (it could not be applied: %r); the high-water "
        "mark moves past it",
        transaction.partition_id,
        transaction.transaction_id,
        exception,
    )


class SqliteClientCallbacks(WaltzClientCallbacks, _Counters):
    """Exactly-once callbacks on a SQLite database file (stdlib :mod:`sqlite3`).

    Implement :meth:`apply` (the changes of one transaction, on the connection
    given: do not commit). The file is put in WAL mode; processes sharing it
    wait up to ``busy_timeout`` seconds for each other's write transactions.
    """

    def __init__(
        self,
        database: str | Path,
        *,
        table: str = DEFAULT_TABLE,
        busy_timeout: float = 30.0,
    ) -> None:
        _Counters.__init__(self)
        self.database = str(database)
        self.table = _check_table(table)
        self.busy_timeout = busy_timeout
        self._local = threading.local()
        conn = self.connection()
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {self.table} ("
            "partition_id INTEGER PRIMARY KEY, high_water_mark INTEGER NOT NULL)"
        )

    def connection(self) -> sqlite3.Connection:
        """This thread's connection (autocommit mode; transactions are explicit)."""
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.database, timeout=self.busy_timeout, isolation_level=None)
            conn.execute(f"PRAGMA busy_timeout={int(self.busy_timeout * 1000)}")
            self._local.conn = conn
        return conn

    def close(self) -> None:
        """Close this thread's connection."""
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    @abstractmethod
    def apply(self, connection: sqlite3.Connection, transaction: Transaction) -> None:
        """Make the transaction's changes on ``connection`` (inside the transaction
        that also advances the high-water mark; raise to roll both back)."""

    def client_high_water_mark(self, partition_id: int) -> int:
        conn = self.connection()
        select = f"SELECT high_water_mark FROM {self.table} WHERE partition_id = ?"
        row = conn.execute(select, (partition_id,)).fetchone()
        if row is None:  # first use of the partition: create its row (a write, once)
            conn.execute(
                f"INSERT OR IGNORE INTO {self.table} (partition_id, high_water_mark) VALUES (?, ?)",
                (partition_id, NO_TRANSACTION),
            )
            row = conn.execute(select, (partition_id,)).fetchone()
        return int(row[0])

    def apply_transaction(self, transaction: Transaction) -> None:
        self._claimed(transaction, lambda conn: self.apply(conn, transaction))

    def dead_letter(self, transaction: Transaction, exception: BaseException) -> None:
        """A transaction given up under ``ClientConfig(poison_policy="skip")``:
        :meth:`skip` records it and the high-water mark advances past it, in one database
        transaction."""
        if self._claimed(transaction, lambda conn: self.skip(conn, transaction, exception)):
            self.count_dead_letter()

    def skip(
        self, connection: sqlite3.Connection, transaction: Transaction, exception: BaseException
    ) -> None:
        """Record a skipped transaction on ``connection`` (default: a warning in the
        log); override to keep it in a table of your own."""
        _log_skipped(transaction, exception)

    def _claimed(
        self, transaction: Transaction, action: Callable[[sqlite3.Connection], None]
    ) -> bool:
        """Run ``action`` in the database transaction that advances the high-water mark
        to ``transaction`` (False: applied already by another instance, nothing ran)."""
        p, tid = transaction.partition_id, transaction.transaction_id
        conn = self.connection()
        conn.execute("BEGIN IMMEDIATE")
        try:
            claimed = conn.execute(
                f"UPDATE {self.table} SET high_water_mark = ? "
                "WHERE partition_id = ? AND high_water_mark = ?",
                (tid, p, tid - 1),
            ).rowcount
            if claimed != 1:
                row = conn.execute(
                    f"SELECT high_water_mark FROM {self.table} WHERE partition_id = ?", (p,)
                ).fetchone()
                current = NO_TRANSACTION if row is None else int(row[0])
                if row is not None and current >= tid:
                    conn.execute("ROLLBACK")
                    self.count(False)
                    return False
                if row is None and tid == 0:
                    conn.execute(
                        f"INSERT INTO {self.table} (partition_id, high_water_mark) VALUES (?, ?)",
                        (p, tid),
                    )
                else:
                    raise _behind(p, current, tid)
            action(conn)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        self.count(True)
        return True


class SQLAlchemyClientCallbacks(WaltzClientCallbacks, _Counters):
    """Exactly-once callbacks on a SQLAlchemy :class:`~sqlalchemy.Engine` (any database;
    needs the ``waltz-client[sqlalchemy]`` extra).

    Implement :meth:`apply` (the changes of one transaction, on the connection
    given: do not commit).
    """

    def __init__(self, engine: Engine, *, table: str = DEFAULT_TABLE) -> None:
        try:
            import sqlalchemy as sa
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ClientError(
                "SQLAlchemyClientCallbacks needs SQLAlchemy: pip install 'waltz-client[sqlalchemy]'"
            ) from exc
        _Counters.__init__(self)
        self.engine = engine
        self._sa = sa
        metadata = sa.MetaData()
        self.table = sa.Table(
            _check_table(table),
            metadata,
            sa.Column("partition_id", sa.Integer, primary_key=True, autoincrement=False),
            sa.Column("high_water_mark", sa.BigInteger, nullable=False),
        )
        metadata.create_all(engine)

    @abstractmethod
    def apply(self, connection: SAConnection, transaction: Transaction) -> None:
        """Make the transaction's changes on ``connection`` (inside the transaction
        that also advances the high-water mark; raise to roll both back)."""

    def _current(self, conn: SAConnection, partition_id: int) -> int | None:
        t = self.table
        value: Any = conn.execute(
            self._sa.select(t.c.high_water_mark).where(t.c.partition_id == partition_id)
        ).scalar()
        return None if value is None else int(value)

    def client_high_water_mark(self, partition_id: int) -> int:
        with self.engine.connect() as conn:
            current = self._current(conn, partition_id)
        if current is not None:
            return current
        try:
            with self.engine.begin() as conn:
                conn.execute(
                    self.table.insert().values(
                        partition_id=partition_id, high_water_mark=NO_TRANSACTION
                    )
                )
        except self._sa.exc.IntegrityError:
            pass  # another instance created the row meanwhile
        with self.engine.connect() as conn:
            found = self._current(conn, partition_id)
        return NO_TRANSACTION if found is None else found

    def apply_transaction(self, transaction: Transaction) -> None:
        self._claimed(transaction, lambda conn: self.apply(conn, transaction))

    def dead_letter(self, transaction: Transaction, exception: BaseException) -> None:
        """A transaction given up under ``ClientConfig(poison_policy="skip")``:
        :meth:`skip` records it and the high-water mark advances past it, in one database
        transaction."""
        if self._claimed(transaction, lambda conn: self.skip(conn, transaction, exception)):
            self.count_dead_letter()

    def skip(
        self, connection: SAConnection, transaction: Transaction, exception: BaseException
    ) -> None:
        """Record a skipped transaction on ``connection`` (default: a warning in the
        log); override to keep it in a table of your own."""
        _log_skipped(transaction, exception)

    def _claimed(self, transaction: Transaction, action: Callable[[SAConnection], None]) -> bool:
        """Run ``action`` in the database transaction that advances the high-water mark
        to ``transaction`` (False: applied already by another instance, nothing ran)."""
        p, tid = transaction.partition_id, transaction.transaction_id
        t = self.table
        with self.engine.begin() as conn:
            claimed = conn.execute(
                t.update()
                .where(t.c.partition_id == p, t.c.high_water_mark == tid - 1)
                .values(high_water_mark=tid)
            ).rowcount
            if claimed != 1:
                current = self._current(conn, p)
                if current is not None and current >= tid:
                    self.count(False)
                    return (
                        False  # applied by another instance (the context manager commits nothing)
                    )
                if current is None and tid == 0:
                    conn.execute(t.insert().values(partition_id=p, high_water_mark=tid))
                else:
                    raise _behind(p, NO_TRANSACTION if current is None else current, tid)
            action(conn)
        self.count(True)
        return True
