"""Health and metrics over real HTTP (127.0.0.1): the endpoint itself, and
a storage node serving it (in-process through ``serve`` and as a real ``waltz storage``
process) whose metrics follow its appends."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

import pytest
from prometheus_client import Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from waltz_api.errors import ConfigError
from waltz_api.metrics import sample_values
from waltz_api.process import JsonFormatter
from waltz_dev.dev import DevCluster
from waltz_server.observability import (
    ERROR_KINDS,
    SERVER_REQUEST_KINDS,
    Check,
    FeedPosition,
    HttpEndpoint,
    ServerMetrics,
    http_get,
    new_registry,
)

pytestmark = pytest.mark.timeout(120)


async def _get(url: str) -> tuple[int, str, str]:
    reply = await http_get(url, timeout=20)
    return reply.status, reply.content_type, reply.body


async def _raw(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 20)
    writer.close()
    await writer.wait_closed()
    return answer


def _value(text: str, name: str, **labels: str) -> float:
    """A sample's value in a Prometheus exposition (0 when absent)."""
    return next(iter(sample_values(text, name, **labels)), 0.0)


# -- the endpoint ----------------------------------------------------------------------------


async def test_metrics_and_health_over_http() -> None:
    metrics = ServerMetrics()
    healthy = {"storage": True}

    async def storage() -> Check:
        await asyncio.sleep(0)
        return Check(healthy["storage"], "3 of 3 replicas" if healthy["storage"] else "1 of 3")

    def broken() -> Check:
        raise RuntimeError("disk on fire")

    async with HttpEndpoint(
        metrics.registry, host="127.0.0.1", port=0, checks={"storage": storage}
    ) as http:
        assert http.port > 0 and http.url == f"http://127.0.0.1:{http.port}"
        status, content_type, body = await _get(f"{http.url}/metrics")
        assert status == 200 and content_type.startswith("text/plain")
        for family in (
            "waltz_server_commit_latency_seconds",
            "waltz_server_lock_failures",
            "waltz_server_high_water_mark",
            "waltz_server_replica_lag_transactions",
            "waltz_server_recoveries",
            "waltz_server_requests",
            "waltz_server_errors",
            "waltz_build_info",
            "process_resident_memory_bytes",
        ):
            assert f"# TYPE {family}" in body, family
        assert _value(body, "waltz_server_appended_transactions_total", partition="0") == 0

        metrics.committed(0, 5, latency=0.004)
        metrics.committed(0, 2, latency=0.03)
        metrics.lock_failed(1)
        metrics.set_high_water_mark(0, 6)
        metrics.set_replica_lag(0, "127.0.0.1:7001", 3)
        metrics.recovered(0)
        metrics.append_failed(0, "generation")
        _, _, body = await _get(f"{http.url}/metrics")
        assert _value(body, "waltz_server_appended_transactions_total", partition="0") == 7
        latency = "waltz_server_commit_latency_seconds"
        assert _value(body, f"{latency}_count", partition="0") == 2
        assert _value(body, f"{latency}_bucket", partition="0", le="0.005") == 1
        assert _value(body, "waltz_server_lock_failures_total", partition="1") == 1
        assert _value(body, "waltz_server_high_water_mark", partition="0") == 6
        assert (
            _value(
                body,
                "waltz_server_replica_lag_transactions",
                partition="0",
                replica="127.0.0.1:7001",
            )
            == 3
        )
        assert _value(body, "waltz_server_recoveries_total", partition="0") == 1
        assert (
            _value(body, "waltz_server_append_failures_total", partition="0", reason="generation")
            == 1
        )
        metrics.forget_partition(0, ("127.0.0.1:7001",))
        _, _, body = await _get(f"{http.url}/metrics")
        assert 'waltz_server_high_water_mark{partition="0"}' not in body

        status, content_type, body = await _get(f"{http.url}/health")
        assert status == 200 and content_type.startswith("application/json")
        assert '"status": "ok"' in body and "3 of 3 replicas" in body
        healthy["storage"] = False
        http.add_check("broken", broken)
        status, _, body = await _get(f"{http.url}/health")
        assert status == 503 and '"status": "failing"' in body
        assert "1 of 3" in body and "RuntimeError: disk on fire" in body
        status, _, body = await _get(f"{http.url}/readyz")
        assert status == 503 and "RuntimeError: disk on fire" in body
        status, _, body = await _get(f"{http.url}/livez")
        assert status == 200 and '"status": "ok"' in body
        status, _, _ = await _get(f"{http.url}/nothing")
        assert status == 404
        answer = await _raw(http.port, b"POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 405 ")
        answer = await _raw(http.port, b"HEAD /livez HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"\r\n\r\n")
        answer = await _raw(http.port, b"GET /" + b"x" * 9000 + b" HTTP/1.1\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 400 ")
        # a client that sends nothing does not keep the endpoint from answering others
        _, idle = await asyncio.open_connection("127.0.0.1", http.port)
        assert (await _get(f"{http.url}/livez"))[0] == 200
        idle.close()
    with pytest.raises(OSError):
        await _get(f"{http.url}/health")


_series = sample_values


def test_labelled_counters_exist_at_zero_for_known_labels() -> None:
    """Every counter (and histogram) labelled by partition has a series at zero once the
    partition is served, every one labelled by kind for each known kind from the start:
    a dashboard's rate() reads 0, not "No data", before the first event (the storage
    node's families: waltz-storage-node's test_storage_node_metrics.py)."""
    server = ServerMetrics(new_registry(process_metrics=False, role="server"))
    server.serve_partition(3)
    families = {f.name: f for f in server.registry.collect()}
    partitioned = [
        f for f in families.values()
        if f.type in ("counter", "histogram") and f.name.startswith("waltz_")
        and "partition" in _label_names(server, f.name)
    ]  # fmt: skip
    assert partitioned, "no partition-labelled counter found: the check would pass empty"
    for family in partitioned:
        values = [s.value for s in family.samples if s.labels.get("partition") == "3"]
        assert values and all(v == 0 for v in values), family.name
    text = _exposition(server)
    for kind in SERVER_REQUEST_KINDS:
        assert _series(text, "waltz_server_requests_total", kind=kind) == [0.0], kind
    for kind in ERROR_KINDS:
        assert _series(text, "waltz_server_errors_total", kind=kind) == [0.0], kind


def _label_names(metrics: ServerMetrics, family: str) -> tuple[str, ...]:
    """The label names of the metric behind ``family`` (the client's own record of them:
    a family without samples has none to show)."""
    for value in vars(metrics).values():
        if isinstance(value, Counter | Histogram) and value._name in (family, family + "_total"):
            return tuple(value._labelnames)
    return ()


def _exposition(metrics: ServerMetrics) -> str:
    return generate_latest(metrics.registry).decode()


async def test_a_dev_clusters_counters_read_zero_before_any_client(tmp_path: Path) -> None:
    """Real processes (``waltz dev --metrics``): before any client came, each served or
    hosted partition has its counters at zero on /metrics, and each request and error
    kind its series."""
    cluster = DevCluster(tmp_path / "dev", partitions=2, metrics=True)
    try:
        await cluster.start()
        urls = dict(cluster.metrics_urls)
        scraped = {name: (await _get(f"{url}/metrics"))[2] for name, url in urls.items()}
    finally:
        await cluster.stop()
    servers = [text for name, text in scraped.items() if name.startswith("server")]
    nodes = [text for name, text in scraped.items() if name.startswith("storage")]
    assert len(servers) == 1 and len(nodes) == 3, sorted(scraped)
    (server,) = servers
    for partition in ("0", "1"):
        for name in (
            "waltz_server_appended_transactions_total",
            "waltz_server_commit_latency_seconds_count",
            "waltz_server_lock_failures_total",
            "waltz_server_archive_failures_total",
            "waltz_server_archived_records_total",
            "waltz_server_archive_orphans_rejected_total",
        ):
            assert _series(server, name, partition=partition) == [0.0], (name, partition)
        assert _series(server, "waltz_server_recoveries_total", partition=partition)
        failures = "waltz_server_append_failures_total"
        assert _series(server, failures, partition=partition, reason="generation") == [0.0]
        for node in nodes:
            for name in (
                "waltz_storage_appended_records_total",
                "waltz_storage_append_batches_total",
                "waltz_storage_append_latency_seconds_count",
                "waltz_storage_fenced_requests_total",
                "waltz_storage_sessions_fenced_total",
            ):
                assert len(_series(node, name, partition=partition)) == 1, (name, partition)
    for kind in ("AppendRequest", "MountRequest", "HighWaterMarkRequest"):
        assert _series(server, "waltz_server_requests_total", kind=kind) == [0.0], kind
    for kind in ("not_committed", "access_denied", "stale_generation"):
        assert _series(server, "waltz_server_errors_total", kind=kind) == [0.0], kind
    for node in nodes:
        assert _series(node, "waltz_storage_requests_total", kind="TruncateRequest")
        assert _series(node, "waltz_storage_errors_total", kind="fenced") == [0.0]


async def test_build_info_and_no_created_series() -> None:
    metrics = ServerMetrics()
    metrics.committed(0, 1, latency=0.001)
    metrics.request("AppendRequest")
    metrics.error("stale_generation")
    async with HttpEndpoint(metrics.registry) as http:
        _, _, body = await _get(f"{http.url}/metrics")
    assert "_created" not in body
    build = [
        s
        for f in text_string_to_metric_families(body)
        for s in f.samples
        if s.name == "waltz_build_info"
    ]
    assert len(build) == 1 and build[0].value == 1
    assert build[0].labels["role"] == "server" and build[0].labels["version"]
    assert _value(body, "waltz_server_requests_total", kind="AppendRequest") == 1
    assert _value(body, "waltz_server_errors_total", kind="stale_generation") == 1


async def test_connected_clients_and_feed_lag_are_read_when_scraped() -> None:
    metrics = ServerMetrics(new_registry(process_metrics=False))
    feeds = [FeedPosition(0, "client:1", 7, 10), FeedPosition(1, "client:2", 5, 5)]
    connected = {"n": 2}
    metrics.watch_clients(lambda: connected["n"], lambda: feeds)
    async with HttpEndpoint(metrics.registry) as http:
        _, _, body = await _get(f"{http.url}/metrics")
        lag = "waltz_server_feed_lag_transactions"
        assert _value(body, lag, partition="0", client="client:1") == 3
        assert _value(body, lag, partition="1", client="client:2") == 0
        assert _value(body, "waltz_server_connected_clients") == 2
        feeds.pop(0)
        connected["n"] = 1
        _, _, body = await _get(f"{http.url}/metrics")
        assert 'client="client:1"' not in body
        assert _value(body, "waltz_server_connected_clients") == 1

        def broken() -> int:
            raise RuntimeError("gone")

        metrics.watch_clients(broken, lambda: feeds)  # a failing callback: logged, no data
        status, _, body = await _get(f"{http.url}/metrics")
        assert status == 200 and "waltz_server_high_water_mark" in body


async def test_bad_addresses_get_a_clear_error() -> None:
    registry = new_registry(process_metrics=False)
    with pytest.raises(ConfigError, match=r"'http.port' must be a TCP port from 0 to 65535") as e:
        HttpEndpoint(registry, port=70000)
    assert e.value.key == "http.port"
    with pytest.raises(ConfigError, match=r"http\.host"):
        HttpEndpoint(registry, host=" ")
    async with HttpEndpoint(registry) as taken:
        with pytest.raises(ConfigError, match=f"127.0.0.1:{taken.port}.*choose another") as e:
            await HttpEndpoint(registry, port=taken.port).start()
        assert e.value.key == "http.port"


def test_json_log_lines_carry_partition_and_session_fields() -> None:
    formatter = JsonFormatter()

    def line(message: str, *args: object, **extra: object) -> dict[str, object]:
        record = logging.LogRecord("waltz.x", logging.INFO, __file__, 1, message, args, None)
        record.__dict__.update(extra)
        entry: dict[str, object] = json.loads(formatter.format(record))
        return entry

    entry = line("partition %d: store session %d open at high-water mark %d", 3, 7, 99)
    assert entry["partition"] == 3 and entry["session"] == 7 and entry["level"] == "INFO"
    assert entry["message"] == "partition 3: store session 7 open at high-water mark 99"
    assert "partition" not in line("server %d ready", 1)
    assert line("partition 3 moved", partition=5)["partition"] == 5
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("w", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    assert "ValueError: boom" in json.loads(formatter.format(record))["exception"]
