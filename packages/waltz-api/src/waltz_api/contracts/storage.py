"""The StorageEngine contract: durable, per-partition transaction logs on one node."""

from __future__ import annotations

import asyncio
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from waltz_api.errors import StorageAppendError, StorageError
from waltz_api.features import MAX_FEATURE_LEVEL, MIN_FEATURE_LEVEL
from waltz_api.types import Record, RecordHeader, SessionInfo
from waltz_api.wire import RecordBlock


@dataclass(frozen=True, slots=True)
class LogExtent:
    """A piece of a partition's local log as the engine keeps it (a segment file).

    ``first..last`` (inclusive) are the transaction ids it holds, ``size`` its bytes on
    disk (-1: unknown) and ``created_ms`` when it was started (ms since the epoch, -1:
    unknown). Every extent but the last is *sealed*: nothing is appended to it again,
    and its age is the next one's ``created_ms``."""

    first: int
    last: int
    size: int = -1
    created_ms: int = -1


@dataclass(frozen=True)
class LocalLog:
    """A replica's local log (the storage node's ``local_log`` admin answer):
    ``log_start .. max_transaction_id`` held, in ``extents`` (segments, ascending; the
    last one is not sealed)."""

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


@dataclass(frozen=True, slots=True)
class ScrubProgress:
    """What one :meth:`StoragePartition.scrub` call did."""

    next_start: int | None
    """The id the next call continues from; None: this pass reached the end of the sealed
    records (start the next pass at 0)."""
    records: int = 0
    """Records read back and verified by this call."""
    bytes_read: int = 0
    """Stored bytes of records read by this call (what a rate bound counts)."""
    damaged: tuple[tuple[int, int], ...] = ()
    """Ranges ``(first, last)`` (inclusive, ascending) this call found damaged: they are
    missing ranges now."""


class StoragePartition(ABC):
    """One partition's log in a storage engine.

    The log is a dense sequence of records with transaction ids
    ``0 .. max_transaction_id()`` (``-1`` when empty). Records may be
    truncated away from the end and re-appended (by recovery), never changed
    in the middle. An engine with the ``prefix`` capability may also delete a
    prefix of records that were archived elsewhere (:meth:`drop_prefix`): it then
    holds ``log_start() .. max_transaction_id()`` locally.

    Durability: when ``append``, ``truncate``, ``repair`` or ``set_session_info``
    returns, the change is on stable storage (for a disk engine: fdatasync'd)
    and survives a crash at any later byte. A crash during the call leaves
    either the old or the new state of each record.

    Start-up recovery never deletes what it cannot prove to be a torn tail of
    the last write that was not yet flushed (such a tail was never
    acknowledged). Anything else it cannot read back is moved aside (a disk
    engine quarantines the files) and reported: records lost below intact ones
    as :meth:`missing_ranges` (repaired from a peer with :meth:`repair`), a
    lost tail by ``session_info().low_water_mark_session_id ==
    LOST_SESSION`` (see :class:`~waltz_api.types.SessionInfo`). A record is
    never served changed: it reads back byte-identical or raises
    :class:`~waltz_api.errors.CorruptionError` naming it.

    Concurrency: calls for one partition are issued one at a time (the storage node
    serialises them: the next once the one before returned, or for
    :meth:`start_append` once its future is resolved); an engine may still batch
    concurrent appends of different partitions into one flush (group commit).
    """

    partition_id: int

    starts_appends: ClassVar[bool] = False
    """Whether the engine implements :meth:`start_append` (the storage node then runs an
    append to completion in callbacks, no task waiting for it)."""

    @abstractmethod
    def max_transaction_id(self) -> int:
        """The highest transaction id stored (committed or not); -1 when empty."""

    @abstractmethod
    def session_info(self) -> SessionInfo:
        """The last store session info, as last made durable by ``set_session_info``."""

    @abstractmethod
    async def set_session_info(self, info: SessionInfo) -> None:
        """Make ``info`` the partition's session info, durably (crash-safe: after a
        crash the old or the new value is read back, never a mix or nothing)."""

    @abstractmethod
    async def append(self, records: Sequence[Record]) -> None:
        """Append ``records`` durably; returns only once all are on stable storage.

        The ids must be dense and continue the log: the first is
        ``max_transaction_id() + 1``. Otherwise raises
        :class:`~waltz_api.errors.StorageAppendError` and stores nothing.
        Each record's checksum must be the CRC-32C of its data, else
        :class:`~waltz_api.errors.ChecksumError` and nothing is stored.
        """

    def start_append(self, records: Sequence[Record]) -> asyncio.Future[None]:
        """:meth:`append` handed over without waiting (engines whose ``starts_appends``
        is true; called on the event loop): what ``append`` refuses at once (ids that
        do not continue the log, a bad checksum, a closed partition) is raised here and
        nothing is stored; otherwise the returned future is resolved on the event loop
        once every record is on stable storage, or with the error ``append`` would
        raise. It must never block on the disk."""
        raise StorageError(
            f"{type(self).__name__} does not start appends without waiting "
            "(starts_appends is false): call append"
        )

    @abstractmethod
    async def truncate(self, transaction_id: int) -> None:
        """Remove every record with an id above ``transaction_id``, durably.

        Truncating at or above ``max_transaction_id()`` is a no-op; ``-1``
        empties the log."""

    def missing_ranges(self) -> list[tuple[int, int]]:
        """Ranges ``(first, last)`` (inclusive, ascending) of transaction ids at or below
        :meth:`max_transaction_id` that start-up recovery found lost to damage, with
        intact records after them: reading one raises CorruptionError naming it until
        :meth:`repair` fills it. A truncation below a range drops it. Empty for an intact
        log (this default: an engine that declares no ``repair`` capability)."""
        return []

    async def repair(self, records: Sequence[Record]) -> None:
        """Fill the lowest missing range with ``records`` copied from a healthy replica:
        dense, from the range's first id, not past its last (checked as ``append``
        checks); durable on return. Raises StorageAppendError (nothing stored) when they
        do not fit the lowest range, or when there is none (this default)."""
        raise StorageAppendError(
            f"partition {self.partition_id} has no missing range to repair; nothing was stored"
        )

    async def scrub(self, start: int, max_bytes: int) -> ScrubProgress:
        """Read back the sealed records from id ``start`` on and verify them as a read
        does (each record's checksums and id): background verification that finds damage
        before a read needs the record. Sealed records are those of every extent but the
        last (:meth:`local_extents`); ids below :meth:`log_start` or in a missing range
        are skipped. One call reads at most ``max_bytes`` stored bytes of records, except
        that it always reads one whole record when one is left; call again from
        ``next_start`` until it is None (a whole pass).

        Damage found becomes a missing range exactly as damage start-up recovery finds:
        the damaged bytes are moved aside (never deleted), every intact record stays
        readable and unchanged, the range is reported in ``damaged`` and by
        :meth:`missing_ranges`, reading one of its records raises
        :class:`~waltz_api.errors.CorruptionError` naming it, and :meth:`repair` fills it
        (the storage node then makes its server repair it from a peer). Nothing else
        changes: :meth:`max_transaction_id`, the session info and the log's start stay.
        Durable on return; a crash during the call leaves the damaged record in place (a
        later pass finds it again) or the range missing, never an intact record lost.

        This default (an engine that does not declare the ``scrub`` capability) raises
        StorageError: the engine leaves damage to its reads and start-up recovery."""
        raise StorageError(
            f"this storage engine cannot scrub partition {self.partition_id} (no 'scrub' "
            "capability): damage is found when a record is read, or at start-up"
        )

    def available(self) -> bool:
        """Whether the partition is available to servers, as an administrator last set it
        with :meth:`set_available` (``True`` until then); kept across a reopen."""
        return True

    async def set_available(self, available: bool) -> None:
        """Record the administrator's availability of the partition, durably. This default
        raises StorageError: the engine does not keep it (the storage node then keeps it
        until it restarts)."""
        raise StorageError(
            f"this storage engine does not keep partition {self.partition_id}'s availability"
        )

    def log_start(self) -> int:
        """The id of the first record held locally (``max_transaction_id() + 1`` when the
        log is empty): the records below it were deleted by :meth:`drop_prefix` (they are
        in the archive) and reading one raises
        :class:`~waltz_api.errors.RecordsArchivedError`. Kept across a reopen. 0 for an
        engine without the ``prefix`` capability (this default)."""
        return 0

    def local_extents(self) -> list[LogExtent]:
        """The pieces of the local log, ascending (what :meth:`drop_prefix` deletes whole).
        This default: the whole log as one extent of unknown size (none when empty)."""
        top = self.max_transaction_id()
        start = self.log_start()
        return [LogExtent(start, top)] if top >= start else []

    async def drop_prefix(self, through: int) -> int:
        """Delete local records with ids up to ``through`` (they were archived and the
        archive verified them: the caller's promise), durably; returns the new
        :meth:`log_start`.

        The engine deletes whole extents and may keep records at or below ``through``
        that share one with later records; it never deletes a record above
        ``through``. When ``through >= max_transaction_id()`` every local record is
        deleted and the log continues after it: ``max_transaction_id() == through`` and
        the next append starts at ``through + 1`` (a replica started from the archive
        mark). A crash during the call leaves the old or the new start, never a hole:
        start-up recovery finishes an interrupted deletion and never reports the
        deleted prefix as missing. :meth:`truncate` below the log start empties the
        local log, which then starts after the truncation point.

        This default raises StorageError: an engine without the ``prefix`` capability
        keeps every record."""
        raise StorageError(
            f"this storage engine cannot delete the start of partition {self.partition_id}'s "
            "log (no 'prefix' capability): it keeps every record"
        )

    @abstractmethod
    async def read_record(self, transaction_id: int) -> Record | None:
        """The record with that id, or ``None`` when there is none.

        Raises :class:`~waltz_api.errors.CorruptionError` when the stored
        record fails its checksum."""

    @abstractmethod
    async def read_header(self, transaction_id: int) -> RecordHeader | None:
        """The record header with that id, or ``None``."""

    @abstractmethod
    async def read_records(
        self, start: int, max_records: int, max_bytes: int = 16 * 1024 * 1024
    ) -> list[Record]:
        """Consecutive records from ``start``: at most ``max_records``, and no more
        data bytes than ``max_bytes`` (but always at least one record when
        ``start`` exists). Empty when ``start`` is beyond the log."""

    @abstractmethod
    async def read_headers(self, start: int, max_records: int) -> list[RecordHeader]:
        """Consecutive record headers from ``start``, at most ``max_records``."""

    async def read_block(
        self, start: int, max_records: int, max_bytes: int = 16 * 1024 * 1024
    ) -> RecordBlock:
        """:meth:`read_records` as one :class:`~waltz_api.wire.RecordBlock` (the records
        in their wire form): what a range read sends on. An engine overrides it to build
        the block straight from its stored bytes (each record's stored checksums
        verified, as ``read_records`` does); this default encodes ``read_records``."""
        return RecordBlock.of(await self.read_records(start, max_records, max_bytes))


class StorageEngine(ABC):
    """A storage directory (or its equivalent): the cluster key and many partitions.

    Opened with :meth:`open`. A new location needs ``cluster_key`` and
    ``num_partitions``; an existing one checks them when given and raises
    :class:`~waltz_api.errors.ClusterKeyMismatchError` on a mismatch.

    Feature levels (:mod:`waltz_api.features`): the storage writes the formats of its
    :attr:`feature_level` only, so that a storage node of the release that introduced an
    earlier level can still read it until the cluster's level is raised. It reads every
    format it ever wrote, at any level.
    """

    max_feature_level: int = MAX_FEATURE_LEVEL
    """The highest cluster feature level this engine can write at."""

    _feature_level: int = MIN_FEATURE_LEVEL

    @classmethod
    @abstractmethod
    async def open(
        cls,
        location: str,
        *,
        cluster_key: uuid.UUID | None = None,
        num_partitions: int | None = None,
        options: Mapping[str, Any] | None = None,
        feature_level: int | None = None,
    ) -> StorageEngine:
        """Open (or create) the storage at ``location`` and recover its partitions.

        ``options`` are engine-specific (the ``fs`` engine: ``segment_size``,
        ``index_checkpoint_interval``, ``read_threads``); an unknown option is
        a StorageError. A partition that fails recovery stays closed without
        failing the open; a damaged storage-wide header fails it (nothing is
        changed then).

        ``feature_level``: the level new storage is created at (None: the engine's
        :attr:`max_feature_level`; a storage node passes 1 and is told the cluster's
        level afterwards). An existing storage keeps the level it recorded: opening
        never raises it (nor lowers it)."""

    @property
    @abstractmethod
    def cluster_key(self) -> uuid.UUID:
        """The key of the cluster this storage belongs to."""

    @property
    @abstractmethod
    def num_partitions(self) -> int:
        """The cluster's number of partitions, recorded at creation."""

    def check_cluster_key(self, cluster_key: uuid.UUID, num_partitions: int) -> None:
        """Raise :class:`ClusterKeyMismatchError` unless both match this storage."""
        from waltz_api.errors import ClusterKeyMismatchError

        if cluster_key != self.cluster_key:
            raise ClusterKeyMismatchError(
                f"cluster key {cluster_key} does not match this storage's key "
                f"{self.cluster_key}: the server and the storage node belong to different "
                "clusters; check the server's coordination root and the storage directory"
            )
        if num_partitions != self.num_partitions:
            raise ClusterKeyMismatchError(
                f"number of partitions {num_partitions} does not match this storage's "
                f"{self.num_partitions}"
            )

    @property
    def feature_level(self) -> int:
        """The cluster feature level this storage writes at (kept across a reopen by an
        engine whose formats depend on it)."""
        return self._feature_level

    async def raise_feature_level(self, level: int) -> None:
        """Write the formats of ``level`` from now on (migrating what it holds where a
        format changed), durably; idempotent, and a lower level than :attr:`feature_level`
        changes nothing (a level is never lowered). Raises StorageError, changing
        nothing, for a level above :attr:`max_feature_level`. Records stay readable and
        unchanged, the session info and the log's start too; appends may continue
        meanwhile (they wait for it).

        This default keeps the level in memory only: an engine whose stored formats do
        not depend on the level (the memory engine)."""
        self._check_feature_level(level)
        self._feature_level = max(self._feature_level, level)

    def _check_feature_level(self, level: int) -> None:
        if isinstance(level, bool) or not isinstance(level, int) or level < MIN_FEATURE_LEVEL:
            raise StorageError(f"feature level must be an integer >= 1, got {level!r}")
        if level > self.max_feature_level:
            raise StorageError(
                f"this storage engine writes at feature level {self.max_feature_level} at "
                f"most, not {level}: upgrade the storage node before raising the cluster's level"
            )

    @abstractmethod
    def partition_ids(self) -> list[int]:
        """The partitions hosted here, ascending.

        This includes a hosted partition whose files could not be recovered:
        :meth:`partition` raises PartitionClosedError (with the reason) for it,
        and :meth:`remove_partition` followed by :meth:`add_partition` starts it
        afresh (empty, to be caught up from other replicas)."""

    @abstractmethod
    async def add_partition(self, partition_id: int) -> StoragePartition:
        """Host a new, empty partition (idempotent: an existing one is returned)."""

    @abstractmethod
    async def remove_partition(self, partition_id: int) -> None:
        """Stop hosting the partition and delete its data (idempotent)."""

    @abstractmethod
    def partition(self, partition_id: int) -> StoragePartition:
        """The hosted partition; raises PartitionNotFoundError, or
        PartitionClosedError when its files could not be recovered."""

    @abstractmethod
    async def close(self) -> None:
        """Release files and threads. Everything already returned is durable."""
