"""The replication rule of one store session, pure (no I/O, no event loop, no clock).

A store session (:mod:`waltz_server.server.store`) writes one partition's records
to its replicas. This module decides; the session only carries the decisions out
over the network (as :mod:`waltz_client.state` does for the client):

- the transaction id of the next append, and whether there is room for it (back
  pressure: records not yet committed, bytes held in memory);
- the *window*: the records appended recently, kept in memory until every writing
  replica has them, or until the window is over its byte budget (a replica behind
  the window then catches up from a healthy replica's storage);
- each replica's progress in this session: ``acked``, the highest id it durably
  acknowledged, and ``sent``, the highest id in flight to it; what it is sent next
  (:meth:`Replication.next_send`), several batches in flight at once;
- the commit rule: a record is committed once a quorum (a majority) of the
  session's replicas acknowledged it; the high-water mark never goes back;
- the writers: a replica whose connection or storage fails *leaves* the writers
  (what it had in flight is forgotten; what it acknowledged stays acknowledged,
  it is durable) and the session goes on while the others can commit; when the
  replica comes back it *joins* again at the mark :func:`plan_rejoin` proves it
  holds, and catches up.

Why a replica may leave and rejoin one session without a new one
----------------------------------------------------------------
A store session writes exactly one record at each transaction id (ids are
assigned once, from the window, in order), and every replica receives records
only from this session's window or from another writer's storage, which holds
the same records. So for any two replicas the records of this session at one id
are the same record, and a replica's log is always a prefix of the session's
log: losing a connection can only shorten what a replica holds, never change it.
A returning replica is therefore asked what it holds (its session info and log
end); :func:`plan_rejoin` keeps only what is proven to be this session's (up to
what it acknowledged, when its storage is the one that acknowledged it) or,
when its storage changed under the session (a restore, a wiped disk), what its
own low-water mark proves committed, and the session sends it the rest. Storage
nodes fence by session id, so once a newer session exists none of this
session's requests (rejoin included) is accepted anywhere: fencing, not timing,
keeps an old session from writing. A commit counts acknowledgements of replicas
that are clean in this session in the partition store metadata (every writer
joined through recovery, which records it), so the next session's recovery,
which votes with exactly those replicas, finds every committed record on a
quorum of voters.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from waltz_api.errors import WaltzError
from waltz_api.types import NO_SESSION, Record, ReqId, SessionInfo
from waltz_server.server.voting import quorum_of


@dataclass(frozen=True, slots=True)
class ReplicationLimits:
    """The session's memory and batching budget (from ``StoreConfig``)."""

    max_batch_records: int = 512
    max_batch_bytes: int = 4 * 1024 * 1024
    max_pending_records: int = 8192
    max_window_bytes: int = 32 * 1024 * 1024
    catch_up_batch: int = 256
    max_inflight_batches: int = 4


@dataclass(frozen=True, slots=True)
class Send:
    """Append ``records`` (dense, continuing the replica's log) to the replica."""

    records: tuple[Record, ...]

    @property
    def last_transaction_id(self) -> int:
        return self.records[-1].transaction_id


@dataclass(frozen=True, slots=True)
class CatchUp:
    """The replica is behind the window: read ``count`` records from ``start`` out of
    one of ``sources`` (writers that acknowledged them), then hand them to
    :meth:`Replication.caught_up_read`."""

    start: int
    count: int
    sources: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Committed:
    """The high-water mark advanced; ``records`` are the newly committed ones, in order."""

    high_water_mark: int
    records: tuple[Record, ...]


@dataclass(slots=True)
class ReplicaProgress:
    acked: int
    """The highest id this replica durably acknowledged in this session (or held when
    it joined)."""
    sent: int
    """The highest id sent to it (``acked`` when nothing is in flight)."""
    inflight: int = 0
    """Batches sent and not yet acknowledged."""
    writing: bool = True
    """In the writers now; False after it left (its ``acked`` still counts)."""


class Replication:
    """One store session's window, replica progress and commit rule.

    Created when the session's recovery has decided the opening high-water mark
    (``low_water_mark``). Replicas :meth:`join` with the mark they hold, then the
    session loops on :meth:`next_send` / :meth:`on_appended` for each, and
    :meth:`append` assigns ids to new records.
    """

    def __init__(
        self,
        *,
        replicas: Sequence[str],
        low_water_mark: int,
        limits: ReplicationLimits | None = None,
    ) -> None:
        if len(set(replicas)) != len(replicas):
            raise WaltzError(f"a store session's replicas must be distinct, got {list(replicas)}")
        self.replicas = tuple(replicas)
        self.quorum = quorum_of(len(self.replicas))
        self.limits = limits or ReplicationLimits()
        self.low_water_mark = low_water_mark
        self.high_water_mark = low_water_mark
        self._window: collections.deque[Record] = collections.deque()
        self._window_start = low_water_mark + 1
        self._window_bytes = 0
        self._progress: dict[str, ReplicaProgress] = {}

    # -- appends ------------------------------------------------------------------------

    @property
    def next_transaction_id(self) -> int:
        return self._window_start + len(self._window)

    @property
    def pending(self) -> int:
        """Records appended and not yet committed."""
        return self.next_transaction_id - 1 - self.high_water_mark

    @property
    def window_bytes(self) -> int:
        return self._window_bytes

    @property
    def window_start(self) -> int:
        """The first transaction id still held in memory."""
        return self._window_start

    def has_room(self) -> bool:
        """Room for one more append (back pressure): fewer than ``max_pending_records``
        pending, and the window under its byte budget unless nothing is pending."""
        pending = self.pending
        return pending < self.limits.max_pending_records and (
            self._window_bytes < self.limits.max_window_bytes or pending == 0
        )

    def append(self, req_id: ReqId, header: int, data: bytes, checksum: int) -> Record:
        """Give the record the next transaction id and add it to the window."""
        record = Record(self.next_transaction_id, req_id, header, data, checksum)
        self._window.append(record)
        self._window_bytes += len(data)
        return record

    # -- writers ------------------------------------------------------------------------

    @property
    def writers(self) -> list[str]:
        """The replicas writing now, sorted."""
        return sorted(node for node, p in self._progress.items() if p.writing)

    def progress(self, node: str) -> ReplicaProgress | None:
        return self._progress.get(node)

    def acknowledged_marks(self) -> dict[str, int]:
        """The highest transaction id each writer acknowledged (or held when it joined)."""
        return {node: p.acked for node, p in self._progress.items() if p.writing}

    def join(self, node: str, mark: int) -> Committed | None:
        """``node`` joins the writers holding this session's log up to ``mark`` (the
        session's opening mark after recovery, or a rejoin's :attr:`RejoinPlan.mark`).
        Its records are sent from ``mark + 1``."""
        if node not in self.replicas:
            raise WaltzError(f"{node} is not a replica of this store session {self.replicas}")
        if mark >= self.next_transaction_id:
            raise WaltzError(
                f"replica {node} joins holding up to {mark}, but this session assigned ids "
                f"only up to {self.next_transaction_id - 1}"
            )
        self._progress[node] = ReplicaProgress(acked=mark, sent=mark)
        return self._advance()

    def leave(self, node: str) -> None:
        """``node`` failed: it stops writing; what it had in flight is forgotten, what it
        acknowledged still counts (it is durable on its storage)."""
        progress = self._progress.get(node)
        if progress is None:
            return
        progress.writing = False
        progress.sent = progress.acked
        progress.inflight = 0
        self._trim()

    # -- sending ------------------------------------------------------------------------

    def next_send(self, node: str) -> Send | CatchUp | None:
        """What to send ``node`` now, or None: nothing to send (idle), its in-flight
        budget is used, or it must catch up and no writer holds the records yet."""
        progress = self._progress.get(node)
        if progress is None or not progress.writing:
            return None
        start = progress.sent + 1
        if start >= self.next_transaction_id:
            return None
        if progress.inflight >= self.limits.max_inflight_batches:
            return None
        if start < self._window_start:
            if progress.inflight:
                return None  # catch up with nothing in flight: read, then append
            end = self._window_start - 1
            sources = tuple(self.sources(start, exclude=node))
            if not sources:
                return None
            count = min(self.limits.catch_up_batch, end - start + 1)
            return CatchUp(start, count, sources)
        records: list[Record] = []
        size = 0
        window = self._window
        for index in range(start - self._window_start, len(window)):
            record = window[index]
            if records and (
                len(records) >= self.limits.max_batch_records
                or size + len(record.data) > self.limits.max_batch_bytes
            ):
                break
            records.append(record)
            size += len(record.data)
        progress.sent = records[-1].transaction_id
        progress.inflight += 1
        return Send(tuple(records))

    def caught_up_read(self, node: str, records: Sequence[Record]) -> Send | None:
        """Records read from a source for a :class:`CatchUp` of ``node``: the batch to
        append to it, or None when they do not continue its log (the source changed
        meanwhile: ask :meth:`next_send` again)."""
        progress = self._progress.get(node)
        if progress is None or not progress.writing or not records:
            return None
        if not _dense_from(records, progress.sent + 1):
            return None
        progress.sent = records[-1].transaction_id
        progress.inflight += 1
        return Send(tuple(records))

    def on_appended(self, node: str, last_transaction_id: int) -> Committed | None:
        """``node`` durably acknowledged its oldest batch in flight, ending at
        ``last_transaction_id``; returns what became committed."""
        progress = self._progress.get(node)
        if progress is None or not progress.writing:
            return None
        if not progress.acked < last_transaction_id <= progress.sent:
            raise WaltzError(
                f"replica {node} acknowledged up to {last_transaction_id}, but it had "
                f"acknowledged {progress.acked} and was sent up to {progress.sent}"
            )
        progress.acked = last_transaction_id
        progress.inflight -= 1
        return self._advance()

    def sources(self, transaction_id: int, exclude: str | None = None) -> list[str]:
        """Writers that acknowledged ``transaction_id`` (sorted), to read it from."""
        return sorted(
            node
            for node, p in self._progress.items()
            if p.writing and node != exclude and p.acked >= transaction_id
        )

    # -- reads ----------------------------------------------------------------------------

    def read_window(self, start: int, count: int, max_bytes: int) -> list[Record] | None:
        """Records ``start``.. from memory (at least one, then up to ``max_bytes``), or
        None when ``start`` is below the window (read it from a replica)."""
        if start < self._window_start:
            return None
        records: list[Record] = []
        size = 0
        end = min(start + count, self.next_transaction_id)
        for index in range(start - self._window_start, end - self._window_start):
            record = self._window[index]
            if records and size + len(record.data) > max_bytes:
                break
            records.append(record)
            size += len(record.data)
        return records

    # -- the commit rule ----------------------------------------------------------------

    def _advance(self) -> Committed | None:
        marks = sorted((p.acked for p in self._progress.values()), reverse=True)
        committed: Committed | None = None
        if len(marks) >= self.quorum:
            mark = min(marks[self.quorum - 1], self.next_transaction_id - 1)
            if mark > self.high_water_mark:
                first = self.high_water_mark + 1 - self._window_start
                newly = tuple(self._window[i] for i in range(first, mark + 1 - self._window_start))
                self.high_water_mark = mark
                committed = Committed(mark, newly)
        self._trim()
        return committed

    def _trim(self) -> None:
        """Drop committed records every writer has (or, over the byte budget, committed
        records a writer lacks: it will read them from a healthy replica)."""
        writing = [p.acked for p in self._progress.values() if p.writing]
        slowest = min(writing) if writing else self.high_water_mark
        window = self._window
        budget = self.limits.max_window_bytes
        while window:
            first = window[0]
            if first.transaction_id > self.high_water_mark:
                break
            if first.transaction_id > slowest and self._window_bytes <= budget:
                break
            window.popleft()
            self._window_start += 1
            self._window_bytes -= len(first.data)


def _dense_from(records: Iterable[Record], start: int) -> bool:
    return all(r.transaction_id == start + i for i, r in enumerate(records))


# -- a returning replica ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RejoinPlan:
    """What a replica that left this session does before it writes again.

    - ``truncate_to``: truncate its log to this id first (None: leave it);
    - ``set_low_water_mark``: record the session's low-water mark on it again (its
      storage changed under the session, so its session info is not this session's);
    - ``mark``: its log end once that is done: it joins the writers there.
    """

    truncate_to: int | None
    set_low_water_mark: bool
    mark: int


def plan_rejoin(
    *,
    session_id: int,
    low_water_mark: int,
    acked: int,
    storage: SessionInfo,
    max_transaction_id: int,
) -> RejoinPlan:
    """Decide how a replica that joined this session before, and left it, comes back.

    ``acked`` is what it acknowledged in this session; ``storage`` and
    ``max_transaction_id`` are what its storage reports now. When the storage still
    carries this session's start (its session id and low-water mark) and holds at
    least what it acknowledged, it is the storage that acknowledged: keep up to
    ``acked`` (anything after it was in flight, never counted: cut it, the window
    sends it again). Otherwise the storage changed under the session (restored from a
    backup, wiped, replaced): only what its own low-water mark proves committed is
    kept, the session's low-water mark is recorded on it again, and it catches up.
    """
    same_storage = (
        _marks_written_by(storage, session_id)
        and storage.low_water_mark == low_water_mark
        and max_transaction_id >= acked
    )
    if same_storage:
        return RejoinPlan(
            truncate_to=acked if max_transaction_id > acked else None,
            set_low_water_mark=False,
            mark=acked,
        )
    keep = min(max_transaction_id, storage.low_water_mark, low_water_mark)
    return RejoinPlan(
        truncate_to=keep if max_transaction_id > keep else None,
        set_low_water_mark=True,
        mark=keep,
    )


def _marks_written_by(storage: SessionInfo, session_id: int) -> bool:
    """Whether this session's SetLowWaterMark wrote the storage's marks. An engine that
    does not keep the marks' session (NO_SESSION) is judged by its fence; one that
    found it lost acknowledged records (LOST_SESSION) never is this session's."""
    if storage.low_water_mark_session_id == NO_SESSION:
        return storage.session_id == session_id
    return storage.low_water_mark_session_id == session_id
