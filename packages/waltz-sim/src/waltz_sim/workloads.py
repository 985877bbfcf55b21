"""Workloads: the simulated clients, their databases, and the ops they submit.

Each client process runs the real ``waltz_client.AsyncWaltzClient`` with async
callbacks (they run on the loop: no callback thread) and a :class:`ClientDatabase`
that outlives its crashes, as an application's database would: applying a
transaction updates the state and the partition's high-water mark in one step.
The client submits ops at random (rate and mix from the seed); each op is a
``TransactionContext`` whose ``execute`` reads the database, decides (or
declines: a withdrawal without the funds), and writes the transaction's envelope
(:func:`waltz_sim.checker.encode_txn`: op id, high-water mark, locks, body), so
the checker recognises every transaction in the log.

The ops themselves are pure (:class:`OpMix`: a random stream in, an :class:`OpSpec`
out; :class:`WorkloadOp` turns one into a transaction), so clients on real processes
(``waltz chaos``) submit the same ops and the same checker judges them.

Adding a workload: a :class:`~waltz_sim.checker.Semantics` (what a transaction does
to the state, and what it must not do) and an :class:`OpMix` subclass choosing ops
(:meth:`OpMix.choose`), registered in :data:`OP_MIXES`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from waltz_api.errors import ClientError, PermissionDeniedError, WaltzError
from waltz_api.types import Lock, LockMode
from waltz_client import (
    AsyncWaltzClient,
    ClientConfig,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    TransactionExpiredError,
    WaltzClientCallbacks,
)
from waltz_sim.checker import (
    FAIL,
    OK,
    UNKNOWN,
    BankSemantics,
    FeedEvent,
    LockFailure,
    RegisterSemantics,
    Semantics,
    StoredRecord,
    encode_txn,
)
from waltz_sim.checker.access import REFUSED
from waltz_sim.checker.semantics import APPEND, READ, WRITE
from waltz_sim.checker.semantics import Lock as LockSpec
from waltz_sim.loop import CallbackThread, Incarnation, SimLoop

if TYPE_CHECKING:
    from waltz_sim.config import SimConfig
    from waltz_sim.history import HistoryRecorder

log = logging.getLogger(__name__)

_MODES = {READ: LockMode.READ, WRITE: LockMode.WRITE, APPEND: LockMode.APPEND}

Build = Callable[[dict[str, Any]], "tuple[str, dict[str, Any], list[LockSpec]] | None"]
"""Reads a partition's state; returns (kind, body, locks), or None to decline."""


@dataclass
class OpSpec:
    partition: int
    detail: str
    build: Build


@dataclass
class ClientDatabase:
    """A client's database: per partition, the applied state and its high-water mark."""

    high_water_marks: dict[int, int] = field(default_factory=dict)
    states: dict[int, dict[str, Any]] = field(default_factory=dict)
    ops: int = 0


class ClientProcess(Protocol):
    """What a client's workload needs of its process (the world's ``SimProcess``)."""

    @property
    def name(self) -> str: ...

    @property
    def incarnation(self) -> Incarnation | None: ...

    @property
    def incarnations(self) -> int: ...

    handle: Any
    """What its main made available (here the client)."""


class ClientWorld(Protocol):
    """What the workload needs of its world (``waltz_sim.world.World``)."""

    @property
    def loop(self) -> SimLoop: ...

    @property
    def config(self) -> SimConfig: ...

    @property
    def history(self) -> HistoryRecorder: ...

    @property
    def coordination_uri(self) -> str: ...

    @property
    def submissions_end(self) -> float: ...

    @property
    def client_databases(self) -> dict[str, Any]: ...

    def rng(self, name: str) -> random.Random: ...


class _Callbacks(WaltzClientCallbacks):
    def __init__(self, workload: Workload, process: ClientProcess, db: ClientDatabase) -> None:
        self.workload = workload
        self.process = process
        self.incarnation = process.incarnations
        self.db = db

    async def client_high_water_mark(self, partition_id: int) -> int:
        return self.db.high_water_marks[partition_id]

    async def apply_transaction(self, transaction: Transaction) -> None:
        self.apply(transaction, await transaction.fetch_data())

    def apply(self, transaction: Transaction, data: bytes) -> None:
        semantics = self.workload.semantics
        txn = semantics.decode(data)
        partition = transaction.partition_id
        # one step, no await: the state and the high-water mark change together
        if txn is not None:
            semantics.apply(self.db.states[partition], txn)
        self.db.high_water_marks[partition] = transaction.transaction_id
        world = self.workload.world
        world.history.applied(
            FeedEvent(
                self.process.name,
                self.incarnation,
                partition,
                transaction.transaction_id,
                None if txn is None else txn.op_id,
                world.loop.time(),
            )
        )


class _PlainCallbacks(WaltzClientCallbacks):
    """The same database through the synchronous callbacks most applications use: the
    client runs them on its callback thread (in the simulation, the loop's stand-in for
    it, :class:`~waltz_sim.loop.CallbackThread`), the data read with ``get_data()``."""

    def __init__(self, workload: Workload, process: ClientProcess, db: ClientDatabase) -> None:
        self.database = _Callbacks(workload, process, db)

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.database.db.high_water_marks[partition_id]

    def apply_transaction(self, transaction: Transaction) -> None:
        self.database.apply(transaction, transaction.get_data())


class ReadOnlyCallbacks(WaltzClientCallbacks):
    """For the read-back at the end: applies nothing, starts from the latest."""

    async def client_high_water_mark(self, partition_id: int) -> int:
        return -1

    async def apply_transaction(self, transaction: Transaction) -> None:
        return None


@dataclass(frozen=True)
class Attempt:
    """What an op's latest attempt was built on (for its lock failure, if one comes)."""

    built_at: float
    client_high_water_mark: int
    locks: tuple[LockSpec, ...]


class WorkloadOp(TransactionContext):
    """One op as a transaction: ``execute`` builds it from the partition's state in
    ``states`` (the client's database), with the op's envelope as its data.
    ``on_lock_failed`` (optional) hears of each attempt the server's lock check
    rejected: the attempt and the conflicting transaction id."""

    def __init__(
        self,
        op_id: str,
        spec: OpSpec,
        states: Mapping[int, dict[str, Any]],
        *,
        clock: Callable[[], float] | None = None,
        on_lock_failed: Callable[[WorkloadOp, Attempt, int], None] | None = None,
    ) -> None:
        super().__init__()
        self.op_id = op_id
        self.spec = spec
        self.states = states
        self.transaction_id = -1
        self.clock = clock
        self.on_lock_failed = on_lock_failed
        self.attempt: Attempt | None = None
        self.last_failure: tuple[int, tuple[LockSpec, ...], int] | None = None

    def partition_id(self, num_partitions: int) -> int:
        return self.spec.partition

    def build(self, builder: TransactionBuilder) -> bool:
        built = self.spec.build(self.states[self.spec.partition])
        if built is None:
            return False
        kind, body, locks = built
        for name, lock_id, mode in locks:
            builder.lock(Lock(name, lock_id, _MODES[mode]))
        hwm = builder.client_high_water_mark
        builder.set_data(encode_txn(self.op_id, hwm, locks, kind, body))
        if self.clock is not None:
            self.attempt = Attempt(self.clock(), hwm, tuple(locks))
        return True

    async def execute(self, builder: TransactionBuilder) -> bool:
        return self.build(builder)

    def on_lock_failure(self, transaction_id: int) -> None:
        if self.on_lock_failed is not None and self.attempt is not None:
            self.on_lock_failed(self, self.attempt, transaction_id)

    def on_application(self, transaction_id: int) -> None:
        self.transaction_id = transaction_id


class PlainWorkloadOp(WorkloadOp):
    """A :class:`WorkloadOp` whose ``execute`` is a plain method (the client runs it on
    its callback thread, with the read of the client high-water mark)."""

    def execute(self, builder: TransactionBuilder) -> bool:  # type: ignore[override]
        return self.build(builder)


class Workload:
    """The simulated clients of a run: each submits the ops of :attr:`ops` (whose
    :attr:`semantics` says what they mean) and keeps its database."""

    def __init__(self, world: ClientWorld, ops: OpMix) -> None:
        self.world = world
        self.flush_rate = 0.0
        """Per client, ``flush()`` calls per second (``Profile.client_flushes``)."""
        self.ops = ops
        self.name = ops.name
        self.semantics = ops.semantics

    def choose(self, rng: random.Random, partitions: int) -> OpSpec:
        """The next op of a client."""
        return self.ops.choose(rng, partitions)

    def database(self, process: ClientProcess) -> ClientDatabase:
        databases = self.world.client_databases
        db = databases.get(process.name)
        if db is None:
            db = databases[process.name] = ClientDatabase()
            for p in range(self.world.config.partitions):
                db.high_water_marks[p] = -1
                db.states[p] = self.semantics.initial_state(p)
        assert isinstance(db, ClientDatabase)
        return db

    async def client_main(self, process: ClientProcess) -> None:
        world = self.world
        config = world.config
        db = self.database(process)
        assert process.incarnation is not None
        plain = config.callbacks == "plain"
        client = AsyncWaltzClient(
            _PlainCallbacks(self, process, db) if plain else _Callbacks(self, process, db),
            ClientConfig(
                coordination=world.coordination_uri,
                coordination_options={"session_timeout": config.session_timeout},
                transport="sim",
                transport_options={"identity": process.name},
                transaction_timeout=config.transaction_timeout,
                request_timeout=config.request_timeout,
                prefetch_data=plain,  # a plain apply cannot wait for its data on the loop
            ),
            rng=world.rng(f"client:{process.incarnation.name}"),
            callback_executor=CallbackThread(world.loop) if plain else None,
        )
        op_class = PlainWorkloadOp if plain else WorkloadOp
        await client.start()
        process.handle = client
        rng = world.rng(f"workload:{process.incarnation.name}")
        inflight: set[asyncio.Task[None]] = set()
        loop = asyncio.get_running_loop()
        flusher = loop.create_task(self._flush(client, process)) if self.flush_rate > 0 else None
        while loop.time() < world.submissions_end:
            await asyncio.sleep(rng.expovariate(config.ops_per_second))
            if len(inflight) >= config.max_inflight or loop.time() >= world.submissions_end:
                continue
            spec = self.choose(rng, config.partitions)
            db.ops += 1
            op = op_class(
                f"{process.name}:{db.ops}",
                spec,
                db.states,
                clock=loop.time,
                on_lock_failed=self._lock_failed,
            )
            task = loop.create_task(self._submit(client, process, op))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
        await loop.create_future()  # the client stays up (its feed goes on) until the end
        assert flusher is None or flusher.done()  # (held until here: a task of the process)

    async def _flush(self, client: AsyncWaltzClient, process: ClientProcess) -> None:
        """Now and then the client flushes a partition (a flush round beside its appends)."""
        assert process.incarnation is not None
        rng = self.world.rng(f"flush:{process.incarnation.name}")
        loop = asyncio.get_running_loop()
        while loop.time() < self.world.submissions_end:
            await asyncio.sleep(rng.expovariate(self.flush_rate))
            partition = rng.randrange(self.world.config.partitions)
            try:
                await client.flush(partition)
            except (ClientError, WaltzError) as exc:
                log.debug("%s: flush of partition %d: %s", process.name, partition, exc)

    async def _submit(
        self, client: AsyncWaltzClient, process: ClientProcess, op: WorkloadOp
    ) -> None:
        history = self.world.history
        history.invoke(op.op_id, process.name, op.spec.partition, op.spec.detail)
        try:
            committed = await client.submit(op)
        except TransactionExpiredError as exc:
            history.end(FAIL, op.op_id, detail=f"expired: {exc}"[:200])
        except PermissionDeniedError as exc:  # the ACL: definitely not committed
            history.end(FAIL, op.op_id, detail=f"{REFUSED}: {exc}"[:200])
        except asyncio.CancelledError:
            raise
        except (ClientError, WaltzError) as exc:
            history.end(UNKNOWN, op.op_id, detail=f"{type(exc).__name__}: {exc}"[:200])
        else:
            if committed:
                history.end(OK, op.op_id, op.transaction_id)
            else:
                history.end(FAIL, op.op_id, detail="declined by execute")

    def _lock_failed(self, op: WorkloadOp, attempt: Attempt, conflict: int) -> None:
        history = self.world.history
        pending = history.pending.get(op.op_id)
        seen = (attempt.client_high_water_mark, attempt.locks, conflict)
        if pending is None or op.last_failure == seen:
            return  # a retry failing the same way again says nothing new
        op.last_failure = seen
        history.lock_failed(
            LockFailure(
                op.op_id,
                pending.process,
                self.world.loop.time(),
                op.spec.partition,
                attempt.client_high_water_mark,
                attempt.locks,
                conflict,
                attempt.built_at,
            )
        )


class OpMix(ABC):
    """The ops a workload's clients submit, chosen from a random stream (pure: no
    client, no loop); :attr:`semantics` says what they mean."""

    name = ""
    semantics: Semantics

    @abstractmethod
    def choose(self, rng: random.Random, partitions: int) -> OpSpec:
        """The next op of a client, on one of partitions ``0..partitions-1``."""


class BankOps(OpMix):
    """Deposits (APPEND), withdrawals and transfers (WRITE), audits (READ on every account)."""

    name = "bank"

    def __init__(self, semantics: BankSemantics | None = None) -> None:
        self.semantics = semantics or BankSemantics()

    def choose(self, rng: random.Random, partitions: int) -> OpSpec:
        semantics = self.semantics
        assert isinstance(semantics, BankSemantics)
        accounts = semantics.accounts
        partition = rng.randrange(partitions)
        roll = rng.random()
        if roll < 0.35:
            acct, amount = rng.randrange(accounts), rng.randint(1, 100)

            def deposit(state: dict[str, Any]) -> tuple[str, dict[str, Any], list[LockSpec]]:
                return "deposit", {"acct": acct, "amount": amount}, [("acct", acct, APPEND)]

            return OpSpec(partition, f"deposit {amount} to {acct}", deposit)
        if roll < 0.55:
            acct, amount = rng.randrange(accounts), rng.randint(1, 150)

            def withdraw(
                state: dict[str, Any],
            ) -> tuple[str, dict[str, Any], list[LockSpec]] | None:
                seen = state["balances"][str(acct)]
                if seen < amount:
                    return None
                body = {"acct": acct, "amount": amount, "seen": seen}
                return "withdraw", body, [("acct", acct, WRITE)]

            return OpSpec(partition, f"withdraw {amount} from {acct}", withdraw)
        if roll < 0.85:
            source, target = rng.sample(range(accounts), 2)
            amount = rng.randint(1, 100)

            def transfer(
                state: dict[str, Any],
            ) -> tuple[str, dict[str, Any], list[LockSpec]] | None:
                balances = state["balances"]
                seen = [balances[str(source)], balances[str(target)]]
                if seen[0] < amount:
                    return None
                body = {"from": source, "to": target, "amount": amount, "seen": seen}
                return "transfer", body, [("acct", source, WRITE), ("acct", target, WRITE)]

            return OpSpec(partition, f"transfer {amount} {source}->{target}", transfer)

        def audit(state: dict[str, Any]) -> tuple[str, dict[str, Any], list[LockSpec]]:
            seen = dict(state["balances"])
            return "audit", {"seen": seen}, [("acct", a, READ) for a in range(accounts)]

        return OpSpec(partition, "audit", audit)


class RegisterOps(OpMix):
    """Registers (WRITE to set, READ to read) and counters (APPEND to increment)."""

    name = "register"

    def __init__(self, semantics: RegisterSemantics | None = None) -> None:
        self.semantics = semantics or RegisterSemantics()

    def choose(self, rng: random.Random, partitions: int) -> OpSpec:
        semantics = self.semantics
        assert isinstance(semantics, RegisterSemantics)
        partition = rng.randrange(partitions)
        roll = rng.random()
        if roll < 0.35:
            counter, by = rng.randrange(semantics.counters), rng.randint(1, 5)

            def incr(state: dict[str, Any]) -> tuple[str, dict[str, Any], list[LockSpec]]:
                return "incr", {"ctr": counter, "by": by}, [("ctr", counter, APPEND)]

            return OpSpec(partition, f"incr counter {counter} by {by}", incr)
        reg = rng.randrange(semantics.registers)
        if roll < 0.7:
            value = rng.randint(1, 10_000)

            def write(state: dict[str, Any]) -> tuple[str, dict[str, Any], list[LockSpec]]:
                seen = state["registers"][str(reg)]
                return "write", {"reg": reg, "seen": seen, "value": value}, [("reg", reg, WRITE)]

            return OpSpec(partition, f"write register {reg} := {value}", write)

        def read(state: dict[str, Any]) -> tuple[str, dict[str, Any], list[LockSpec]]:
            seen = state["registers"][str(reg)]
            return "read", {"reg": reg, "seen": seen}, [("reg", reg, READ)]

        return OpSpec(partition, f"read register {reg}", read)


OP_MIXES: dict[str, type[OpMix]] = {"bank": BankOps, "register": RegisterOps}
WORKLOADS = OP_MIXES
"""The workloads by name (what ``--workload`` chooses)."""


def op_mix(name: str) -> OpMix:
    """The ops of the workload ``name`` (a ClientError naming the choices if unknown)."""
    try:
        return OP_MIXES[name]()
    except KeyError:
        raise ClientError(
            f"unknown workload {name!r}; choose one of {', '.join(sorted(OP_MIXES))}"
        ) from None


def make_workload(name: str, world: ClientWorld) -> Workload:
    return Workload(world, op_mix(name))


def stored_record(record: Any) -> StoredRecord:
    """A record (``waltz_api.types.Record``, or any object with its fields) as the
    checker's :class:`~waltz_sim.checker.StoredRecord`."""
    r = record.req_id
    return StoredRecord(
        record.transaction_id,
        (r.client_id, r.generation, r.partition_id, r.seq_num),
        record.header,
        record.checksum,
        bytes(record.data),
    )


__all__ = [
    "OP_MIXES",
    "WORKLOADS",
    "Attempt",
    "BankOps",
    "ClientDatabase",
    "OpMix",
    "OpSpec",
    "PlainWorkloadOp",
    "ReadOnlyCallbacks",
    "RegisterOps",
    "Workload",
    "WorkloadOp",
    "make_workload",
    "op_mix",
    "stored_record",
]
