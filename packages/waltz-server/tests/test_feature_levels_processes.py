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
import sys
from pathlib import Path

import pytest
from process_support import DEADLINE, Writers, library_client, waltz

import waltz_api
from waltz_api.features import MAX_FEATURE_LEVEL
from waltz_conformance.suites.system.clients import read_log
from waltz_conformance.suites.system.harness import SystemHarness, wait_for
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools
from waltz_storage_node.snapshot import DATA

pytestmark = [pytest.mark.timeout(300), pytest.mark.system, pytest.mark.slow]

PARTITION = 0
WRITERS = 4


def control_versions(harness: SystemHarness) -> list[int]:
    assert harness.workdir is not None
    return [
        tools.read_control_file(harness.workdir / f"data{i}").header.version
        for i in range(harness.num_storage_nodes)
    ]


async def test_a_level_1_cluster_keeps_format_2_until_raised_under_load(tmp_path: Path) -> None:
    harness = SystemHarness.of_processes(tmp_path, "features", num_servers=2, feature_level=1)
    await harness.start()
    client = library_client(harness, PARTITION)
    writers = Writers(client, PARTITION, WRITERS, lambda w, n: f"writer-{w}-{n}".encode())
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
        assert not writers.acked_twice, f"ids acknowledged twice: {writers.acked_twice[:5]}"
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
