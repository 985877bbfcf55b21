"""Health and metrics over HTTP for Waltz servers and storage nodes.

Each process owns one :class:`prometheus_client.CollectorRegistry` (never the
global one, so several servers or storage nodes can run in one process, as
tests do) holding its metric families (:class:`ServerMetrics`,
:class:`StorageNodeMetrics`), and serves it with an :class:`HttpEndpoint`
(aiohttp, on the process's event loop):

- ``GET /metrics``: the Prometheus text exposition of the registry.
- ``GET /health``: JSON ``{"status": "ok" | "failing", "checks": {name:
  {"ok": bool, "detail": str}}}`` from the checks the process supplies
  (plain or async callables returning a :class:`Check`); HTTP 200 when every
  check passes, 503 otherwise. A check that raises or takes longer than
  ``check_timeout`` counts as failing, with the reason in ``detail``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.process_collector import ProcessCollector

from waltz_api.errors import ConfigError

log = logging.getLogger(__name__)

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


def new_registry(*, process_metrics: bool = True) -> CollectorRegistry:
    """A registry of its own, with the process collector (memory, CPU, open files)."""
    registry = CollectorRegistry(auto_describe=True)
    if process_metrics:
        ProcessCollector(registry=registry)
    return registry


class ServerMetrics:
    """The metric families of a Waltz server (partitions, store sessions, cluster)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
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
            "waltz_server_replica_lag",
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
        self._appends: dict[int, Counter] = {}  # labelled children, for the hot path

    def committed(self, partition_id: int, count: int, latency: float | None = None) -> None:
        """``count`` transactions committed; ``latency`` seconds for the request (if known)."""
        child = self._appends.get(partition_id)
        if child is None:
            child = self._appends[partition_id] = self.appends.labels(str(partition_id))
        child.inc(count)
        if latency is not None:
            self.commit_latency.observe(latency)

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

    def forget_partition(self, partition_id: int, replicas: tuple[str, ...] = ()) -> None:
        """Drop a partition's gauges once this server no longer serves it (counters stay)."""
        label = str(partition_id)
        with suppress(KeyError):
            self.high_water_mark.remove(label)
        for replica in replicas:
            with suppress(KeyError):
                self.replica_lag.remove(label, replica)


class StorageNodeMetrics:
    """The metric families of a storage node."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
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
            "Engine appends (one write and fsync each; queued requests are merged)",
            ["partition"],
            registry=r,
        )
        self.fsync_latency = Histogram(
            "waltz_storage_fsync_latency_seconds",
            "Time of one durable engine append (write and fsync), per batch",
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
        self._append_children: dict[int, tuple[Counter, Counter, Counter]] = {}

    def appended(self, partition_id: int, records: int, data_bytes: int, seconds: float) -> None:
        children = self._append_children.get(partition_id)
        if children is None:
            label = str(partition_id)
            children = self._append_children[partition_id] = (
                self.appended_records.labels(label),
                self.appended_bytes.labels(label),
                self.append_batches.labels(label),
            )
        children[0].inc(records)
        children[1].inc(data_bytes)
        children[2].inc()
        self.fsync_latency.observe(seconds)

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


# -- health -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Check:
    """The outcome of one health check."""

    ok: bool
    detail: str = ""


HealthCheck = Callable[[], Check | Awaitable[Check]]


async def run_checks(
    checks: Mapping[str, HealthCheck], timeout: float = 5.0
) -> tuple[bool, dict[str, dict[str, Any]]]:
    """Run every check (each bounded by ``timeout`` seconds); (all ok, per-check results)."""
    results: dict[str, dict[str, Any]] = {}
    for name, check in checks.items():
        try:
            outcome = check()
            if inspect.isawaitable(outcome):
                outcome = await asyncio.wait_for(outcome, timeout)
            if not isinstance(outcome, Check):
                raise TypeError(f"returned {type(outcome).__name__}, not a Check")
            result = outcome
        except TimeoutError:
            result = Check(False, f"no answer within {timeout:g}s")
        except Exception as exc:
            log.warning("health check %r failed: %s", name, exc)
            result = Check(False, f"{type(exc).__name__}: {exc}")
        results[name] = {"ok": result.ok, "detail": result.detail}
    return all(r["ok"] for r in results.values()), results


# -- the HTTP endpoint -----------------------------------------------------------------------------


def validate_http_address(host: str, port: int, key: str = "http") -> None:
    """ConfigError naming ``key.host`` / ``key.port`` when the address cannot be bound."""
    if not host.strip():
        raise ConfigError(
            f"config key '{key}.host' must be an address to listen on (e.g. '127.0.0.1')",
            f"{key}.host",
        )
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(
            f"config key '{key}.port' must be a TCP port from 0 to 65535 (0 picks a free "
            f"one), got {port!r}",
            f"{key}.port",
        )


class HttpEndpoint:
    """Serves ``/health`` and ``/metrics`` on ``host:port`` (port 0 picks a free one)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        checks: Mapping[str, HealthCheck] | None = None,
        check_timeout: float = 5.0,
        config_key: str = "http",
    ) -> None:
        validate_http_address(host, port, config_key)
        self.registry = registry
        self.host = host
        self.requested_port = port
        self.checks: dict[str, HealthCheck] = dict(checks or {})
        self.check_timeout = check_timeout
        self._config_key = config_key
        self._runner: web.AppRunner | None = None
        self._port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the HTTP endpoint is not started")
        return self._port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def add_check(self, name: str, check: HealthCheck) -> None:
        self.checks[name] = check

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.requested_port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise ConfigError(
                f"cannot serve health and metrics on {self.host}:{self.requested_port}: "
                f"{exc.strerror or exc}; choose another '{self._config_key}.port' or "
                f"'{self._config_key}.host'",
                f"{self._config_key}.port",
            ) from exc
        self._runner = runner
        self._port = _bound_port(runner, self.requested_port)
        log.info("health and metrics on %s (/health, /metrics)", self.url)

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> HttpEndpoint:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _health(self, request: web.Request) -> web.Response:
        ok, results = await run_checks(self.checks, self.check_timeout)
        return web.json_response(
            {"status": "ok" if ok else "failing", "checks": results}, status=200 if ok else 503
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _bound_port(runner: web.AppRunner, requested: int) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return requested
