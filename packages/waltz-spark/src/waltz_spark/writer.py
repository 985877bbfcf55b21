"""Appending Spark rows as Waltz transactions (what a write task runs)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from waltz_api.errors import ClientError, ConfigError
from waltz_api.types import Lock, LockMode
from waltz_client import (
    ClientConfig,
    SubmissionResult,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClient,
    WaltzClientCallbacks,
)
from waltz_spark.reader import LogReader

log = logging.getLogger(__name__)


class _Tail(WaltzClientCallbacks):
    """A writer follows the log from its current end (it applies nothing)."""

    def __init__(self, marks: dict[int, int]) -> None:
        self.marks = dict(marks)

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.marks.get(partition_id, -1)

    def apply_transaction(self, transaction: Transaction) -> None:
        self.marks[transaction.partition_id] = transaction.transaction_id


class RowAppend(TransactionContext):
    """One row as one transaction; never retried after a lock failure (reported)."""

    def __init__(
        self,
        partition: int,
        header: int,
        data: bytes,
        locks: list[Lock],
        client_high_water_mark: int | None,
    ) -> None:
        super().__init__()
        self.partition = partition
        self.header = header
        self.data = data
        self.locks = locks
        self.client_high_water_mark = client_high_water_mark
        self.lock_failed_at: int | None = None

    def partition_id(self, num_partitions: int) -> int:
        if not 0 <= self.partition < num_partitions:
            raise ClientError(
                f"row partition {self.partition} does not exist (the cluster has "
                f"{num_partitions} partitions: 0..{num_partitions - 1})"
            )
        return self.partition

    def execute(self, builder: TransactionBuilder) -> bool:
        if self.lock_failed_at is not None:
            return False  # rejected: reported, not retried on newer state
        builder.set_header(self.header)
        builder.set_data(self.data)
        for lock in self.locks:
            builder.lock(lock)
        if self.client_high_water_mark is not None:
            builder.client_high_water_mark = self.client_high_water_mark
        return True

    def on_lock_failure(self, transaction_id: int) -> None:
        self.lock_failed_at = transaction_id


def _data(value: Any) -> bytes:
    if value is None:
        return b""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    raise ClientError(
        f"column 'data' must be binary or string, got {type(value).__name__}; cast it first"
    )


def _shown(row: dict[str, Any], context: RowAppend) -> dict[str, Any]:
    return {
        "partition": context.partition,
        "header": context.header,
        "data": context.data.decode("utf-8", "backslashreplace"),
        "locks": [f"{lock.name}:{lock.id}:{lock.mode.name.lower()}" for lock in context.locks],
        "client_high_water_mark": context.client_high_water_mark,
        "conflicting_transaction_id": context.lock_failed_at,
    }


def append_rows(
    coordination: str, transport: str, rows: Iterable[dict[str, Any]], timeout: float
) -> tuple[int, list[dict[str, Any]]]:
    """Append each row; returns (appended count, the rows a lock check rejected)."""
    with LogReader(coordination, transport=transport) as reader:
        marks = reader.high_water_marks(range(reader.num_partitions()))
    config = ClientConfig(coordination, transport=transport, request_timeout=timeout)
    pending: list[tuple[dict[str, Any], RowAppend, Future[SubmissionResult]]] = []
    appended = 0
    rejected: list[dict[str, Any]] = []
    with WaltzClient(_Tail(marks), config) as client:
        for row in rows:
            hwm = row.get("client_high_water_mark")
            context = RowAppend(
                int(row.get("partition") or 0),
                int(row.get("header") or 0),
                _data(row.get("data")),
                row_locks(row),
                None if hwm is None else int(hwm),
            )
            pending.append((row, context, client.submit(context)))
        for row, context, future in pending:
            if future.result(timeout=timeout):
                appended += 1
            else:
                rejected.append(_shown(row, context))
    log.info("waltz write task: %d appended, %d rejected", appended, len(rejected))
    return appended, rejected


def _lock_mode(raw: Any) -> LockMode:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return LockMode(raw)
    text = str(raw or "write").strip().upper()
    try:
        return LockMode[text]
    except KeyError:
        raise ConfigError(
            f"lock mode must be one of read, write, append; got {raw!r}", key="locks"
        ) from None


def row_locks(row: dict[str, Any]) -> list[Lock]:
    """The ``locks`` column: an array of structs (name, id, mode) or of "name:id" strings."""
    raw = row.get("locks")
    locks: list[Lock] = []
    for item in raw or ():
        if isinstance(item, str):
            name, _, lock_id = item.rpartition(":")
            locks.append(Lock(name, int(lock_id), LockMode.WRITE))
        else:
            value = item.asDict() if hasattr(item, "asDict") else dict(item)
            locks.append(Lock(value["name"], int(value["id"]), _lock_mode(value.get("mode"))))
    return locks
