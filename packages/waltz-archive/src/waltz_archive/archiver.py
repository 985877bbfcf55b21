"""The archiver of one partition: committed records to Parquet, verified, then the mark.

Run by the partition's owner while its store session is open (docs/archive.md, "Who
archives"). A round: read the archive mark ``A`` (cluster metadata) and the committed
high-water mark; decide with :func:`plan_range` how far retention wants to go; adopt
an orphan object a crash left for ``A + 1`` (one of this cluster's incarnation, or of
no stated identity, that reads back whole and holds exactly the replicas' committed
records of its ids; any other is set aside, never adopted) or write a new one from the
records read from the replicas; read it back (count, first and last id, every data
checksum, the digest of what was read); write a new manifest; advance the mark by
compare-and-set; ask the replicas to delete up to it.

Nothing here blocks appends: the archiver only reads committed records, every call to
the archive location runs in a thread under a deadline, and a failed round leaves the
mark, so no replica deletes anything. The source of records, the replicas' local logs
and their pruning are the server's (:class:`ArchiveSource`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from waltz_api.backoff import Backoff
from waltz_api.cluster import ArchiveMark, ClusterMetadata, Stored
from waltz_api.contracts.coordination import Coordination
from waltz_api.contracts.storage import LogExtent
from waltz_api.errors import ArchiveError, BadVersionError, WaltzError
from waltz_api.faultpoints import point
from waltz_api.types import Record
from waltz_api.wire import RecordBlock
from waltz_archive import layout
from waltz_archive.manifest import ArchivedRange, Manifest
from waltz_archive.objects import (
    ArchiveIdentity,
    RangeWriter,
    WriteOptions,
    describe,
    range_from_footer,
    verify_object,
)
from waltz_archive.records import Fingerprint, block_to_batch, check_rows
from waltz_archive.store import ArchiveStore

log = logging.getLogger(__name__)

T = TypeVar("T")

MiB = 1024 * 1024


@dataclass(frozen=True)
class ArchivePolicy:
    """What to archive and when (``[server.archive]``, docs/operators.md)."""

    min_range_bytes: int = 64 * MiB
    """A range is written once this much is ready (unless retention needs less)."""
    max_range_bytes: int = 256 * MiB
    """A range holds at most this much data (analytics-sized Parquet files)."""
    max_local_bytes: int = 1024 * MiB
    """Retention by size: sealed segments beyond the newest this many bytes of a
    replica's local log are archived (0: off)."""
    max_local_age: float = 7 * 24 * 3600.0
    """Retention by age: sealed segments sealed longer ago than this (seconds) are
    archived (0: off)."""
    keep_local_transactions: int = 0
    """Retention by id: what is more than this many transactions below the high-water
    mark is archived (0: off)."""
    read_batch_bytes: int = 4 * MiB
    """Bytes per read of records from the replicas."""
    interval: float = 10.0
    """Seconds between two rounds that found nothing to do."""
    timeout: float = 120.0
    """Deadline of one call to the archive location (a write, a read-back, a listing)."""
    write: WriteOptions = field(default_factory=WriteOptions)


class LocalLogView(Protocol):
    """A replica's local log (``waltz_server.server.replica.LocalLog``)."""

    @property
    def log_start(self) -> int: ...

    @property
    def max_transaction_id(self) -> int: ...

    @property
    def extents(self) -> tuple[LogExtent, ...]: ...


class ArchiveSource(Protocol):
    """What the archiver needs from the partition's owner."""

    def committed(self) -> int:
        """The partition's high-water mark (-1 before its first recovery)."""

    async def read(self, start: int, max_records: int, max_bytes: int) -> Sequence[Record]:
        """Committed records from ``start`` read from the replicas (never the archive):
        a RecordBlock when it can."""

    async def local_log(self) -> LocalLogView | None:
        """One writing replica's local log (None when none can tell)."""

    async def prune(self, through: int) -> None:
        """Ask the writing replicas to delete their records up to ``through`` (bounded by
        what each acknowledged)."""


AdvanceMark = Callable[[Stored[ArchiveMark], ArchiveMark], Awaitable[Stored[ArchiveMark]]]
"""``advance(current, new)``: the archive mark's compare-and-set (the server's
``ClusterAdmin.advance_archive_mark``): BadVersionError when ``current`` is stale."""


class ArchiveListener(Protocol):
    """Metrics (the server's): each callback is cheap and never raises."""

    def archived(self, archived: ArchivedRange, seconds: float, adopted: bool) -> None: ...

    def progress(self, mark: int, high_water_mark: int, local_bytes: int) -> None: ...

    def failed(self, error: BaseException) -> None: ...

    def rejected(self, name: str, reason: str) -> None:
        """An orphan object (``name``) was refused for adoption and set aside."""


def plan_range(
    policy: ArchivePolicy,
    mark: int,
    high_water_mark: int,
    local: LocalLogView | None,
    now_ms: int,
) -> int | None:
    """The last id of the next range to archive (from ``mark + 1``), or None for nothing
    yet. Pure.

    Eligible: sealed segments (all but the last) of the replica's local log that are
    older than ``max_local_age`` or beyond its newest ``max_local_bytes``, and anything
    ``keep_local_transactions`` below the high-water mark; never above the high-water
    mark. A range waits until it holds ``min_range_bytes`` (estimated from the
    segments' sizes) unless retention by age or size needs it now."""
    if high_water_mark <= mark:
        return None
    end = -1
    forced = False
    if policy.keep_local_transactions > 0:
        end = high_water_mark - policy.keep_local_transactions
    extents = list(local.extents) if local is not None else []
    sealed = extents[:-1]
    if sealed:
        newer_bytes = sum(max(e.size, 0) for e in extents)
        for i, extent in enumerate(sealed):
            sealed_at = extents[i + 1].created_ms
            old = (
                policy.max_local_age > 0
                and sealed_at >= 0
                and now_ms - sealed_at >= policy.max_local_age * 1000
            )
            big = policy.max_local_bytes > 0 and newer_bytes > policy.max_local_bytes
            newer_bytes -= max(extent.size, 0)
            if (old or big) and extent.last > mark:
                end = max(end, extent.last)
                forced = True
    end = min(end, high_water_mark)
    if end <= mark:
        return None
    if not forced:
        estimate = _estimate_bytes(extents, mark + 1, end)
        if estimate is not None and estimate < policy.min_range_bytes:
            return None
    return end


def _estimate_bytes(extents: list[LogExtent], first: int, last: int) -> int | None:
    """Bytes of ids ``first..last`` from the segments' sizes (None: unknown)."""
    total = 0.0
    for extent in extents:
        if extent.size < 0:
            return None
        low, high = max(first, extent.first), min(last, extent.last)
        if low <= high:
            total += extent.size * (high - low + 1) / (extent.last - extent.first + 1)
    if last > (extents[-1].last if extents else -1):
        return None  # beyond what the replica holds: unknown
    return int(total)


class PartitionArchiver:
    """Archives one partition for as long as :meth:`run` runs (the owner's task)."""

    def __init__(
        self,
        *,
        partition_id: int,
        coordination: Coordination,
        store: ArchiveStore,
        source: ArchiveSource,
        advance: AdvanceMark,
        policy: ArchivePolicy | None = None,
        listener: ArchiveListener | None = None,
        on_mark: Callable[[Manifest], None] | None = None,
        rng: random.Random | None = None,
        cluster_key: uuid.UUID | None = None,
    ) -> None:
        """``cluster_key``: the cluster's (read from the cluster metadata when None)."""
        self.partition_id = partition_id
        self.coordination = coordination
        self.store = store
        self.source = source
        self.advance = advance
        self.policy = policy or ArchivePolicy()
        self.listener = listener
        self.on_mark = on_mark
        self.rng = rng or random.Random()
        self.stored: Stored[ArchiveMark] = Stored(ArchiveMark(partition_id), -1)
        self.manifest = Manifest(partition_id)
        self.rounds = 0
        self.last_error: BaseException | None = None
        self.cluster_key = cluster_key
        self.rejected: dict[str, str] = {}
        """Orphans refused for adoption (name: why), never examined again."""

    # -- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """Rounds until cancelled; a failed round is retried with back-off (the mark
        stays, so nothing is deleted meanwhile)."""
        backoff = Backoff(min(1.0, self.policy.interval), max(self.policy.interval, 1.0), self.rng)
        while True:
            try:
                archived = await self.round()
            except asyncio.CancelledError:
                raise
            except (WaltzError, OSError, TimeoutError) as exc:
                self.last_error = exc
                if self.listener is not None:
                    self.listener.failed(exc)
                log.warning(
                    "partition %d: archiving failed, retrying (nothing is deleted "
                    "meanwhile): %s: %s",
                    self.partition_id,
                    type(exc).__name__,
                    exc,
                )
                await backoff.sleep()
                continue
            self.last_error = None
            backoff.reset()
            if archived is None:
                await asyncio.sleep(self.policy.interval)

    async def _blocking(self, what: str, fn: Callable[[], T]) -> T:
        """``fn`` off the loop (:meth:`ArchiveStore.call`), under the archive deadline."""
        try:
            return await self.store.call(fn, self.policy.timeout)
        except TimeoutError:
            raise ArchiveError(
                f"partition {self.partition_id}: {what} at {self.store.url} took longer than "
                f"{self.policy.timeout:g}s (archive unreachable or slow)"
            ) from None

    @property
    def mark(self) -> ArchiveMark:
        return self.stored.value

    async def identity(self) -> ArchiveIdentity:
        """Who this archiver writes as: the cluster key and the mark's incarnation."""
        if self.cluster_key is None:
            self.cluster_key = (await ClusterMetadata(self.coordination).config()).cluster_key
        return ArchiveIdentity(str(self.cluster_key), self.mark.incarnation)

    async def refresh(self) -> ArchiveMark:
        """The archive mark from the cluster metadata, and its manifest."""
        stored = await ClusterMetadata(self.coordination).archive_mark(self.partition_id)
        mark = stored.value
        if mark.mark >= 0 and (mark.manifest != self.mark.manifest or self.manifest.mark < 0):
            manifest = await self.load_manifest(mark)
            self.manifest = manifest
            if self.on_mark is not None:
                self.on_mark(manifest)
        elif mark.mark < 0:
            self.manifest = Manifest(self.partition_id)
        self.stored = stored
        return mark

    async def load_manifest(self, mark: ArchiveMark) -> Manifest:
        path = self.store.path(layout.partition_dir(self.partition_id), mark.manifest)
        raw = await self._blocking("reading the manifest", lambda: self.store.read_bytes(path))
        manifest = Manifest.decode(raw, self.store.where(path), self.partition_id)
        if manifest.mark != mark.mark:
            raise ArchiveError(
                f"partition {self.partition_id}: manifest {self.store.where(path)} ends at "
                f"{manifest.mark}, the archive mark says {mark.mark}"
            )
        return manifest

    async def round(self) -> ArchivedRange | None:
        """One round (see the module docstring); the range archived, or None."""
        self.rounds += 1
        mark = await self.refresh()
        current = self.stored
        high_water_mark = self.source.committed()
        local = await self.source.local_log()
        if self.listener is not None:
            local_bytes = -1
            if local is not None and all(e.size >= 0 for e in local.extents):
                local_bytes = sum(e.size for e in local.extents)
            self.listener.progress(mark.mark, high_water_mark, local_bytes)
        end = plan_range(self.policy, mark.mark, high_water_mark, local, int(time.time() * 1000))
        if end is None:
            await self._prune(mark.mark)
            return None
        clock = asyncio.get_running_loop()
        started = clock.time()
        identity = await self.identity()
        adopted = await self._adopt_orphan(mark.mark + 1, high_water_mark, identity)
        archived = (
            adopted if adopted is not None else await self._write(mark.mark + 1, end, identity)
        )
        point("archive.object_uploaded", partition=self.partition_id, last=archived.last)
        manifest = self.manifest.extended(archived, mark.manifest)
        name = layout.ManifestName(archived.last, self.store.new_token()).name
        path = self.store.path(layout.partition_dir(self.partition_id), name)
        encoded = manifest.encode()

        def write_manifest() -> None:
            self.store.write_bytes(path, encoded)
            if Manifest.decode(self.store.read_bytes(path), path, self.partition_id) != manifest:
                raise ArchiveError(
                    f"manifest {self.store.where(path)} did not read back as written"
                )

        await self._blocking("writing the manifest", write_manifest)
        new = ArchiveMark(
            self.partition_id,
            archived.last,
            name,
            len(manifest.ranges),
            manifest.total_bytes,
            self.store.url,
            mark.incarnation,
        )
        try:
            self.stored = await self.advance(current, new)
        except BadVersionError as exc:
            log.info(
                "partition %d: another archiver advanced the archive mark first (%s); this "
                "round's objects stay unused",
                self.partition_id,
                exc,
            )
            return None
        point("archive.mark_advanced", partition=self.partition_id, mark=archived.last)
        self.manifest = manifest
        if self.on_mark is not None:
            self.on_mark(manifest)
        seconds = clock.time() - started
        if self.listener is not None:
            self.listener.archived(archived, seconds, adopted is not None)
        log.info(
            "partition %d: archived %d..%d (%d records, %d bytes) as %s in %.2fs%s",
            self.partition_id,
            archived.first,
            archived.last,
            archived.records,
            archived.size,
            archived.name,
            seconds,
            " (an orphan adopted)" if adopted is not None else "",
        )
        await self._prune(archived.last)
        return archived

    async def _prune(self, through: int) -> None:
        if through < 0:
            return
        try:
            await self.source.prune(through)
        except (WaltzError, OSError) as exc:
            log.info("partition %d: replicas not pruned to %d: %s", self.partition_id, through, exc)

    # -- writing and verifying -----------------------------------------------------------------

    async def _write(self, first: int, end: int, identity: ArchiveIdentity) -> ArchivedRange:
        policy = self.policy
        writer = await self._blocking(
            "starting a range",
            lambda: RangeWriter(self.store, self.partition_id, first, policy.write, identity),
        )
        try:
            next_id = first
            while next_id <= end and writer.data_bytes < policy.max_range_bytes:
                room = policy.max_range_bytes - writer.data_bytes
                records = await self.source.read(
                    next_id, end - next_id + 1, max(1, min(policy.read_batch_bytes, room))
                )
                if not records:
                    raise ArchiveError(
                        f"partition {self.partition_id}: no replica served committed record "
                        f"{next_id} to archive"
                    )
                block = RecordBlock.of(records) if not isinstance(records, RecordBlock) else records
                batch, heads = block_to_batch(block)
                if batch.num_rows and batch.column("transaction_id")[0].as_py() != next_id:
                    raise ArchiveError(
                        f"partition {self.partition_id}: asked records from {next_id}, got "
                        f"{batch.column('transaction_id')[0].as_py()}"
                    )
                await self._blocking("writing a range", functools.partial(writer.add, batch, heads))
                next_id += batch.num_rows
            archived, _ = await self._blocking("uploading a range", writer.finish)
        except BaseException:
            writer.discard()
            raise
        await self._verify(archived)
        return archived

    async def _verify(self, archived: ArchivedRange) -> None:
        """Read the object back: every row checked against what was written."""
        records, _ = await self._blocking(
            "reading a range back",
            lambda: verify_object(self.store, self.partition_id, archived),
        )
        if records != archived.records:  # pragma: no cover - verify_object checks it
            raise ArchiveError(f"{describe(self.store, self.partition_id, archived)}: short")

    async def _adopt_orphan(
        self, first: int, high_water_mark: int, identity: ArchiveIdentity
    ) -> ArchivedRange | None:
        """An object for ``first`` that a crashed round wrote and never recorded, if it
        is this cluster's (its identity is ``identity``, or it states none: written
        before objects carried one), reads back whole, and holds exactly the records
        the replicas hold for its ids (compared by :class:`Fingerprint`); None
        otherwise. An orphan of another cluster or incarnation, or whose records are not
        the log's, is set aside (docs/archive.md, "Incarnations"); one that cannot be
        read stays where it is, unused."""
        directory = self.store.path(layout.partition_dir(self.partition_id))
        names = await self._blocking("listing the archive", lambda: self.store.list(directory))
        prefix = layout.range_prefix(first)
        candidates = []
        for name in names:
            parsed = layout.RangeName.parse(name) if name.startswith(prefix) else None
            if parsed is None or parsed.last > high_water_mark or parsed.name in self.rejected:
                continue
            candidates.append(parsed)
        for parsed in sorted(candidates, key=lambda p: p.last, reverse=True):
            fingerprint = Fingerprint()
            try:
                archived, written_by = await self._blocking(
                    "reading an orphan range",
                    functools.partial(
                        range_from_footer, self.store, self.partition_id, parsed.name
                    ),
                )
                if written_by is not None and written_by != identity:
                    await self._reject(
                        parsed.name, f"it was written by {written_by}; this is {identity}"
                    )
                    continue
                await self._blocking(
                    "reading an orphan range back",
                    functools.partial(
                        verify_object, self.store, self.partition_id, archived, fingerprint
                    ),
                )
            except ArchiveError as exc:
                log.info(
                    "partition %d: orphan %s is not usable (%s); it stays unused",
                    self.partition_id,
                    parsed.name,
                    exc,
                )
                continue
            committed = await self._log_fingerprint(archived.first, archived.last)
            if committed.value != fingerprint.value:
                await self._reject(
                    parsed.name,
                    f"its records {archived.first}..{archived.last} are not the ones the "
                    "replicas committed",
                )
                continue
            return archived
        return None

    async def _log_fingerprint(self, first: int, last: int) -> Fingerprint:
        """The fingerprint of the committed records ``first..last`` read from the replicas."""
        fingerprint = Fingerprint()
        next_id = first
        while next_id <= last:
            records = await self.source.read(
                next_id, last - next_id + 1, max(1, self.policy.read_batch_bytes)
            )
            if not records:
                raise ArchiveError(
                    f"partition {self.partition_id}: no replica served committed record "
                    f"{next_id} to compare an orphan range with"
                )
            block = RecordBlock.of(records) if not isinstance(records, RecordBlock) else records
            batch, _ = block_to_batch(block)
            check_rows(batch, next_id, f"partition {self.partition_id}'s replicas", False)
            if next_id + batch.num_rows > last + 1:
                batch = batch.slice(0, last + 1 - next_id)
            fingerprint.add_batch(batch)
            next_id += batch.num_rows
        return fingerprint

    async def _reject(self, name: str, reason: str) -> None:
        """Never adopt the orphan ``name``: set it aside (logged, counted)."""
        self.rejected[name] = reason
        directory = layout.partition_dir(self.partition_id)
        source = self.store.path(directory, name)
        target = self.store.path(directory, layout.set_aside(name))
        where = self.store.where(target)
        try:
            await self._blocking("setting an orphan aside", lambda: self.store.move(source, target))
        except ArchiveError as exc:
            where = f"nowhere: it stays in place, never adopted by this archiver ({exc})"
        log.warning(
            "partition %d: orphan range %s is not this cluster's log and is never adopted: "
            "%s; set aside to %s",
            self.partition_id,
            self.store.where(source),
            reason,
            where,
        )
        if self.listener is not None:
            self.listener.rejected(name, reason)
