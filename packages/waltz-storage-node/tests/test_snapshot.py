"""``waltz storage snapshot`` of a running storage node (a real process, real ZeroMQ,
real fsync) while a writer appends, ``verify-snapshot`` (catching a damaged copy) and
``restore`` into a new node that serves the same records and session info."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from waltz_api.contracts.transport import Transport
from waltz_api.plugins import get_registry
from waltz_api.ports import free_port
from waltz_api.types import LOST_SESSION, Record
from waltz_conformance.records import make_records
from waltz_storage_node import StorageClient
from waltz_storage_node.testing import StorageNodeProcess

pytestmark = [pytest.mark.system, pytest.mark.timeout(180)]

CLUSTER_KEY = uuid.UUID("0b7e3c55-6d1f-4e2a-8c9b-5a4d3e2f1a0b")
PARTITIONS = 3


def _config(tmp_path: Path, name: str, endpoint: str, data_dir: Path) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(
        "\n".join(
            [
                "[storage]",
                f'data_dir = "{data_dir}"',
                f'cluster_key = "{CLUSTER_KEY}"',
                f"num_partitions = {PARTITIONS}",
                "partitions = [0, 1]",
                "[transport]",
                f'endpoint = "{endpoint}"',
                "",
            ]
        )
    )
    return path


def _waltz(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "waltz_cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
async def zmq() -> AsyncIterator[Transport]:
    transport: Transport = get_registry().get("transport", "zmq").factory({})
    try:
        yield transport
    finally:
        await transport.close()


async def _read_all(client: StorageClient, session_id: int, partition_id: int) -> list[Record]:
    highest = await client.max_transaction_id(session_id, partition_id)
    records: list[Record] = []
    while len(records) <= highest:
        records += await client.records(session_id, partition_id, len(records), 1000)
    return records


async def test_snapshot_of_a_running_node_verify_and_restore(
    tmp_path: Path, zmq: Transport
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    node = StorageNodeProcess(
        _config(tmp_path, "source", endpoint, tmp_path / "source"), endpoint, tmp_path / "a.log"
    )
    node.start()
    snapshot = tmp_path / "snap"
    try:
        await node.wait_ready(zmq, timeout=60)
        client = await StorageClient.connect(zmq, endpoint, sender="test")
        try:
            await client.open(CLUSTER_KEY, PARTITIONS)
            await client.append(1, 0, make_records(0, 300, partition_id=0, size=200))
            await client.set_low_water_mark(2, 0, 299)  # session 2 took over at 299
            await client.append(2, 0, make_records(300, 50, partition_id=0, size=200))
            await client.append(1, 1, make_records(0, 10, partition_id=1, size=50))

            async def keep_appending() -> int:
                next_id = 350
                while True:
                    await client.append(2, 0, make_records(next_id, 20, partition_id=0, size=200))
                    next_id += 20
                    await asyncio.sleep(0.01)

            writer = asyncio.create_task(keep_appending())
            taken = await asyncio.to_thread(
                _waltz, "storage", "snapshot", str(snapshot), "--endpoint", endpoint
            )
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            assert taken.returncode == 0, taken.stderr
            assert "snapshot" in taken.stdout and "2 partition(s)" in taken.stdout
            manifest = json.loads((snapshot / "manifest.json").read_text())
            assert manifest["cluster_key"] == str(CLUSTER_KEY)
            copied = manifest["partitions"]["0"]
            assert copied["max_transaction_id"] >= 349
            assert copied["records"] == copied["max_transaction_id"] + 1
            assert copied["session_info"]["session_id"] == 2
            assert copied["session_info"]["low_water_mark"] == 299
            assert manifest["partitions"]["1"]["records"] == 10
            originals = {
                0: (await _read_all(client, 2, 0))[: copied["records"]],
                1: await _read_all(client, 1, 1),
            }
        finally:
            await client.close()
        # the source still serves (the snapshot fenced nothing)
        refused = await asyncio.to_thread(
            _waltz, "storage", "snapshot", str(snapshot), "--endpoint", endpoint
        )
        assert refused.returncode == 1 and "is not empty" in refused.stderr
    finally:
        assert node.terminate() == 0

    verified = _waltz("storage", "verify-snapshot", str(snapshot))
    assert verified.returncode == 0, verified.stderr
    assert "is intact" in verified.stdout

    # restore into a new node's empty directory; it serves the same log and session
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = _config(tmp_path, "restored", endpoint, tmp_path / "restored")
    restored = _waltz("storage", "restore", str(snapshot), "--config", str(config))
    assert restored.returncode == 0, restored.stderr
    again = _waltz("storage", "restore", str(snapshot), "--config", str(config))
    assert again.returncode == 1 and "is not empty" in again.stderr
    node = StorageNodeProcess(config, endpoint, tmp_path / "b.log")
    node.start()
    try:
        await node.wait_ready(zmq, timeout=60)
        listed = _waltz("storage", "list", "--endpoint", endpoint, "--json")
        rows = {row["partition_id"]: row for row in json.loads(listed.stdout)}
        kept = ("session_id", "low_water_mark", "local_low_water_mark")
        assert {k: rows[0]["session_info"][k] for k in kept} == {
            k: copied["session_info"][k] for k in kept
        }
        # marked restored: it rejoins as a suspect replica, never as a voter
        assert rows[0]["session_info"]["low_water_mark_session_id"] == LOST_SESSION
        assert rows[1]["session_info"]["low_water_mark_session_id"] == LOST_SESSION
        client = await StorageClient.connect(zmq, endpoint, sender="test")
        try:
            await client.open(CLUSTER_KEY, PARTITIONS)
            assert await _read_all(client, 2, 0) == originals[0]
            assert await _read_all(client, 1, 1) == originals[1]
        finally:
            await client.close()
    finally:
        assert node.terminate() == 0

    # --keep-marks (a whole cluster restored): the marks stay as copied
    kept_dir = tmp_path / "kept"
    as_copied = _waltz(
        "storage", "restore", str(snapshot), "--data-dir", str(kept_dir), "--keep-marks"
    )
    assert as_copied.returncode == 0, as_copied.stderr
    from waltz_storage_node.snapshot import _open_engine

    engine = await _open_engine("fs", kept_dir, CLUSTER_KEY, PARTITIONS)
    try:
        info = engine.partition(0).session_info()
        assert info.low_water_mark_session_id == copied["session_info"]["low_water_mark_session_id"]
        assert info.low_water_mark_session_id != LOST_SESSION
    finally:
        await engine.close()


async def test_a_damaged_snapshot_is_caught(tmp_path: Path, zmq: Transport) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    node = StorageNodeProcess(
        _config(tmp_path, "source", endpoint, tmp_path / "source"), endpoint, tmp_path / "a.log"
    )
    node.start()
    snapshot = tmp_path / "snap"
    try:
        await node.wait_ready(zmq, timeout=60)
        client = await StorageClient.connect(zmq, endpoint, sender="test")
        try:
            await client.open(CLUSTER_KEY, PARTITIONS)
            await client.append(1, 1, make_records(0, 40, partition_id=1, size=100))
        finally:
            await client.close()
        taken = await asyncio.to_thread(
            _waltz, "storage", "snapshot", str(snapshot), "--endpoint", endpoint
        )
        assert taken.returncode == 0, taken.stderr
    finally:
        assert node.terminate() == 0
    # one record's data changed in the copy (its checksum still the old one), and a
    # manifest that disagrees with the data: both are reported, exit 1
    manifest_path = snapshot / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["partitions"]["1"]["records"] = 39
    manifest_path.write_text(json.dumps(manifest))
    damaged = _waltz("storage", "verify-snapshot", str(snapshot))
    assert damaged.returncode == 1
    assert "is damaged" in damaged.stderr and "partition 1" in damaged.stderr
    refused = _waltz("storage", "restore", str(snapshot), "--data-dir", str(tmp_path / "new"))
    assert refused.returncode == 1 and "is damaged" in refused.stderr
    assert not (tmp_path / "new").exists()
    segments = sorted((snapshot / "data").rglob("*.seg"))
    assert segments
    raw = bytearray(segments[0].read_bytes())
    raw[-5] ^= 0xFF  # inside the last record's data
    segments[0].write_bytes(bytes(raw))
    manifest["partitions"]["1"]["records"] = 40
    manifest_path.write_text(json.dumps(manifest))
    damaged = _waltz("storage", "verify-snapshot", str(snapshot))
    assert damaged.returncode == 1 and "is damaged" in damaged.stderr, damaged.stderr
    assert "no snapshot" not in damaged.stderr
    missing = _waltz("storage", "verify-snapshot", str(tmp_path))
    assert missing.returncode == 1 and "manifest.json is missing" in missing.stderr
