"""Two small building blocks for scripts, tools and tests.

- :class:`MemoryMarks`: callbacks that keep each partition's client high-water mark
  in memory. A client with them applies nothing to a database, so it starts from the
  beginning of each partition on every run: right for a tool that writes and reads
  back, wrong for an application whose state must survive a restart (keep the mark
  in the application's own database, in the same transaction as what it applies:
  docs/application-authors.md).
- :class:`Put`: a transaction of given bytes on a given partition, without locks.
"""

from __future__ import annotations

from waltz_client.api import (
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClientCallbacks,
)


class MemoryMarks(WaltzClientCallbacks):
    """Each partition's client high-water mark, in memory (-1 before anything)."""

    def __init__(self) -> None:
        self.hwm: dict[int, int] = {}

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwm.get(partition_id, -1)

    def apply_transaction(self, transaction: Transaction) -> None:
        self.hwm[transaction.partition_id] = transaction.transaction_id


class Put(TransactionContext):
    """Append ``data`` (with ``header``) to ``partition``, no locks."""

    def __init__(self, data: bytes, partition: int = 0, header: int = 0) -> None:
        super().__init__()
        self.data = data
        self.partition = partition
        self.header = header

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_header(self.header).set_data(self.data)
        return True
