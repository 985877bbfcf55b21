"""What the console shows, computed from what it read: pure functions, no I/O, no clock.

:class:`MetaState` is the cluster metadata as the coordination watches last delivered it;
:class:`Probes` what the servers' and storage nodes' HTTP endpoints last answered
(``/status`` and ``/metrics``); :class:`Trackers` keeps the recent samples that rates
and latency percentiles are computed from. :func:`build` turns them into a
:class:`Snapshot` (plain dicts, ready to be served as JSON), :func:`derive_events`
compares two snapshots and names what happened between them, and :func:`page` cuts a
table into the part one page shows.
"""

from __future__ import annotations

import bisect
import math
import re
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from waltz_api.access import AccessControl
from waltz_api.cluster import (
    NO_SERVER,
    ArchiveMark,
    ClusterConfig,
    PartitionAssignment,
    PartitionStoreMetadata,
    ReplicaAssignments,
    ServerInfo,
)
from waltz_api.errors import ConfigError

RATE_WINDOW = 10.0
"""Seconds of samples a rate is computed over."""
LATENCY_WINDOW = 60.0
"""Seconds of histogram reads a latency percentile is computed over: ``/metrics`` is
read every 5 s, so a shorter window would show nothing for the first seconds after
a commit and nothing again 10 s later."""
MAX_PAGE = 500
DEFAULT_PAGE = 50


# -- inputs ---------------------------------------------------------------------------------------


@dataclass
class MetaState:
    """The cluster metadata as last read from coordination (``error``: why it could not be)."""

    uri: str = ""
    config: ClusterConfig | None = None
    assignments: ReplicaAssignments | None = None
    servers: dict[int, ServerInfo] = field(default_factory=dict)
    owners: dict[int, PartitionAssignment] = field(default_factory=dict)
    store: dict[int, PartitionStoreMetadata] = field(default_factory=dict)
    overrides: dict[str, tuple[int, ...]] = field(default_factory=dict)
    acl: AccessControl | None = None
    archive: dict[int, ArchiveMark] = field(default_factory=dict)
    error: str | None = None


@dataclass
class Probes:
    """What each HTTP endpoint (by base URL) last answered: its ``/status`` document and
    its parsed ``/metrics`` (absent until read once), or why it did not answer."""

    status: dict[str, dict[str, Any]] = field(default_factory=dict)
    metrics: dict[str, dict[str, list[tuple[dict[str, str], float]]]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    silent_servers: set[int] = field(default_factory=set)
    """Servers whose endpoint answered before and does not now."""
    metrics_read: dict[str, float] = field(default_factory=dict)
    """When each endpoint's ``metrics`` were read (the event loop's time): histogram
    samples are timed by their read, not by the refreshes that reuse them."""


def _total(value: Any) -> Any:
    """A counter's value, or a histogram's count (its last bucket's)."""
    return value[-1][1] if isinstance(value, list) and value else value


class Series:
    """Timed samples of one value (a counter or a set of histogram buckets), kept for
    ``window`` seconds."""

    __slots__ = ("samples", "window")

    def __init__(self, window: float = RATE_WINDOW) -> None:
        self.samples: deque[tuple[float, Any]] = deque()
        self.window = window

    def add(self, now: float, value: Any) -> None:
        if self.samples and _total(value) < _total(self.samples[-1][1]):
            # a counter (or a histogram's count) that went down restarted (the
            # partition moved, the server restarted): the samples before are forgotten
            self.samples.clear()
        self.samples.append((now, value))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window:
            self.samples.popleft()

    def rate(self) -> float | None:
        """Increase per second over the window; None with fewer than two samples."""
        if len(self.samples) < 2:
            return None
        (t0, v0), (t1, v1) = self.samples[0], self.samples[-1]
        return None if t1 <= t0 else max(0.0, (v1 - v0) / (t1 - t0))

    def delta(self) -> Any:
        """The last sample minus the first (for histograms: a bucket list)."""
        if len(self.samples) < 2:
            return None
        first, last = self.samples[0][1], self.samples[-1][1]
        if isinstance(last, list):
            if len(first) != len(last):
                return None
            return [(le, c1 - c0) for (le, c0), (_, c1) in zip(first, last, strict=True)]
        return last - first


class Trackers:
    """Every :class:`Series` the console keeps, by key."""

    def __init__(self) -> None:
        self._series: dict[tuple[Any, ...], Series] = {}

    def add(
        self, key: tuple[Any, ...], now: float, value: Any, window: float = RATE_WINDOW
    ) -> Series:
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = Series(window)
        series.add(now, value)
        return series

    def add_read(
        self, key: tuple[Any, ...], read_at: float, value: Any, window: float = LATENCY_WINDOW
    ) -> Series:
        """Add a sample read at ``read_at`` unless that read is in already (a refresh
        between two reads of ``/metrics`` reuses the last one)."""
        series = self._series.get(key)
        if series is not None and series.samples and series.samples[-1][0] >= read_at:
            return series
        return self.add(key, read_at, value, window)

    def get(self, key: tuple[Any, ...]) -> Series | None:
        return self._series.get(key)

    def forget_except(self, keep: set[tuple[Any, ...]]) -> None:
        for key in [k for k in self._series if k not in keep]:
            del self._series[key]


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]] | None) -> float | None:
    """The ``q`` quantile of cumulative ``(upper bound, count)`` buckets, interpolated
    linearly inside the bucket (Prometheus's ``histogram_quantile``); None without data."""
    if not buckets:
        return None
    ordered = sorted(buckets)
    total = ordered[-1][1]
    if total <= 0:
        return None
    rank = q * total
    counts = [c for _, c in ordered]
    i = bisect.bisect_left(counts, rank)
    i = min(i, len(ordered) - 1)
    upper, count = ordered[i]
    if math.isinf(upper):
        # beyond the last finite bucket: the best known answer is that bound
        return ordered[i - 1][0] if i > 0 else None
    lower, below = (0.0, 0.0) if i == 0 else ordered[i - 1]
    if count == below:
        return upper
    return lower + (upper - lower) * (rank - below) / (count - below)


def merge_buckets(
    histograms: Sequence[Sequence[tuple[float, float]]],
) -> list[tuple[float, float]] | None:
    """The sum of cumulative histograms with the same bounds (the cluster's commit
    latency from its partitions'); None without any."""
    total: dict[float, float] = {}
    for buckets in histograms:
        for le, count in buckets:
            total[le] = total.get(le, 0.0) + count
    return sorted(total.items()) or None


def histogram_buckets(
    samples: Iterable[tuple[dict[str, str], float]], name: str, **labels: str
) -> list[tuple[float, float]]:
    """The cumulative buckets of histogram ``name`` (its ``_bucket`` samples) whose labels
    include ``labels``, sorted by upper bound."""
    found = []
    for sample_labels, value in samples:
        if all(sample_labels.get(k) == v for k, v in labels.items()) and "le" in sample_labels:
            found.append((float(sample_labels["le"]), value))
    return sorted(found)


def metric_value(
    metrics: Mapping[str, list[tuple[dict[str, str], float]]], name: str, **labels: str
) -> float | None:
    for sample_labels, value in metrics.get(name, []):
        if all(sample_labels.get(k) == v for k, v in labels.items()):
            return value
    return None


def redact_uri(uri: str) -> str:
    """``uri`` without its secrets (the page is readable without a login): the password
    of its user part and the value of any query option naming a password, secret or
    token (``?password=...``, ``tls_key_password``), each shown as ``***``."""
    parts = urlsplit(uri)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username}:***@{netloc.rpartition('@')[2]}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(_SECRET.search(k) for k, _ in pairs):
            query = "&".join(
                f"{k}=***" if _SECRET.search(k) else urlencode({k: v}) for k, v in pairs
            )
    if netloc == parts.netloc and query == parts.query:
        return uri
    return urlunsplit(parts._replace(netloc=netloc, query=query))


_SECRET = re.compile(r"password|secret|token", re.IGNORECASE)


# -- the snapshot -----------------------------------------------------------------------------


@dataclass
class Snapshot:
    """Everything one refresh computed, as JSON-able rows."""

    cluster: dict[str, Any]
    servers: list[dict[str, Any]]
    storage: list[dict[str, Any]]
    partitions: list[dict[str, Any]]
    clients: list[dict[str, Any]]
    acl: dict[str, Any] | None = None
    """The ACL (``enforced`` and its ``grants``, one row each), None while there is none."""

    def partition(self, partition_id: int) -> dict[str, Any] | None:
        if 0 <= partition_id < len(self.partitions):
            row = self.partitions[partition_id]
            if row["partition"] == partition_id:
                return row
        return next((r for r in self.partitions if r["partition"] == partition_id), None)


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def build(
    meta: MetaState,
    probes: Probes,
    trackers: Trackers,
    now: float,
    *,
    storage_endpoint: str = "tcp://{}",
) -> Snapshot:
    """The views over ``meta`` and ``probes``; records this refresh's samples in
    ``trackers`` (``now``: the event loop's time) and reads rates from them."""
    server_status: dict[int, dict[str, Any]] = {}
    server_metrics: dict[int, Mapping[str, list[tuple[dict[str, str], float]]]] = {}
    server_urls: dict[int, str] = {}
    read_at: dict[str, float] = {u: probes.metrics_read.get(u, now) for u in probes.metrics}
    storage_status: dict[str, dict[str, Any]] = {}
    storage_metrics: dict[str, Mapping[str, list[tuple[dict[str, str], float]]]] = {}
    storage_urls: dict[str, str] = {}
    for url, status in probes.status.items():
        if status.get("role") == "server" and status.get("server_id") is not None:
            sid = int(status["server_id"])
            server_status[sid] = status
            server_metrics[sid] = probes.metrics.get(url, {})
            server_urls[sid] = url
        elif status.get("role") == "storage":
            storage_status[str(status.get("endpoint"))] = status
            storage_metrics[str(status.get("endpoint"))] = probes.metrics.get(url, {})
            storage_urls[str(status.get("endpoint"))] = url
    keep: set[tuple[Any, ...]] = set()
    key: tuple[Any, ...]

    # partitions ------------------------------------------------------------------------
    num_partitions = meta.config.num_partitions if meta.config is not None else 0
    served: dict[int, tuple[int, dict[str, Any]]] = {}
    for sid, status in server_status.items():
        for row in status.get("partitions", []):
            pid = int(row["partition"])
            owner = meta.owners.get(pid)
            # the status of the owner at the current generation wins over a stale one
            if owner is not None and owner.server_id == sid:
                served[pid] = (sid, row)
            else:
                served.setdefault(pid, (sid, row))
    node_partitions: dict[str, dict[int, dict[str, Any]]] = {}
    for endpoint, status in storage_status.items():
        node_partitions[endpoint] = {int(p["partition"]): p for p in status.get("partitions", [])}

    holders: dict[int, list[str]] = {}
    if meta.assignments is not None:
        for node, hosted_ids in meta.assignments.storage.items():
            for hosted_id in hosted_ids:
                holders.setdefault(hosted_id, []).append(node)
    latency: dict[int, dict[str, list[tuple[float, float]]]] = {}

    def latency_by_partition(sid: int) -> dict[str, list[tuple[float, float]]]:
        """The server's commit latency buckets by partition label (indexed once)."""
        found = latency.get(sid)
        if found is None:
            found = latency[sid] = {}
            samples = server_metrics.get(sid, {})
            for labels, value in samples.get("waltz_server_commit_latency_seconds_bucket", []):
                if "le" in labels and "partition" in labels:
                    found.setdefault(labels["partition"], []).append((float(labels["le"]), value))
            for buckets in found.values():
                buckets.sort()
        return found

    partitions: list[dict[str, Any]] = []
    clients: list[dict[str, Any]] = []
    cluster_latency: list[list[tuple[float, float]]] = []
    total_rate = 0.0
    metrics_seen = [sid for sid, url in server_urls.items() if url in probes.metrics]
    for pid in range(num_partitions):
        owner = meta.owners.get(pid)
        store = meta.store.get(pid)
        live = owner is not None and owner.server_id in meta.servers
        sid_row = served.get(pid)
        row = sid_row[1] if sid_row is not None else None
        hwm = None if row is None else row.get("high_water_mark")
        rate = None
        if hwm is not None:
            key = ("hwm", pid)
            keep.add(key)
            rate = trackers.add(key, now, int(hwm)).rate()
        elif (series := trackers.get(("hwm", pid))) is not None:
            keep.add(("hwm", pid))
            rate = series.rate()
        total_rate += rate or 0.0
        lock_rate = None
        p50 = p99 = None
        if row is not None and sid_row is not None:
            key = ("locks", pid, sid_row[0], row.get("generation"))
            keep.add(key)
            lock_rate = trackers.add(key, now, int(row.get("lock_failures", 0))).rate()
            buckets = latency_by_partition(sid_row[0]).get(str(pid), [])
            if buckets:
                key = ("latency", pid, sid_row[0])
                keep.add(key)
                seen = trackers.get(("metrics", sid_row[0]))
                if trackers.get(key) is None and seen is not None and seen.samples:
                    # a partition's histogram appears with its first commit: it was
                    # empty when this server's metrics were read before
                    trackers.add(
                        key, seen.samples[-1][0], [(le, 0.0) for le, _ in buckets], LATENCY_WINDOW
                    )
                at = read_at.get(server_urls[sid_row[0]], now)
                window = trackers.add_read(key, at, buckets).delta()
                p50 = histogram_quantile(0.5, window)
                p99 = histogram_quantile(0.99, window)
                if window:
                    cluster_latency.append(window)
        archived = meta.archive.get(pid)
        acknowledged: dict[str, int] = dict(row.get("acknowledged", {})) if row else {}
        writable = set(row.get("writable_replicas", [])) if row else set()
        replica_nodes = sorted(holders.get(pid, ()))
        replicas = []
        for node in replica_nodes:
            held = node_partitions.get(storage_endpoint.format(node), {}).get(pid)
            max_id = None if held is None else held.get("max_transaction_id")
            behind = None
            if hwm is not None:
                mark = acknowledged.get(node, max_id)
                behind = None if mark is None else max(0, int(hwm) - int(mark))
            replicas.append(
                {
                    "node": node,
                    "max_transaction_id": max_id,
                    "acknowledged": acknowledged.get(node),
                    "writable": node in writable,
                    "lag": behind,
                }
            )
        partition_clients = [] if row is None else list(row.get("clients", []))
        for client in partition_clients:
            position = int(client["position"])
            clients.append(
                {
                    "partition": pid,
                    "client": str(client["client"]),
                    "position": position,
                    "lag": None if hwm is None else max(0, int(hwm) - position),
                    "server_id": None if sid_row is None else sid_row[0],
                }
            )
        partitions.append(
            {
                "partition": pid,
                "owner": None if owner is None or owner.server_id == NO_SERVER else owner.server_id,
                "owner_endpoint": None if owner is None else owner.endpoint,
                "owner_alive": live,
                "generation": None if owner is None else owner.generation,
                "high_water_mark": hwm,
                "commit_rate": _round(rate),
                "session_id": store.session_id if store is not None else None,
                "state": None if row is None else row.get("state"),
                "serving_session_id": None if row is None else row.get("session_id"),
                "low_water_mark": None if row is None else row.get("low_water_mark"),
                "replicas": replicas,
                "lock_failure_rate": _round(lock_rate),
                "commit_p50_ms": _ms(p50),
                "commit_p99_ms": _ms(p99),
                "clients": len(partition_clients),
                "archive_mark": None if archived is None else archived.mark,
                "archived_bytes": None if archived is None else archived.archived_bytes,
            }
        )

    for sid in metrics_seen:  # after the partitions: "seen before this refresh" above
        keep.add(("metrics", sid))
        trackers.add_read(("metrics", sid), read_at[server_urls[sid]], 0)
    merged = merge_buckets(cluster_latency)

    # servers ---------------------------------------------------------------------------------
    owned: dict[int, list[int]] = {}
    for pid, owner in meta.owners.items():
        owned.setdefault(owner.server_id, []).append(pid)
    leader_ids = [sid for sid, s in server_status.items() if s.get("leader")]
    expected_leader = min(meta.servers) if meta.servers else None
    servers = []
    for sid in sorted(set(meta.servers) | set(server_status)):
        info = meta.servers.get(sid)
        status = server_status.get(sid, {})
        endpoint = info.endpoint if info is not None else str(status.get("endpoint", ""))
        preferred = meta.overrides.get(
            endpoint, info.preferred_partitions if info is not None else ()
        )
        servers.append(
            {
                "server_id": sid,
                "endpoint": endpoint,
                "alive": info is not None,
                "http": server_urls.get(sid),
                "partitions": sorted(owned.get(sid, [])),
                "preferred_partitions": list(preferred),
                "preferred_source": "override" if endpoint in meta.overrides else "config",
                "leader": sid in leader_ids if leader_ids else sid == expected_leader,
                "connected_clients": status.get("connected_clients"),
                "answering": True
                if sid in server_status
                else (False if sid in probes.silent_servers else None),
            }
        )

    # storage nodes ----------------------------------------------------------------------------
    storage = []
    nodes = sorted(meta.assignments.storage) if meta.assignments is not None else []
    for node in nodes:
        node_endpoint = storage_endpoint.format(node)
        node_status = storage_status.get(node_endpoint)
        node_url = storage_urls.get(node_endpoint)
        disk = None if node_status is None else node_status.get("disk")
        fsync_p50 = fsync_p99 = None
        fenced_rate = None
        metrics = storage_metrics.get(node_endpoint, {})
        buckets = histogram_buckets(
            metrics.get("waltz_storage_fsync_latency_seconds_bucket", []),
            "waltz_storage_fsync_latency_seconds_bucket",
        )
        if buckets:
            key = ("fsync", node)
            keep.add(key)
            at = read_at.get(node_url, now) if node_url is not None else now
            window = trackers.add_read(key, at, buckets).delta()
            fsync_p50 = histogram_quantile(0.5, window)
            fsync_p99 = histogram_quantile(0.99, window)
        fenced = sum(v for _, v in metrics.get("waltz_storage_fenced_requests_total", []))
        if metrics:
            key = ("fenced", node)
            keep.add(key)
            fenced_rate = trackers.add(key, now, fenced).rate()
        assert meta.assignments is not None
        storage.append(
            {
                "node": node,
                "group": meta.assignments.group_of(node),
                "up": None if node_status is None else bool(node_status.get("serving")),
                "http": node_url,
                "partitions": list(meta.assignments.partitions_of(node)),
                "hosted": sorted(node_partitions.get(node_endpoint, {})),
                "disk_used": None if disk is None else disk.get("used"),
                "disk_free": None if disk is None else disk.get("free"),
                "disk_size": None if disk is None else disk.get("size"),
                "fsync_p50_ms": _ms(fsync_p50),
                "fsync_p99_ms": _ms(fsync_p99),
                "fenced_requests": fenced if metrics else None,
                "fenced_rate": _round(fenced_rate),
            }
        )
    trackers.forget_except(keep)

    cluster: dict[str, Any] = {
        "coordination": redact_uri(meta.uri),
        "coordination_error": meta.error,
        "cluster_key": None if meta.config is None else str(meta.config.cluster_key),
        "partitions": num_partitions,
        "replicas": None if meta.config is None else meta.config.num_replicas,
        "servers_alive": len(meta.servers),
        "storage_nodes": len(nodes),
        "storage_up": sum(1 for s in storage if s["up"]),
        "commit_rate": round(total_rate, 2),
        "commit_p50_ms": _ms(histogram_quantile(0.5, merged)),
        "commit_p99_ms": _ms(histogram_quantile(0.99, merged)),
        "unowned": sum(1 for p in partitions if not p["owner_alive"]),
        "probe_errors": dict(sorted(probes.errors.items())),
    }
    acl = None
    if meta.acl is not None:
        acl = {"enforced": meta.acl.enforced, "grants": meta.acl.rows()}
        cluster["acl"] = {"enforced": meta.acl.enforced, "keys": len(meta.acl.keys)}
    else:
        cluster["acl"] = None
    return Snapshot(cluster, servers, storage, partitions, clients, acl)


# -- paging -----------------------------------------------------------------------------------


def parse_int(value: str | None, name: str, *, default: int | None = None, minimum: int = 0) -> int:
    """``value`` as an int of at least ``minimum``; ConfigError naming ``name`` otherwise."""
    if value is None or value == "":
        if default is None:
            raise ConfigError(f"{name} is required (a whole number)", key=name)
        return default
    text = value.strip()
    if not text.lstrip("-").isdigit():
        raise ConfigError(f"{name} must be a whole number, got {value!r}", key=name)
    number = int(text)
    if number < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {number}", key=name)
    return number


def page(
    rows: Sequence[dict[str, Any]],
    *,
    offset: int = 0,
    limit: int = DEFAULT_PAGE,
    query: str = "",
    fields: Sequence[str] = (),
) -> dict[str, Any]:
    """One page of ``rows`` (after keeping those whose ``fields`` contain ``query``, or
    equal it when it is a number): ``{"total", "offset", "limit", "rows"}``."""
    if limit < 1 or limit > MAX_PAGE:
        raise ConfigError(f"limit must be from 1 to {MAX_PAGE}, got {limit}", key="limit")
    if offset < 0:
        raise ConfigError(f"offset must be at least 0, got {offset}", key="offset")
    wanted = query.strip().lower()
    if wanted:
        exact = wanted.isdigit()

        def matches(row: dict[str, Any]) -> bool:
            for name in fields:
                value = row.get(name)
                if value is None:
                    continue
                text = str(value).lower()
                if (exact and text == wanted) or (not exact and wanted in text):
                    return True
            return False

        rows = [r for r in rows if matches(r)]
    return {
        "total": len(rows),
        "offset": offset,
        "limit": limit,
        "rows": list(rows[offset : offset + limit]),
    }
