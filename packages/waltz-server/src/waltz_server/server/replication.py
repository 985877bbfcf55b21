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
when its storage lost what it acknowledged (a damaged tail, a wiped disk, a
restore, a lost write), what its own low-water mark proves committed, and the
session sends it the rest. Storage nodes fence by session id, so once a newer
session exists none of this session's requests (rejoin included) is accepted
anywhere: fencing, not timing, keeps an old session from writing.

Why the next session's recovery finds every committed record
------------------------------------------------------------
A record is committed once a quorum acknowledged it. The next session's recovery
votes with the replicas that are *clean* in this session (their storage's marks
were written by this session as clean, and the partition store metadata records
them: every writer joined through recovery, which records it), and counts every
other replica of this session as offline (it may hold anything), so it decides
no mark that a quorum including that replica could contradict. That holds only
while a voter's storage still holds what it acknowledged. The protocol points it
relies on, each faulted by the simulation and the tests:

1. *Storage that lost what it acknowledged never votes.* A replica whose storage
   lost records it acknowledged (its engine reports ``LOST_SESSION``; a wiped or
   new partition is recorded ``LOST_SESSION`` by its storage node when a session
   first raises its fence; a restore shows an older session's marks) is not clean.
   When it rejoins this session, its storage is first marked *suspect*
   (MarkReplica clean=False, durable, before it writes: its marks keep reading
   ``LOST_SESSION``), it joins at the mark it provably holds (its earlier
   acknowledgements stop counting: :meth:`Replication.join`), and only once it
   holds everything committed when it rejoined (:meth:`Replication.clean_due`) is
   it marked clean again (MarkReplica clean=True, which the node refuses if its log
   does not reach that far). An owner that dies anywhere in between leaves a
   replica that the next recovery counts as offline. A recovery catching up a suspect
   replica writes the new session's marks on it only once it holds the closing mark's
   prefix (storage seed 101: written first, they cleared LOST_SESSION).
2. *A silently shortened log is beyond it.* A lost write at the very end of a log, or
   a restore from a snapshot taken within this session, leaves marks that look clean
   and a log that looks complete; the store session that wrote it sees the loss when
   the replica returns to it (its log is shorter than what it acknowledged: case 1),
   but a recovery that runs first counts it as a voter. Closing at the highest
   voter's end instead was tried and dropped: it commits a record one replica holds,
   and when that copy is lost too every replica is left behind the recorded mark
   (simulation storage seed 1027). The simulation's ``storage`` profile names such
   losses (known issue ``unseen-lost-tail``).
3. *Every writer is recorded clean before it writes.* A replica that recovers into the
   session after it opened writes its state (clean in this session) to the partition
   store metadata first, also when the replicas that recovered before it have left
   since (storage seed 578: recorded behind the old closing mark, it was truncated to
   that mark by the next recovery, its acknowledgements lost).
4. *Acknowledgements after a rejoin are real.* A suspect replica's new
   acknowledgements count toward commits (its storage holds them); the next
   recovery still counts it as offline until it was marked clean, which is
   conservative.

The guarantee (docs/server.md): no acknowledged transaction is lost, and the
partition stays writable, while a majority of storage nodes runs and every
committed record has at least one intact copy among them; beyond that, recovery
does not decide (the partition is refused, its status naming the ids at risk)
rather than close the log short.
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
    clean_at: int | None = None
    """Set while the replica is *suspect* (it rejoined with storage that lost what it
    acknowledged, and its storage says so): once ``acked`` reaches this id (the
    session's high-water mark when it rejoined) it holds the committed prefix again and
    the session marks it clean (:meth:`Replication.clean_due`)."""


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

    def join(self, node: str, mark: int, *, suspect: bool = False) -> Committed | None:
        """``node`` joins the writers holding this session's log up to ``mark`` (the
        session's opening mark after recovery, or a rejoin's :attr:`RejoinPlan.mark`).
        Its records are sent from ``mark + 1``. Whatever it acknowledged before no longer
        counts (its progress starts at ``mark``). A ``suspect`` replica (its storage lost
        what it acknowledged) is due to be marked clean once it holds everything
        committed now (:meth:`clean_due`)."""
        if node not in self.replicas:
            raise WaltzError(f"{node} is not a replica of this store session {self.replicas}")
        if mark >= self.next_transaction_id:
            raise WaltzError(
                f"replica {node} joins holding up to {mark}, but this session assigned ids "
                f"only up to {self.next_transaction_id - 1}"
            )
        self._progress[node] = ReplicaProgress(
            acked=mark, sent=mark, clean_at=self.high_water_mark if suspect else None
        )
        return self._advance()

    def clean_due(self, node: str) -> int | None:
        """A suspect writer that now holds the session's committed prefix as of its rejoin:
        the log end to mark it clean at (then :meth:`marked_clean`); None otherwise."""
        progress = self._progress.get(node)
        if progress is None or progress.clean_at is None or not progress.writing:
            return None
        return progress.acked if progress.acked >= progress.clean_at else None

    def marked_clean(self, node: str) -> None:
        """Its storage records it clean in this session: a voter again for the next
        session's recovery."""
        progress = self._progress.get(node)
        if progress is not None:
            progress.clean_at = None

    @property
    def suspects(self) -> list[str]:
        """Writers whose storage lost what they acknowledged and that have not caught up
        to the committed prefix yet (sorted)."""
        return sorted(node for node, p in self._progress.items() if p.clean_at is not None)

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
    - ``suspect``: its storage no longer holds what it acknowledged (a damaged tail, a
      wiped disk, a restore): it is marked *suspect* on its storage (MarkReplica,
      clean=False: its marks read LOST_SESSION, so a recovery counts it as a replica
      that may have held anything) before it writes, and marked clean only once it
      holds the session's committed prefix again;
    - ``mark``: its log end once that is done: it joins the writers there.
    """

    truncate_to: int | None
    suspect: bool
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
    carries this session's start (its session id and low-water mark, written by this
    session as clean) and holds at least what it acknowledged, it is the storage that
    acknowledged: keep up to ``acked`` (anything after it was in flight, never counted:
    cut it, the window sends it again). Otherwise the storage lost what it acknowledged
    (restored from a backup, wiped, a damaged tail, a lost write, or it was still
    suspect from an earlier rejoin): only what its own low-water mark proves committed
    is kept and it is *suspect* until it caught up (see :class:`RejoinPlan`).
    """
    same_storage = (
        _marks_written_by(storage, session_id)
        and storage.low_water_mark == low_water_mark
        and max_transaction_id >= acked
    )
    if same_storage:
        return RejoinPlan(
            truncate_to=acked if max_transaction_id > acked else None,
            suspect=False,
            mark=acked,
        )
    keep = min(max_transaction_id, storage.low_water_mark, low_water_mark)
    return RejoinPlan(
        truncate_to=keep if max_transaction_id > keep else None,
        suspect=True,
        mark=keep,
    )


def _marks_written_by(storage: SessionInfo, session_id: int) -> bool:
    """Whether this session's SetLowWaterMark wrote the storage's marks. An engine that
    does not keep the marks' session (NO_SESSION) is judged by its fence; one that
    found it lost acknowledged records (LOST_SESSION) never is this session's."""
    if storage.low_water_mark_session_id == NO_SESSION:
        return storage.session_id == session_id
    return storage.low_water_mark_session_id == session_id
