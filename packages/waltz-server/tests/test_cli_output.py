"""-o/--output json|table|text on every read command; fresh replica counts in
`cluster show`; plugin versions in `plugins list` (a real `local` coordination store,
metadata only)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from waltz_api.cluster import coordination_from_uri
from waltz_server.cli import main as waltz_cli
from waltz_server.cluster_admin import ClusterAdmin

READ_COMMANDS = [
    ["plugins", "list"],
    ["cluster", "show"],
    ["cluster", "verify"],
    ["server", "list"],
    ["server", "list-preferred-partitions"],
    ["storage", "list"],
    ["storage", "stats"],
    ["storage", "max-transaction-id"],
    ["client", "tail"],
    ["client", "high-water-mark"],
    ["acl", "list"],
    ["acl", "check"],
]


def waltz(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(waltz_cli, list(args), terminal_width=200)
    return result.exit_code, result.output


@pytest.mark.parametrize("command", READ_COMMANDS, ids=" ".join)
def test_every_read_command_has_one_output_option(command: list[str]) -> None:
    code, text = waltz(*command, "--help")
    assert code == 0
    assert "-o, --output [text|table|json]" in text, text


async def _add_replica(uri: str, partition: int, node: str) -> None:
    coordination = coordination_from_uri(uri)
    await coordination.start()
    try:
        await ClusterAdmin(coordination).add_replica(partition, node)
    finally:
        await coordination.close()


def test_cluster_show_counts_the_replicas_each_partition_has_now(tmp_path: Path) -> None:
    uri = f"local://{tmp_path}/coordination?root=/waltz"
    nodes = [f"127.0.0.1:{5500 + i}" for i in range(4)]
    code, out = waltz(
        "cluster", "create", "--coordination", uri, "--partitions", "2", "--replicas", "3",
        *[a for n in nodes for a in ("--storage", n)],
    )  # fmt: skip
    assert code == 0, out
    code, out = waltz("cluster", "show", "--coordination", uri)
    assert "replicas:    3 per partition" in out
    # a fourth replica of partition 0 (waltz cluster add-replica, metadata part)
    shown = json.loads(waltz("cluster", "show", "--coordination", uri, "-o", "json")[1])
    spare = next(n for n, parts in shown["storage"].items() if 0 not in parts)
    asyncio.run(_add_replica(uri, 0, spare))
    code, out = waltz("cluster", "show", "--coordination", uri)
    assert code == 0
    assert "replicas:    3 configured; now partition 0: 4 (3 for the others)" in out
    code, out = waltz("cluster", "show", "--coordination", uri, "--output", "json")
    shown = json.loads(out)
    assert shown["replica_counts"] == [
        {"partition": 0, "replicas": 4},
        {"partition": 1, "replicas": 3},
    ]
    assert json.loads(waltz("cluster", "show", "--coordination", uri, "--json")[1]) == shown
    code, out = waltz("cluster", "show", "--coordination", uri, "-o", "table")
    assert code == 0
    assert out.splitlines()[0].split() == ["KEY", "VALUE"]
    assert "replica_counts:" in out and "PARTITION  REPLICAS" in out
    code, out = waltz("server", "list", "--coordination", uri, "-o", "json")
    assert code == 0 and json.loads(out)["servers"] == []


def test_plugins_list_shows_each_plugins_package_and_version() -> None:
    code, out = waltz("plugins", "list", "-o", "json")
    assert code == 0
    rows = {(r["kind"], r["name"]): r for r in json.loads(out)}
    fs = rows[("storage", "fs")]
    assert fs["package"] == "waltz-storage-fs" and fs["version"][0].isdigit()
    assert rows[("lock_table", "hwm-array")]["package"] == "waltz-server"
    code, out = waltz("plugins", "list")
    assert f"waltz-storage-fs {fs['version']}" in out
    code, out = waltz("plugins", "list", "-o", "table")
    assert out.splitlines()[0].split()[:4] == ["KIND", "NAME", "PACKAGE", "VERSION"]
