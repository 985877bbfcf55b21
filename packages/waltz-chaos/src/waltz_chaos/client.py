"""A chaos client: one process running a workload through the real ``waltz_client``.

``python -m waltz_chaos.client SPEC.json INCARNATION`` (started by the run, in the
client's network namespace). It submits the workload's ops (the simulation's own,
:mod:`waltz_sim.workloads`: the same ops, the same envelope, the same checker) at a
random rate, a few in flight, with ``AsyncWaltzClient`` and async callbacks, and
keeps everything in one SQLite database (:class:`ClientDatabase`) that outlives its
kills, as an application's database would:

- ``state``: per partition, the workload's state and its high-water mark;
- ``feed``: every transaction applied, written in the same SQLite transaction as the
  state it changed (a kill -9 leaves both or neither);
- ``ops``: each op's ``invoke`` and its end (``ok`` with its id, ``fail``, ``unknown``);
- ``marks``: the incarnation's milestones (started, ready, drained, caught-up).

Signals: SIGUSR1 stops new submissions (the ops in flight finish: *drained*);
SIGTERM also catches the database up with every partition's high-water mark, then
the process exits 0. Times are ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for
every process of the machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import random
import signal
import sqlite3
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from waltz_api.errors import ClientError, WaltzError
from waltz_client import (
    AsyncWaltzClient,
    ClientConfig,
    Transaction,
    TransactionExpiredError,
    WaltzClientCallbacks,
)
from waltz_sim.checker import FAIL, INVOKE, OK, UNKNOWN, Semantics
from waltz_sim.workloads import WorkloadOp, op_mix

log = logging.getLogger("waltz_chaos.client")

READY = "chaos client ready"
DRAINED = "chaos client drained"
CAUGHT_UP = "chaos client caught up"


@dataclass
class ClientSpec:
    """What a client process runs (written as JSON by the run)."""

    name: str
    workload: str
    partitions: list[int]
    coordination: str
    database: str
    seed: int = 0
    coordination_options: dict[str, Any] = field(default_factory=dict)
    transport_options: dict[str, Any] = field(default_factory=dict)
    ops_per_second: float = 4.0
    max_inflight: int = 2
    transaction_timeout: float = 15.0
    request_timeout: float = 10.0
    catch_up_timeout: float = 60.0

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> ClientSpec:
        return cls(**json.loads(path.read_text()))


_SCHEMA = """
CREATE TABLE IF NOT EXISTS state (partition INTEGER PRIMARY KEY, hwm INTEGER NOT NULL,
    state TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS feed (seq INTEGER PRIMARY KEY, incarnation INTEGER NOT NULL,
    partition INTEGER NOT NULL, txid INTEGER NOT NULL, op TEXT, time REAL NOT NULL);
CREATE TABLE IF NOT EXISTS ops (seq INTEGER PRIMARY KEY, incarnation INTEGER NOT NULL,
    kind TEXT NOT NULL, op TEXT NOT NULL, time REAL NOT NULL, partition INTEGER NOT NULL,
    txid INTEGER NOT NULL, detail TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS marks (seq INTEGER PRIMARY KEY, incarnation INTEGER NOT NULL,
    what TEXT NOT NULL, time REAL NOT NULL);
"""


class ClientDatabase:
    """A client's SQLite database (see the module docstring). One writer: its process."""

    def __init__(self, path: str | Path, partitions: Iterable[int], semantics: Semantics) -> None:
        self.semantics = semantics
        self.conn = sqlite3.connect(str(path), isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=OFF")  # a kill -9 keeps the page cache
        self.conn.executescript(_SCHEMA)
        self.states: dict[int, dict[str, Any]] = {}
        self.high_water_marks: dict[int, int] = {}
        rows = {
            p: (h, s) for p, h, s in self.conn.execute("SELECT partition, hwm, state FROM state")
        }
        with self._transaction():
            for partition in partitions:
                if partition in rows:
                    hwm, state = rows[partition]
                    self.high_water_marks[partition] = int(hwm)
                    self.states[partition] = json.loads(state)
                else:
                    self.high_water_marks[partition] = -1
                    self.states[partition] = semantics.initial_state(partition)
                    self.conn.execute(
                        "INSERT INTO state VALUES (?, ?, ?)",
                        (partition, -1, json.dumps(self.states[partition])),
                    )

    @contextlib.contextmanager
    def _transaction(self) -> Any:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def apply(self, incarnation: int, partition: int, transaction_id: int, data: bytes) -> None:
        """Apply one transaction of the feed: the state, its mark and the feed record
        change together."""
        txn = self.semantics.decode(data)
        state = copy.deepcopy(self.states[partition])
        if txn is not None:
            self.semantics.apply(state, txn)
        with self._transaction():
            self.conn.execute(
                "UPDATE state SET hwm = ?, state = ? WHERE partition = ?",
                (transaction_id, json.dumps(state), partition),
            )
            self.conn.execute(
                "INSERT INTO feed (incarnation, partition, txid, op, time) VALUES (?, ?, ?, ?, ?)",
                (
                    incarnation,
                    partition,
                    transaction_id,
                    None if txn is None else txn.op_id,
                    time.monotonic(),
                ),
            )
        self.states[partition] = state
        self.high_water_marks[partition] = transaction_id

    def op(
        self,
        incarnation: int,
        kind: str,
        op_id: str,
        partition: int,
        *,
        transaction_id: int = -1,
        detail: str = "",
    ) -> None:
        self.conn.execute(
            "INSERT INTO ops (incarnation, kind, op, time, partition, txid, detail) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (incarnation, kind, op_id, time.monotonic(), partition, transaction_id, detail[:300]),
        )

    def mark(self, incarnation: int, what: str) -> None:
        self.conn.execute(
            "INSERT INTO marks (incarnation, what, time) VALUES (?, ?, ?)",
            (incarnation, what, time.monotonic()),
        )

    def close(self) -> None:
        self.conn.close()


class _Callbacks(WaltzClientCallbacks):
    def __init__(self, db: ClientDatabase, incarnation: int) -> None:
        self.db = db
        self.incarnation = incarnation

    async def client_high_water_mark(self, partition_id: int) -> int:
        return self.db.high_water_marks[partition_id]

    async def apply_transaction(self, transaction: Transaction) -> None:
        data = await transaction.fetch_data()
        self.db.apply(self.incarnation, transaction.partition_id, transaction.transaction_id, data)


class ChaosClient:
    """One incarnation of a client process (see the module docstring)."""

    def __init__(self, spec: ClientSpec, incarnation: int) -> None:
        self.spec = spec
        self.incarnation = incarnation
        self.mix = op_mix(spec.workload)
        self.db = ClientDatabase(spec.database, spec.partitions, self.mix.semantics)
        self.stopping = asyncio.Event()
        self.finishing = asyncio.Event()
        self.inflight: set[asyncio.Task[None]] = set()
        self.client: AsyncWaltzClient | None = None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, self.stopping.set)
        loop.add_signal_handler(signal.SIGTERM, self._finish)
        loop.add_signal_handler(signal.SIGINT, self._finish)
        self.db.mark(self.incarnation, "started")
        client = await self._start()
        if client is None:
            return
        self.client = client
        self.db.mark(self.incarnation, "ready")
        log.info("%s (%s, partitions %s)", READY, self.spec.name, self.spec.partitions)
        try:
            await self._submit_ops(client)
            await self._drain()
            await self.finishing.wait()
            await self._catch_up(client)
        finally:
            await client.close()
            self.db.mark(self.incarnation, "stopped")
            self.db.close()

    def _finish(self) -> None:
        self.stopping.set()
        self.finishing.set()

    def _config(self) -> ClientConfig:
        spec = self.spec
        return ClientConfig(
            coordination=spec.coordination,
            coordination_options=dict(spec.coordination_options),
            transport="zmq",
            transport_options=dict(spec.transport_options),
            partitions=list(spec.partitions),
            transaction_timeout=spec.transaction_timeout,
            request_timeout=spec.request_timeout,
        )

    async def _start(self) -> AsyncWaltzClient | None:
        """A started client; tries again while the coordination service is out of reach
        (None: told to stop first)."""
        while not self.stopping.is_set():
            client = AsyncWaltzClient(_Callbacks(self.db, self.incarnation), self._config())
            try:
                await client.start()
                return client
            except (WaltzError, OSError, TimeoutError) as exc:
                log.warning("client start failed (%s: %s); trying again", type(exc).__name__, exc)
                with contextlib.suppress(Exception):
                    await client.close()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), 1.0)
        return None

    async def _submit_ops(self, client: AsyncWaltzClient) -> None:
        spec = self.spec
        rng = random.Random(f"waltz-chaos:{spec.seed}:{spec.name}:{self.incarnation}")
        loop = asyncio.get_running_loop()
        count = 0
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), rng.expovariate(spec.ops_per_second))
                break
            if len(self.inflight) >= spec.max_inflight:
                continue
            chosen = self.mix.choose(rng, len(spec.partitions))
            chosen.partition = spec.partitions[chosen.partition]
            count += 1
            op = WorkloadOp(f"{spec.name}#{self.incarnation}:{count}", chosen, self.db.states)
            task = loop.create_task(self._submit(client, op))
            self.inflight.add(task)
            task.add_done_callback(self.inflight.discard)

    async def _submit(self, client: AsyncWaltzClient, op: WorkloadOp) -> None:
        db, incarnation, partition = self.db, self.incarnation, op.spec.partition
        db.op(incarnation, INVOKE, op.op_id, partition, detail=op.spec.detail)
        try:
            result = await client.submit(op)
        except TransactionExpiredError as exc:
            db.op(incarnation, FAIL, op.op_id, partition, detail=f"expired: {exc}")
        except asyncio.CancelledError:
            db.op(incarnation, UNKNOWN, op.op_id, partition, detail="stopped with the op in flight")
            raise
        except (ClientError, WaltzError) as exc:
            db.op(incarnation, UNKNOWN, op.op_id, partition, detail=f"{type(exc).__name__}: {exc}")
        except Exception as exc:
            log.exception("op %s: unexpected error from submit", op.op_id)
            detail = f"unexpected {type(exc).__name__}: {exc}"
            db.op(incarnation, UNKNOWN, op.op_id, partition, detail=detail)
        else:
            if result:
                db.op(incarnation, OK, op.op_id, partition, transaction_id=result.transaction_id)
            else:
                db.op(incarnation, FAIL, op.op_id, partition, detail="declined by execute")

    async def _drain(self) -> None:
        """The ops in flight end (bounded: their deadline and an answer's wait)."""
        if self.inflight:
            bound = self.spec.transaction_timeout + self.spec.request_timeout + 10.0
            _, late = await asyncio.wait(set(self.inflight), timeout=bound)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)
        self.db.mark(self.incarnation, "drained")
        log.info("%s (%s)", DRAINED, self.spec.name)

    async def _catch_up(self, client: AsyncWaltzClient) -> None:
        """Until the database holds every partition's committed log (bounded)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.spec.catch_up_timeout
        for partition in self.spec.partitions:
            target: int | None = None
            while loop.time() < deadline:
                if target is None:
                    try:
                        target = await client.high_water_mark(
                            partition, timeout=self.spec.request_timeout
                        )
                    except (WaltzError, TimeoutError) as exc:
                        log.warning("partition %d: no high-water mark yet: %s", partition, exc)
                        await asyncio.sleep(0.5)
                        continue
                if self.db.high_water_marks[partition] >= target:
                    break
                await asyncio.sleep(0.05)
            else:
                log.warning(
                    "partition %d: not caught up within %.0f s (at %d, high-water mark %s)",
                    partition,
                    self.spec.catch_up_timeout,
                    self.db.high_water_marks[partition],
                    target,
                )
        self.db.mark(self.incarnation, "caught-up")
        log.info("%s (%s)", CAUGHT_UP, self.spec.name)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        sys.stderr.write("usage: python -m waltz_chaos.client SPEC.json INCARNATION\n")
        return 2
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("kazoo", "waltz_client", "waltz_coord_zk", "waltz_coord_etcd"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    spec = ClientSpec.load(Path(args[0]))
    asyncio.run(ChaosClient(spec, int(args[1])).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["CAUGHT_UP", "DRAINED", "READY", "ChaosClient", "ClientDatabase", "ClientSpec"]
