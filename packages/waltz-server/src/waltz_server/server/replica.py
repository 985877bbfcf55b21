"""What a store session needs from one replica: a partition on one storage node.

A :class:`ReplicaConnection` speaks for one store session id and one
partition; every request carries that session id, and a storage node that has
seen a newer one refuses it with SessionFencedError (FailureResponse FENCED).
The storage client (``waltz_server.storage_node.client``) provides it over any
Transport; tests may provide it in-process.

Errors: SessionFencedError when fenced; TransportError (ConnectionClosedError)
when the node is unreachable or the connection broke; StorageError for any
other refusal. A connection is safe for concurrent calls from several tasks
(a recovering replica reads from another replica while that one appends); the
storage node serves one partition's requests in arrival order.

The contract is :class:`ReplicaConnection`, every call the store session and
recovery make (mypy proves each implementation has them all). Two groups of calls are
optional features of the storage behind a replica, declared in its ``capabilities``
(the constants of :mod:`waltz_api.capabilities`, never guessed by probing attributes):

- :data:`~waltz_api.capabilities.REPAIR`: ``missing_range() -> tuple[int, int] | None``,
  the lowest range of the replica's log its storage lost to damage, and
  ``repair(records)``, records copied from a healthy replica into it. Without it a
  replica has no damage to report (``missing_range`` is None).
- :data:`~waltz_api.capabilities.PREFIX` (the archive, docs/archive.md): ``local_log()
  -> LocalLog``, the replica's local log, and ``prune(through) -> int``, delete its
  local records up to ``through`` (archived and verified; past its end: the log
  continues after ``through``), returning its new start. Without it the replica keeps
  every record; both calls raise StorageError.

The storage client's StorageReplica declares both (a storage node whose engine lacks
the prefix capability refuses ``prune`` with StorageError, which recovery handles).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from waltz_api.capabilities import PREFIX, REPAIR
from waltz_api.contracts.storage import LogExtent
from waltz_api.types import Record, SessionInfo


@dataclass(frozen=True)
class LocalLog:
    """A replica's local log: ``log_start .. max_transaction_id`` held, in ``extents``
    (segments, ascending; the last one is not sealed)."""

    log_start: int
    max_transaction_id: int
    extents: tuple[LogExtent, ...] = ()

    @property
    def local_bytes(self) -> int:
        """Bytes of the local log (-1 when the engine cannot tell)."""
        sizes = [e.size for e in self.extents]
        return -1 if any(size < 0 for size in sizes) else sum(sizes)

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> LocalLog:
        return cls(
            int(value["log_start"]),
            int(value["max_transaction_id"]),
            tuple(LogExtent(*(int(v) for v in e)) for e in value.get("extents", ())),
        )


REPLICA_CAPABILITIES: Final = frozenset({REPAIR, PREFIX})
"""The optional features a replica connection may declare (see the module docstring)."""


class ReplicaConnection(Protocol):
    """One partition on one storage node, for one store session: every call the store
    session and recovery make (see the module docstring for the optional ones)."""

    @property
    def storage_node(self) -> str:
        """The storage node's connect string (the replica's identity in the metadata)."""

    @property
    def capabilities(self) -> frozenset[str]:
        """The optional features it has, of :data:`REPLICA_CAPABILITIES`."""

    async def last_session_info(self) -> SessionInfo: ...

    async def max_transaction_id(self) -> int: ...

    async def truncate(self, transaction_id: int) -> None:
        """Keep records up to ``transaction_id``, durably."""

    async def set_low_water_mark(self, low_water_mark: int) -> None:
        """Record this session's start (its low-water mark), durably."""

    async def mark_replica(self, low_water_mark: int, *, clean: bool, log_end: int = -1) -> None:
        """Record on the replica's storage, durably, whether it holds what it acknowledged
        in this session (MarkReplicaRequest): ``clean=False`` when it came back having
        lost it (its log must end at or below ``low_water_mark``; its marks then read
        LOST_SESSION), ``clean=True`` once it holds the committed prefix again (its log
        reaches ``log_end``)."""

    async def append(self, records: Sequence[Record]) -> None:
        """Append dense records continuing the log, durably."""

    def start_append(self, records: Sequence[Record]) -> asyncio.Future[None]:
        """:meth:`append` as a future, the request posted before it returns (the store
        session's write loop keeps several in flight without a task per batch); their
        results come in the order they were started."""

    async def read_records(self, start: int, max_records: int, max_bytes: int) -> list[Record]: ...

    async def read_block(self, start: int, max_records: int, max_bytes: int) -> Sequence[Record]:
        """:meth:`read_records` as the storage sent them (a ``RecordBlock``, nothing
        decoded, where it can); it may hold more than ``max_records`` records."""

    async def missing_range(self) -> tuple[int, int] | None:
        """The lowest range its storage lost to damage (capability REPAIR; else None)."""

    async def repair(self, records: Sequence[Record]) -> None:
        """Fill a missing range with records copied from a peer (capability REPAIR)."""

    async def local_log(self) -> LocalLog:
        """Its local log (capability PREFIX; else StorageError)."""

    async def prune(self, through: int) -> int:
        """Delete its local records up to ``through``; its new log start (capability
        PREFIX; else StorageError)."""

    async def close(self) -> None: ...


ReplicaConnector = Callable[[str, int, int], Awaitable[ReplicaConnection]]
"""``connector(storage_node, partition_id, session_id)``: open a replica connection
(raises TransportError when the node cannot be reached)."""
