"""Scrubbing on a storage node (in-process, the memory transport, the fs engine): the
``[storage.scrub]`` keys, the rate bound, damage found closing the connections that serve
that partition (so that their server rejoins and repairs it), the metrics, the admin
command and ``waltz storage scrub`` on a stopped node's directory. The same with real
processes and a real server: test_scrub_processes.py."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client import generate_latest

from waltz_api.capabilities import SCRUB
from waltz_api.contracts.transport import Transport
from waltz_api.errors import ConfigError, StorageError, TransportError
from waltz_api.plugins import get_registry
from waltz_cli import main
from waltz_conformance.records import make_record
from waltz_storage_fs import tools
from waltz_storage_fs.engine import FsStorageEngine
from waltz_storage_node import StorageAdminClient, StorageClient, StorageNode
from waltz_storage_node.config import load_storage_config
from waltz_storage_node.metrics import StorageNodeMetrics
from waltz_storage_node.scrub import CHUNK_BYTES, Pacer, Scrubber

pytestmark = pytest.mark.timeout(120)

KEY = uuid.UUID("7a1c3d7e-0a4f-4c1e-9a51-3d2b8f6e7c90")
PARTITIONS = 2
OPTIONS = {"segment_size": 2048, "index_checkpoint_interval": 8}
LAST = 199


def _transport() -> Transport:
    transport: Transport = get_registry().get("transport", "memory").factory({})
    return transport


async def _filled(directory: Path) -> FsStorageEngine:
    engine = await FsStorageEngine.open(
        str(directory), cluster_key=KEY, num_partitions=PARTITIONS, options=OPTIONS
    )
    for pid in range(PARTITIONS):
        part = await engine.add_partition(pid)
        for first in range(0, LAST + 1, 10):
            await part.append([make_record(t, pid) for t in range(first, first + 10)])
    return engine


def _flip(directory: Path, pid: int, txid: int) -> None:
    path, start, end = tools.find_record(directory, pid, txid)
    with path.open("r+b") as f:
        f.seek((start + end) // 2)
        byte = f.read(1)[0]
        f.seek((start + end) // 2)
        f.write(bytes([byte ^ 0x04]))


def _sealed_victim(engine: FsStorageEngine, pid: int) -> int:
    extents = engine.partition(pid).local_extents()
    assert len(extents) >= 4, extents
    return extents[len(extents) // 2].first + 1


class Node:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.node: StorageNode | None = None
        self.metrics = StorageNodeMetrics()
        self.server_transport = _transport()
        self.client_transport = _transport()
        self.clients: list[StorageClient] = []

    async def start(self, scrub: dict[str, Any] | None = None) -> StorageNode:
        engine = await _filled(self.directory)
        self.node = StorageNode(
            engine,
            self.server_transport,
            f"memory://scrub-{uuid.uuid4()}",
            metrics=self.metrics,
            capabilities=frozenset({SCRUB}),
        )
        if scrub is not None:
            self.node.scrubber = Scrubber(self.node, **scrub)
        await self.node.start()
        return self.node

    async def client(self) -> StorageClient:
        assert self.node is not None
        client = await StorageClient.connect(
            self.client_transport, self.node.endpoint, sender="test"
        )
        self.clients.append(client)
        await client.open(KEY, PARTITIONS)
        return client

    def metric(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        assert value is not None, (name, labels)
        return value

    async def close(self) -> None:
        for client in self.clients:
            await client.close()
        if self.node is not None:
            await self.node.close()
        await self.server_transport.close()
        await self.client_transport.close()


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    fixture = Node(tmp_path / "data")
    try:
        yield fixture
    finally:
        await fixture.close()


def _base_config(tmp_path: Path, scrub: str) -> Path:
    path = tmp_path / "storage.toml"
    path.write_text(
        f'[storage]\ndata_dir = "{tmp_path}/d"\n[storage.scrub]\n{scrub}\n'
        '[transport]\nendpoint = "tcp://127.0.0.1:1"\n'
    )
    return path


@pytest.mark.parametrize(
    ("scrub", "message"),
    [
        ("rate_bytes_per_second = 0", "'storage.scrub.rate_bytes_per_second' must be"),
        ("interval = -1.0", "'storage.scrub.interval' must be a number of seconds"),
        ("interval = inf", "'storage.scrub.interval' must be a number of seconds"),
        ("rate = 5", "unknown config key 'storage.scrub.rate'"),
    ],
)
def test_scrub_config_is_validated(tmp_path: Path, scrub: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_storage_config(_base_config(tmp_path, scrub), env={})


def test_scrub_config_defaults_and_environment(tmp_path: Path) -> None:
    config = load_storage_config(_base_config(tmp_path, ""), env={})
    assert config.storage.scrub.enabled
    assert config.storage.scrub.rate_bytes_per_second == 4 * 1024 * 1024
    assert config.storage.scrub.interval == 86400.0
    config = load_storage_config(
        _base_config(tmp_path, ""),
        env={"WALTZ_STORAGE__SCRUB__RATE_BYTES_PER_SECOND": "1000"},
    )
    assert config.storage.scrub.rate_bytes_per_second == 1000


async def test_a_pass_reads_within_the_rate(node: Node) -> None:
    """Bytes read by time t never exceed rate * t + one call's budget: the pass takes at
    least (bytes - chunk) / rate."""
    started_node = await node.start()
    rate = 3000
    scrubber = Scrubber(started_node, rate_bytes_per_second=rate, interval=0.0)
    started = time.monotonic()
    (result,) = await scrubber.run_pass([0])
    elapsed = time.monotonic() - started
    chunk = Pacer(rate).chunk
    assert chunk == rate and result.complete and not result.damaged
    assert result.bytes_read > 3 * chunk
    assert elapsed >= (result.bytes_read - chunk) / rate, (elapsed, result.bytes_read)
    unbounded = Scrubber(started_node, rate_bytes_per_second=None, interval=0.0)
    (again,) = await unbounded.run_pass([0])
    assert again.bytes_read == result.bytes_read
    assert Pacer(None).chunk == CHUNK_BYTES


async def test_damage_closes_the_connections_serving_that_partition(node: Node) -> None:
    """The scrub finds a flipped byte, the range is missing, the connection that sent
    requests for that partition is closed (its server rejoins, and a rejoin repairs), one
    that served only another partition is not; the counters say so."""
    started_node = await node.start()
    assert node.metric("waltz_storage_scrub_last_pass_timestamp_seconds") == 0
    scrubber = Scrubber(started_node, rate_bytes_per_second=None, interval=0.0)
    serving_0, serving_1 = await node.client(), await node.client()
    assert await serving_0.max_transaction_id(1, 0) == LAST
    assert await serving_1.max_transaction_id(1, 1) == LAST
    engine = started_node.engine
    assert isinstance(engine, FsStorageEngine)
    victim = _sealed_victim(engine, 0)
    _flip(node.directory, 0, victim)

    results = await scrubber.run_pass()
    assert [r.damaged for r in results] == [[(victim, victim)], []]
    assert engine.partition(0).missing_ranges() == [(victim, victim)]
    with pytest.raises(TransportError):
        await serving_0.max_transaction_id(1, 0)
    assert await serving_1.max_transaction_id(1, 1) == LAST
    fresh = await node.client()  # the server connects again: the range is reported
    assert await fresh.missing_range(1, 0) == (victim, victim)
    await fresh.repair(1, 0, [make_record(victim, 0)])
    assert await fresh.record(1, 0, victim) == make_record(victim, 0)

    assert node.metric("waltz_storage_scrub_damaged_records_total", partition="0") == 1
    assert node.metric("waltz_storage_scrub_damaged_records_total", partition="1") == 0
    sealed = sum(e.last - e.first + 1 for e in engine.partition(1).local_extents()[:-1])
    assert node.metric("waltz_storage_scrubbed_records_total", partition="1") == sealed
    assert node.metric("waltz_storage_scrubbed_bytes_total", partition="1") > 0
    assert node.metric("waltz_storage_scrub_last_pass_timestamp_seconds") > 1e9
    assert b"waltz_storage_scrub_damaged_records_total" in generate_latest(node.metrics.registry)


async def test_the_background_scrub_finds_damage_by_itself(node: Node) -> None:
    started_node = await node.start(
        {"rate_bytes_per_second": 1 << 20, "interval": 0.05}  # passes back to back
    )
    # counters exist at zero before the first damage, for rate() and increase()
    assert node.metric("waltz_storage_scrub_damaged_records_total", partition="0") == 0
    engine = started_node.engine
    assert isinstance(engine, FsStorageEngine)
    victim = _sealed_victim(engine, 1)
    _flip(node.directory, 1, victim)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while engine.partition(1).missing_ranges() != [(victim, victim)]:
        assert loop.time() < deadline, "the background scrub did not find the damage"
        await asyncio.sleep(0.05)
    # the engine publishes the hole (committer thread) before the scrub's call returns
    # to the node, which then counts it
    while node.metric("waltz_storage_scrub_damaged_records_total", partition="1") != 1:
        assert loop.time() < deadline, "the damage found was not counted"
        await asyncio.sleep(0.05)
    assert started_node.scrubber is not None


async def test_the_admin_command_runs_a_pass_now(node: Node) -> None:
    started_node = await node.start()
    engine = started_node.engine
    assert isinstance(engine, FsStorageEngine)
    victim = _sealed_victim(engine, 0)
    _flip(node.directory, 0, victim)
    admin = await StorageAdminClient.connect(node.client_transport, started_node.endpoint)
    try:
        result = await admin.command("scrub", timeout=None, partition_id=0)
        (row,) = result["partitions"]
        assert row["damaged"] == [[victim, victim]] and row["complete"]
        assert row["missing_ranges"] == [[victim, victim]]
        result = await admin.command("scrub", timeout=None, rate_bytes_per_second=0)
        assert [r["damaged"] for r in result["partitions"]] == [[], []]
        with pytest.raises(StorageError, match="rate_bytes_per_second must be an integer"):
            await admin.command("scrub", rate_bytes_per_second=-1)
        started_node.capabilities = frozenset()
        with pytest.raises(StorageError, match="does not scrub"):
            await admin.command("scrub")
    finally:
        await admin.close()


def test_waltz_storage_scrub_on_a_stopped_nodes_directory(tmp_path: Path) -> None:
    data = tmp_path / "data"

    async def build() -> int:
        engine = await _filled(data)
        victim = _sealed_victim(engine, 1)
        await engine.close()
        return victim

    victim = asyncio.run(build())
    _flip(data, 1, victim)
    runner = CliRunner()
    options = ["--engine-option", "segment_size=2048"]
    result = runner.invoke(main, ["storage", "scrub", "--data-dir", str(data), *options])
    assert result.exit_code == 1, result.output
    assert "partition 0: " in result.output and ", no damage" in result.output
    assert f"DAMAGED {victim}..{victim}: moved aside" in result.output
    result = runner.invoke(
        main, ["storage", "scrub", "--data-dir", str(data), "--partition", "1", "-o", "json"]
    )
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)["partitions"]
    assert row["damaged"] == [] and row["missing_ranges"] == [[victim, victim]]
    (entry,) = tools.list_quarantine(data)
    assert f"a scrub found transactions {victim}..{victim}" in entry.readme
    result = runner.invoke(main, ["storage", "scrub", "--data-dir", str(data), "--engine", "x"])
    assert result.exit_code == 1 and "--engine" in result.output
    result = runner.invoke(main, ["storage", "scrub"])
    assert result.exit_code == 2 and "--endpoint" in result.output
