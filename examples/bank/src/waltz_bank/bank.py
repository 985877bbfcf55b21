"""The bank: accounts in SQLite as a materialized view of the Waltz log.

Every client (an application instance) keeps its own SQLite database, filled
from the log exactly once by the SQL helper (`SqliteClientCallbacks`). The
log holds one JSON operation per transaction:

- ``deposit``  ``{account, amount}``: an APPEND lock on the account (it never
  fails; it records the change so that whoever read the account before fails);
- ``withdraw`` ``{account, amount}``: built only when the balance read from the
  client's database covers it, with a WRITE lock on the account: if the account
  changed after the state the check was made on, the server refuses the append
  (lock failure) and the client re-executes it on fresh data;
- ``transfer`` ``{source, target, amount}``: the balance check and WRITE lock on
  the source, an APPEND lock on the target;
- ``audit`` ``{accounts, total}``: the sum of a few balances, with a READ lock on
  each: it commits only if none of them changed since the state it read, so the
  log proves the total was true at that point.

Every operation also carries ``id`` (unique per operation: an application-level
key) and ``ts``: when it was built, in milliseconds since the Unix epoch (UTC).
Records written before ``ts`` existed have none; readers treat it as optional
(``waltz_bank.spark_jobs`` counts them under an unknown day).

`verify` recomputes everything from the log alone and compares.

The bank lives on one partition (:data:`PARTITION`), whatever the cluster's partition
count: its clients mount that one only, and the check reads that one only (the others
are other applications'). Records on it that are not bank operations (another
application's, or a ``waltz client append`` on the same cluster) are skipped with a
warning, once per record in a run (not once per client), by the views and the check
alike: the bank does not wedge on a record it cannot read.
"""

from __future__ import annotations

import json
import logging
import random
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from waltz_client import (
    JSON,
    AsyncWaltzClient,
    ClientConfig,
    SubmissionResult,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClient,
    WaltzClientCallbacks,
)
from waltz_client.sql import SqliteClientCallbacks

PARTITION = 0
"""The bank's partition: its operations, and everything its clients and check read."""
LOCK_NAMESPACE = "account"
DAY_MS = 86_400_000
KINDS = frozenset({"deposit", "withdraw", "transfer", "audit"})

log = logging.getLogger(__name__)

MAX_WARNED = 1000
"""Foreign records a :class:`Skipped` warns about one by one; past that, it is silent."""


class Skipped:
    """The records that are not bank operations, warned about once each: the views of
    one run's clients and its check meet every such record, one warning is enough."""

    def __init__(self) -> None:
        self._seen: set[tuple[int, int]] = set()
        self._lock = threading.Lock()

    def first(self, transaction: Transaction) -> bool:
        """Whether this record is new here (and should be warned about)."""
        record = (transaction.partition_id, transaction.transaction_id)
        with self._lock:
            if record in self._seen or len(self._seen) > MAX_WARNED:
                return False
            self._seen.add(record)
            if len(self._seen) > MAX_WARNED:
                log.warning("more than %d records are not bank operations: skipped", MAX_WARNED)
                return False
            return True


def bank_operation(
    transaction: Transaction, data: bytes, skipped: Skipped | None = None
) -> dict[str, Any] | None:
    """The bank operation ``data`` (the transaction's) holds, or None (with a warning;
    once per record of ``skipped``) when it is not one: a record another application
    wrote to this cluster."""
    try:
        op = json.loads(data)
    except ValueError:  # not JSON, or not UTF-8
        op = None
    if isinstance(op, dict) and op.get("op") in KINDS and isinstance(op.get("id"), str):
        return op
    if skipped is None or skipped.first(transaction):
        log.warning(
            "transaction %d of partition %d is not a bank operation (%d bytes: %r): skipped",
            transaction.transaction_id,
            transaction.partition_id,
            len(data),
            data[:40],
        )
    return None


def now_ms() -> int:
    """The current time in milliseconds since the Unix epoch (UTC): an operation's ``ts``."""
    return time.time_ns() // 1_000_000


class Accounts(SqliteClientCallbacks):
    """One client's view: ``account(id, balance, min_balance)`` applied from the log."""

    def __init__(self, database: str, skipped: Skipped | None = None) -> None:
        super().__init__(database)
        self.foreign = skipped or Skipped()
        self.connection().execute(
            "CREATE TABLE IF NOT EXISTS account ("
            "id INTEGER PRIMARY KEY, balance INTEGER NOT NULL, min_balance INTEGER NOT NULL)"
        )

    def connection(self) -> sqlite3.Connection:
        """synchronous=NORMAL: safe with the SQL helper, as the high-water mark lives in the
        same database: a power loss that drops the last commits rewinds it too, and the log
        applies them again."""
        conn = super().connection()
        if not getattr(self._local, "tuned", False):
            conn.execute("PRAGMA synchronous=NORMAL")
            self._local.tuned = True
        return conn

    def _add(self, connection: sqlite3.Connection, account: int, delta: int) -> None:
        connection.execute(
            "INSERT INTO account (id, balance, min_balance) VALUES (?, ?, min(0, ?)) "
            "ON CONFLICT(id) DO UPDATE SET balance = balance + excluded.balance, "
            "min_balance = min(min_balance, balance + excluded.balance)",
            (account, delta, delta),
        )

    def apply(self, connection: sqlite3.Connection, transaction: Transaction) -> None:
        op = bank_operation(transaction, transaction.get_data(), self.foreign)
        if op is None:
            return  # not ours: skipped (the high-water mark still moves past it)
        kind = op["op"]
        if kind == "deposit":
            self._add(connection, op["account"], op["amount"])
        elif kind == "withdraw":
            self._add(connection, op["account"], -op["amount"])
        elif kind == "transfer":
            self._add(connection, op["source"], -op["amount"])
            self._add(connection, op["target"], op["amount"])
        # an audit changes nothing

    def balance(self, account: int) -> int:
        row = (
            self.connection()
            .execute("SELECT balance FROM account WHERE id = ?", (account,))
            .fetchone()
        )
        return 0 if row is None else int(row[0])

    def balances(self) -> dict[int, tuple[int, int]]:
        """account -> (balance, lowest balance ever)."""
        rows = self.connection().execute("SELECT id, balance, min_balance FROM account")
        return {int(a): (int(b), int(m)) for a, b, m in rows}


class Operation(TransactionContext):
    """One bank operation, re-executed on fresh data after a lock failure."""

    def __init__(self, accounts: Accounts, op: dict[str, Any]) -> None:
        super().__init__()
        self.accounts = accounts
        self.op = op
        self.lock_failures = 0

    def partition_id(self, num_partitions: int) -> int:
        return PARTITION

    def execute(self, builder: TransactionBuilder) -> bool:
        op = dict(self.op)
        op.setdefault("ts", now_ms())  # re-executions keep a given (simulated) time
        kind = op["op"]
        if kind == "deposit":
            builder.append_lock(LOCK_NAMESPACE, op["account"])
        elif kind == "withdraw":
            if self.accounts.balance(op["account"]) < op["amount"]:
                return False  # insufficient funds: declined, nothing is sent
            builder.write_lock(LOCK_NAMESPACE, op["account"])
        elif kind == "transfer":
            if self.accounts.balance(op["source"]) < op["amount"]:
                return False
            builder.write_lock(LOCK_NAMESPACE, op["source"])
            builder.append_lock(LOCK_NAMESPACE, op["target"])
        elif kind == "audit":
            op["total"] = sum(self.accounts.balance(a) for a in op["accounts"])
            for account in op["accounts"]:
                builder.read_lock(LOCK_NAMESPACE, account)
        builder.set_data(op, JSON)
        return True

    def on_lock_failure(self, transaction_id: int) -> None:
        self.lock_failures += 1


def random_operation(rng: random.Random, accounts: int, op_id: str) -> dict[str, Any]:
    roll = rng.random()
    if roll < 0.35:
        return {"id": op_id, "op": "deposit", "account": rng.randrange(accounts),
                "amount": rng.randint(1, 100)}  # fmt: skip
    if roll < 0.65:
        return {"id": op_id, "op": "withdraw", "account": rng.randrange(accounts),
                "amount": rng.randint(1, 120)}  # fmt: skip
    if roll < 0.92 and accounts > 1:
        source, target = rng.sample(range(accounts), 2)
        return {"id": op_id, "op": "transfer", "source": source, "target": target,
                "amount": rng.randint(1, 120)}  # fmt: skip
    chosen = sorted(rng.sample(range(accounts), min(3, accounts)))
    return {"id": op_id, "op": "audit", "accounts": chosen}


@dataclass
class Stats:
    run: str = ""
    """This run's tag, the prefix of its operation ids."""
    committed: dict[str, int] = field(default_factory=dict)
    declined: int = 0
    lock_failures: int = 0
    committed_ids: set[str] = field(default_factory=set)
    latencies: list[float] = field(default_factory=list)
    """Seconds from each submission to its decision (committed or declined)."""
    first_attempt: list[float] = field(default_factory=list)
    """Those of the operations decided at their first attempt."""
    retried: list[float] = field(default_factory=list)
    """Those of the operations re-executed after lock failures."""
    most_retried: tuple[int, str] = (0, "")
    """The most lock failures of one operation, and its kind."""
    lock = threading.Lock()

    def record(self, op: Operation, committed: bool, latency: float) -> None:
        with self.lock:
            self.lock_failures += op.lock_failures
            self.latencies.append(latency)
            if op.lock_failures:
                self.retried.append(latency)
                self.most_retried = max(self.most_retried, (op.lock_failures, op.op["op"]))
            else:
                self.first_attempt.append(latency)
            if committed:
                kind = op.op["op"]
                self.committed[kind] = self.committed.get(kind, 0) + 1
                self.committed_ids.add(op.op["id"])
            else:
                self.declined += 1


@dataclass
class Replay:
    """The bank recomputed from the log alone."""

    balances: dict[int, int] = field(default_factory=dict)
    lowest: dict[int, int] = field(default_factory=dict)
    deposited: int = 0
    withdrawn: int = 0
    transferred: int = 0
    audits: int = 0
    bad_audits: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    transactions: int = 0
    foreign: int = 0
    """Records that are not bank operations (skipped)."""

    def _add(self, account: int, delta: int) -> None:
        value = self.balances.get(account, 0) + delta
        self.balances[account] = value
        self.lowest[account] = min(self.lowest.get(account, 0), value)

    def apply(self, op: dict[str, Any] | None) -> None:
        """One transaction of the log: a bank operation, or None for a record that is
        not one (counted, skipped)."""
        self.transactions += 1
        if op is None:
            self.foreign += 1
            return
        self.ids.append(op["id"])
        kind = op["op"]
        if kind == "deposit":
            self.deposited += op["amount"]
            self._add(op["account"], op["amount"])
        elif kind == "withdraw":
            self.withdrawn += op["amount"]
            self._add(op["account"], -op["amount"])
        elif kind == "transfer":
            self.transferred += op["amount"]
            self._add(op["source"], -op["amount"])
            self._add(op["target"], op["amount"])
        elif kind == "audit":
            self.audits += 1
            actual = sum(self.balances.get(a, 0) for a in op["accounts"])
            if actual != op["total"]:
                self.bad_audits.append(f"{op['id']}: recorded {op['total']}, log says {actual}")


class LogReader(WaltzClientCallbacks):
    """Reads the whole log from transaction 0 into a Replay (no database)."""

    def __init__(self, skipped: Skipped | None = None) -> None:
        self.replay = Replay()
        self.hwm = -1
        self.foreign = skipped or Skipped()

    async def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwm

    async def apply_transaction(self, transaction: Transaction) -> None:
        data = await transaction.fetch_data()
        self.replay.apply(bank_operation(transaction, data, self.foreign))
        self.hwm = transaction.transaction_id


@dataclass
class Report:
    replay: Replay
    stats: Stats
    high_water_mark: int
    elapsed: float
    views: list[dict[int, tuple[int, int]]]
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


async def read_log(uri: str, skipped: Skipped | None = None) -> tuple[Replay, int]:
    """The bank's partition read from transaction 0, and its high-water mark."""
    reader = LogReader(skipped)
    config = ClientConfig(uri, transport="zmq", partitions=[PARTITION], prefetch_data=True)
    async with AsyncWaltzClient(reader, config) as client:
        top = await client.flush(PARTITION)
        # flush answers once every append is decided and the feed reached the mark
        return reader.replay, top


def check(
    replay: Replay, top: int, stats: Stats, views: list[dict[int, tuple[int, int]]]
) -> list[str]:
    problems: list[str] = []
    run_ids = [i for i in replay.ids if i.startswith(f"{stats.run}-")]
    if replay.transactions != top + 1:
        problems.append(f"read {replay.transactions} transactions, the log has {top + 1}")
    if len(set(replay.ids)) != len(replay.ids):
        problems.append("an operation is in the log twice")
    if set(run_ids) != stats.committed_ids:
        problems.append(
            f"the log and the committed operations differ: {len(set(run_ids))} of this run in "
            f"the log, {len(stats.committed_ids)} committed"
        )
    total = sum(replay.balances.values())
    if total != replay.deposited - replay.withdrawn:
        problems.append(
            f"money is not conserved: balances sum to {total}, deposits - withdrawals = "
            f"{replay.deposited - replay.withdrawn}"
        )
    negative = {a: m for a, m in replay.lowest.items() if m < 0}
    if negative:
        problems.append(f"balances went negative in the log: {negative}")
    problems.extend(f"audit {a}" for a in replay.bad_audits)
    expected = {a: (b, replay.lowest[a]) for a, b in replay.balances.items()}
    for i, view in enumerate(views):
        if view != expected:
            problems.append(f"client {i}'s database differs from the log")
    return problems


def run_bank(
    uri: str,
    work_dir: str,
    *,
    clients: int = 8,
    operations: int = 50,
    accounts: int = 10,
    in_flight: int = 4,
    seed: int = 7,
    progress: Callable[[int], None] | None = None,
    timeout: float = 120.0,
    history_days: int = 0,
) -> Report:
    """``clients`` threads, each an application instance with its own SQLite view and
    WaltzClient, submit ``operations`` random operations each (``in_flight`` at a time);
    then the log is read back and everything is checked.

    ``history_days`` > 0 simulates a history: operation ``k`` of each client is stamped
    (``ts``) ``history_days * (1 - k / operations)`` days before now instead of now, so
    the daily report (``waltz spark bank-report``) has several days to show."""
    import asyncio
    import concurrent.futures
    import os

    stats = Stats(run=os.urandom(4).hex())
    skipped = Skipped()  # each foreign record warned about once, not once per client
    instances = [
        Accounts(os.path.join(work_dir, f"client-{i}.db"), skipped) for i in range(clients)
    ]
    config = ClientConfig(
        uri,
        transport="zmq",
        partitions=[PARTITION],
        max_concurrent_transactions=in_flight,
        prefetch_data=True,
    )
    errors: list[BaseException] = []
    waltz_clients: list[WaltzClient] = []
    interrupted = threading.Event()

    def run_client(index: int, client: WaltzClient) -> None:
        rng = random.Random(seed * 1000 + index)
        pending: list[concurrent.futures.Future[SubmissionResult]] = []

        def submit(op: Operation) -> concurrent.futures.Future[SubmissionResult]:
            started = time.monotonic()
            future = client.submit(op, timeout=timeout)

            def decided(done: concurrent.futures.Future[SubmissionResult]) -> None:
                # the latency ends when the operation is decided, not when this thread
                # gets to it: behind a slow one, a fast one would wait (and look slow)
                if not done.cancelled() and done.exception() is None:
                    stats.record(op, done.result().committed, time.monotonic() - started)

            future.add_done_callback(decided)
            return future

        def settle(future: concurrent.futures.Future[SubmissionResult]) -> None:
            future.result(timeout=timeout)  # (its latency is recorded as it is decided)
            if progress is not None:
                progress(1)

        for k in range(operations):
            if interrupted.is_set():
                break
            fields = random_operation(rng, accounts, f"{stats.run}-c{index}-{k}")
            if history_days > 0:
                fields["ts"] = now_ms() - round(history_days * DAY_MS * (1 - k / operations))
            pending.append(submit(Operation(instances[index], fields)))
            if len(pending) >= in_flight:
                settle(pending.pop(0))
        for future in pending:
            settle(future)

    try:
        for instance in instances:
            waltz_clients.append(WaltzClient(instance, config))
        started = time.monotonic()  # the operations, not the clients' start
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            futures = [pool.submit(run_client, i, c) for i, c in enumerate(waltz_clients)]
            for future in futures:
                try:
                    future.result(timeout=timeout * 2)
                except KeyboardInterrupt:
                    interrupted.set()  # the clients stop after their current operations
                    raise
                except BaseException as exc:  # reported after every client stopped
                    errors.append(exc)
        if errors:
            raise errors[0]
        top = -1
        for client in waltz_clients:
            top = max(top, client.flush(PARTITION, timeout=timeout))
    finally:
        for client in waltz_clients:
            client.close()
    elapsed = time.monotonic() - started
    replay, log_top = asyncio.run(asyncio.wait_for(read_log(uri, skipped), timeout))
    views = [instance.balances() for instance in instances]
    for instance in instances:
        instance.close()
    problems = check(replay, log_top, stats, views)
    if log_top != top:
        problems.append(f"the clients flushed to {top}, the log ends at {log_top}")
    return Report(replay, stats, log_top, elapsed, views, problems)
