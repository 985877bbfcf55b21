"""The storage node as a real process: `waltz storage --config`, ZeroMQ, the fs engine.

Every node is a child process stopped by its pid (also on failure). Covers:
durability of acknowledged appends across kill -9, fencing that survives a
kill -9 and restart, the admin CLI against a running node, clean shutdown on
SIGTERM, malformed frames over real sockets, and bad config.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from waltz_api import wire
from waltz_api.contracts.transport import Transport
from waltz_api.errors import (
    ClusterKeyMismatchError,
    ConnectionClosedError,
    SessionFencedError,
    WaltzError,
)
from waltz_api.messages import ErrorCode, FailureResponse
from waltz_api.plugins import get_registry
from waltz_api.ports import free_port
from waltz_api.types import LOST_SESSION, SessionInfo
from waltz_conformance.records import make_record, make_records
from waltz_storage_node import StorageAdminClient, StorageClient
from waltz_storage_node.testing import StorageNodeProcess

pytestmark = [pytest.mark.system, pytest.mark.timeout(180)]

CLUSTER_KEY = uuid.UUID("0d7f3e2a-8b41-4c55-a0e3-6f1e2d9c4b77")
NUM_PARTITIONS = 16


def _zmq_transport() -> Transport:
    transport: Transport = get_registry().get("transport", "zmq").factory({})
    return transport


def _write_config(tmp_path: Path, endpoint: str, **storage: object) -> Path:
    lines = [
        'log_level = "INFO"',
        "[storage]",
        f'data_dir = "{tmp_path / "data"}"',
        'engine = "fs"',
        f'cluster_key = "{CLUSTER_KEY}"',
        f"num_partitions = {NUM_PARTITIONS}",
        "partitions = [0, 1, 2]",
    ]
    lines += [f"{key} = {json.dumps(value)}" for key, value in storage.items()]
    lines += ["[transport]", 'plugin = "zmq"', f'endpoint = "{endpoint}"']
    path = tmp_path / "storage.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


class Cluster:
    def __init__(self, tmp_path: Path) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.config = _write_config(tmp_path, self.endpoint)
        self.node = StorageNodeProcess(self.config, self.endpoint, tmp_path / "node.log")
        self.transport = _zmq_transport()
        self.clients: list[StorageClient] = []

    async def start(self) -> None:
        self.node.start()
        await self.node.wait_ready(self.transport, timeout=60)

    async def restart_after_kill(self) -> None:
        await self.drop_clients()
        self.node.kill()
        await self.start()

    async def client(self) -> StorageClient:
        client = await StorageClient.connect(self.transport, self.endpoint, sender="server:1")
        await client.open(CLUSTER_KEY, NUM_PARTITIONS)
        self.clients.append(client)
        return client

    async def drop_clients(self) -> None:
        for client in self.clients:
            await client.close()
        self.clients.clear()

    async def close(self) -> None:
        try:
            await self.drop_clients()
        finally:
            self.node.kill()
            await self.transport.close()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        await c.start()
        yield c
    finally:
        await c.close()


def _waltz(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "waltz_cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )


async def test_acknowledged_appends_survive_kill_9(cluster: Cluster) -> None:
    c = await cluster.client()
    acked: dict[int, int] = {0: -1, 1: -1, 2: -1}
    stop = asyncio.Event()

    async def writer(p: int) -> None:
        next_id = 0
        while not stop.is_set() and next_id < 5000:
            batch = [
                c.append(1, p, [make_record(next_id + i, partition_id=p, size=200)])
                for i in range(20)
            ]
            results = await asyncio.gather(*batch, return_exceptions=True)
            for i, result in enumerate(results):
                if result is not None:
                    return
                acked[p] = next_id + i
            next_id += 20

    tasks = [asyncio.create_task(writer(p)) for p in acked]
    # let some appends be acknowledged, then crash the node in the middle of writing
    for _ in range(600):
        if min(acked.values()) >= 100:
            break
        await asyncio.sleep(0.05)
    assert min(acked.values()) >= 100, f"writers made too little progress: {acked}"
    cluster.node.kill()
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)

    await cluster.restart_after_kill()
    c2 = await cluster.client()
    for p, last in acked.items():
        max_id = await c2.max_transaction_id(1, p)
        assert max_id >= last, f"partition {p}: acknowledged {last}, found only {max_id}"
        start = 0
        while start <= max_id:  # every record intact, dense, the one we wrote
            got = await c2.records(1, p, start, 1000)
            assert got == [
                make_record(start + i, partition_id=p, size=200) for i in range(len(got))
            ]
            start += len(got)


async def test_fencing_survives_kill_9_and_restart(cluster: Cluster) -> None:
    old = await cluster.client()
    new = await cluster.client()
    await old.append(5, 0, make_records(0, 3, partition_id=0))
    # session 5's append found the partition pristine (no marks, no records) when it
    # raised the fence: recorded LOST_SESSION (a wiped disk never reads as a clean voter)
    assert await new.last_session_info(8, 0) == SessionInfo(5, -1, -1, LOST_SESSION)
    with pytest.raises(SessionFencedError):
        await old.append(5, 0, [make_record(3, partition_id=0)])

    await cluster.restart_after_kill()
    old2 = await cluster.client()
    with pytest.raises(SessionFencedError) as fenced:
        await old2.append(5, 0, [make_record(3, partition_id=0)])
    assert fenced.value.highest_session_id == 8
    with pytest.raises(SessionFencedError):
        await old2.max_transaction_id(7, 0)
    new2 = await cluster.client()
    await new2.truncate(8, 0, 1)
    await new2.set_low_water_mark(8, 0, 1)
    await new2.append(8, 0, [make_record(2, partition_id=0)])
    # a session that never wrote still fences after a restart
    await new2.max_transaction_id(9, 1)

    await cluster.restart_after_kill()
    c = await cluster.client()
    assert await c.last_session_info(9, 0) == SessionInfo(8, 1, 1, 8)
    assert await c.records(9, 0, 0, 10) == make_records(0, 3, partition_id=0)
    with pytest.raises(SessionFencedError) as fenced1:
        await c.append(8, 1, [make_record(0, partition_id=1)])
    assert fenced1.value.highest_session_id == 9


async def test_many_partitions_and_wrong_cluster_key(cluster: Cluster) -> None:
    hosted = list(range(12))
    async with await StorageAdminClient.connect(cluster.transport, cluster.endpoint) as admin:
        for p in hosted[3:]:
            await admin.add_partition(p, CLUSTER_KEY)
    clients = [await cluster.client(), await cluster.client()]

    async def write(p: int) -> None:
        client = clients[p % 2]
        for start in range(0, 120, 40):
            await asyncio.gather(
                *(client.append(2, p, [make_record(start + i, partition_id=p)]) for i in range(40))
            )

    await asyncio.gather(*(write(p) for p in hosted))
    for p in hosted:
        assert await clients[0].records(2, p, 0, 1000) == make_records(0, 120, partition_id=p)

    stranger = await StorageClient.connect(cluster.transport, cluster.endpoint, sender="x")
    try:
        with pytest.raises(ClusterKeyMismatchError):
            await stranger.open(uuid.uuid4(), NUM_PARTITIONS)
    finally:
        await stranger.close()


async def test_admin_cli_against_a_running_node(cluster: Cluster) -> None:
    """One real `waltz storage list` process; the other commands run the same
    click commands in a thread (each would otherwise pay a process start-up)."""
    from click.testing import CliRunner

    from waltz_cli import main

    c = await cluster.client()
    await c.append(3, 1, make_records(0, 4, partition_id=1))
    loop = asyncio.get_running_loop()

    async def waltz_process(*args: str) -> subprocess.CompletedProcess[str]:
        return await loop.run_in_executor(None, lambda: _waltz("storage", *args))

    async def waltz(*args: str) -> tuple[int, str, str]:
        def run() -> tuple[int, str, str]:
            result = CliRunner().invoke(main, ["storage", *args])
            return result.exit_code, result.stdout, result.stderr

        return await loop.run_in_executor(None, run)

    listed = await waltz_process("list", "--endpoint", cluster.endpoint, "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {row["partition_id"]: row for row in json.loads(listed.stdout)}
    assert sorted(rows) == [0, 1, 2]
    assert rows[1]["max_transaction_id"] == 3
    assert rows[1]["session_info"]["session_id"] == 3
    assert rows[0]["available"] is True

    code, out, err = await waltz("add-partition", "3", "--config", str(cluster.config))
    assert code == 0, err
    await c.append(3, 3, [make_record(0, partition_id=3)])
    code, out, err = await waltz(
        "availability", "3", "unavailable", "--config", str(cluster.config)
    )
    assert code == 0, err
    code, out, err = await waltz("list", "--config", str(cluster.config))
    assert code == 0, err
    last = out.splitlines()[-1].split()
    # partition, max id, session, low-water, local lwm, lwm session, available, notes:
    # the session's append found it pristine when it raised the fence (LOST_SESSION)
    assert last[0] == "3" and last[1] == "0" and last[5] == "LOST" and last[6] == "no"
    code, out, err = await waltz("remove-partition", "3", "--endpoint", cluster.endpoint, "--yes")
    assert code == 2 and "--cluster-key" in err
    code, out, err = await waltz(
        "remove-partition", "3", "--endpoint", cluster.endpoint, "--yes",
        "--cluster-key", str(uuid.uuid4()),
    )  # fmt: skip
    assert code == 1 and "does not match" in err
    code, out, err = await waltz("remove-partition", "3", "--config", str(cluster.config), "--yes")
    assert code == 0, err
    code, out, err = await waltz("max-transaction-id", "1", "--endpoint", cluster.endpoint)
    assert code == 0 and out.strip() == "3"
    code, out, err = await waltz("stats", "--endpoint", cluster.endpoint, "-o", "json")
    assert code == 0, err
    counters = {row["partition_id"]: row for row in json.loads(out)["partitions"]}
    assert counters[1]["records_appended"] == 4 and counters[1]["append_requests"] == 1

    async with await StorageAdminClient.connect(cluster.transport, cluster.endpoint) as admin:
        assert [p.partition_id for p in await admin.list_partitions()] == [0, 1, 2]


async def test_malformed_frame_over_zmq_closes_only_that_connection(cluster: Cluster) -> None:
    good = await cluster.client()
    await good.append(1, 2, [make_record(0, partition_id=2)])
    conn = await cluster.transport.connect(cluster.endpoint)
    try:
        protocol = wire.ProtocolConnection(wire.Role.INITIATOR, sender="fuzz")
        await conn.send(protocol.start_handshake())
        protocol.receive_frame(await asyncio.wait_for(conn.recv(), 20))
        await conn.send(b"\xff\x01not a waltz message")
        reply = wire.decode(await asyncio.wait_for(conn.recv(), 20))
        assert isinstance(reply, FailureResponse) and reply.code is ErrorCode.BAD_REQUEST
        with pytest.raises(ConnectionClosedError):  # closed by the node (not a timeout)
            await asyncio.wait_for(conn.recv(), 30)
    finally:
        await conn.close()
    await good.append(1, 2, [make_record(1, partition_id=2)])
    assert await good.max_transaction_id(1, 2) == 1


async def test_sigterm_and_sigint_stop_cleanly_and_data_reopens(cluster: Cluster) -> None:
    c = await cluster.client()
    await c.append(1, 0, make_records(0, 10, partition_id=0))
    await cluster.drop_clients()
    assert cluster.node.terminate(timeout=30) == 0
    assert "storage node stopped" in cluster.node.output()
    await cluster.start()
    c2 = await cluster.client()
    assert await c2.records(1, 0, 0, 100) == make_records(0, 10, partition_id=0)
    await cluster.drop_clients()
    assert cluster.node.terminate(timeout=30, signum=signal.SIGINT) == 0
    assert cluster.node.output().count("storage node stopped") == 2


def test_bad_config_exits_with_the_key_named(tmp_path: Path) -> None:
    config = _write_config(tmp_path, "tcp://127.0.0.1:1", queue_size=0)
    result = _waltz("storage", "--config", str(config))
    assert result.returncode == 1
    assert "storage.queue_size" in result.stderr

    config = _write_config(tmp_path, "tcp://127.0.0.1:1")
    config.write_text(config.read_text().replace(str(CLUSTER_KEY), "xyz"))
    result = _waltz("storage", "--config", str(config))
    assert result.returncode == 1 and "storage.cluster_key" in result.stderr


@contextlib.contextmanager
def _node(tmp_path: Path, config: Path, endpoint: str) -> Iterator[StorageNodeProcess]:
    node = StorageNodeProcess(config, endpoint, tmp_path / "node2.log")
    try:
        yield node
    finally:
        node.kill()


async def test_existing_storage_with_another_cluster_key_refuses_to_start(tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = _write_config(tmp_path, endpoint)
    transport = _zmq_transport()
    try:
        with _node(tmp_path, config, endpoint) as node:
            node.start()
            await node.wait_ready(transport, timeout=60)
            assert node.terminate() == 0
        config.write_text(config.read_text().replace(str(CLUSTER_KEY), str(uuid.uuid4())))
        with _node(tmp_path, config, endpoint) as node:
            node.start()
            with pytest.raises(WaltzError, match="exited with 1"):
                await node.wait_ready(transport, timeout=60)
            assert "storage.cluster_key" in node.output()
    finally:
        await transport.close()
    assert (tmp_path / "data").is_dir()


async def test_a_node_configured_by_environment_alone(tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    env = {
        "WALTZ_STORAGE__DATA_DIR": str(tmp_path / "data"),
        "WALTZ_STORAGE__ENGINE": "fs",
        "WALTZ_STORAGE__CLUSTER_KEY": str(CLUSTER_KEY),
        "WALTZ_STORAGE__NUM_PARTITIONS": str(NUM_PARTITIONS),
        "WALTZ_STORAGE__PARTITIONS": "[5]",
        "WALTZ_TRANSPORT__PLUGIN": "zmq",
        "WALTZ_TRANSPORT__ENDPOINT": endpoint,
        "WALTZ_LOG_LEVEL": "INFO",
    }
    transport = _zmq_transport()
    node = StorageNodeProcess(None, endpoint, tmp_path / "env-node.log", env=env)
    try:
        node.start()
        await node.wait_ready(transport, timeout=60)
        client = await StorageClient.connect(transport, endpoint)
        try:
            await client.open(CLUSTER_KEY, NUM_PARTITIONS)
            await client.append(1, 5, make_records(0, 3, partition_id=5))
            assert await client.max_transaction_id(1, 5) == 2
        finally:
            await client.close()
        assert node.terminate() == 0
    finally:
        node.kill()
        await transport.close()
