"""Health and metrics over HTTP for Waltz servers and storage nodes.

(The HTTP endpoint and the health checks are in :mod:`waltz_server.http_endpoint`,
re-exported here.)

Each process owns one :class:`prometheus_client.CollectorRegistry` (never the
global one, so several servers or storage nodes can run in one process, as
tests do) holding its metric families (:class:`ServerMetrics`,
:class:`StorageNodeMetrics`), and serves it with an :class:`HttpEndpoint`
(a small HTTP/1.1 server on the process's event loop, standard library only):

- ``GET /metrics``: the Prometheus text exposition of the registry.
- ``GET /livez``: 200 while the process's event loop answers (a supervisor
  restarts a process that stops answering); the liveness checks, if any.
- ``GET /readyz``: 200 when the process does its job: a server is registered
  with the coordination service and every partition it owns has recovered
  (so it owns, or can take, partitions); a storage node serves its endpoint,
  every hosted partition is available and holds at least what its store
  session's recovery committed. 503 otherwise.
- ``GET /health``: the same as ``/readyz`` (kept for older probes).
- ``GET /status``: a JSON document of what the process holds now (a server's
  partitions, store sessions, replicas' acknowledged marks and connected clients; a
  storage node's endpoint, hosted partitions and disk), for ``waltz console``; only
  when the process supplies it (``json_routes``).

Each check endpoint answers JSON ``{"status": "ok" | "failing", "checks":
{name: {"ok": bool, "detail": str}}}`` from the checks the process supplies
(plain or async callables returning a :class:`Check`). A check that raises or
takes longer than ``check_timeout`` counts as failing, with the reason in
``detail``.

Values computed when scraped (consumer lag, connected clients, disk usage)
come from :class:`ScrapeCollector` callbacks, so the hot paths pay nothing
for them.
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from importlib import metadata

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from waltz_api.messages import (
    AppendRequest,
    ErrorCode,
    FeedRequest,
    FlushRequest,
    HighWaterMarkRequest,
    MountRequest,
    PeerPing,
    RangeReadRequest,
    TransactionDataRequest,
)
from waltz_server.http_endpoint import (
    MAX_REQUEST_HEAD,
    REQUEST_TIMEOUT,
    Check,
    HealthCheck,
    HttpEndpoint,
    HttpReply,
    JsonRoute,
    http_get,
    run_checks,
    validate_http_address,
)

log = logging.getLogger(__name__)

__all__ = [
    "LATENCY_BUCKETS",
    "MAX_REQUEST_HEAD",
    "REQUEST_TIMEOUT",
    "SERVER_SCRAPED",
    "STORAGE_SCRAPED",
    "Check",
    "DiskUsage",
    "FeedPosition",
    "HealthCheck",
    "HttpEndpoint",
    "HttpReply",
    "JsonRoute",
    "PartitionState",
    "ScrapeCollector",
    "ServerMetrics",
    "StorageNodeMetrics",
    "exported_families",
    "http_get",
    "new_registry",
    "run_checks",
    "validate_http_address",
    "waltz_version",
]

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
)
"""Seconds: from a fast fsync (half a millisecond) to a stalled disk."""


# Counters expose `_total` only: the `_created` twin of every series (a timestamp
# per label set) doubles what a scrape stores and no dashboard here uses it.
disable_created_metrics()  # type: ignore[no-untyped-call]


def waltz_version() -> str:
    """The installed waltz-server version (``unknown`` when not installed as a package)."""
    try:
        return metadata.version("waltz-server")
    except metadata.PackageNotFoundError:
        return "unknown"


def new_registry(*, process_metrics: bool = True, role: str = "") -> CollectorRegistry:
    """A registry of its own, with the process collector (memory, CPU, open files) and
    ``waltz_build_info`` (1, labelled with the version, Python and the process's role)."""
    registry = CollectorRegistry(auto_describe=True)
    if process_metrics:
        ProcessCollector(registry=registry)
    Gauge(
        "waltz_build_info",
        "Always 1; the labels say which Waltz runs (version, Python, role)",
        ["version", "python_version", "role"],
        registry=registry,
    ).labels(waltz_version(), platform.python_version(), role).set(1)
    return registry


class ScrapeCollector(Collector):
    """Gauges computed when the registry is scraped, by ``collect_fn``.

    ``collect_fn`` returns ``(name, help, labels, samples)`` tuples, ``samples``
    being ``(label values, value)`` pairs. A failing callback is logged and
    yields nothing (a scrape never fails because of it)."""

    def __init__(
        self,
        describe: Iterable[tuple[str, str, tuple[str, ...]]],
        collect_fn: Callable[[], Iterable[tuple[str, Iterable[tuple[tuple[str, ...], float]]]]],
    ) -> None:
        self._families = {name: (help_text, labels) for name, help_text, labels in describe}
        self._collect_fn = collect_fn

    def describe(self) -> Iterator[Metric]:
        for name, (help_text, labels) in self._families.items():
            yield GaugeMetricFamily(name, help_text, labels=list(labels))

    def collect(self) -> Iterator[Metric]:
        families = {
            name: GaugeMetricFamily(name, help_text, labels=list(labels))
            for name, (help_text, labels) in self._families.items()
        }
        try:
            for name, samples in self._collect_fn():
                family = families[name]
                for label_values, value in samples:
                    family.add_metric(list(label_values), value)
        except Exception:
            log.exception("computing metrics for a scrape failed")
        yield from families.values()


# -- counters at zero -----------------------------------------------------------------------------
# A labelled counter has no series until its first event: a dashboard's rate() and an
# alert's increase() of it read "No data" until then (and an alert cannot see the first
# event, the increase from nothing). So every counter labelled by partition or kind is
# made at zero for its known labels: the kinds at start, a partition's once it is served
# (server) or hosted (storage node).

ERROR_KINDS = tuple(code.name.lower() for code in ErrorCode)
"""The ``kind`` labels of the error counters: every error code (an answer's)."""
SERVER_REQUEST_KINDS = tuple(
    kind.__name__
    for kind in (
        MountRequest,
        AppendRequest,
        FeedRequest,
        TransactionDataRequest,
        FlushRequest,
        HighWaterMarkRequest,
        RangeReadRequest,
        PeerPing,
    )
)
"""The ``kind`` labels of ``waltz_server_requests``: what clients (and peers) send."""
APPEND_FAILURE_REASONS = ("generation",)
"""The ``reason`` labels of ``waltz_server_append_failures``."""


# -- the server ----------------------------------------------------------------------------------

SERVER_SCRAPED = (
    ("waltz_server_connected_clients", "Client connections open now (handshake done)", ()),
    (
        "waltz_server_feed_lag_transactions",
        "A connected client's feed position behind the partition's high-water mark, as "
        "this server sees it (transactions)",
        ("partition", "client"),
    ),
)


@dataclass(frozen=True, slots=True)
class FeedPosition:
    """A client's feed on a partition: the last transaction id it was sent (or the
    high-water mark it mounted with) and the partition's high-water mark now."""

    partition_id: int
    client: str
    position: int
    high_water_mark: int


class ServerMetrics:
    """The metric families of a Waltz server (partitions, store sessions, clients)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry(role="server")
        r = self.registry
        self.appends = Counter(
            "waltz_server_appended_transactions",
            "Transactions committed (rate() of it is the append rate)",
            ["partition"],
            registry=r,
        )
        self.append_failures = Counter(
            "waltz_server_append_failures",
            "Append requests not committed, by reason (generation, storage, ...)",
            ["partition", "reason"],
            registry=r,
        )
        self.commit_latency = Histogram(
            "waltz_server_commit_latency_seconds",
            "Time from receiving an append request to its commit at a majority of replicas",
            ["partition"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.lock_failures = Counter(
            "waltz_server_lock_failures",
            "Append requests refused because a lock check failed",
            ["partition"],
            registry=r,
        )
        self.high_water_mark = Gauge(
            "waltz_server_high_water_mark",
            "The partition's high-water mark (highest committed transaction id)",
            ["partition"],
            registry=r,
        )
        self.replica_lag = Gauge(
            "waltz_server_replica_lag_transactions",
            "Transactions a replica is behind the partition's high-water mark",
            ["partition", "replica"],
            registry=r,
        )
        self.recoveries = Counter(
            "waltz_server_recoveries",
            "Store session recoveries completed",
            ["partition"],
            registry=r,
        )
        self.partitions_owned = Gauge(
            "waltz_server_partitions_owned", "Partitions this server serves now", registry=r
        )
        self.assignment_changes = Counter(
            "waltz_cluster_assignment_changes",
            "Partition assignment writes made by this server as the leader (generation bumps)",
            registry=r,
        )
        self.requests = Counter(
            "waltz_server_requests",
            "Client requests received, by kind (the message type: AppendRequest, ...)",
            ["kind"],
            registry=r,
        )
        self.errors = Counter(
            "waltz_server_errors",
            "Error answers sent to clients, by kind (the error code: partition_not_assigned, "
            "stale_generation, ...)",
            ["kind"],
            registry=r,
        )
        self._archive_families()
        self._appends: dict[int, Counter] = {}  # labelled children, for the hot path
        self._latency: dict[int, Histogram] = {}
        self._requests: dict[str, Counter] = {}
        self._scraped: ScrapeCollector | None = None
        for kind in SERVER_REQUEST_KINDS:
            self._requests[kind] = self.requests.labels(kind)
        for kind in ERROR_KINDS:
            self.errors.labels(kind)

    def serve_partition(self, partition_id: int) -> None:
        """The partition is served here: its counters exist from now on (at zero when
        new), so its rates and increases read 0, not "No data", until its first event."""
        label = str(partition_id)
        if partition_id not in self._appends:
            self._appends[partition_id] = self.appends.labels(label)
        if partition_id not in self._latency:
            self._latency[partition_id] = self.commit_latency.labels(label)
        for reason in APPEND_FAILURE_REASONS:
            self.append_failures.labels(label, reason)
        for counter in (
            self.lock_failures,
            self.recoveries,
            self.archived_records,
            self.archived_bytes,
            self.archive_failures,
            self.archive_orphans_rejected,
        ):
            counter.labels(label)

    def committed(self, partition_id: int, count: int, latency: float | None = None) -> None:
        """``count`` transactions committed; ``latency`` seconds for the request (if known)."""
        child = self._appends.get(partition_id)
        if child is None:
            child = self._appends[partition_id] = self.appends.labels(str(partition_id))
        child.inc(count)
        if latency is not None:
            self.observe_commit_latency(partition_id, latency)

    def observe_commit_latency(self, partition_id: int, seconds: float) -> None:
        child = self._latency.get(partition_id)
        if child is None:
            child = self._latency[partition_id] = self.commit_latency.labels(str(partition_id))
        child.observe(seconds)

    def request(self, kind: str) -> None:
        """A client request of type ``kind`` received."""
        child = self._requests.get(kind)
        if child is None:
            child = self._requests[kind] = self.requests.labels(kind)
        child.inc()

    def error(self, kind: str) -> None:
        """An error answer of ``kind`` (a fixed word, never free text) sent."""
        self.errors.labels(kind).inc()

    def lock_failed(self, partition_id: int) -> None:
        self.lock_failures.labels(str(partition_id)).inc()

    def append_failed(self, partition_id: int, reason: str) -> None:
        """An append not committed; ``reason`` is a short fixed word (``generation``,
        ``storage``, ``fenced``...), never free text (it is a label)."""
        self.append_failures.labels(str(partition_id), reason).inc()

    def set_high_water_mark(self, partition_id: int, high_water_mark: int) -> None:
        self.high_water_mark.labels(str(partition_id)).set(high_water_mark)

    def set_replica_lag(self, partition_id: int, replica: str, lag: int) -> None:
        self.replica_lag.labels(str(partition_id), replica).set(lag)

    def recovered(self, partition_id: int) -> None:
        self.recoveries.labels(str(partition_id)).inc()

    def _archive_families(self) -> None:
        r = self.registry
        self.archive_mark = Gauge(
            "waltz_server_archive_mark",
            "The partition's archive mark: every id at or below it is archived and verified",
            ["partition"],
            registry=r,
        )
        self.archive_lag = Gauge(
            "waltz_server_archive_lag",
            "Committed transactions above the archive mark (not archived yet), at the "
            "archiver's last round",
            ["partition"],
            registry=r,
        )
        self.archive_local_bytes = Gauge(
            "waltz_server_archive_local_bytes",
            "Bytes of the partition's local log on the replica the archiver asked (-1: "
            "the engine cannot tell)",
            ["partition"],
            registry=r,
        )
        self.archived_records = Counter(
            "waltz_server_archived_records",
            "Transactions archived (the archive mark moved past them)",
            ["partition"],
            registry=r,
        )
        self.archived_bytes = Counter(
            "waltz_server_archived_bytes",
            "Bytes of the Parquet objects archived",
            ["partition"],
            registry=r,
        )
        self.archive_failures = Counter(
            "waltz_server_archive_failures",
            "Archive rounds that failed (the archive unreachable, slow, full or corrupting: "
            "retried; nothing is deleted meanwhile)",
            ["partition"],
            registry=r,
        )
        self.archive_orphans_rejected = Counter(
            "waltz_server_archive_orphans_rejected",
            "Orphan range objects the archiver refused to adopt and set aside (another "
            "cluster's or incarnation's, or not holding the committed records of their ids)",
            ["partition"],
            registry=r,
        )
        self.archive_read_latency = Histogram(
            "waltz_server_archive_read_latency_seconds",
            "Time of one read of archived records (a feed, a data fetch or a range read "
            "below the replicas), cache hits included",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def forget_partition(self, partition_id: int, replicas: tuple[str, ...] = ()) -> None:
        """Drop a partition's gauges once this server no longer serves it (counters stay)."""
        label = str(partition_id)
        for gauge in (
            self.high_water_mark,
            self.archive_mark,
            self.archive_lag,
            self.archive_local_bytes,
        ):
            with suppress(KeyError):
                gauge.remove(label)
        for replica in replicas:
            with suppress(KeyError):
                self.replica_lag.remove(label, replica)

    def watch_clients(
        self, connected: Callable[[], int], feeds: Callable[[], Iterable[FeedPosition]]
    ) -> None:
        """Report connected clients and each one's feed lag, read when scraped."""

        def collect() -> Iterator[tuple[str, list[tuple[tuple[str, ...], float]]]]:
            yield "waltz_server_connected_clients", [((), float(connected()))]
            yield (
                "waltz_server_feed_lag_transactions",
                [
                    (
                        (str(f.partition_id), f.client),
                        float(max(f.high_water_mark - f.position, 0)),
                    )
                    for f in feeds()
                ],
            )

        self._watch(ScrapeCollector(SERVER_SCRAPED, collect))

    def _watch(self, collector: ScrapeCollector) -> None:
        """Register ``collector`` in place of the one registered before (a new watch
        replaces the old)."""
        if self._scraped is not None:
            self.registry.unregister(self._scraped)
        self.registry.register(collector)
        self._scraped = collector


# -- the storage node ----------------------------------------------------------------------------

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
        self.registry = registry if registry is not None else new_registry(role="storage")
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
    """Every ``waltz_*`` metric family a server or a storage node exports, with its type
    (``counter`` names with their ``_total``), for docs, dashboards and alert rules."""
    server = ServerMetrics(new_registry(process_metrics=False, role="server"))
    server.watch_clients(lambda: 0, list)
    storage = StorageNodeMetrics(new_registry(process_metrics=False, role="storage"))
    storage.watch_storage(lambda: DiskUsage(0, 0, 0), list)
    found: dict[str, str] = {}
    for metrics in (server, storage):
        for family in metrics.registry.collect():
            if family.name.startswith("waltz_"):
                suffix = "_total" if family.type == "counter" else ""
                found[family.name + suffix] = family.type
    return found
