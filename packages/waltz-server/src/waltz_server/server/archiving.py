"""The server's side of the archive (``[server.archive]``, docs/archive.md).

With an archive URL configured, every partition this server owns gets:

- a :class:`PartitionArchiveLink` (the store's :class:`~waltz_server.server.store.ArchiveLink`):
  the archive mark, and reads of archived records through the ``waltz_archive`` reader
  (a bounded cache of row groups), in a thread under a deadline;
- a :class:`~waltz_archive.archiver.PartitionArchiver` task, fed by
  :class:`StoreArchiveSource` (committed records from the replicas, one writer's local
  log, pruning of the writers), started with the partition and cancelled with it.

``waltz_archive`` (pyarrow, fsspec) is imported only when an archive is configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from waltz_api.cluster import ClusterMetadata
from waltz_api.contracts.coordination import Coordination
from waltz_api.errors import ArchiveError, ConfigError, CoordinationError
from waltz_api.types import NO_TRANSACTION, Record
from waltz_server.cluster_admin import ClusterAdmin

if TYPE_CHECKING:
    from waltz_api.contracts.storage import LocalLog
    from waltz_archive.archiver import ArchivePolicy, PartitionArchiver
    from waltz_archive.manifest import ArchivedRange, Manifest
    from waltz_archive.reader import ArchiveReader
    from waltz_archive.store import ArchiveStore
    from waltz_server.observability import ServerMetrics
    from waltz_server.server.store import StorePartition

log = logging.getLogger(__name__)

MiB = 1024 * 1024
COMPRESSIONS = ("zstd", "snappy", "lz4", "gzip", "none")


@dataclass
class ArchiveSection:
    """``[server.archive]``: where and when a server archives the partitions it owns."""

    url: str = field(
        default="",
        metadata={"help": "fsspec URL of the archive (file://, s3://, gs://...); empty: off"},
    )
    storage_options: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "fsspec options of the archive (e.g. endpoint_url, key), as-is"},
    )
    min_range_bytes: int = field(
        default=64 * MiB,
        metadata={"min": 1, "help": "a range is written once this much is ready"},
    )
    max_range_bytes: int = field(
        default=256 * MiB,
        metadata={"min": 1, "help": "data bytes per Parquet range, at most"},
    )
    max_local_bytes: int = field(
        default=1024 * MiB,
        metadata={
            "min": 0,
            "help": "retention by size: sealed segments beyond the newest this many bytes "
            "of local log are archived (0: off)",
        },
    )
    max_local_age: float = field(
        default=7 * 24 * 3600.0,
        metadata={
            "min": 0.0,
            "help": "retention by age: segments sealed more than this many seconds ago "
            "are archived (0: off)",
        },
    )
    keep_local_transactions: int = field(
        default=0,
        metadata={
            "min": 0,
            "help": "retention by id: transactions this far below the high-water mark are "
            "archived (0: off)",
        },
    )
    row_group_bytes: int = field(
        default=8 * MiB,
        metadata={"min": 1024, "help": "data bytes per Parquet row group"},
    )
    compression: str = field(
        default="zstd",
        metadata={"choices": COMPRESSIONS, "help": "Parquet compression of the ranges"},
    )
    interval: float = field(
        default=10.0,
        metadata={"min": 0.01, "help": "seconds between archive rounds with nothing to do"},
    )
    timeout: float = field(
        default=120.0,
        metadata={"min": 0.1, "help": "deadline of one call to the archive (seconds)"},
    )
    cache_bytes: int = field(
        default=64 * MiB,
        metadata={"min": 0, "help": "archived row groups cached per partition for reads"},
    )
    spool_dir: str = field(
        default="",
        metadata={"help": "where ranges are written before upload (default: the temp dir)"},
    )

    def __post_init__(self) -> None:
        if self.max_range_bytes < self.min_range_bytes:
            raise ConfigError(
                "config key 'server.archive.max_range_bytes' must be at least min_range_bytes "
                f"({self.max_range_bytes} < {self.min_range_bytes})",
                "server.archive.max_range_bytes",
            )

    @property
    def enabled(self) -> bool:
        return bool(self.url.strip())

    def policy(self) -> ArchivePolicy:
        from waltz_archive.archiver import ArchivePolicy
        from waltz_archive.objects import WriteOptions

        return ArchivePolicy(
            min_range_bytes=self.min_range_bytes,
            max_range_bytes=self.max_range_bytes,
            max_local_bytes=self.max_local_bytes,
            max_local_age=self.max_local_age,
            keep_local_transactions=self.keep_local_transactions,
            interval=self.interval,
            timeout=self.timeout,
            write=WriteOptions(
                row_group_bytes=self.row_group_bytes,
                compression=self.compression,
                spool_dir=self.spool_dir or None,
            ),
        )


class PartitionArchiveLink:
    """One partition's archive as its store sees it: the mark and archived reads."""

    def __init__(
        self,
        partition_id: int,
        coordination: Coordination,
        store: ArchiveStore,
        *,
        cache_bytes: int,
        timeout: float,
        metrics: ServerMetrics | None = None,
    ) -> None:
        from waltz_archive.reader import ArchiveReader

        self.partition_id = partition_id
        self.coordination = coordination
        self.store = store
        self.timeout = timeout
        self.metrics = metrics
        self.reader: ArchiveReader = ArchiveReader(store, partition_id, cache_bytes)
        self._mark = NO_TRANSACTION
        self._manifest_name = ""
        self._loading: asyncio.Lock = asyncio.Lock()

    @property
    def mark(self) -> int:
        return self._mark

    def update(self, manifest: Manifest) -> None:
        """A manifest the archiver wrote or loaded (the mark moved)."""
        self.reader.set_manifest(manifest)
        self._set_mark(max(self._mark, manifest.mark))

    def _set_mark(self, mark: int) -> None:
        self._mark = mark
        if self.metrics is not None and mark >= 0:
            self.metrics.archive_mark.labels(str(self.partition_id)).set(mark)

    async def refresh(self) -> int:
        found = (await ClusterMetadata(self.coordination).archive_mark(self.partition_id)).value
        if found.mark > self._mark:
            self._manifest_name = found.manifest
            self._set_mark(found.mark)
        return self._mark

    async def _load_manifest(self) -> None:
        """The manifest of the mark, when the reader's is older (a mark another owner set)."""
        from waltz_archive import layout
        from waltz_archive.manifest import Manifest

        async with self._loading:
            if self.reader.mark >= self._mark:
                return
            name = self._manifest_name
            if not name:
                metadata = ClusterMetadata(self.coordination)
                name = (await metadata.archive_mark(self.partition_id)).value.manifest
            path = self.store.path(layout.partition_dir(self.partition_id), name)
            raw = await self._blocking(lambda: self.store.read_bytes(path))
            manifest = Manifest.decode(raw, self.store.where(path), self.partition_id)
            self.reader.set_manifest(manifest)

    async def _blocking(self, fn: Any) -> Any:
        try:
            return await self.store.call(fn, self.timeout)
        except TimeoutError:
            raise ArchiveError(
                f"partition {self.partition_id}: the archive {self.store.url} did not answer "
                f"within {self.timeout:g}s"
            ) from None

    async def read(self, start: int, max_records: int, max_bytes: int) -> list[Record]:
        started = time.perf_counter()
        try:
            if start > self.reader.mark:
                await self._load_manifest()
            records: list[Record] = await self._blocking(
                lambda: self.reader.read(start, max_records, max_bytes)
            )
            return records
        finally:
            if self.metrics is not None:
                self.metrics.archive_read_latency.observe(time.perf_counter() - started)

    def close(self) -> None:
        self.reader.close()


class StoreArchiveSource:
    """The archiver's view of a partition's store (an ``ArchiveSource``)."""

    def __init__(self, store: StorePartition) -> None:
        self.store = store

    def committed(self) -> int:
        return self.store.high_water_mark

    async def read(self, start: int, max_records: int, max_bytes: int) -> Sequence[Record]:
        session = await self.store.wait_ready()
        return await session.read_committed_block(start, max_records, max_bytes)

    async def local_log(self) -> LocalLog | None:
        return await self.store.local_log()

    async def prune(self, through: int) -> None:
        await self.store.prune(through)


class _Listener:
    def __init__(self, partition_id: int, metrics: ServerMetrics) -> None:
        self.label = str(partition_id)
        self.metrics = metrics

    def archived(self, archived: ArchivedRange, seconds: float, adopted: bool) -> None:
        self.metrics.archived_records.labels(self.label).inc(archived.records)
        self.metrics.archived_bytes.labels(self.label).inc(archived.size)

    def progress(self, mark: int, high_water_mark: int, local_bytes: int) -> None:
        self.metrics.archive_lag.labels(self.label).set(max(0, high_water_mark - mark))
        self.metrics.archive_local_bytes.labels(self.label).set(local_bytes)

    def failed(self, error: BaseException) -> None:
        self.metrics.archive_failures.labels(self.label).inc()

    def rejected(self, name: str, reason: str) -> None:
        self.metrics.archive_orphans_rejected.labels(self.label).inc()


class ServerArchive:
    """The archive of one server: a link and an archiver per partition it owns."""

    def __init__(
        self,
        section: ArchiveSection,
        coordination: Coordination,
        metrics: ServerMetrics | None = None,
        rng: random.Random | None = None,
    ) -> None:
        try:
            from waltz_archive.store import open_store
        except ImportError as exc:
            raise ConfigError(
                f"config key 'server.archive.url' is set but the archive cannot be used: "
                f"{exc}; install it: pip install 'waltz-server[archive]' (or [s3])",
                "server.archive.url",
            ) from None

        self.section = section
        self.coordination = coordination
        self.metrics = metrics
        self.rng = rng or random.Random()
        self.store = open_store(section.url, section.storage_options)
        self.policy = section.policy()
        self.links: dict[int, PartitionArchiveLink] = {}
        self.archivers: dict[int, PartitionArchiver] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}

    def link(self, partition_id: int) -> PartitionArchiveLink:
        """A new link for a partition this server starts to serve."""
        link = PartitionArchiveLink(
            partition_id,
            self.coordination,
            self.store,
            cache_bytes=self.section.cache_bytes,
            timeout=self.section.timeout,
            metrics=self.metrics,
        )
        old = self.links.pop(partition_id, None)
        if old is not None:
            old.close()
        self.links[partition_id] = link
        return link

    def start(self, store: StorePartition) -> None:
        """Archive ``store``'s partition until :meth:`stop`."""
        from waltz_archive.archiver import PartitionArchiver

        partition_id = store.partition_id
        link = self.links.get(partition_id) or self.link(partition_id)
        archiver = PartitionArchiver(
            partition_id=partition_id,
            coordination=self.coordination,
            store=self.store,
            source=StoreArchiveSource(store),
            advance=ClusterAdmin(self.coordination).advance_archive_mark,
            policy=self.policy,
            listener=_Listener(partition_id, self.metrics) if self.metrics is not None else None,
            on_mark=link.update,
            rng=random.Random(self.rng.getrandbits(64)),
        )
        self.archivers[partition_id] = archiver
        self._tasks[partition_id] = asyncio.create_task(
            self._run(archiver, store), name=f"archiver-{partition_id}"
        )

    async def _run(self, archiver: PartitionArchiver, store: StorePartition) -> None:
        try:
            await store.wait_ready()
        except Exception as exc:  # the partition stopped or moved before it opened
            log.info("partition %d: no archiving: %s", archiver.partition_id, exc)
            return
        try:
            await archiver.run()
        except CoordinationError as exc:  # pragma: no cover - run() retries these
            log.warning("partition %d: archiver stopped: %s", archiver.partition_id, exc)

    async def stop(self, partition_id: int) -> None:
        task = self._tasks.pop(partition_id, None)
        self.archivers.pop(partition_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        link = self.links.pop(partition_id, None)
        if link is not None:
            link.close()

    async def close(self) -> None:
        for partition_id in list(self._tasks):
            await self.stop(partition_id)
        for link in self.links.values():
            link.close()
        self.links.clear()
