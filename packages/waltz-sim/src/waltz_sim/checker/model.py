"""The checker's data model: what a run recorded, and what the checker says about it.

Everything here is plain data (frozen dataclasses of ints, strings, bytes), so a
history can come from anywhere: the simulation fills it in one process; a harness
of real processes (``waltz chaos``) fills it from its clients' logs and from the
storage nodes' data read back at the end. Times are seconds on any clock that the
whole history shares (the simulation's virtual clock, or a wall clock).

A run yields:

- :class:`OpEvent` s: each submission a client made (an *op*, named by a unique
  ``op_id`` that the client also writes into the transaction's data) is
  ``invoke`` d once and then ends ``ok`` (committed, with its transaction id),
  ``fail`` (definitely not committed: the client says nothing of it is pending) or
  ``unknown`` (the client crashed, or was stopped, with it in flight), or never
  ends (no answer: a liveness failure when the run gave it time to end);
- :class:`FeedEvent` s: every transaction a client's ``apply_transaction``
  received, in the order received, per client *incarnation* (a client restarted
  from its database is a new incarnation);
- :class:`ClientSnapshot` s: each client's database at the end (its high-water
  mark and state per partition);
- a :class:`ClusterSnapshot`: per partition, every replica's stored records, the
  committed high-water mark the cluster reports at the end, and the log as the
  cluster served it (range reads) at the end;
- :class:`LockFailure` s: each attempt of an op that the server's lock check
  rejected, with what the attempt was built on (its client high-water mark and
  locks) and the conflicting transaction id the server reported;
- :class:`SessionSpan` s (when the harness can see them): each store session the
  servers opened, with the high-water mark its recovery closed the last one at
  (where the server's lock table was reset), and when it ended.

:func:`waltz_sim.checker.check` turns these (with the workload's
:class:`~waltz_sim.checker.semantics.Semantics`) into a :class:`CheckResult`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

INVOKE = "invoke"
OK = "ok"
FAIL = "fail"
UNKNOWN = "unknown"
OP_KINDS = (INVOKE, OK, FAIL, UNKNOWN)


@dataclass(frozen=True, slots=True)
class OpEvent:
    """One step of a submission's life (see the module docstring)."""

    kind: str
    """``invoke``, ``ok``, ``fail`` or ``unknown``."""
    op_id: str
    client: str
    time: float
    partition: int
    transaction_id: int = -1
    """For ``ok``: the id it committed as."""
    detail: str = ""
    """For ``invoke``: what the op does; for ``fail`` and ``unknown``: why."""


@dataclass(frozen=True, slots=True)
class FeedEvent:
    """A transaction handed to a client's ``apply_transaction``."""

    client: str
    incarnation: int
    partition: int
    transaction_id: int
    op_id: str | None
    """The op id in the data the client applied (None: the data did not decode)."""
    time: float


@dataclass(frozen=True, slots=True)
class ClientSnapshot:
    """A client's database for one partition, at the end of the run."""

    client: str
    partition: int
    high_water_mark: int
    state: Mapping[str, Any]
    """The workload's state (what :meth:`Semantics.state_at` computes from the log)."""


@dataclass(frozen=True, slots=True)
class StoredRecord:
    """A transaction as a replica stores it (or as the cluster served it)."""

    transaction_id: int
    req_id: tuple[int, int, int, int]
    """client id, generation, partition id, sequence number."""
    header: int
    checksum: int
    data: bytes


@dataclass
class PartitionSnapshot:
    """One partition at the end of a run."""

    partition: int
    high_water_mark: int | None
    """The committed high-water mark the cluster reported at the end (None: it did not
    answer, itself a liveness failure; the checker then checks what it can)."""
    replicas: Mapping[str, Sequence[StoredRecord]]
    """Every replica's records (storage node -> all it stores, committed or not)."""
    served: Sequence[StoredRecord] | None = None
    """The committed log as the cluster served it at the end (None: not read)."""
    removed: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Replicas removed from the partition during the run (and not put back): storage node
    -> (the store session its fence holds at the end, the first session over a replica
    set without it). None of those later sessions may raise its fence."""
    archived: Sequence[StoredRecord] = ()
    """The partition's archive read at the end: ids 0 to the archive mark (empty without
    an archive). A replica may then start anywhere up to the mark's next id (it deleted
    what is archived), and an archived id counts as held safely by the archive."""
    archive_error: str | None = None
    """Why the archive the mark names could not be read at the end (committed records
    lost: ``archive-unreadable``)."""


@dataclass(frozen=True, slots=True)
class LockFailure:
    """An attempt of an op that the server's lock check rejected (the client re-executes
    the op once it has applied ``conflict``)."""

    op_id: str
    client: str
    time: float
    """When the client received the failure."""
    partition: int
    client_high_water_mark: int
    """The client high-water mark the attempt was built on."""
    locks: tuple[tuple[str, int, str], ...]
    """The attempt's locks: (name, id, mode), as in the transaction's envelope (mode
    ``r``, ``w`` or ``a``: :data:`waltz_sim.checker.semantics.READ`...)."""
    conflict: int
    """The transaction id the server reported (its lock table's estimate)."""
    built_at: float
    """When the attempt was built (the server checked it between this and ``time``)."""


@dataclass(frozen=True, slots=True)
class SessionSpan:
    """A store session a server opened for a partition: from then on its lock table
    estimates every lock at ``mark`` at least (a reset), until ``closed_at``."""

    partition: int
    session_id: int
    opened_at: float
    mark: int
    """The high-water mark the session opened at (its recovery's closing mark)."""
    closed_at: float | None = None
    """When it ended (fenced, failed, closed, or its server crashed); None: open at the end."""
    server: str = ""


@dataclass
class ClusterSnapshot:
    partitions: dict[int, PartitionSnapshot] = field(default_factory=dict)


@dataclass
class History:
    """What the clients saw."""

    ops: list[OpEvent] = field(default_factory=list)
    feed: list[FeedEvent] = field(default_factory=list)
    clients: list[ClientSnapshot] = field(default_factory=list)
    start_time: float = 0.0
    end_time: float = 0.0
    healed_at: float | None = None
    """When the last fault healed (None: no fault). Liveness is checked from here."""
    quiet: list[tuple[float, float]] = field(default_factory=list)
    """Fault-free periods (start, end) before ``healed_at``, when faults come and go
    through a run (``waltz chaos``): in each, as after the last heal, an op is decided
    within its deadline (counted from the later of its invocation and the period's
    start) when the period lasts that long, and a commit comes within the bound when
    the period lasts that long and ops were in flight in it."""
    submissions_end: float | None = None
    """When the workload stopped starting new ops (liveness: each op has until its
    deadline; ops started later than ``end_time`` minus the deadline are not held to it,
    unless the run was ``drained``)."""
    drained: bool = False
    """The run drained its submissions before the end: the clients stopped starting ops
    at ``submissions_end``, then the run waited for every open op to be answered (for at
    least the decision deadline after ``submissions_end``). Every op without an answer
    at the end is then ``undecided``, whenever it was invoked."""
    lock_failures: list[LockFailure] = field(default_factory=list)
    sessions: list[SessionSpan] | None = None
    """The store sessions the servers opened (None: not known; the lock-precision check
    then only checks what the failures say by themselves)."""
    lock_table: str | None = None
    """The servers' lock table, when known: ``exact`` is held to exact precision (a lock
    fails only when a transaction it does not see changed one of its locks), ``hwm-array``
    to never failing a client that has seen what the conflict names."""
    baseline: list[tuple[float, float]] = field(default_factory=list)
    """Fault-free windows (start, end) where the throughput is held to the floor
    (:attr:`LivenessBounds.throughput_floor`), together: the warm-up, the quiet end
    once the cluster settled, a run without faults."""
    offered_rate: float | None = None
    """Ops per second the clients start together when nothing holds them back (the
    throughput floor is a share of it; None: no floor)."""
    refused: frozenset[tuple[str, int]] | None = None
    """With an enforced ACL: the (client, partition) pairs whose appends it refuses
    (every other client may write there). None: no ACL."""


@dataclass(frozen=True)
class LivenessBounds:
    """How long the cluster may take, after the last fault healed (seconds)."""

    decision_deadline: float = 12.0
    """Every submission is decided (ok or fail) within this, counted from the later of
    its invocation and the heal."""
    commit_bound: float = 8.0
    """A commit happens within this after the heal (when ops were submitted)."""
    catch_up: bool = True
    """At the end every client's database holds the whole committed log, and every
    replica the committed prefix."""
    throughput_floor: float = 0.0
    """Over the fault-free windows of :attr:`History.baseline`, ops commit at least at
    this share of :attr:`History.offered_rate` (0: not checked). A bug that makes the
    cluster turn work away with nothing wrong (a lock check too strict, a stall) shows
    as a rate far below a clean run's."""
    throughput_window: float = 5.0
    """Baselines shorter than this in all (seconds) are not judged: too few ops."""


@dataclass(frozen=True)
class Violation:
    """An invariant that did not hold, with where to look."""

    invariant: str
    message: str
    time: float | None = None
    partition: int | None = None
    transaction_id: int | None = None
    op_id: str | None = None
    client: str | None = None

    def __str__(self) -> str:
        where = [
            f"{name} {value}"
            for name, value in (
                ("partition", self.partition),
                ("transaction", self.transaction_id),
                ("op", self.op_id),
                ("client", self.client),
            )
            if value is not None
        ]
        suffix = f" ({', '.join(where)})" if where else ""
        return f"[{self.invariant}] {self.message}{suffix}"


@dataclass
class CheckResult:
    violations: list[Violation] = field(default_factory=list)
    committed: dict[int, int] = field(default_factory=dict)
    """Committed transactions per partition."""
    outcomes: dict[str, int] = field(default_factory=dict)
    """Ops by how they ended (ok, fail, unknown, pending)."""
    throughput: float | None = None
    """Commits per second over the baseline's fault-free windows, as a share of the
    offered rate (None: no baseline long enough, or no offered rate)."""

    @property
    def ok(self) -> bool:
        return not self.violations


__all__ = [
    "FAIL",
    "INVOKE",
    "OK",
    "OP_KINDS",
    "UNKNOWN",
    "CheckResult",
    "ClientSnapshot",
    "ClusterSnapshot",
    "FeedEvent",
    "History",
    "LivenessBounds",
    "LockFailure",
    "OpEvent",
    "PartitionSnapshot",
    "SessionSpan",
    "StoredRecord",
    "Violation",
]
