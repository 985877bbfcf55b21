"""The console's I/O: coordination watches and the processes' HTTP endpoints, refreshed
into a :class:`~waltz_console.views.Snapshot` and a time line of events.

- The cluster metadata comes from watches (live servers, replica assignments,
  preferred partition overrides, the ACL, each partition's assignment, store
  metadata and archive mark): a change refreshes the views at once.
- Every ``interval`` seconds each HTTP endpoint given (servers and storage nodes) is
  asked its ``/status``, and every ``metrics_interval`` seconds its ``/metrics`` (a
  server's at once when its status shows commits on a partition whose latency is not
  known yet: the first commits' latency shows within a refresh or two); a process that
  does not answer is shown as such, never waited for beyond ``probe_timeout``.
- While the coordination service cannot be reached (or holds no cluster) the console
  keeps serving, says why on every page, and retries with back-off.

Time for rates comes from the event loop; the events' timestamps from ``wall_clock``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import re
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from waltz_api.access import AccessControl
from waltz_api.backoff import Backoff
from waltz_api.cluster import (
    ARCHIVE_PARTITION_DIR,
    STORE_PARTITION_DIR,
    ClusterMetadata,
    PartitionAssignment,
    ReplicaAssignments,
    coordination_from_uri,
    decode_archive_mark,
    decode_store_metadata,
)
from waltz_api.contracts.coordination import Coordination, SessionState, Versioned, Watch, join_path
from waltz_api.errors import WaltzError
from waltz_api.http_endpoint import http_get
from waltz_console.events import Event, derive_events
from waltz_console.history import History
from waltz_console.views import (
    MetaState,
    Probes,
    Snapshot,
    Trackers,
    build,
    redact_uri,
)
from waltz_server.server.preferred import PreferredPartitionStore

log = logging.getLogger(__name__)

MAX_EVENTS = 2000
PROMPT_METRICS_SPACING = 2.0
"""Seconds at least between a server's ``/metrics`` reads made early for new commits
(a cluster with many partitions committing now and then reads no more often)."""
WANTED_METRICS = (
    "waltz_server_commit_latency_seconds_bucket",
    "waltz_storage_fsync_latency_seconds_bucket",
    "waltz_storage_fenced_requests_total",
)
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(
    text: str, wanted: Sequence[str] = WANTED_METRICS
) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The samples of the ``wanted`` metric names in a Prometheus text exposition
    (other lines are skipped without being parsed: a server with 1,000 partitions
    exposes tens of thousands of lines)."""
    prefixes = tuple(wanted)
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line.startswith(prefixes):
            continue
        match = _SAMPLE.match(line)
        if match is None or match.group(1) not in wanted:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        labels = {k: v for k, v in _LABEL.findall(match.group(2) or "")}
        found.setdefault(match.group(1), []).append((labels, value))
    return found


class Collector:
    """Keeps :attr:`snapshot` and :attr:`events` current; :meth:`wait_change` lets a
    page's event stream wait for the next refresh."""

    def __init__(
        self,
        uri: str,
        *,
        http_urls: Sequence[str] = (),
        coordination_options: dict[str, Any] | None = None,
        storage_endpoint: str = "tcp://{}",
        interval: float = 1.0,
        metrics_interval: float = 5.0,
        probe_timeout: float = 2.0,
        timeout: float = 5.0,
        wall_clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.uri = uri
        self.http_urls = [u.rstrip("/") for u in http_urls]
        self.coordination_options = dict(coordination_options or {})
        self.storage_endpoint = storage_endpoint
        self.interval = interval
        self.metrics_interval = max(interval, metrics_interval)
        self._next_metrics = 0.0
        self.probe_timeout = probe_timeout
        self.timeout = timeout
        self.wall_clock = wall_clock
        self.started = wall_clock()
        """When the console started (the time line begins there)."""
        self.meta = MetaState(uri=uri, error="connecting to the coordination service ...")
        self.probes = Probes()
        self.trackers = Trackers()
        self.snapshot: Snapshot = build(self.meta, self.probes, self.trackers, 0.0)
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self.history = History()
        """The charts' points (every 5 s, the last 10 minutes)."""
        self.version = 0
        self.coordination: Coordination | None = None
        self.metadata: ClusterMetadata | None = None
        self._event_seq = 0
        self._changed = asyncio.Event()
        self._dirty = asyncio.Event()
        self._lost = asyncio.Event()
        self._watches: list[Watch] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._backoff = Backoff(0.2, 5.0, rng)
        self._marks_at_metrics: dict[str, dict[Any, Any]] = {}
        """Each server's high-water marks when its metrics were read last."""
        self._url_server: dict[str, int] = {}
        """Which server answered last at each URL (to tell who fell silent)."""

    # -- life cycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._follow_coordination(), name="console-coordination"),
            asyncio.create_task(self._refresh_loop(), name="console-refresh"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._disconnect()

    async def wait_change(self, version: int, timeout: float) -> int:
        """Until the next refresh when :attr:`version` is still ``version`` (or ``timeout``
        seconds, or :meth:`wake`); the version then."""
        if self.version == version:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._changed.wait()
        return self.version

    def wake(self) -> None:
        """Return every :meth:`wait_change` now (the console is closing)."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def recent_events(self, after: int = 0) -> list[dict[str, Any]]:
        return [e for e in self.events if e["id"] > after]

    # -- coordination --------------------------------------------------------------------------

    async def _disconnect(self) -> None:
        for watch in self._watches:
            watch.cancel()
        self._watches.clear()
        coordination, self.coordination, self.metadata = self.coordination, None, None
        if coordination is not None:
            with contextlib.suppress(WaltzError, OSError):
                await coordination.close()

    async def _follow_coordination(self) -> None:
        while True:
            try:
                await self._connect()
                self._backoff.reset()
                await self._lost.wait()
                self.meta.error = "the coordination session was lost; reconnecting ..."
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure: show it, retry
                self.meta.error = f"coordination service {redact_uri(self.uri)}: {exc}"
                log.warning("console: %s", self.meta.error)
            self._dirty.set()
            await self._disconnect()
            await self._backoff.sleep()

    async def _connect(self) -> None:
        self._lost.clear()
        coordination = coordination_from_uri(self.uri, self.coordination_options)
        self.coordination = coordination
        # a plugin with its own connect timeout (zk, etcd) gives up by itself then
        own = getattr(coordination, "connect_timeout", None)
        if isinstance(own, int | float) and not isinstance(own, bool) and own > self.timeout:
            coordination.connect_timeout = self.timeout  # type: ignore[attr-defined]
        try:
            async with asyncio.timeout(self.timeout + 5):
                await coordination.start()
        except TimeoutError:
            raise WaltzError(
                f"no answer within {self.timeout + 5:g} s; is it running and reachable?"
            ) from None
        meta = ClusterMetadata(coordination)
        self.metadata = meta
        config = await meta.config()

        def on_session(state: SessionState) -> None:
            if state is SessionState.LOST:
                self._lost.set()
            elif state is SessionState.SUSPENDED:
                self.meta.error = "the coordination connection is suspended; waiting ..."
                self._dirty.set()
            elif state is SessionState.CONNECTED and self.meta.error:
                self.meta.error = None
                self._dirty.set()

        coordination.add_session_listener(on_session)
        # filled by the watches' first calls, shown once complete (a half-read cluster
        # would look like storage nodes and partitions appearing)
        fresh = MetaState(uri=self.uri, config=config)

        async def on_servers(_ids: list[int]) -> None:
            try:
                fresh.servers = {s.server_id: s for s in await meta.servers()}
            except WaltzError as exc:
                log.warning("console: reading the servers failed: %s", exc)
            self._dirty.set()

        def on_assignments(value: ReplicaAssignments | None) -> None:
            fresh.assignments = value
            self._dirty.set()

        def on_overrides(value: Any) -> None:
            fresh.overrides = {str(k): tuple(v) for k, v in dict(value).items()}
            self._dirty.set()

        self._watches.append(await meta.watch_server_ids(on_servers))
        self._watches.append(await meta.watch_replica_assignments(on_assignments))

        def on_acl(value: AccessControl | None) -> None:
            fresh.acl = value
            self._dirty.set()

        self._watches.append(await PreferredPartitionStore(coordination).watch(on_overrides))
        self._watches.append(await meta.watch_access_control(on_acl))
        for pid in range(config.num_partitions):
            self._watches.append(
                await meta.watch_partition_assignment(pid, self._on_owner(fresh, pid))
            )
            path = join_path(STORE_PARTITION_DIR, pid)
            self._watches.append(await coordination.watch(path, self._on_store(fresh, pid, path)))
            path = join_path(ARCHIVE_PARTITION_DIR, pid)
            self._watches.append(await coordination.watch(path, self._on_archive(fresh, pid, path)))
        fresh.error = None
        self.meta = fresh
        self._dirty.set()
        log.info("console: following cluster %s at %s", config.cluster_key, redact_uri(self.uri))

    def _on_owner(self, state: MetaState, pid: int) -> Callable[[PartitionAssignment | None], None]:
        def on_owner(value: PartitionAssignment | None) -> None:
            if value is None:
                state.owners.pop(pid, None)
            else:
                state.owners[pid] = value
            self._dirty.set()

        return on_owner

    def _on_store(
        self, state: MetaState, pid: int, path: str
    ) -> Callable[[Versioned | None], None]:
        def on_store(value: Versioned | None) -> None:
            if value is None:
                state.store.pop(pid, None)
            else:
                try:
                    state.store[pid] = decode_store_metadata(value.value, path, pid)
                except WaltzError as exc:
                    log.warning("console: %s", exc)
            self._dirty.set()

        return on_store

    def _on_archive(
        self, state: MetaState, pid: int, path: str
    ) -> Callable[[Versioned | None], None]:
        def on_archive(value: Versioned | None) -> None:
            if value is None:
                state.archive.pop(pid, None)
            else:
                try:
                    state.archive[pid] = decode_archive_mark(value.value, path, pid)
                except WaltzError as exc:
                    log.warning("console: %s", exc)
            self._dirty.set()

        return on_archive

    # -- HTTP endpoints -------------------------------------------------------------------------

    def _commits_without_latency(self, url: str, status: dict[str, Any]) -> bool:
        """Whether a server's ``status`` shows a high-water mark that moved since its
        metrics were read, on a partition whose commit latency the page does not know."""
        if status.get("role") != "server" or url not in self._marks_at_metrics:
            return False
        last = self.probes.metrics_read.get(url)
        if last is not None and asyncio.get_running_loop().time() - last < PROMPT_METRICS_SPACING:
            return False
        marks = self._marks_at_metrics[url]
        for row in status.get("partitions", []):
            pid, hwm = row.get("partition"), row.get("high_water_mark")
            if hwm is None or pid not in marks or marks[pid] == hwm:
                continue
            shown = self.snapshot.partition(int(pid)) if isinstance(pid, int) else None
            if shown is not None and shown["commit_p99_ms"] is None:
                return True
        return False

    async def _probe(
        self, url: str, with_metrics: bool
    ) -> tuple[str, dict[str, Any] | None, Any, str | None]:
        try:
            status_reply = await http_get(f"{url}/status", self.probe_timeout)
            if status_reply.status != 200:
                return url, None, None, f"/status answered {status_reply.status}"
            status = json.loads(status_reply.body)
            if not isinstance(status, dict):
                return url, None, None, "/status did not answer a JSON object"
            metrics = None
            if with_metrics or self._commits_without_latency(url, status):
                metrics_reply = await http_get(f"{url}/metrics", self.probe_timeout)
                metrics = parse_metrics(metrics_reply.body) if metrics_reply.status == 200 else {}
                self._marks_at_metrics[url] = {
                    row.get("partition"): row.get("high_water_mark")
                    for row in status.get("partitions", [])
                }
            return url, status, metrics, None
        except TimeoutError:
            return url, None, None, f"no answer within {self.probe_timeout:g} s"
        except (OSError, ValueError) as exc:
            return url, None, None, f"{type(exc).__name__}: {exc}"

    async def probe_all(self) -> None:
        """Every endpoint's ``/status``; its ``/metrics`` every ``metrics_interval`` (a
        scrape costs a server with many partitions more than its status; between two,
        the last one read stands)."""
        now = asyncio.get_running_loop().time()
        with_metrics = now >= self._next_metrics
        if with_metrics:
            self._next_metrics = now + self.metrics_interval
        results = await asyncio.gather(*(self._probe(url, with_metrics) for url in self.http_urls))
        probes = Probes()
        for url, status, metrics, error in results:
            if error is not None or status is None:
                probes.errors[url] = error or "no status"
                if url in self._url_server:
                    probes.silent_servers.add(self._url_server[url])
                continue
            if status.get("role") == "server" and status.get("server_id") is not None:
                self._url_server[url] = int(status["server_id"])
            probes.status[url] = status
            if metrics is not None:
                probes.metrics[url] = metrics
                probes.metrics_read[url] = now
            elif url in self.probes.metrics:  # between two reads, the last one stands
                probes.metrics[url] = self.probes.metrics[url]
                probes.metrics_read[url] = self.probes.metrics_read.get(url, now)
        self.probes = probes

    # -- refreshing ----------------------------------------------------------------------------

    def refresh(self) -> None:
        """Rebuild the snapshot from what was read last, and add the events it shows."""
        loop = asyncio.get_running_loop()
        snapshot = build(
            self.meta,
            self.probes,
            self.trackers,
            loop.time(),
            storage_endpoint=self.storage_endpoint,
        )
        first = self.version == 0 or self.snapshot.cluster.get("cluster_key") is None
        events = [] if first else derive_events(self.snapshot, snapshot)
        before_error = self.snapshot.cluster.get("coordination_error")
        if before_error != snapshot.cluster["coordination_error"]:
            if snapshot.cluster["coordination_error"]:
                events.append(Event("coordination", snapshot.cluster["coordination_error"]))
            elif self.version:
                events.append(Event("coordination", f"connected to {redact_uri(self.uri)}"))
        self.add_events(events)
        self.history.record(self.wall_clock(), snapshot)
        self.snapshot = snapshot
        self.version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def add_events(self, events: Sequence[Event]) -> None:
        now = self.wall_clock()
        for event in events:
            self._event_seq += 1
            self.events.append({"id": self._event_seq, "time": now, **event.to_json()})
            log.info("console event: %s", event.message)

    async def _refresh_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_probe = loop.time()
        while True:
            if loop.time() >= next_probe:
                next_probe = loop.time() + self.interval
                await self.probe_all()
                self._dirty.clear()
                self.refresh()
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, next_probe - loop.time())):
                    await self._dirty.wait()
            if self._dirty.is_set():
                # a metadata change: wait a moment for the changes that come with it
                await asyncio.sleep(0.05)
                self._dirty.clear()
                self.refresh()
