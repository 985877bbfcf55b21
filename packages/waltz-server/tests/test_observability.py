"""Health and metrics over real HTTP (127.0.0.1): the endpoint itself, and
a storage node serving it (in-process through ``serve`` and as a real ``waltz storage``
process) whose metrics follow its appends."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from waltz_api.contracts.transport import Transport
from waltz_api.errors import ConfigError, SessionFencedError
from waltz_api.plugins import get_registry
from waltz_api.ports import free_port
from waltz_api.process import JsonFormatter
from waltz_conformance.records import make_records
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
from waltz_storage_node import StorageClient
from waltz_storage_node.config import load_storage_config
from waltz_storage_node.main import serve
from waltz_storage_node.metrics import StorageNodeMetrics
from waltz_storage_node.node import REQUEST_KINDS
from waltz_storage_node.testing import StorageNodeProcess

pytestmark = pytest.mark.timeout(120)

CLUSTER_KEY = uuid.UUID("7a0c6f55-2d1b-4e8e-9b4a-1c2d3e4f5a6b")
NUM_PARTITIONS = 4


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
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


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


def _series(text: str, name: str, **labels: str) -> list[float]:
    """The values of a family's samples with these labels (none when absent)."""
    return [
        float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    ]


def test_labelled_counters_exist_at_zero_for_known_labels() -> None:
    """Every counter (and histogram) labelled by partition has a series at zero once the
    partition is served or hosted, every one labelled by kind for each known kind from
    the start: a dashboard's rate() reads 0, not "No data", before the first event."""
    server = ServerMetrics(new_registry(process_metrics=False, role="server"))
    storage = StorageNodeMetrics(new_registry(process_metrics=False, role="storage"))
    storage.expect_requests(REQUEST_KINDS)
    server.serve_partition(3)
    storage.host_partition(3)
    for metrics in (server, storage):
        families = {f.name: f for f in metrics.registry.collect()}
        partitioned = [
            f for f in families.values()
            if f.type in ("counter", "histogram") and f.name.startswith("waltz_")
            and "partition" in _label_names(metrics, f.name)
        ]  # fmt: skip
        assert partitioned, "no partition-labelled counter found: the check would pass empty"
        for family in partitioned:
            values = [s.value for s in family.samples if s.labels.get("partition") == "3"]
            assert values and all(v == 0 for v in values), family.name
    text = "\n".join(
        sample_line
        for metrics in (server, storage)
        for sample_line in _exposition(metrics).splitlines()
    )
    for kind in SERVER_REQUEST_KINDS:
        assert _series(text, "waltz_server_requests_total", kind=kind) == [0.0], kind
    for kind in REQUEST_KINDS:
        assert _series(text, "waltz_storage_requests_total", kind=kind) == [0.0], kind
    for kind in ERROR_KINDS:
        assert _series(text, "waltz_server_errors_total", kind=kind) == [0.0], kind
        assert _series(text, "waltz_storage_errors_total", kind=kind) == [0.0], kind


def _label_names(metrics: ServerMetrics | StorageNodeMetrics, family: str) -> tuple[str, ...]:
    """The label names of the metric behind ``family`` (the client's own record of them:
    a family without samples has none to show)."""
    for value in vars(metrics).values():
        if isinstance(value, Counter | Histogram) and value._name in (family, family + "_total"):
            return tuple(value._labelnames)
    return ()


def _exposition(metrics: ServerMetrics | StorageNodeMetrics) -> str:
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


async def test_two_registries_in_one_process_are_independent() -> None:
    first, second = StorageNodeMetrics(), StorageNodeMetrics(new_registry(process_metrics=False))
    first.appended(0, 10, 1000, 0.002)
    async with HttpEndpoint(first.registry) as a, HttpEndpoint(second.registry) as b:
        assert a.port != b.port
        _, _, body_a = await _get(f"{a.url}/metrics")
        _, _, body_b = await _get(f"{b.url}/metrics")
    assert _value(body_a, "waltz_storage_appended_records_total", partition="0") == 10
    assert _value(body_b, "waltz_storage_appended_records_total", partition="0") == 0
    assert "process_resident_memory_bytes" not in body_b


async def test_bad_addresses_get_a_clear_error(tmp_path: Path) -> None:
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
    # The storage node's config refuses it before anything starts.
    config = tmp_path / "storage.toml"
    config.write_text(
        f'[storage]\ndata_dir = "{tmp_path}"\n[transport]\nendpoint = "tcp://127.0.0.1:1"\n'
        "[http]\nenabled = true\nport = 70000\n"
    )
    with pytest.raises(ConfigError, match=r"'http\.port' must be at most 65535") as e:
        load_storage_config(config, env={})
    assert e.value.key == "http.port"


# -- a storage node serving it ------------------------------------------------------------------


def _storage_config(
    tmp_path: Path, endpoint: str, http_port: int, log_format: str = "text"
) -> Path:
    path = tmp_path / "storage.toml"
    path.write_text(
        "\n".join(
            [
                f'log_format = "{log_format}"',
                "[storage]",
                f'data_dir = "{tmp_path / "data"}"',
                'engine = "fs"',
                f'cluster_key = "{CLUSTER_KEY}"',
                f"num_partitions = {NUM_PARTITIONS}",
                "partitions = [0, 1]",
                "[transport]",
                'plugin = "zmq"',
                f'endpoint = "{endpoint}"',
                "[http]",
                "enabled = true",
                'host = "127.0.0.1"',
                f"port = {http_port}",
                "",
            ]
        )
    )
    return path


@pytest.fixture
async def zmq() -> AsyncIterator[Transport]:
    transport: Transport = get_registry().get("transport", "zmq").factory({})
    try:
        yield transport
    finally:
        await transport.close()


async def _wait_healthy(url: str, timeout: float = 60) -> str:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            status, _, body = await _get(f"{url}/health")
            if status == 200:
                return body
        except OSError:
            pass
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"{url}/health did not answer 200 within {timeout}s")
        await asyncio.sleep(0.1)


async def _appends_move_the_metrics(url: str, transport: Transport, endpoint: str) -> None:
    _, _, before = await _get(f"{url}/metrics")
    assert _value(before, "waltz_storage_appended_records_total", partition="0") == 0
    client = await StorageClient.connect(transport, endpoint, sender="test")
    try:
        await client.open(CLUSTER_KEY, NUM_PARTITIONS)
        records = make_records(0, 5, partition_id=0, size=100)
        for record in records:
            await client.append(1, 0, [record])
        await client.append(1, 1, make_records(0, 3, partition_id=1, size=10))
        await client.max_transaction_id(2, 0)  # session 2 supersedes (fences) session 1
        with pytest.raises(SessionFencedError):
            await client.append(1, 0, make_records(5, 1, partition_id=0))
    finally:
        await client.close()
    _, _, after = await _get(f"{url}/metrics")
    assert _value(after, "waltz_storage_appended_records_total", partition="0") == 5
    data_bytes = sum(len(record.data) for record in records)
    assert _value(after, "waltz_storage_appended_bytes_total", partition="0") == data_bytes
    assert _value(after, "waltz_storage_appended_records_total", partition="1") == 3
    batches = _value(after, "waltz_storage_append_batches_total", partition="0")
    assert 1 <= batches <= 5
    append = "waltz_storage_append_latency_seconds"
    assert _value(after, f"{append}_count", partition="0") == batches
    # fsync alone: one per group commit (the appends and the session's write), each
    # shorter than the append (write and fsync) it belongs to
    fsyncs = _value(after, "waltz_storage_fsync_latency_seconds_count")
    assert fsyncs >= 1
    assert _value(after, "waltz_storage_fsync_latency_seconds_sum") > 0
    assert _value(after, "waltz_storage_fsync_latency_seconds_sum") < (
        _value(after, f"{append}_sum", partition="0")
        + _value(after, f"{append}_sum", partition="1")
    )
    assert _value(after, "waltz_storage_max_transaction_id", partition="0") == 4
    assert _value(after, "waltz_storage_max_transaction_id", partition="1") == 2
    assert _value(after, "waltz_storage_partition_available", partition="0") == 1
    assert _value(after, "waltz_storage_disk_used_bytes") > data_bytes
    free = _value(after, "waltz_storage_filesystem_free_bytes")
    assert 0 < free <= _value(after, "waltz_storage_filesystem_size_bytes")
    assert "waltz_build_info{" in after and 'role="storage"' in after
    assert _value(after, "waltz_storage_sessions_fenced_total", partition="0") == 1
    assert _value(after, "waltz_storage_fenced_requests_total", partition="0") == 1
    requests = "waltz_storage_requests_total"
    assert _value(after, requests, kind="StorageAppendRequest") == 7  # 5 + 1 + the fenced one
    assert _value(after, requests, kind="StorageOpenRequest") == 1
    assert _value(after, "waltz_storage_errors_total", kind="fenced") == 1


async def test_storage_node_serves_health_and_metrics(tmp_path: Path, zmq: Transport) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    http_port = free_port()
    config = load_storage_config(_storage_config(tmp_path, endpoint, http_port), env={})
    stop = asyncio.Event()
    node = asyncio.create_task(serve(config, stop))
    url = f"http://127.0.0.1:{http_port}"
    try:
        body = await _wait_healthy(url)
        assert '"transport"' in body and "listening on" in body and "2 hosted" in body
        assert '"caught_up"' in body
        await _appends_move_the_metrics(url, zmq, endpoint)
    finally:
        stop.set()
        await asyncio.wait_for(node, 30)
    with pytest.raises(OSError):
        await _get(f"{url}/health")


async def test_storage_node_with_a_taken_http_port_stops_with_a_clear_error(
    tmp_path: Path,
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        config = load_storage_config(_storage_config(tmp_path, endpoint, taken), env={})
        with pytest.raises(ConfigError, match=r"http\.port") as e:
            await asyncio.wait_for(serve(config, asyncio.Event()), 30)
        assert e.value.key == "http.port"


async def test_storage_node_process_serves_metrics(tmp_path: Path, zmq: Transport) -> None:
    """A real `waltz storage` process with JSON logs: metrics over HTTP, and on SIGTERM
    a clean exit whose every stderr line is one JSON object."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    http_port = free_port()
    node = StorageNodeProcess(
        _storage_config(tmp_path, endpoint, http_port, log_format="json"),
        endpoint,
        tmp_path / "node.log",
    )
    node.start()
    try:
        await node.wait_ready(zmq, timeout=60)
        url = f"http://127.0.0.1:{http_port}"
        await _wait_healthy(url)
        await _appends_move_the_metrics(url, zmq, endpoint)
        assert node.terminate(timeout=30) == 0
    finally:
        node.kill()
    entries = [json.loads(line) for line in node.output().splitlines() if line.strip()]
    assert entries and all({"time", "level", "logger", "message", "pid"} <= set(e) for e in entries)
    assert any("storage node ready on" in e["message"] for e in entries)
    fenced = [e for e in entries if "session 2 supersedes" in e["message"]]
    assert fenced and fenced[0]["partition"] == 0 and fenced[0]["session"] == 2
    assert entries[-1]["message"] == "storage node stopped"


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
