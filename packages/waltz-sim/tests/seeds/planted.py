"""Planted bugs: broken variants of real components, to prove the simulation finds them.

Each is a subclass or a wrapper of a real component, selected only here (test
code): a plugin registered under its own name, or a class swapped in for the
duration of one run with ``pytest.MonkeyPatch``. Production code has no switch.

- ``early-ack``: a storage engine that acknowledges an append before its
  fdatasync completed (the sync comes later): a power loss loses acknowledged
  records;
- ``forget-append``: a lock table that does not record APPEND locks: a WRITE or
  READ lock built before a concurrent APPEND passes;
- ``skip-generation``: a server that skips the generation check of appends and
  mounts: a request of another generation is taken as one of the partition's own
  (stamped with its generation) instead of refused;
- ``skip-fencing``: a storage node that records newer store sessions but does not
  refuse older ones: a deposed server's writes land after its successor's recovery;
- ``double-apply``: a client that, after every mount, applies its last applied
  transaction again (an off-by-one in its feed position);
- ``over-strict``: a lock check with ``>=`` for ``>``: a client that has applied the
  last change of its locks still fails (and retries until its op expires); nothing
  unsafe, but commits fall to a third;
- ``reads-recorded``: the ``exact`` lock table recording READ locks as changes too: an
  attempt fails on a transaction that only read what it locks (nothing unsafe, the
  conflicts have no reason);
- ``half-quorum``: a quorum of ``n // 2`` (1 of 3) for commits and recoveries: a
  transaction is acknowledged when one replica holds it;
- ``acked-in-flight``: a server that counts appends in flight to a replica as
  acknowledged by it: a transaction commits before a quorum stored it;
- ``mark-before-apply``: a client database that records a transaction's id as its
  high-water mark before it applies the transaction (across an await): an op built in
  between claims a mark whose changes it has not seen, and a crash in between leaves a
  mark without its changes;
- ``fs-truncate``: the real fs engine (``--storage-engine fs``) with an off-by-one in
  segment truncation: the data file is cut at the end of the first record to remove
  instead of its start (the index is cut right), so the removed record's bytes stay
  between the last kept record and the next one appended; reads of the record before
  them fail, and the start-up recovery after a restart takes the stale record back as
  the next id and cuts the records appended after it as damage;
- ``fs-unsynced-data``: the real fs engine acknowledging appends before their data is
  durable: the committer's write step registers the segment's index file for the
  round's flush (at feature level 3: the checkpoint's) instead of its data file (the
  data is flushed only when a segment rolls over), so a power loss loses acknowledged
  records;
- ``suspect-as-clean``: a storage node that records a replica marked suspect (its storage
  lost records it had acknowledged, and it rejoined its store session) as clean: the
  rejoin clears LOST_SESSION, as before issue 27's fix (found by the ``storage`` profile);
- the three halves of the replaced-replica fix undone, one at a time (runs with a replica
  replaced: ``membership = "replace"``); each can leave a partition whose recovery waits
  for ever, found by the liveness checks (and the seed passes without the plant):
  ``clean-at-plan``: recovery records a new (non-voting) replica clean as soon as its
  plan is made, before its storage holds the session's marks;
  ``never-clean-suspect``: a replica the metadata never recorded clean is taken for a
  suspect when its storage reads LOST_SESSION (a pristine partition's fence);
  ``recovering-kept``: a replica assignment change does not give up a store session still
  recovering (its recovery over the old set may wait for a removed replica);
- ``archive-prunes-ahead``: the archiver asks the replicas to delete a dozen records more
  than it archived (runs with the archive on the fs engine, which deletes whole
  segments): committed records are then nowhere, neither on a replica nor in the archive;
- ``acl-open``: a server whose access gate refuses nothing: a client the ACL lets only
  read a partition commits there (runs with the ACL on);
- ``acl-every-partition``: the ACL's permission ignoring a key's grants on one partition
  (only its grant on every partition counts): a client allowed to write partition 0 is
  refused there.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest

from waltz_api.access import EVERY_PARTITION, AccessControl, Permission
from waltz_api.contracts.storage import StoragePartition
from waltz_api.hookspecs import PluginDescriptor, PluginKind, hookimpl
from waltz_api.plugins import get_registry, reset_registry
from waltz_api.types import (
    LOST_SESSION,
    NO_SESSION,
    NO_TRANSACTION,
    LockRequest,
    Record,
    SessionInfo,
)
from waltz_client import Transaction
from waltz_client import partition as client_partition
from waltz_client.state import FeedTracker
from waltz_server.locktables.exact import ExactLockTable
from waltz_server.locktables.hwm_array import HwmArrayLockTable
from waltz_server.server import partition as server_partition
from waltz_server.server import recovery as recovery_module
from waltz_server.server import replication as replication_module
from waltz_server.server import server as server_module
from waltz_server.server import store_session as store_session_module
from waltz_server.server import voting as voting_module
from waltz_server.server.access import AccessGate
from waltz_server.server.archiving import StoreArchiveSource
from waltz_server.server.recovery import RecoveryManager
from waltz_server.server.replication import Committed, Replication
from waltz_server.server.store import StorePartition
from waltz_server.server.store_session import StoreSession
from waltz_sim import workloads
from waltz_sim.checker import FeedEvent
from waltz_sim.disk import SimStorageEngine, SimStoragePartition
from waltz_sim.loop import WORLD_CONTEXT
from waltz_sim.world import SimConfig
from waltz_storage_fs import format as fmt
from waltz_storage_fs.committer import DATA, INDEX, Job
from waltz_storage_fs.engine import FsStoragePartition
from waltz_storage_fs.recovery import delete_segment_files, missing_ranges, write_log_start
from waltz_storage_node import node as node_module
from waltz_storage_node import partition as node_partition
from waltz_storage_node.partition import PartitionWorker

# -- early-ack: an engine that acknowledges before fdatasync -------------------------------------


class EarlyAckPartition(SimStoragePartition):
    async def append(self, records: Sequence[Record]) -> None:
        self._validate(records)
        if not records:
            return
        image = await self._write()
        image.written.extend(records)
        image.visible = len(image.written)
        # acknowledged now; the fdatasync happens a while later (the bug)
        disk = self.disk
        loop = asyncio.get_running_loop()
        loop.call_at(loop.time() + 0.5, _late_sync, disk, self.partition_id, context=WORLD_CONTEXT)


def _late_sync(disk: Any, partition_id: int) -> None:
    image = disk.partitions.get(partition_id)
    if image is not None and disk.engine is not None:
        image.sync()


class EarlyAckEngine(SimStorageEngine):
    partition_class = EarlyAckPartition


# -- forget-append: a lock table that ignores APPEND locks ----------------------------------------


class ForgetfulLockTable(HwmArrayLockTable):
    def record(self, request: LockRequest, transaction_id: int) -> None:
        super().record(replace(request, append=()), transaction_id)


# -- over-strict: a lock check with >= for > ------------------------------------------------------


class OverStrictLockTable(HwmArrayLockTable):
    def check(self, request: LockRequest, client_high_water_mark: int) -> int | None:
        if not (request.read or request.write):
            return None
        estimate = self.estimate(request)
        return estimate if estimate >= client_high_water_mark else None  # the bug: >=


# -- reads-recorded: an exact lock table that records READ locks as changes ------------------------


_exact_record = ExactLockTable.record


def _record_reads_too(self: ExactLockTable, request: LockRequest, transaction_id: int) -> None:
    _exact_record(self, replace(request, write=(*request.write, *request.read)), transaction_id)


# -- half-quorum: a quorum of n // 2 ---------------------------------------------------------------


def half_quorum(num_replicas: int) -> int:
    return max(1, num_replicas // 2)  # the bug: a majority is n // 2 + 1


# -- acked-in-flight: appends in flight counted as acknowledged ------------------------------------


class InFlightAckedReplication(Replication):
    def _advance(self) -> Committed | None:
        acked = {node: p.acked for node, p in self._progress.items()}
        for p in self._progress.values():
            p.acked = max(p.acked, p.sent)  # the bug: what was sent counts as stored
        try:
            return super()._advance()
        finally:
            for node, p in self._progress.items():
                p.acked = acked[node]


# -- mark-before-apply: a client database that moves its mark before applying --------------------


class MarkFirstCallbacks(workloads._Callbacks):
    async def apply_transaction(self, transaction: Transaction) -> None:
        partition = transaction.partition_id
        self.db.high_water_marks[partition] = transaction.transaction_id  # the bug: first
        data = await transaction.fetch_data()
        txn = self.workload.semantics.decode(data)
        if txn is not None:
            self.workload.semantics.apply(self.db.states[partition], txn)
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


# -- skip-generation: a server without its generation check ---------------------------------------


class NoGenerationCheckPartition(server_partition.Partition):
    """Takes an append or a mount of another generation as one of its own (it stamps its
    generation on the request instead of refusing it)."""

    async def _append(self, message: Any, stream: Any) -> None:
        if message.req_id.generation != self.generation:
            req_id = replace(message.req_id, generation=self.generation)
            message = replace(message, req_id=req_id)
        await super()._append(message, stream)

    def _mount(self, message: Any, stream: Any) -> None:
        if message.req_id.generation != self.generation:
            message = replace(message, req_id=replace(message.req_id, generation=self.generation))
        super()._mount(message, stream)


# -- skip-fencing: a storage node that records newer sessions but accepts older ones --------------


class UnfencedPartitionWorker(PartitionWorker):
    async def _fence(self, partition: StoragePartition, session_id: int) -> None:
        info = partition.session_info()
        if session_id <= info.session_id:
            return  # the bug: an older session is not refused
        await super()._fence(partition, session_id)


# -- suspect-as-clean: a storage node that records a suspect replica as clean ----------------------


_real_marked = node_partition._marked


def _marked_clean(partition: StoragePartition, request: Any) -> SessionInfo:
    """A suspect mark (clean=False) recorded as the session's clean marks: the replica
    that lost what it acknowledged reads as a voter at once."""
    info = _real_marked(partition, request)
    if request.clean:
        return info
    return replace(info, low_water_mark_session_id=request.session_id)


# -- the replaced-replica fix undone (clean-at-plan, never-clean-suspect, recovering-kept) ---------


class CleanAtPlanRecovery(RecoveryManager):
    """Records a replica that does not vote (a new one, one behind) clean as soon as its
    plan is made: the replica states written next say it holds the session's marks
    before its SetLowWaterMark (the recovery before the fix)."""

    def _evaluate(self) -> None:
        for state in self._states.values():
            if not state.voting:
                self._clean.add(state.node)
        super()._evaluate()


def _older_even_never_clean(
    state_session_id: int, storage_session_id: int, storage_low_water_mark_session_id: int
) -> bool:
    """voting.storage_older_than_metadata before the fix: a replica never recorded clean
    (state session -1) whose storage reads LOST_SESSION is older than the metadata."""
    if storage_low_water_mark_session_id == LOST_SESSION:
        return True
    if storage_low_water_mark_session_id == NO_SESSION:
        return storage_session_id < state_session_id
    return storage_low_water_mark_session_id < state_session_id


async def _open_whatever_changes(self: StorePartition, session: StoreSession) -> int:
    """StorePartition._open before the fix: the session opens (its recovery completes)
    whatever the replica assignment does meanwhile."""
    return await session.open()


# -- double-apply: a client re-applying its last transaction after each mount --------------------


class OffByOneFeedTracker(FeedTracker):
    def start_mount(self, application_high_water_mark: int) -> int:
        position = super().start_mount(application_high_water_mark)
        if position > NO_TRANSACTION:
            self._position = self._floor = position - 1  # re-deliver (and apply) the last one
        return self._position if self._position is not None else NO_TRANSACTION


# -- fs-truncate: the fs engine's segment truncation, one record off ------------------------------


def _truncate_files_one_record_late(self: FsStoragePartition, transaction_id: int) -> None:
    """FsStoragePartition._truncate_files with the data file cut one record too late."""
    files = self._files
    if any(a <= transaction_id for a, _ in missing_ranges(self._segments, self._start)):
        self._mark_lost()
    removed = False
    while self._segments and self._segments[-1].first > transaction_id:
        delete_segment_files(files, self._segments.pop())
        removed = True
    if removed:
        files.fsync_dir(self.directory)
    if transaction_id + 1 < self._start:
        write_log_start(files, self.directory, transaction_id + 1)
        self._start = transaction_id + 1
    if self._segments:
        seg = self._segments[-1]
        keep = transaction_id - seg.first + 1
        if keep < seg.count:
            cut = keep + 1  # the bug: the entry after the first record to remove (keep)
            if cut < seg.count:
                raw = files.pread(
                    seg.index_fd, fmt.INDEX_ENTRY_SIZE, fmt.HEADER_SIZE + cut * fmt.INDEX_ENTRY_SIZE
                )
                (end,) = fmt.INDEX_ENTRY.unpack(raw)
            else:
                end = seg.size
            files.ftruncate(seg.data_fd, end)
            files.fdatasync(seg.data_fd)
            files.ftruncate(seg.index_fd, fmt.HEADER_SIZE + keep * fmt.INDEX_ENTRY_SIZE)
            files.fsync(seg.index_fd)
            seg.count = keep
            seg.size = end
    self.publish()


# -- fs-unsynced-data: the fs engine flushing the index instead of the data -----------------------

_write_batch = FsStoragePartition.write_batch


def _write_batch_flushing_the_index(
    self: FsStoragePartition, job: Job, flushes: set[tuple[int, int]]
) -> None:
    _write_batch(self, job, flushes)
    seg = self._segments[-1]
    if (DATA, seg.data_fd) in flushes:  # the bug: the index's fd where the data's belongs
        flushes.discard((DATA, seg.data_fd))
        flushes.add((INDEX, seg.index_fd))
    # with a node journal (feature level 3) the same bug in the checkpoint's flush: the
    # journal is freed while the data it covered is not durable
    self._dirty.discard((DATA, seg.data_fd))


# -- selecting them ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Planted:
    name: str
    detected_by: frozenset[str]
    """The violations that mean "found" (safety invariants only: a liveness problem of
    the code under test is not this bug)."""
    config: Mapping[str, Any]
    profile: str = "standard"
    also: frozenset[str] = frozenset()
    """Violations the seed that finds it must show too (another check that sees it)."""
    control: bool = False
    """Found by liveness invariants: the seed that finds it must pass without the plant
    (the violations are the plant's, not a liveness problem of the code under test)."""


class _Plugins:
    @hookimpl
    def waltz_storage_engines(self) -> list[PluginDescriptor]:
        return [PluginDescriptor(PluginKind.STORAGE, "planted-early-ack", EarlyAckEngine)]

    @hookimpl
    def waltz_lock_tables(self) -> list[PluginDescriptor]:
        return [
            PluginDescriptor(PluginKind.LOCK_TABLE, "planted-forget-append", ForgetfulLockTable),
            PluginDescriptor(PluginKind.LOCK_TABLE, "planted-over-strict", OverStrictLockTable),
        ]


_LOSS = frozenset(
    {"acknowledged-lost", "committed-lost", "replica-fork", "under-replicated", "feed-content"}
)
_REAL = (
    (store_session_module, "RecoveryManager", RecoveryManager),
    (voting_module, "storage_older_than_metadata", voting_module.storage_older_than_metadata),
    (StorePartition, "_open", StorePartition._open),
)
"""What the control runs of the liveness-found plants put back (see ``unplanted``)."""
_STUCK = frozenset(
    {"undecided", "no-commit-after-heal", "no-high-water-mark", "replica-behind", "client-behind"}
)
"""A partition whose recovery waits for ever after a replica set change."""
# -- the archive and the ACL ---------------------------------------------------------------------


async def _prune_ahead(self: StoreArchiveSource, through: int) -> None:
    await self.store.prune(through + 12)  # the bug: a dozen records not archived deleted too


def _refuse_nothing(self: AccessGate, *args: object, **kwargs: object) -> str | None:
    return None  # the bug: the gate lets every request through


def _permission_everywhere_only(
    self: AccessControl, identity: str | None, partition_id: int
) -> Permission | None:
    grants = self.keys.get(identity) if identity is not None else None
    return None if grants is None else grants.partitions.get(EVERY_PARTITION)  # the bug


PLANTED: dict[str, Planted] = {
    p.name: p
    for p in (
        Planted(
            "early-ack",
            _LOSS | {"client-ahead", "client-state"},
            {"storage_engine": "planted-early-ack"},
        ),
        Planted(
            "forget-append",
            frozenset({"lock-safety", "workload"}),
            {"lock_table": "planted-forget-append"},
        ),
        Planted(
            "skip-generation",
            _LOSS | {"duplicate", "lock-safety", "workload", "false-failure", "dense-ids"},
            {},
        ),
        Planted(
            "skip-fencing",
            _LOSS
            | {
                "duplicate",
                "lock-safety",
                "workload",
                "false-failure",
                "dense-ids",
                "client-state",
            },
            {},
            # a deposed owner's write landing after its successor's recovery: the points
            # profile strikes at recovery's steps (seed 13; the standard profile took 160)
            profile="points",
        ),
        Planted("double-apply", frozenset({"feed-order", "client-state"}), {}),
        Planted(
            "over-strict",
            frozenset({"lock-precision", "throughput", "undecided"}),
            # its ops retry at once, thousands of times each: a shorter run costs less
            {"lock_table": "planted-over-strict", "duration": 25.0},
            also=frozenset({"throughput"}),  # the floor sees it without the lock failures
        ),
        Planted(
            "reads-recorded",
            frozenset({"lock-precision"}),
            {"lock_table": "exact"},  # the exact table, its record method broken
        ),
        Planted(
            "half-quorum",
            _LOSS | {"client-ahead", "client-state", "duplicate"},
            {},
            profile="disk",
        ),
        Planted("acked-in-flight", _LOSS | {"client-ahead", "client-state", "duplicate"}, {}),
        Planted("mark-before-apply", frozenset({"client-state", "workload", "lock-safety"}), {}),
        Planted(
            "fs-truncate",
            _LOSS | {"dense-ids", "duplicate", "client-ahead", "client-state"},
            {"storage_engine": "fs"},
            profile="chaos",
        ),
        Planted(
            "fs-unsynced-data",
            _LOSS | {"client-ahead", "client-state"},
            {"storage_engine": "fs"},
        ),
        Planted("suspect-as-clean", _LOSS | {"client-ahead", "duplicate"}, {}, profile="storage"),
        *(
            Planted(name, _STUCK, {"membership": "replace"}, profile=profile, control=True)
            for name, profile in (
                ("clean-at-plan", "standard"),
                ("never-clean-suspect", "standard"),
                ("recovering-kept", "standard"),
            )
        ),
        Planted(
            "archive-prunes-ahead",
            _LOSS | {"dense-ids", "replica-behind"},
            {"storage_engine": "fs", "archive": "on"},
        ),
        Planted("acl-open", frozenset({"acl-refused-committed"}), {"acl": "on"}),
        Planted("acl-every-partition", frozenset({"acl-wrongly-refused"}), {"acl": "on"}),
    )
}


@contextlib.contextmanager
def planted(name: str) -> Iterator[Planted]:
    """Plant bug ``name`` for the duration of the block."""
    bug = PLANTED[name]
    patch = pytest.MonkeyPatch()
    registry = get_registry()
    registry.register(_Plugins(), name="waltz_sim_planted")
    try:
        if name == "skip-generation":
            patch.setattr(server_module, "Partition", NoGenerationCheckPartition)

        elif name == "skip-fencing":
            patch.setattr(node_module, "PartitionWorker", UnfencedPartitionWorker)
        elif name == "double-apply":
            patch.setattr(client_partition, "FeedTracker", OffByOneFeedTracker)
        elif name == "reads-recorded":
            patch.setattr(ExactLockTable, "record", _record_reads_too)
        elif name == "half-quorum":
            for module in (replication_module, store_session_module, recovery_module):
                patch.setattr(module, "quorum_of", half_quorum)
        elif name == "acked-in-flight":
            patch.setattr(store_session_module, "Replication", InFlightAckedReplication)
        elif name == "mark-before-apply":
            patch.setattr(workloads, "_Callbacks", MarkFirstCallbacks)
        elif name == "fs-unsynced-data":
            patch.setattr(FsStoragePartition, "write_batch", _write_batch_flushing_the_index)
        elif name == "fs-truncate":
            patch.setattr(FsStoragePartition, "_truncate_files", _truncate_files_one_record_late)
        elif name == "suspect-as-clean":
            patch.setattr(node_partition, "_marked", _marked_clean)
        elif name == "clean-at-plan":
            patch.setattr(store_session_module, "RecoveryManager", CleanAtPlanRecovery)
        elif name == "never-clean-suspect":
            patch.setattr(voting_module, "storage_older_than_metadata", _older_even_never_clean)
        elif name == "recovering-kept":
            patch.setattr(StorePartition, "_open", _open_whatever_changes)
        elif name == "archive-prunes-ahead":
            patch.setattr(StoreArchiveSource, "prune", _prune_ahead)
        elif name == "acl-open":
            patch.setattr(AccessGate, "refusal", _refuse_nothing)
        elif name == "acl-every-partition":
            patch.setattr(AccessControl, "permission", _permission_everywhere_only)
        yield bug
    finally:
        patch.undo()
        reset_registry()


@contextlib.contextmanager
def unplanted() -> Iterator[None]:
    """Inside a ``planted`` block: the real components again, for the block."""
    patch = pytest.MonkeyPatch()
    try:
        for module, name, real in _REAL:
            patch.setattr(module, name, real)
        yield
    finally:
        patch.undo()


def config_for(bug: Planted, seed: int, **changes: Any) -> SimConfig:
    return SimConfig(**{"seed": seed, "faults": bug.profile, **bug.config, **changes})
