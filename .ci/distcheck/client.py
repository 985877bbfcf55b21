"""The client half of the `dist` smoke test, run by the client venv's Python (only
`waltz-client[default]` installed): append transactions and read them back."""

from __future__ import annotations

import asyncio
import sys

import waltz_client
from waltz_client import (
    JSON,
    AsyncWaltzClient,
    ClientConfig,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClientCallbacks,
)


class Recorder(WaltzClientCallbacks):
    def __init__(self) -> None:
        self.hwm = -1
        self.values: list[str] = []

    async def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwm

    async def apply_transaction(self, transaction: Transaction) -> None:
        self.values.append((await transaction.fetch_data(JSON))["v"])
        self.hwm = transaction.transaction_id


class Put(TransactionContext):
    def __init__(self, value: str) -> None:
        super().__init__()
        self.value = value

    def partition_id(self, num_partitions: int) -> int:
        return 0

    async def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_data({"v": self.value}, JSON)
        builder.write_lock("smoke", 1)
        return True


async def main(uri: str) -> None:
    values = [f"value-{i}" for i in range(20)]
    app = Recorder()
    config = ClientConfig(uri, transport="zmq", transaction_timeout=60)
    async with AsyncWaltzClient(app, config) as client:
        for value in values:
            if not await client.submit(Put(value)):
                raise SystemExit(f"{value} was not committed")
        await client.flush(0)
    if app.values != values:
        raise SystemExit(f"read back {app.values}, appended {values}")
    print(f"client ({waltz_client.__file__}): 20 appended and read back in order")


if __name__ == "__main__":
    asyncio.run(asyncio.wait_for(main(sys.argv[1]), 120))
