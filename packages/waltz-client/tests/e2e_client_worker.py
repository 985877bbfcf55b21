"""An application process for the end-to-end tests: ``python e2e_client_worker.py URI
DATABASE COUNT NAME [PARTITION [COORDINATION_OPTIONS_JSON]]``. It applies the feed of
PARTITION (default 0) to DATABASE exactly once (the SQL helper), submits COUNT
transactions (data: a unique tag) with 20 in flight, flushes and exits. Killed with
-9 at any point and restarted on the same database, it resumes from the database's
high-water mark."""

from __future__ import annotations

import concurrent.futures
import json
import sqlite3
import sys

from waltz_client import (
    JSON,
    ClientConfig,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClient,
)
from waltz_client.sql import SqliteClientCallbacks


class Ledger(SqliteClientCallbacks):
    def __init__(self, database: str) -> None:
        super().__init__(database)
        self.connection().execute(
            "CREATE TABLE IF NOT EXISTS ledger (transaction_id INTEGER, tag TEXT)"
        )

    def apply(self, connection: sqlite3.Connection, transaction: Transaction) -> None:
        tag = transaction.get_data(JSON)["tag"]
        connection.execute("INSERT INTO ledger VALUES (?, ?)", (transaction.transaction_id, tag))


class Entry(TransactionContext):
    def __init__(self, partition: int, tag: str) -> None:
        super().__init__()
        self.partition = partition
        self.tag = tag

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_data({"tag": self.tag}, JSON)
        return True


def main() -> int:
    uri, database, count, name = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    partition = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    options = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    config = ClientConfig(
        uri,
        coordination_options=options,
        transport="zmq",
        partitions=[partition],
        max_concurrent_transactions=20,
    )
    with WaltzClient(Ledger(database), config) as client:
        futures = [client.submit(Entry(partition, f"{name}-{k}")) for k in range(count)]
        for future in concurrent.futures.as_completed(futures, timeout=120):
            if not future.result().committed:
                return 1
        top = client.flush(partition)
    sys.stdout.write(f"{name} done at {top}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
