"""The storage node's metrics: every family at zero before the first event, a registry
per node, and a node (in-process and as a real `waltz storage` process) serving
``/health`` and ``/metrics`` whose counters move with appends and fencing."""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import Counter, Histogram, generate_latest

from waltz_api.contracts.transport import Transport
from waltz_api.errors import ConfigError, SessionFencedError
from waltz_api.http_endpoint import HttpEndpoint, http_get
from waltz_api.metrics import ERROR_KINDS, new_registry, sample_values
from waltz_api.plugins import get_registry
from waltz_api.ports import free_port
from waltz_conformance.records import make_records
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


def _value(text: str, name: str, **labels: str) -> float:
    """A sample's value in a Prometheus exposition (0 when absent)."""
    return next(iter(sample_values(text, name, **labels)), 0.0)


def _label_names(metrics: StorageNodeMetrics, family: str) -> tuple[str, ...]:
    """The label names of the metric behind ``family`` (the client's own record of them:
    a family without samples has none to show)."""
    for value in vars(metrics).values():
        if isinstance(value, Counter | Histogram) and value._name in (family, family + "_total"):
            return tuple(value._labelnames)
    return ()


def test_labelled_counters_exist_at_zero_for_known_labels() -> None:
    """Every counter (and histogram) labelled by partition has a series at zero once the
    partition is hosted, every one labelled by kind for each known kind from the start:
    a dashboard's rate() reads 0, not "No data", before the first event."""
    storage = StorageNodeMetrics(new_registry(process_metrics=False, role="storage"))
    storage.expect_requests(REQUEST_KINDS)
    storage.host_partition(3)
    families = {f.name: f for f in storage.registry.collect()}
    partitioned = [
        f for f in families.values()
        if f.type in ("counter", "histogram") and f.name.startswith("waltz_")
        and "partition" in _label_names(storage, f.name)
    ]  # fmt: skip
    assert partitioned, "no partition-labelled counter found: the check would pass empty"
    for family in partitioned:
        values = [s.value for s in family.samples if s.labels.get("partition") == "3"]
        assert values and all(v == 0 for v in values), family.name
    text = generate_latest(storage.registry).decode()
    for kind in REQUEST_KINDS:
        assert sample_values(text, "waltz_storage_requests_total", kind=kind) == [0.0], kind
    for kind in ERROR_KINDS:
        assert sample_values(text, "waltz_storage_errors_total", kind=kind) == [0.0], kind


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


def test_the_storage_config_refuses_a_bad_http_port(tmp_path: Path) -> None:
    """The storage node's config refuses it before anything starts."""
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
