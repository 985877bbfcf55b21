"""The recovery manager: closes the last store session before a new one writes.

../shared/spec/waltz-server.txt, "Recovery Procedure". Each replica session calls
:meth:`RecoveryManager.recover` once connected. The replica reports its last
session info and log end, truncates what cannot be trusted (per
:func:`~waltz_server.server.voting.plan_replica`), then the replicas vote on
the closing high-water mark of the last session. Until it is decided,
replicas behind a higher one catch up from it (which adds their vote). Once
decided, each replica truncates its dirty tail, records the new session's
low-water mark, and catches up to the mark. When a quorum of the current
replicas is clean, the replica states are written to the partition store
metadata by compare-and-set, and the session may write. They record a replica
clean in the new session only once its storage holds the session's low-water mark
(the next recovery takes storage without that session's marks for storage that
lost what it acknowledged); a replica writes only once they record it clean.

Damaged storage: a replica whose log misses a range (its engine moved damaged
files aside, with intact records after them) has the range copied from a peer
before it votes; one whose storage lost records it may have acknowledged (a
backup restored, a damaged tail: ``ReplicaPlan.suspect``) counts as offline.

The archive (docs/archive.md): every id at or below the partition's archive mark
is committed and in the archive. A replica whose log (once its plan's truncation
is done) ends below the mark is *fast-forwarded* to it (its connection's
``prune(mark)``: its local records are deleted and its log continues after the
mark) instead of being caught up from id 0, and a hole at or below the mark is
dropped the same way instead of being repaired. A partition without replica
history whose archive mark is set (a cluster restored from the archive) opens at
the mark.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from waltz_api.capabilities import PREFIX, REPAIR
from waltz_api.contracts.coordination import Coordination
from waltz_api.errors import (
    SessionFencedError,
    StorageError,
    StoreSessionClosedError,
    TransportError,
)
from waltz_api.faultpoints import point
from waltz_api.types import NO_TRANSACTION, UNRESOLVED, Record, ReplicaId, ReplicaState
from waltz_server.server.replica import ReplicaConnection
from waltz_server.server.store_metadata import (
    VersionedMetadata,
    replica_states,
    update_replica_states,
)
from waltz_server.server.voting import (
    Outcome,
    ReplicaPlan,
    plan_replica,
    quorum_of,
    resolve_high_water_mark,
)

log = logging.getLogger(__name__)


@dataclass
class _Recovering:
    node: str
    connection: ReplicaConnection
    mark: int
    voting: bool
    new: bool
    suspect: bool = False
    failed: BaseException | None = None
    """A read from this replica (catching another up) failed: its connection or
    storage is gone. Its own task, waiting in :meth:`RecoveryManager.recover`, raises
    this and retries the replica (nothing it has in flight would tell it)."""


@dataclass(frozen=True, slots=True)
class _Archived:
    """An usher deleted the records asked for: everything up to ``through`` is archived."""

    through: int


class RecoveryManager:
    """Resolves the last session's closing high-water mark across the replicas."""

    def __init__(
        self,
        *,
        coordination: Coordination,
        metadata: VersionedMetadata,
        replica_nodes: Sequence[str],
        catch_up_batch: int = 256,
        catch_up_bytes: int = 4 * 1024 * 1024,
        archive_mark: int = NO_TRANSACTION,
    ) -> None:
        self._coordination = coordination
        self._metadata = metadata
        self.partition_id = metadata.value.partition_id
        self.session_id = metadata.value.session_id
        self._replica_nodes = list(replica_nodes)
        self._last_replicas = replica_states(metadata.value)
        self._last_quorum = quorum_of(len(self._last_replicas)) if self._last_replicas else 0
        self.quorum = quorum_of(len(self._replica_nodes))
        self._catch_up_batch = catch_up_batch
        self._catch_up_bytes = catch_up_bytes
        self.archive_mark = archive_mark
        """Every id at or below it is committed and archived (-1: nothing is)."""
        self._states: dict[str, _Recovering] = {}
        # a partition without replica history starts empty, or at its archive mark
        self._resolved: int | None = (
            None if self._last_replicas else max(NO_TRANSACTION, archive_mark)
        )
        self._clean: set[str] = set()
        self._recovered: set[str] = set()
        self._aborted: BaseException | None = None
        self._changed = asyncio.Event()
        self._metadata_written = asyncio.Event()
        self._write_lock = asyncio.Lock()
        self.outcome: Outcome | None = None
        """The last vote's outcome (None before any voter answered): UNDECIDABLE while the
        offline replicas could change the closing mark (read by status endpoints)."""
        self.at_risk: str | None = None
        """While UNDECIDABLE: which transaction ids may be committed on which replicas
        that did not answer or are suspect (read by status endpoints)."""

    @property
    def resolved_high_water_mark(self) -> int | None:
        return self._resolved

    @property
    def complete(self) -> bool:
        """A quorum of the current replicas is clean and the metadata says so."""
        return self._metadata_written.is_set()

    @property
    def metadata(self) -> VersionedMetadata:
        return self._metadata

    def abort(self, cause: BaseException) -> None:
        if self._aborted is None:
            self._aborted = cause
            self._notify()

    def _check(self) -> None:
        if self._aborted is not None:
            raise StoreSessionClosedError(
                f"recovery of partition {self.partition_id} (session {self.session_id}) "
                f"aborted: {self._aborted}"
            ) from self._aborted

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self) -> None:
        await self._changed.wait()

    async def wait_complete(self) -> int:
        """Wait until the session may write; returns the closing high-water mark."""
        while not self._metadata_written.is_set():
            self._check()
            await self._wait_change()
        assert self._resolved is not None
        return self._resolved

    async def recover(self, node: str, connection: ReplicaConnection) -> int:
        """Recover the replica on ``node``; returns the closing high-water mark once the
        replica is clean, caught up to it, and the metadata records it as clean."""
        self._check()
        state = self._last_replicas.get(node)
        info = await connection.last_session_info()
        max_id = await connection.max_transaction_id()
        plan = plan_replica(
            known=state is not None,
            metadata_empty=not self._last_replicas,
            state_session_id=state.session_id if state else -1,
            state_closing_high_water_mark=state.closing_high_water_mark if state else UNRESOLVED,
            storage_session_id=info.session_id,
            storage_low_water_mark=info.low_water_mark,
            max_transaction_id=max_id,
            storage_low_water_mark_session_id=info.low_water_mark_session_id,
        )
        max_id, plan = await self._skip_archived(node, connection, plan, max_id)
        max_id = await self._repair_missing(node, connection, plan.mark_after(max_id), max_id)
        mark = max_id
        if plan.truncate_to is not None and max_id > plan.truncate_to:
            await connection.truncate(plan.truncate_to)
            mark = plan.truncate_to
        log.debug(
            "partition %d session %d: replica %s last session %s, max id %d, plan %s",
            self.partition_id,
            self.session_id,
            node,
            info,
            max_id,
            plan,
        )
        self._check()
        me = _Recovering(node, connection, mark, plan.voting, plan.new, plan.suspect)
        self._states[node] = me
        self._evaluate()
        self._notify()
        point("recovery.voted", partition=self.partition_id, replica=node, mark=mark)

        low_water_mark_set = False
        while True:
            self._check()
            resolved = self._resolved
            if resolved is not None:
                # A suspect's storage gets this session's marks only once it holds the
                # prefix up to the closing mark: written before (while it still lacks
                # what it lost), they clear its LOST_SESSION, and an owner that dies
                # during the catch-up leaves a replica the next recovery takes for a
                # clean one that is merely behind, to vote once caught up from a peer
                # (storage seed 101 of the replica-change runs: acknowledged ids lost).
                if not low_water_mark_set and (not me.suspect or me.mark >= resolved):
                    if me.mark > resolved:
                        await connection.truncate(resolved)  # the dirty tail
                        me.mark = resolved
                    await connection.set_low_water_mark(resolved)
                    low_water_mark_set = True
                    # its storage's marks are this session's now: the replica states
                    # written next may record it clean in this session (not before:
                    # the next recovery would take storage without them for storage
                    # that lost what it acknowledged, a suspect counted as offline)
                    self._clean.add(node)
                    point(
                        "recovery.marks_written",
                        partition=self.partition_id,
                        replica=node,
                        suspect=me.suspect,
                    )
                    self._check()
                if low_water_mark_set and me.mark >= resolved:
                    break
            usher = self._usher_for(me)
            if usher is None:
                await self._wait_change()
                self._check_alive(me)
                continue
            target = resolved if resolved is not None else usher.mark
            records = await self._read_usher(
                usher, me.mark + 1, min(self._catch_up_batch, target - me.mark)
            )
            self._check()
            self._check_alive(me)
            if records is None:
                continue  # the usher failed: another one, or wait
            if isinstance(records, _Archived):
                await self._start_after(node, connection, me, records.through)
                continue
            if not records:
                # the usher was truncated meanwhile; the next evaluation picks another
                await asyncio.sleep(0)
                continue
            if records[0].transaction_id != me.mark + 1:
                raise StorageError(
                    f"replica {usher.node} returned records from {records[0].transaction_id}, "
                    f"asked from {me.mark + 1}"
                )
            await connection.append(records)
            me.mark += len(records)
            self._evaluate()
            self._notify()

        self._recovered.add(node)
        self._notify()
        late = self._metadata_written.is_set()
        if len(self._recovered) >= self.quorum or late:
            # Once the states were written, a replica recovering late records itself
            # clean before it writes, whatever the others do: those that recovered may
            # have left meanwhile (forget), and a writer the states do not record clean
            # in this session is truncated to the old closing mark by the next recovery
            # (its acknowledgements lost: storage seed 578).
            await self._write_replica_states()
            if late:
                point("recovery.late_recorded", partition=self.partition_id, replica=node)
        else:
            while not self._metadata_written.is_set():
                self._check()
                self._check_alive(me)
                await self._wait_change()
        assert self._resolved is not None
        return self._resolved

    def _check_alive(self, me: _Recovering) -> None:
        if me.failed is not None:
            raise me.failed

    async def _start_after(
        self, node: str, connection: ReplicaConnection, me: _Recovering, through: int
    ) -> None:
        """The ushers deleted what ``node`` needs next (archived, after an archive mark
        newer than this recovery's): it starts after ``through`` instead."""
        if PREFIX not in connection.capabilities:
            raise StorageError(
                f"replica {node} cannot be caught up: the others archived and deleted "
                f"transactions up to {through}, and it cannot start after them"
            )
        await connection.prune(through)
        me.mark = await connection.max_transaction_id()
        log.info(
            "partition %d session %d: replica %s starts after %d, archived and deleted by "
            "the replica it caught up from",
            self.partition_id,
            self.session_id,
            node,
            through,
        )
        self._evaluate()
        self._notify()

    async def _read_usher(
        self, usher: _Recovering, start: int, count: int
    ) -> list[Record] | _Archived | None:
        """Records from ``usher`` for another replica; None when the usher failed the
        read: it is forgotten (no longer a source or a voter until it recovers again)
        and its own task is told, so the reader is not blamed for the usher's fault.
        :class:`_Archived` when the usher deleted them (archived): not its fault either."""
        try:
            return await usher.connection.read_records(start, count, self._catch_up_bytes)
        except (TransportError, StorageError) as exc:
            if isinstance(exc, SessionFencedError):
                raise
            archived = await self._archived_below(usher, start, exc)
            if archived is not None:
                return archived
            log.warning(
                "partition %d session %d: replica %s failed a catch-up read (%s: %s); "
                "it is retried",
                self.partition_id,
                self.session_id,
                usher.node,
                type(exc).__name__,
                exc,
            )
            usher.failed = exc
            self.forget(usher.node, usher.connection)
            return None

    async def _skip_archived(
        self, node: str, connection: ReplicaConnection, plan: ReplicaPlan, max_id: int
    ) -> tuple[int, ReplicaPlan]:
        """A replica ending below the archive mark once its plan's truncation is done is
        fast-forwarded to the mark (its records there are all archived: deleting them and
        continuing the log after the mark is catching it up from the archive); one with a
        hole at or below the mark drops its archived prefix instead of repairing it.
        Returns its log end and the plan left to carry out."""
        archive_mark = self.archive_mark
        capabilities = connection.capabilities
        if archive_mark < 0 or PREFIX not in capabilities:
            return max_id, plan
        if plan.mark_after(max_id) < archive_mark:
            if plan.truncate_to is not None and max_id > plan.truncate_to:
                await connection.truncate(plan.truncate_to)  # its dirty tail, first
                max_id = plan.truncate_to
                plan = replace(plan, truncate_to=None)
            try:
                await connection.prune(archive_mark)
            except StorageError as exc:
                if isinstance(exc, SessionFencedError):
                    raise
                log.warning(  # (an engine without the prefix capability): caught up instead
                    "partition %d session %d: replica %s cannot start at the archive mark: %s",
                    self.partition_id,
                    self.session_id,
                    node,
                    exc,
                )
                return max_id, plan
            max_id = await connection.max_transaction_id()
            log.info(
                "partition %d session %d: replica %s fast-forwarded to the archive mark %d",
                self.partition_id,
                self.session_id,
                node,
                archive_mark,
            )
            return max_id, replace(plan, truncate_to=None)
        if REPAIR in capabilities:
            missing = await connection.missing_range()
            if missing is not None and missing[0] <= archive_mark:
                try:
                    await connection.prune(archive_mark)
                except StorageError as exc:
                    if isinstance(exc, SessionFencedError):
                        raise
                    log.info("partition %d: %s not pruned: %s", self.partition_id, node, exc)
        return max_id, plan

    async def _archived_below(
        self, usher: _Recovering, start: int, error: BaseException
    ) -> _Archived | None:
        """Whether ``usher`` failed a read at ``start`` because it deleted the records
        there (its log starts above: everything below was archived and verified)."""
        if not isinstance(error, StorageError) or PREFIX not in usher.connection.capabilities:
            return None
        try:
            found = await usher.connection.local_log()
        except (TransportError, StorageError):
            return None
        return _Archived(found.log_start - 1) if found.log_start > start else None

    async def _repair_missing(
        self, node: str, connection: ReplicaConnection, keep: int, max_id: int
    ) -> int:
        """Copy what the replica's storage lost to damage (its missing ranges at or below
        ``keep``, what its plan keeps) from a replica recovering beside it, whose records
        there agree (the committed prefix, or the same session's). Until it is whole the
        replica is not in the vote: it does not vote beyond a hole. Returns its log end
        (lower when a missing range above the decided closing mark was truncated away)."""
        if REPAIR not in connection.capabilities:
            return max_id  # a connection that cannot report damage has none to report
        waiting = False
        while True:
            self._check()
            missing = await connection.missing_range()
            if missing is None or missing[0] > keep:
                return max_id
            first, last = missing[0], min(missing[1], keep)
            resolved = self._resolved
            if resolved is not None and first > resolved:
                # in the last session's dirty tail: truncated away whatever it held
                await connection.truncate(resolved)
                return min(max_id, resolved)
            if resolved is not None:
                last = min(last, resolved)  # above it, the dirty tail is truncated next
            usher = max(
                (s for s in self._states.values() if s.node != node and s.mark >= last),
                key=lambda s: s.mark,
                default=None,
            )
            if usher is None:
                if not waiting:
                    log.info(
                        "partition %d session %d: replica %s lacks %d..%d (damaged storage); "
                        "waiting for a replica holding them",
                        self.partition_id,
                        self.session_id,
                        node,
                        first,
                        last,
                    )
                    waiting = True
                await self._wait_change()
                continue
            log.warning(
                "partition %d session %d: repairing replica %s: transactions %d..%d, lost "
                "to damage, copied from %s",
                self.partition_id,
                self.session_id,
                node,
                first,
                last,
                usher.node,
            )
            next_id = first
            while next_id <= last:
                records = await self._read_usher(
                    usher, next_id, min(self._catch_up_batch, last - next_id + 1)
                )
                self._check()
                if isinstance(records, _Archived):
                    if PREFIX not in connection.capabilities:
                        break
                    await connection.prune(records.through)  # the hole was archived: dropped
                    break
                if not records:
                    break  # the usher failed or was truncated meanwhile: choose again
                if records[0].transaction_id != next_id:
                    raise StorageError(
                        f"replica {usher.node} returned records from "
                        f"{records[0].transaction_id}, asked from {next_id}"
                    )
                records = [r for r in records if r.transaction_id <= last]
                await connection.repair(records)
                point("replica.repaired", partition=self.partition_id, replica=node)
                next_id += len(records)

    def forget(self, node: str, connection: ReplicaConnection) -> None:
        """The replica on ``node`` failed during its recovery through ``connection``:
        it no longer counts (as a voter or as a source to catch others up) until it
        recovers again. What it already contributed to a decided closing mark stays:
        its log was real when it voted."""
        state = self._states.get(node)
        if state is not None and state.connection is connection:
            del self._states[node]
            self._recovered.discard(node)
            self._notify()

    def rejoined(self, node: str, connection: ReplicaConnection, mark: int) -> None:
        """The replica on ``node``, which recovered, left after the closing mark was
        decided (:meth:`forget` dropped it) and rejoined the session's writers through
        ``connection`` holding up to ``mark``: it is a source again for the replicas
        still recovering. (Else, once every replica that recovered has left and
        rejoined, one that was offline or hung at recovery and is behind the closing
        mark finds nobody to catch up from: it waits forever while it counts as
        connected, and the session's writers alone may not be a quorum.) It does not
        vote: the mark is decided, and it was counted when it recovered."""
        if self._resolved is None:
            return  # (a rejoin comes after the session opened: never)
        self._states[node] = _Recovering(node, connection, mark, voting=False, new=False)
        self._notify()

    def _usher_for(self, me: _Recovering) -> _Recovering | None:
        best: _Recovering | None = None
        for other in self._states.values():
            if (
                other is not me
                and other.mark > me.mark
                and (best is None or other.mark > best.mark)
            ):
                best = other
        return best

    def _evaluate(self) -> None:
        if self._resolved is not None:
            return
        # a suspect replica may have held anything: it counts as offline
        known = [s for s in self._states.values() if not s.new and not s.suspect]
        voters = [s.mark for s in known if s.voting]
        if not voters:
            return  # only replicas that are behind: wait for a voter
        offline = len(self._last_replicas) - len(known)
        resolution = resolve_high_water_mark(
            [s.mark for s in known], offline, self._last_quorum, floor=min(voters)
        )
        self.outcome = resolution.outcome
        if resolution.decided:
            # (Not raised to the highest voter's log end: a record only one replica holds
            # would then be committed on a single copy, and if that copy is lost before
            # the others caught up, every replica is left behind the recorded mark and the
            # partition never recovers: simulation storage seed 1027.)
            self._resolved = resolution.high_water_mark
            self.at_risk = None
            point("recovery.decided", partition=self.partition_id, mark=self._resolved)
            log.info(
                "partition %d session %d: closing high-water mark of the last session is %s",
                self.partition_id,
                self.session_id,
                self._resolved,
            )
        else:
            at_risk = None
            if resolution.outcome is Outcome.UNDECIDABLE:
                absent = sorted(set(self._last_replicas) - {s.node for s in known})
                at_risk = (
                    f"transactions after {max(voters)} may be committed and held only by "
                    f"{', '.join(absent)} (offline, or storage that lost what it "
                    "acknowledged): the partition waits for them"
                )
                if at_risk != self.at_risk:
                    log.warning(
                        "partition %d session %d: %s", self.partition_id, self.session_id, at_risk
                    )
            self.at_risk = at_risk
            log.debug(
                "partition %d session %d: closing high-water mark %s (%d offline)",
                self.partition_id,
                self.session_id,
                resolution.outcome.value,
                offline,
            )

    async def _write_replica_states(self) -> None:
        async with self._write_lock:
            self._check()
            resolved = self._resolved
            assert resolved is not None
            states: dict[str, ReplicaState] = {}
            for node in self._replica_nodes:
                replica_id = ReplicaId(self.partition_id, node)
                previous = self._last_replicas.get(node)
                if node in self._clean:
                    states[node] = ReplicaState(replica_id, self.session_id, UNRESOLVED)
                elif previous is None:
                    states[node] = ReplicaState(replica_id, -1, resolved)
                elif (
                    previous.session_id < self.session_id
                    and previous.closing_high_water_mark == UNRESOLVED
                ):
                    # it may hold the last session's dirty tail: valid up to the closing mark
                    states[node] = ReplicaState(replica_id, previous.session_id, resolved)
                else:
                    states[node] = previous
            try:
                self._metadata = await update_replica_states(
                    self._coordination, self._metadata, states
                )
            except Exception as exc:
                self.abort(exc)
                raise
            self._metadata_written.set()
            self._notify()
