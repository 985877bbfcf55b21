"""The metric families of a storage node (:class:`StorageNodeMetrics`), served by its
HTTP endpoint (:mod:`waltz_storage_node.http`); see docs/observability.md.

The registry, the latency buckets and the scrape-time gauges are
:mod:`waltz_api.metrics`, shared with the server.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from waltz_api.metrics import (
    ERROR_KINDS,
    LATENCY_BUCKETS,
    ScrapeCollector,
    families,
    new_registry,
)

__all__ = [
    "STORAGE_SCRAPED",
    "DiskUsage",
    "PartitionState",
    "StorageNodeMetrics",
    "exported_families",
]

STORAGE_SCRAPED = (
    (
        "waltz_storage_disk_used_bytes",
        "Bytes of the files under the storage node's data directory",
        (),
    ),
    (
        "waltz_storage_filesystem_free_bytes",
        "Free bytes (for an unprivileged user) of the file system holding the data directory",
        (),
    ),
    (
        "waltz_storage_filesystem_size_bytes",
        "Size in bytes of the file system holding the data directory",
        (),
    ),
    (
        "waltz_storage_max_transaction_id",
        "The highest transaction id a hosted partition holds",
        ("partition",),
    ),
    (
        "waltz_storage_low_water_mark",
        "The committed mark the partition's current store session recovered to",
        ("partition",),
    ),
    (
        "waltz_storage_partition_available",
        "1 when the hosted partition is available, 0 when an operator marked it unavailable",
        ("partition",),
    ),
    (
        "waltz_storage_log_start",
        "The first transaction id a hosted partition holds locally (those below it were "
        "archived and deleted here)",
        ("partition",),
    ),
    (
        "waltz_storage_local_bytes",
        "Bytes of a hosted partition's local log (its segments; -1 when the engine cannot "
        "tell): flat once archive retention applies",
        ("partition",),
    ),
)


@dataclass(frozen=True, slots=True)
class PartitionState:
    partition_id: int
    max_transaction_id: int
    low_water_mark: int
    available: bool
    log_start: int = 0
    local_bytes: int = -1


@dataclass(frozen=True, slots=True)
class DiskUsage:
    used_bytes: int
    free_bytes: int
    size_bytes: int


class StorageNodeMetrics:
    """The metric families of a storage node."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = (
            registry
            if registry is not None
            else new_registry(role="storage", distribution="waltz-storage-node")
        )
        r = self.registry
        self.appended_records = Counter(
            "waltz_storage_appended_records",
            "Records appended durably",
            ["partition"],
            registry=r,
        )
        self.appended_bytes = Counter(
            "waltz_storage_appended_bytes",
            "Transaction data bytes appended durably",
            ["partition"],
            registry=r,
        )
        self.append_batches = Counter(
            "waltz_storage_append_batches",
            "Engine appends (queued requests are merged; one write and flush each)",
            ["partition"],
            registry=r,
        )
        self.append_latency = Histogram(
            "waltz_storage_append_latency_seconds",
            "Time of one durable engine append as the storage node sees it (queueing in the "
            "engine, write and fsync), per batch",
            ["partition"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.fsync_latency = Histogram(
            "waltz_storage_fsync_latency_seconds",
            "Time of the engine's flush to disk alone (fdatasync of one group commit's files); "
            "reported by engines that can (the fs engine)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.fenced_requests = Counter(
            "waltz_storage_fenced_requests",
            "Requests refused because their store session was fenced by a newer one",
            ["partition"],
            registry=r,
        )
        self.sessions_fenced = Counter(
            "waltz_storage_sessions_fenced",
            "Store sessions superseded (fenced) by a newer store session id",
            ["partition"],
            registry=r,
        )
        self.requests = Counter(
            "waltz_storage_requests",
            "Requests received, by kind (the message type: StorageAppendRequest, ...)",
            ["kind"],
            registry=r,
        )
        self.errors = Counter(
            "waltz_storage_errors",
            "Failure answers sent, by kind (the error code: fenced, partition_closed, ...)",
            ["kind"],
            registry=r,
        )
        self.scrubbed_records = Counter(
            "waltz_storage_scrubbed_records",
            "Sealed records read back and verified by the scrub (background and on request)",
            ["partition"],
            registry=r,
        )
        self.scrubbed_bytes = Counter(
            "waltz_storage_scrubbed_bytes",
            "Stored bytes of records read back by the scrub",
            ["partition"],
            registry=r,
        )
        self.scrub_damaged_records = Counter(
            "waltz_storage_scrub_damaged_records",
            "Records the scrub found damaged (moved aside, missing until repaired from a peer)",
            ["partition"],
            registry=r,
        )
        self.scrub_last_pass = Gauge(
            "waltz_storage_scrub_last_pass_timestamp_seconds",
            "When the last scrub pass over every hosted partition ended (Unix time; 0: none "
            "since the node started)",
            registry=r,
        )
        self._append_children: dict[int, tuple[Counter, Counter, Counter, Histogram]] = {}
        self._requests: dict[str, Counter] = {}
        self._scraped: ScrapeCollector | None = None
        for kind in ERROR_KINDS:
            self.errors.labels(kind)

    def expect_requests(self, kinds: Iterable[str]) -> None:
        """The request kinds the node serves: their counters exist from now on."""
        for kind in kinds:
            if kind not in self._requests:
                self._requests[kind] = self.requests.labels(kind)

    def host_partition(self, partition_id: int) -> None:
        """The partition is hosted here: its counters exist from now on (at zero when
        new), so its rates and increases read 0, not "No data", until its first event."""
        label = str(partition_id)
        if partition_id not in self._append_children:
            self._append_children[partition_id] = (
                self.appended_records.labels(label),
                self.appended_bytes.labels(label),
                self.append_batches.labels(label),
                self.append_latency.labels(label),
            )
        for counter in (self.fenced_requests, self.sessions_fenced):
            counter.labels(label)
        self.scrub_partitions([partition_id])

    def appended(self, partition_id: int, records: int, data_bytes: int, seconds: float) -> None:
        children = self._append_children.get(partition_id)
        if children is None:
            self.host_partition(partition_id)
            children = self._append_children[partition_id]
        children[0].inc(records)
        children[1].inc(data_bytes)
        children[2].inc()
        children[3].observe(seconds)

    def request(self, kind: str) -> None:
        """A request of type ``kind`` received."""
        child = self._requests.get(kind)
        if child is None:
            child = self._requests[kind] = self.requests.labels(kind)
        child.inc()

    def error(self, kind: str) -> None:
        """A failure answer of ``kind`` (an error code) sent."""
        self.errors.labels(kind).inc()

    def observe_fsync(self, seconds: float) -> None:
        """One flush of the engine (thread-safe: engines call it from their own threads)."""
        self.fsync_latency.observe(seconds)

    def scrub_partitions(self, partition_ids: Iterable[int]) -> None:
        """Make the scrub counters of these partitions exist (at zero): an alert on their
        increase sees the first damage."""
        for partition_id in partition_ids:
            label = str(partition_id)
            for counter in (self.scrubbed_records, self.scrubbed_bytes, self.scrub_damaged_records):
                counter.labels(label)

    def scrubbed(self, partition_id: int, records: int, data_bytes: int, damaged: int) -> None:
        """One scrub call: records and bytes read back, records found damaged."""
        label = str(partition_id)
        self.scrubbed_records.labels(label).inc(records)
        self.scrubbed_bytes.labels(label).inc(data_bytes)
        self.scrub_damaged_records.labels(label).inc(damaged)

    def scrub_pass_completed(self, unix_time: float) -> None:
        self.scrub_last_pass.set(unix_time)

    def fenced_request(self, partition_id: int) -> None:
        self.fenced_requests.labels(str(partition_id)).inc()

    def session_fenced(self, partition_id: int) -> None:
        self.sessions_fenced.labels(str(partition_id)).inc()

    @contextmanager
    def timed_append(self, partition_id: int, records: int, data_bytes: int) -> Iterator[None]:
        """Time an engine append; counted only when it succeeds."""
        started = time.perf_counter()
        yield
        self.appended(partition_id, records, data_bytes, time.perf_counter() - started)

    def watch_storage(
        self, disk: Callable[[], DiskUsage], partitions: Callable[[], Iterable[PartitionState]]
    ) -> None:
        """Report disk usage and each hosted partition's marks, read when scraped."""

        def collect() -> Iterator[tuple[str, list[tuple[tuple[str, ...], float]]]]:
            usage = disk()
            yield "waltz_storage_disk_used_bytes", [((), float(usage.used_bytes))]
            yield "waltz_storage_filesystem_free_bytes", [((), float(usage.free_bytes))]
            yield "waltz_storage_filesystem_size_bytes", [((), float(usage.size_bytes))]
            states = list(partitions())
            for name, attribute in (
                ("waltz_storage_max_transaction_id", "max_transaction_id"),
                ("waltz_storage_low_water_mark", "low_water_mark"),
                ("waltz_storage_partition_available", "available"),
                ("waltz_storage_log_start", "log_start"),
                ("waltz_storage_local_bytes", "local_bytes"),
            ):
                yield (
                    name,
                    [((str(s.partition_id),), float(getattr(s, attribute))) for s in states],
                )

        if self._scraped is not None:
            self.registry.unregister(self._scraped)
        self._scraped = ScrapeCollector(STORAGE_SCRAPED, collect)
        self.registry.register(self._scraped)


def exported_families() -> dict[str, str]:
    """Every ``waltz_*`` metric family a storage node exports, with its type
    (``counter`` names with their ``_total``), for docs, dashboards and alert rules."""
    storage = StorageNodeMetrics(new_registry(process_metrics=False, role="storage"))
    storage.watch_storage(lambda: DiskUsage(0, 0, 0), list)
    return families(storage.registry)
