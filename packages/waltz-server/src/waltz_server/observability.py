"""Health and metrics over HTTP for a Waltz server: its metric families
(:class:`ServerMetrics`).

The HTTP endpoint and the health checks are :mod:`waltz_api.http_endpoint`, the
registry and the scrape-time gauges :mod:`waltz_api.metrics` (shared with the storage
node, whose families are ``waltz_storage_node.metrics``); both are re-exported here.

The process owns one :class:`prometheus_client.CollectorRegistry` (never the global
one, so several servers can run in one process, as tests do) holding its metric
families, and serves it with an :class:`HttpEndpoint` (a small HTTP/1.1 server on the
process's event loop, standard library only):

- ``GET /metrics``: the Prometheus text exposition of the registry.
- ``GET /livez``: 200 while the process's event loop answers (a supervisor
  restarts a process that stops answering); the liveness checks, if any.
- ``GET /readyz``: 200 when the server is registered with the coordination service
  and every partition it owns has recovered (so it owns, or can take, partitions).
  503 otherwise.
- ``GET /health``: the same as ``/readyz`` (kept for older probes).
- ``GET /status``: a JSON document of what the server holds now (partitions, store
  sessions, replicas' acknowledged marks and connected clients), for ``waltz console``.

Each check endpoint answers JSON ``{"status": "ok" | "failing", "checks":
{name: {"ok": bool, "detail": str}}}`` from the checks the process supplies
(plain or async callables returning a :class:`Check`). A check that raises or
takes longer than ``check_timeout`` counts as failing, with the reason in
``detail``.

Values computed when scraped (consumer lag, connected clients) come from
:class:`ScrapeCollector` callbacks, so the hot paths pay nothing for them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from waltz_api.http_endpoint import (
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
from waltz_api.messages import (
    AppendRequest,
    FeedRequest,
    FlushRequest,
    HighWaterMarkRequest,
    MountRequest,
    PeerPing,
    RangeReadRequest,
    TransactionDataRequest,
)
from waltz_api.metrics import (
    ERROR_KINDS,
    LATENCY_BUCKETS,
    ScrapeCollector,
    families,
    new_registry,
    waltz_version,
)

log = logging.getLogger(__name__)

__all__ = [
    "ERROR_KINDS",
    "LATENCY_BUCKETS",
    "MAX_REQUEST_HEAD",
    "REQUEST_TIMEOUT",
    "SERVER_SCRAPED",
    "Check",
    "FeedPosition",
    "HealthCheck",
    "HttpEndpoint",
    "HttpReply",
    "JsonRoute",
    "ScrapeCollector",
    "ServerMetrics",
    "exported_families",
    "http_get",
    "new_registry",
    "run_checks",
    "validate_http_address",
    "waltz_version",
]

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
        self.registry = (
            registry
            if registry is not None
            else new_registry(role="server", distribution="waltz-server")
        )
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


def exported_families() -> dict[str, str]:
    """Every ``waltz_*`` metric family a server exports (``waltz_build_info`` included),
    with its type (``counter`` names with their ``_total``), for docs, dashboards and
    alert rules; a storage node's are ``waltz_storage_node.metrics.exported_families``."""
    server = ServerMetrics(new_registry(process_metrics=False, role="server"))
    server.watch_clients(lambda: 0, list)
    return families(server.registry)
