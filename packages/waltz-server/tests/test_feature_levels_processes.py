"""Cluster feature levels on real processes (waltz_api.features): a cluster created at
level 1 keeps its storage nodes' directories in the format 0.1.0 reads (fs control file
format 2) while clients commit; ``waltz cluster features --raise`` (its own process)
raises the level under load; every storage node migrates its directory to format 3 as
it runs, commits go on, and every acknowledged transaction is in the log, once, at its
id.

Three ``waltz storage`` processes on the fs engine, two ``waltz server`` processes, the
local coordination, ZeroMQ, one partition; the client library's AsyncWaltzClient.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import waltz_api
from waltz_api.errors import WaltzError
from waltz_api.features import MAX_FEATURE_LEVEL
from waltz_client import (
    AsyncWaltzClient,
    ClientConfig,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClientCallbacks,
)
from waltz_conformance.suites.system.clients import read_log
from waltz_conformance.suites.system.harness import SystemHarness, wait_for
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools
from waltz_storage_node.snapshot import DATA

pytestmark = [pytest.mark.timeout(300), pytest.mark.system, pytest.mark.slow]

PARTITION = 0
WRITERS = 4
DEADLINE = 90.0
"""Generous: for each event waited for, on a slow shared machine."""


class Feed(WaltzClientCallbacks):
    def __init__(self) -> None:
        self.high = -1

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.high

    async def apply_transaction(self, transaction: Transaction) -> None:
        self.high = transaction.transaction_id


class Put(TransactionContext):
    def __init__(self, data: bytes) -> None:
        super().__init__()
        self.data = data

    def partition_id(self, num_partitions: int) -> int:
        return PARTITION

    async def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_data(self.data)
        return True


@dataclass
class Writers:
    client: AsyncWaltzClient
    acked: dict[int, bytes] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    stopping: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._write(w)) for w in range(WRITERS)]

    async def _write(self, writer: int) -> None:
        seq = 0
        while not self.stopping:
            seq += 1
            data = f"writer-{writer}-{seq}".encode()
            try:
                result = await self.client.submit(Put(data))
            except WaltzError as exc:
                self.errors[type(exc).__name__] += 1
                await asyncio.sleep(0.2)
                continue
            assert result.committed and result.transaction_id not in self.acked
            self.acked[result.transaction_id] = data

    async def stop(self) -> None:
        self.stopping = True
        _, pending = await asyncio.wait(self.tasks, timeout=DEADLINE)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def control_versions(harness: SystemHarness) -> list[int]:
    assert harness.workdir is not None
    return [
        tools.read_control_file(harness.workdir / f"data{i}").header.version
        for i in range(harness.num_storage_nodes)
    ]


def waltz(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "waltz_server.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def test_a_level_1_cluster_keeps_format_2_until_raised_under_load(tmp_path: Path) -> None:
    coordination = tmp_path / "coordination"
    coordination.mkdir()
    harness = SystemHarness(
        name="features",
        coordination_uri=f"local://{coordination}?root=/waltz-{uuid.uuid4().hex[:8]}",
        transport="zmq",
        storage_engine="fs",
        processes=True,
        workdir=tmp_path,
        num_storage_nodes=3,
        num_servers=2,
        num_partitions=1,
        feature_level=1,
    )
    await harness.start()
    client = AsyncWaltzClient(
        Feed(),
        ClientConfig(
            harness.coordination_uri,
            transport="zmq",
            partitions=[PARTITION],
            transaction_timeout=30.0,
            request_timeout=10.0,
        ),
    )
    writers = Writers(client)
    try:
        await client.start()
        writers.start()

        async def committed(count: int) -> bool:
            return len(writers.acked) >= count

        await wait_for(lambda: committed(200), DEADLINE, "200 commits at level 1")
        # level 1: what 0.1.0 reads, on every node, while it runs
        assert control_versions(harness) == [2, 2, 2]
        shown = await asyncio.to_thread(
            waltz, "cluster", "features", "--coordination", harness.coordination_uri
        )
        assert shown.returncode == 0, shown.stderr
        assert "cluster feature level: 1" in shown.stdout
        # supports the top level, writes at 1; the node's version beside its levels
        top = MAX_FEATURE_LEVEL
        assert shown.stdout.count(f": {top} / 1, {waltz_api.__version__}") == 3, shown.stdout

        # a copy taken before the raise is in the formats of level 1 too: what a node
        # rolled back to 0.1.0 after the raise is restored from
        snapshot = tmp_path / "before-the-raise"
        taken = await asyncio.to_thread(
            waltz, "storage", "snapshot", str(snapshot), "--endpoint", harness.storage_endpoint(0)
        )
        assert taken.returncode == 0, taken.stderr
        assert tools.read_control_file(snapshot / DATA).header.version == 2

        raised = await asyncio.to_thread(
            waltz, "cluster", "features", "--raise", "--coordination", harness.coordination_uri
        )
        assert raised.returncode == 0, raised.stdout + raised.stderr
        assert f"feature level {top} recorded (was 1)" in raised.stdout
        assert raised.stdout.count(f": {top} / {top}") == 3, raised.stdout
        assert control_versions(harness) == [fmt.FORMAT_OF_LEVEL[top]] * 3
        at_raise = len(writers.acked)
        await wait_for(lambda: committed(at_raise + 200), DEADLINE, f"200 commits at level {top}")

        again = await asyncio.to_thread(
            waltz, "cluster", "features", "--raise", "--coordination", harness.coordination_uri
        )
        assert again.returncode == 0 and f"at feature level {top} already" in again.stdout
        lowered = await asyncio.to_thread(
            waltz, "cluster", "features", "--to", "1", "--coordination", harness.coordination_uri
        )
        assert lowered.returncode != 0 and "never lowered" in lowered.stderr + lowered.stdout
    finally:
        await writers.stop()
        await client.close()
    try:
        log = await read_log(harness, PARTITION)
        assert [r.transaction_id for r in log] == list(range(len(log)))
        for txid, data in writers.acked.items():
            assert txid < len(log) and log[txid].data == data, f"transaction {txid} lost"
        assert len({r.data for r in log}) == len(log), "a transaction committed twice"
        # a restarted node keeps its level (its format) and the partition still commits
        await harness.kill_storage_node(0)
        await harness.restart_storage_node(0)
        assert control_versions(harness)[0] == fmt.FORMAT_OF_LEVEL[top]
    finally:
        await harness.close()
    sys.stdout.write(
        f"\n{len(writers.acked)} acknowledged ({at_raise} before the raise), none lost; "
        f"client errors {dict(writers.errors)}\n"
    )
