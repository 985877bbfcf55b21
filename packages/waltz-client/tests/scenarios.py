"""The end-to-end scenarios of the client, shared by the in-process cluster
(test_end_to_end.py) and the cluster of real processes (test_system.py).

Each scenario runs on one partition of a running cluster (:class:`Target`) and
asserts its outcome itself; what differs between the clusters (how a server is
restarted) is passed in as a coroutine function.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sqlite3
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from waltz_api.cluster import ClusterMetadata
from waltz_api.contracts.coordination import Coordination
from waltz_api.types import ReqId
from waltz_client import (
    JSON,
    AsyncWaltzClient,
    ClientConfig,
    SubmissionResult,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    TransactionExpiredError,
    WaltzClientCallbacks,
)

WORKER = Path(__file__).with_name("e2e_client_worker.py")


@dataclass
class Target:
    """One partition of a running cluster, and how to reach it."""

    uri: str
    coordination: Coordination
    """A started coordination client of the test (to read assignments)."""
    partition: int
    coordination_options: Mapping[str, Any] = field(default_factory=dict)

    def config(self, **overrides: Any) -> ClientConfig:
        options: dict[str, Any] = {
            "coordination": self.uri,
            "coordination_options": dict(self.coordination_options),
            "transport": "zmq",
            "partitions": [self.partition],
            "request_timeout": 60.0,
        }
        options.update(overrides)
        return ClientConfig(**options)


@dataclass
class LoggedTransaction:
    transaction_id: int
    req_id: ReqId
    data: dict[str, Any]


class LogReader(WaltzClientCallbacks):
    """An application that keeps every transaction of one partition, data included."""

    def __init__(self, partition: int) -> None:
        self.partition = partition
        self.log: list[LoggedTransaction] = []

    async def client_high_water_mark(self, partition_id: int) -> int:
        return self.log[-1].transaction_id if self.log else -1

    async def apply_transaction(self, transaction: Transaction) -> None:
        assert transaction.partition_id == self.partition
        data: dict[str, Any] = await transaction.fetch_data(JSON)
        self.log.append(LoggedTransaction(transaction.transaction_id, transaction.req_id, data))


async def read_log(target: Target) -> list[LoggedTransaction]:
    """The whole log of the target's partition, read by a new client's feed from -1;
    its transaction ids are dense from 0."""
    reader = LogReader(target.partition)
    async with AsyncWaltzClient(reader, target.config()) as client:
        top = await client.flush(target.partition)
    ids = [t.transaction_id for t in reader.log]
    assert ids == list(range(top + 1)), "transaction ids are not dense from 0"
    return reader.log


async def start_all(clients: list[AsyncWaltzClient]) -> None:
    for client in clients:
        await client.start()


async def close_all(clients: list[AsyncWaltzClient]) -> None:
    for client in clients:
        await client.close()


# -- (1) the counter ------------------------------------------------------------------


class Counter(WaltzClientCallbacks):
    """An application instance: a counter, rebuilt from the feed."""

    def __init__(self) -> None:
        self.value = 0
        self.hwm = -1
        self.applied: list[int] = []
        self.tags: list[str] = []

    async def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwm

    async def apply_transaction(self, transaction: Transaction) -> None:
        assert transaction.transaction_id == self.hwm + 1, "out of order"
        change: dict[str, Any] = await transaction.fetch_data(JSON)
        self.value = change["value"]
        self.tags.append(change["tag"])
        self.applied.append(transaction.transaction_id)
        self.hwm = transaction.transaction_id


class Increment(TransactionContext):
    def __init__(self, app: Counter, partition: int, tag: str) -> None:
        super().__init__()
        self.app = app
        self.partition = partition
        self.tag = tag
        self.lock_failures = 0

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    async def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_data({"value": self.app.value + 1, "tag": self.tag}, JSON)
        builder.write_lock("counter", 0)
        return True

    def on_lock_failure(self, transaction_id: int) -> None:
        self.lock_failures += 1


async def counter(
    target: Target,
    n_clients: int = 3,
    increments: int = 10,
    disrupt: Callable[[], Awaitable[None]] | None = None,
    batch: int = 0,
) -> None:
    """../shared/spec/waltz-announcement.txt: N clients x M increments with a WRITE lock give N x M;
    also when ``disrupt`` (e.g. a server restart) runs once a third of them is applied.
    ``batch``: each client submits its increments ``batch`` at a time (``submit_many``:
    all of a batch conflict on the one counter, so each round commits one of them)."""
    p = target.partition
    apps = [Counter() for _ in range(n_clients)]
    clients = [AsyncWaltzClient(app, target.config()) for app in apps]
    work: asyncio.Future[list[list[Increment]]] | None = None
    try:
        await start_all(clients)

        async def run(i: int, client: AsyncWaltzClient, app: Counter) -> list[Increment]:
            contexts = []
            if batch:
                for first in range(0, increments, batch):
                    group = [
                        Increment(app, p, f"c{i}-{k}")
                        for k in range(first, min(first + batch, increments))
                    ]
                    ids = set()
                    for result in await client.submit_many(group):
                        assert isinstance(result, SubmissionResult) and result.committed, result
                        ids.add(result.transaction_id)
                    assert len(ids) == len(group)  # each committed at its own id
                    contexts.extend(group)
                return contexts
            for k in range(increments):
                ctx = Increment(app, p, f"c{i}-{k}")
                assert (await client.submit(ctx)).committed
                contexts.append(ctx)
            return contexts

        work = asyncio.gather(
            *(run(i, c, a) for i, (c, a) in enumerate(zip(clients, apps, strict=True)))
        )
        if disrupt is not None:
            async with asyncio.timeout(120):
                while apps[0].hwm < n_clients * increments // 3 and not work.done():  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            if work.done():
                await work  # raises what failed, if anything did
                raise AssertionError("the increments ended before the disruption")
            await disrupt()
        done = await asyncio.wait_for(work, 150)
        total = n_clients * increments
        expected = sorted(f"c{i}-{k}" for i in range(n_clients) for k in range(increments))
        for client in clients:
            assert await client.flush(p) == total - 1
        for app in apps:
            assert app.value == total  # no lost update
            assert app.applied == list(range(total))  # each transaction once, in order
            assert sorted(app.tags) == expected
        contexts = [ctx for group in done for ctx in group]
        # concurrent increments conflicted and were retried after the feed caught up
        assert sum(ctx.lock_failures for ctx in contexts) > 0
    finally:
        if work is not None:
            work.cancel()
        await close_all(clients)


# -- (2) the constraint ---------------------------------------------------------------


class Bank(WaltzClientCallbacks):
    def __init__(self) -> None:
        self.balance = 0
        self.hwm = -1
        self.history: list[int] = []

    async def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwm

    async def apply_transaction(self, transaction: Transaction) -> None:
        change: dict[str, int] = await transaction.fetch_data(JSON)
        self.balance += change["amount"]
        self.history.append(self.balance)
        self.hwm = transaction.transaction_id


class Move(TransactionContext):
    def __init__(self, bank: Bank, partition: int, amount: int) -> None:
        super().__init__()
        self.bank = bank
        self.partition = partition
        self.amount = amount

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    async def execute(self, builder: TransactionBuilder) -> bool:
        if self.bank.balance + self.amount < 0:
            return False  # insufficient funds, on the state the transaction is built on
        builder.set_data({"amount": self.amount}, JSON)
        builder.write_lock("account", 1)
        return True


async def withdrawals(
    target: Target, n_clients: int = 3, attempts: int = 4, deposit: int = 100, amount: int = 30
) -> None:
    """Concurrent withdrawals never make a balance negative; the final balance is
    the deposit minus the granted withdrawals, also when recomputed from the log."""
    p = target.partition
    banks = [Bank() for _ in range(n_clients)]
    clients = [AsyncWaltzClient(bank, target.config()) for bank in banks]
    try:
        await start_all(clients)
        assert (await clients[0].submit(Move(banks[0], p, deposit))).committed
        for client in clients:
            await client.flush(p)

        async def withdraw(client: AsyncWaltzClient, bank: Bank) -> list[bool]:
            return [
                (await client.submit(Move(bank, p, -amount))).committed for _ in range(attempts)
            ]

        outcomes = await asyncio.wait_for(
            asyncio.gather(*(withdraw(c, b) for c, b in zip(clients, banks, strict=True))), 150
        )
        for client in clients:
            await client.flush(p)
    finally:
        await close_all(clients)
    granted = sum(o.count(True) for o in outcomes)
    assert granted == min(deposit // amount, n_clients * attempts)  # never one too many
    final = deposit - granted * amount
    for bank in banks:
        assert bank.balance == final
        assert min(bank.history) >= 0
    log = await read_log(target)
    balance, lowest = 0, 0
    for entry in log:
        balance += entry.data["amount"]
        lowest = min(lowest, balance)
    assert (balance, lowest, len(log)) == (final, 0, 1 + granted)


# -- (3) a client process killed -9 and restarted with its database --------------------


def ledger_rows(database: Path) -> list[tuple[int, str]]:
    try:
        with sqlite3.connect(database, timeout=30) as conn:
            return list(conn.execute("SELECT transaction_id, tag FROM ledger"))
    except sqlite3.OperationalError:
        return []  # not created yet


async def client_killed_and_restarted(target: Target, database: Path) -> None:
    """An application process (the exactly-once sqlite helper) killed -9 while it
    submits, then restarted on the same database: every transaction of the log is
    applied exactly once."""

    async def spawn(count: int, name: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            str(WORKER),
            target.uri,
            str(database),
            str(count),
            name,
            str(target.partition),
            json.dumps(dict(target.coordination_options)),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )

    first = await spawn(300, "first")
    try:
        async with asyncio.timeout(90):
            while len(ledger_rows(database)) < 30:
                assert first.returncode is None, await first.communicate()
                await asyncio.sleep(0.02)
        first.kill()  # SIGKILL, mid-way through its submissions
        await first.wait()
        assert first.returncode == -signal.SIGKILL
        before = len(ledger_rows(database))
        second = await spawn(20, "second")  # the same application, same database
        try:
            out, err = await asyncio.wait_for(second.communicate(), 120)
        finally:
            if second.returncode is None:
                second.kill()
                await second.wait()
        assert second.returncode == 0, err.decode()[-3000:]
    finally:
        if first.returncode is None:
            first.kill()
            await first.wait()
    top = int(out.decode().split(" done at ")[1])
    rows = ledger_rows(database)
    # every transaction of the log applied exactly once, in the database, across the crash
    assert sorted(t for t, _ in rows) == list(range(top + 1))
    tags = [tag for _, tag in rows]
    assert len(set(tags)) == len(tags)
    assert sum(tag.startswith("second-") for tag in tags) == 20
    assert before < len(rows)
    # and the database holds exactly the log
    log = await read_log(target)
    assert [(t.transaction_id, t.data["tag"]) for t in log] == sorted(rows)


async def following(
    client: AsyncWaltzClient, metadata: ClusterMetadata, partition: int, timeout: float = 30.0
) -> None:
    """Wait until the client is mounted where the partition is assigned now (a
    restarted server may take partitions back after the move)."""
    mount = client.partitions[partition].mount
    try:
        async with asyncio.timeout(timeout):
            while True:
                now = (await metadata.partition_assignment(partition)).value
                if (mount.endpoint, mount.generation) == (now.endpoint, now.generation):
                    return
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(
            f"the client is mounted at {mount.endpoint} generation {mount.generation}, "
            f"the partition is assigned to {now.endpoint} generation {now.generation}"
        ) from None


# -- (4) a server restarted under load -------------------------------------------------


class Tagged(WaltzClientCallbacks):
    def __init__(self) -> None:
        self.hwm = -1
        self.tags: list[str] = []

    async def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwm

    async def apply_transaction(self, transaction: Transaction) -> None:
        self.tags.append((await transaction.fetch_data(JSON))["tag"])
        assert transaction.transaction_id == self.hwm + 1
        self.hwm = transaction.transaction_id


class Put(TransactionContext):
    def __init__(self, partition: int, tag: str) -> None:
        super().__init__()
        self.partition = partition
        self.tag = tag

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    async def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_data({"tag": self.tag}, JSON)
        return True


async def server_restarted_under_load(
    target: Target,
    restart: Callable[[], Awaitable[None]],
    n_clients: int = 2,
    per_client: int = 60,
    window: int = 8,
    *,
    nowait: bool = False,
) -> None:
    """While clients submit steadily (``window`` in flight each, at least
    ``per_client`` each, and on until the partition has moved), ``restart`` restarts
    the server that serves the partition: every submission succeeds, the clients follow
    the partition, and the log holds each acknowledged transaction exactly once (ids
    dense, nothing twice), at the id its acknowledgement names."""
    p = target.partition
    metadata = ClusterMetadata(target.coordination)
    apps = [Tagged() for _ in range(n_clients)]
    clients = [AsyncWaltzClient(app, target.config(retry_interval=0.05)) for app in apps]
    moved = asyncio.Event()
    in_flight: list[set[asyncio.Future[SubmissionResult]]] = [set() for _ in clients]
    acknowledged: list[tuple[str, SubmissionResult]] = []

    async def produce(i: int, client: AsyncWaltzClient) -> None:
        running = in_flight[i]

        async def one(tag: str) -> None:
            if nowait:  # the submissions of a loop turn: one batch (submit_nowait)
                acknowledged.append((tag, await client.submit_nowait(Put(p, tag))))
            else:
                acknowledged.append((tag, await client.submit(Put(p, tag))))

        k = 0
        while k < per_client or not moved.is_set():
            if len(running) >= window:
                await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for done in [t for t in running if t.done()]:
                    running.discard(done)
                    done.result()  # a failed submission fails the scenario
                continue
            running.add(asyncio.ensure_future(one(f"c{i}-{k}")))
            k += 1
        await asyncio.gather(*running)

    producers: asyncio.Future[list[None]] | None = None
    try:
        await start_all(clients)
        producers = asyncio.gather(*(produce(i, c) for i, c in enumerate(clients)))
        async with asyncio.timeout(60):
            while apps[0].hwm < 10:  # noqa: ASYNC110 - polls application state
                await asyncio.sleep(0.005)
        before = (await metadata.partition_assignment(p)).value
        under_load = sum(not t.done() for running in in_flight for t in running)
        await restart()
        async with asyncio.timeout(60):  # a killed server's session has to expire first
            while (  # noqa: ASYNC110 - polls the coordination service
                (await metadata.partition_assignment(p)).value.generation <= before.generation
            ):
                await asyncio.sleep(0.1)
        moved.set()
        await asyncio.wait_for(producers, 150)
        assert under_load > 0, "the restart was not under load"
        assert all(result.committed for _, result in acknowledged)  # every one acknowledged
        expected = sorted(tag for tag, _ in acknowledged)
        assert len(expected) == len(set(expected)) >= n_clients * per_client
        for client, app in zip(clients, apps, strict=True):
            top = await client.flush(p)
            assert top == len(expected) - 1
            assert sorted(app.tags) == expected  # nothing lost, nothing twice
        for client in clients:  # it follows the partition to its (new) server
            await following(client, metadata, p)
    finally:
        if producers is not None:
            producers.cancel()
        for running in in_flight:
            for task in running:
                task.cancel()
        await close_all(clients)
    log = await read_log(target)  # dense ids from 0
    tags = [t.data["tag"] for t in log]
    assert sorted(tags) == expected  # every acknowledged one present, each once
    req_ids = [t.req_id for t in log]
    assert len(set(req_ids)) == len(req_ids)  # no ReqId appended twice
    # each acknowledgement names the transaction that holds its submission
    assert all(tags[result.transaction_id] == tag for tag, result in acknowledged)


# -- (5) an append in flight while every storage node restarts --------------------------


async def append_in_flight_while_storage_restarts(
    target: Target,
    stop_storage: Callable[[], Awaitable[None]],
    start_storage: Callable[[], Awaitable[None]],
    *,
    deadline: float = 2.0,
    ask: float = 60.0,
) -> None:
    """Every storage node stops, then a submission: its append is in flight when its
    deadline passes, and the server cannot decide it until storage is back. The client
    must not guess: undecided while storage is down, then the true outcome, once
    (committed at the id that holds it, or TransactionExpiredError and not in the log),
    never re-executed past its deadline, within the deadline plus ``ask``."""
    p = target.partition
    app = Tagged()
    config = target.config(transaction_timeout=deadline, request_timeout=ask)
    loop = asyncio.get_running_loop()
    async with AsyncWaltzClient(app, config) as client:
        assert (await client.submit(Put(p, "before"))).committed
        await stop_storage()
        started = loop.time()
        ctx = Put(p, "in flight")
        submission = asyncio.ensure_future(client.submit(ctx))
        async with asyncio.timeout(60):  # the deadline passes with it in flight
            while loop.time() < started + deadline + 1:
                assert not submission.done(), "decided while no storage node is up"
                await asyncio.sleep(0.05)
        await start_storage()
        outcome: SubmissionResult | None = None
        with contextlib.suppress(TransactionExpiredError):
            outcome = await asyncio.wait_for(submission, deadline + ask + 30)
        decided_after = loop.time() - started
        assert decided_after < deadline + ask, f"decided only after {decided_after:.1f} s"
        assert ctx.attempts == 1  # never re-executed past its deadline
        # the log works again, and a flush covers everything before it
        assert (await client.submit(Put(p, "after"))).committed
        await client.flush(p)
    tags = [t.data["tag"] for t in await read_log(target)]
    if outcome is not None:
        assert outcome.committed and tags[outcome.transaction_id] == "in flight"
    else:
        assert "in flight" not in tags  # "not committed" was the truth
    assert sorted(tags) == sorted({"before", "after"} | ({"in flight"} if outcome else set()))
