"""``waltz server``: running (``--config``) versus the admin subcommands, ``list`` and the
preferred partitions, with click's CliRunner on the embedded ``local`` coordination (a
real SQLite file); the preferred partitions' effect on servers following the assignment
in this process (cluster managers on the same file)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from waltz_api.cluster import ServerInfo, coordination_from_uri
from waltz_api.contracts.coordination import Coordination
from waltz_conformance.suites.coordination import eventually
from waltz_server.cli import main
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.server.cluster_manager import ClusterManager, compute_assignment

pytestmark = pytest.mark.timeout(120)

CONVERGE = 30.0
OPTIONS = {"session_timeout": 3.0}


def waltz(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def ok(*args: str) -> str:
    result = waltz(*args)
    assert result.exit_code == 0, (args, result.output, result.exception)
    return result.output


def fails(*args: str, code: int = 1) -> str:
    """The command fails with ``code`` and, for a Waltz error, one line on stderr."""
    result = waltz(*args)
    assert result.exit_code == code, (args, result.output)
    if code == 1:
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return result.output


@pytest.fixture
def uri(tmp_path: Path) -> str:
    return f"local://{tmp_path}?root=/cli-server-{uuid.uuid4().hex[:8]}"


async def _create(uri: str, partitions: int) -> None:
    client = coordination_from_uri(uri, OPTIONS)
    await client.start()
    try:
        await ClusterAdmin(client).create_cluster(
            num_partitions=partitions, num_replicas=1, storage_nodes=["127.0.0.1:7001"]
        )
    finally:
        await client.close()


def test_run_or_subcommand(tmp_path: Path) -> None:
    assert "--config FILE" in fails("server", code=2)
    assert "no subcommand" in fails("server", "--config", "x.toml", "list", code=2)
    missing = tmp_path / "missing.toml"
    assert str(missing) in fails("server", "--config", str(missing))
    shown = ok("server", "--help")
    for command in (
        "list",
        "add-preferred-partition",
        "remove-preferred-partition",
        "reset-preferred-partitions",
        "list-preferred-partitions",
    ):
        assert command in shown


def test_preferred_partitions_without_live_servers(uri: str) -> None:
    assert "no Waltz cluster" in fails("server", "list", "--coordination", uri)
    assert "no Waltz cluster" in fails(
        "server", "add-preferred-partition", "--coordination", uri, "--endpoint", "tcp://e:1",
        "--partition", "1",
    )  # fmt: skip
    asyncio.run(_create(uri, 4))
    assert "no live servers" in ok("server", "list", "--coordination", uri)
    listed = json.loads(ok("server", "list", "--coordination", uri, "--json"))
    assert listed["servers"] == [] and len(listed["not_held"]) == 4
    assert "no server prefers" in ok("server", "list-preferred-partitions", "--coordination", uri)

    add = ("server", "add-preferred-partition", "--coordination", uri)
    out = ok(*add, "--endpoint", "tcp://e:1", "--partition", "3", "--partition", "1")
    assert "tcp://e:1: 1, 3 (now)" in out and "no live server at this endpoint" in out
    assert "(unchanged)" in ok(*add, "--endpoint", "tcp://e:1", "--partition", "3")
    out = ok(*add, "--endpoint", "tcp://f:2", "--partition", "3")
    assert "also preferred at tcp://e:1" in out
    rows = json.loads(ok("server", "list-preferred-partitions", "--coordination", uri, "--json"))[
        "preferred"
    ]
    assert rows == [
        {"endpoint": "tcp://e:1", "server_ids": [], "config": [], "override": [1, 3],
         "effective": [1, 3]},
        {"endpoint": "tcp://f:2", "server_ids": [], "config": [], "override": [3],
         "effective": [3]},
    ]  # fmt: skip

    remove = ("server", "remove-preferred-partition", "--coordination", uri)
    assert "tcp://e:1: 3 (now)" in ok(*remove, "--endpoint", "tcp://e:1", "--partition", "1")
    assert "(unchanged)" in ok(*remove, "--endpoint", "tcp://e:1", "--partition", "1")
    assert "none (now)" in ok(*remove, "--endpoint", "tcp://f:2", "--partition", "3")
    reset = ("server", "reset-preferred-partitions", "--coordination", uri)
    assert "override dropped" in ok(*reset, "--endpoint", "tcp://f:2")
    assert "no override" in ok(*reset, "--endpoint", "tcp://f:2")
    human = ok("server", "list-preferred-partitions", "--coordination", uri)
    assert "tcp://e:1" in human and "tcp://f:2" not in human

    # Bad input: one line, exit 1, nothing changed.
    assert "partitions [4] do not exist" in fails(
        *add, "--endpoint", "tcp://e:1", "--partition", "4"
    )
    assert "exactly one of" in fails(*add, "--partition", "1")
    assert "exactly one of" in fails(
        *add, "--server", "1", "--endpoint", "tcp://e:1", "--partition", "1"
    )
    assert "no live server has id 7" in fails(*add, "--server", "7", "--partition", "1")
    assert "endpoint is needed" in fails(*add, "--endpoint", " ", "--partition", "1")
    fails(*add, "--endpoint", "tcp://e:1", "--partition", "-1", code=2)
    fails(*add, "--endpoint", "tcp://e:1", code=2)  # --partition is required
    rows = json.loads(ok("server", "list-preferred-partitions", "--coordination", uri, "--json"))[
        "preferred"
    ]
    assert [(r["endpoint"], r["override"]) for r in rows] == [("tcp://e:1", [3])]


# -- the effect on running servers ----------------------------------------------------------------


class Servers:
    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.managers: list[ClusterManager] = []

    def new_client(self) -> Coordination:
        return coordination_from_uri(self.uri, OPTIONS)

    async def start(self, name: str, preferred: Sequence[int] = ()) -> ClusterManager:
        manager = ClusterManager(
            self.new_client, f"tcp://127.0.0.1/{name}", preferred_partitions=preferred
        )
        self.managers.append(manager)
        await manager.start()
        return manager

    async def cli(self, *args: str) -> str:
        # The CLI runs its own event loop: in a thread, while the servers run on this one.
        return await asyncio.to_thread(ok, "server", *args, "--coordination", self.uri)

    async def listed(self) -> dict[str, Any]:
        found: dict[str, Any] = json.loads(await self.cli("list", "--json"))
        return found


@pytest.fixture
async def servers(uri: str) -> AsyncIterator[Servers]:
    found = Servers(uri)
    try:
        yield found
    finally:
        for manager in found.managers:
            await asyncio.wait_for(manager.stop(), 30)


async def _settled(servers: Servers, live: Sequence[ClusterManager], partitions: int) -> bool:
    """Every partition held by exactly one of ``live``, at the generation stored."""
    listed = await servers.listed()
    stored = {
        p["partition"]: (row["server_id"], p["generation"])
        for row in listed["servers"]
        for p in row["partitions"]
    }
    held = {p: (m.server_id, g) for m in live for p, g in m.owned.items()}
    if not (len(held) == partitions == sum(len(m.owned) for m in live) and held == stored):
        return False
    # And the leader would move nothing (given the preferences that apply now).
    infos = [
        ServerInfo(row["server_id"], row["endpoint"], tuple(row["preferred_partitions"]))
        for row in listed["servers"]
    ]
    owners = {p: owner for p, (owner, _) in stored.items()}
    return compute_assignment(partitions, infos, owners) == owners


async def test_preferred_partition_moves_and_survives_a_restart(servers: Servers) -> None:
    await _create(servers.uri, 4)
    a = await servers.start("a")
    b = await servers.start("b", preferred=[0])
    await eventually(lambda: _settled(servers, [a, b], 4), CONVERGE, "a and b share")
    assert 0 in b.owned
    listed = await servers.listed()
    rows = {row["server_id"]: row for row in listed["servers"]}
    assert rows[a.server_id]["leader"] and not rows[b.server_id]["leader"]
    assert rows[b.server_id]["preferred_partitions"] == [0]
    assert rows[b.server_id]["preferred_source"] == "config"
    assert rows[a.server_id]["endpoint"] == "tcp://127.0.0.1/a"
    human = await servers.cli("list")
    assert f"{a.server_id}*" in human and "0 (override)" not in human

    # One of a's partitions, preferred at b's endpoint, moves there (generation + 1).
    moved = min(a.owned)
    generation = a.owned[moved]
    out = await servers.cli(
        "add-preferred-partition", "--server", str(b.server_id), "--partition", str(moved)
    )
    assert f"tcp://127.0.0.1/b: {', '.join(str(p) for p in sorted({0, moved}))} (now)" in out
    await eventually(lambda: moved in b.owned, CONVERGE, "the preferred partition moves to b")
    assert b.owned[moved] == generation + 1
    await eventually(lambda: _settled(servers, [a, b], 4), CONVERGE, "settled")
    rows = {row["server_id"]: row for row in (await servers.listed())["servers"]}
    assert rows[b.server_id]["preferred_partitions"] == sorted({0, moved})
    assert rows[b.server_id]["preferred_source"] == "override"
    assert "[override]" in await servers.cli("list")

    # b restarts (a new id, the same endpoint, no preferences in its config): the override
    # is in coordination, so the new b gets both partitions again.
    await b.stop()
    servers.managers.remove(b)
    await eventually(lambda: len(a.owned) == 4, CONVERGE, "a holds everything meanwhile")
    b2 = await servers.start("b")
    await eventually(lambda: {0, moved} <= set(b2.owned), CONVERGE, "the new b gets them back")
    await eventually(lambda: _settled(servers, [a, b2], 4), CONVERGE, "settled again")

    # Dropping the override puts b's config back (none now): nothing is pinned, loads even.
    out = await servers.cli("reset-preferred-partitions", "--endpoint", "tcp://127.0.0.1/b")
    assert "override dropped" in out
    rows = {row["server_id"]: row for row in (await servers.listed())["servers"]}
    assert rows[b2.server_id]["preferred_partitions"] == []
    # Preferring everything at a pulls every partition to a, and removing gives back.
    await servers.cli(
        "add-preferred-partition", "--endpoint", "tcp://127.0.0.1/a",
        *[arg for p in range(4) for arg in ("--partition", str(p))],
    )  # fmt: skip
    await eventually(lambda: len(a.owned) == 4 and not b2.owned, CONVERGE, "all at a")
    await servers.cli(
        "remove-preferred-partition", "--endpoint", "tcp://127.0.0.1/a",
        "--partition", "1", "--partition", "2", "--partition", "3",
    )  # fmt: skip
    await eventually(
        lambda: len(a.owned) == 2 and len(b2.owned) == 2 and 0 in a.owned,
        CONVERGE,
        "balanced again, 0 still at a",
    )
    prefs = json.loads(await servers.cli("list-preferred-partitions", "--json"))["preferred"]
    assert [(r["endpoint"], r["server_ids"], r["effective"]) for r in prefs] == [
        ("tcp://127.0.0.1/a", [a.server_id], [0])
    ]


async def test_override_replaces_the_config(servers: Servers) -> None:
    await _create(servers.uri, 3)
    c = await servers.start("c", preferred=[2])  # the lower id: it would win a conflict
    a = await servers.start("a")
    await eventually(lambda: _settled(servers, [a, c], 3), CONVERGE, "a and c share")
    assert 2 in c.owned
    # The first change starts from what c's config prefers: [2] + [1].
    out = await servers.cli(
        "add-preferred-partition", "--endpoint", "tcp://127.0.0.1/c", "--partition", "1"
    )
    assert "1, 2 (now)" in out
    # Preferring 2 elsewhere (b: no server there yet) notes that c's config prefers it.
    out = await servers.cli(
        "add-preferred-partition", "--endpoint", "tcp://127.0.0.1/b", "--partition", "2"
    )
    assert "also preferred at tcp://127.0.0.1/c" in out
    await servers.cli("reset-preferred-partitions", "--endpoint", "tcp://127.0.0.1/b")
    await eventually(lambda: set(c.owned) == {1, 2}, CONVERGE, "c holds 1 and 2")
    # Removing 2 leaves the override [1]: c's config (2) no longer applies, so when a
    # prefers 2 it gets it (were c's config still counted, c's lower id would win).
    await servers.cli(
        "remove-preferred-partition", "--endpoint", "tcp://127.0.0.1/c", "--partition", "2"
    )
    out = await servers.cli(
        "add-preferred-partition", "--endpoint", "tcp://127.0.0.1/a", "--partition", "2"
    )
    assert "also preferred" not in out  # c's config preference no longer applies
    await eventually(lambda: 2 in a.owned and 1 in c.owned, CONVERGE, "2 moves to a")
    prefs = json.loads(await servers.cli("list-preferred-partitions", "--json"))["preferred"]
    by_endpoint = {r["endpoint"]: r for r in prefs}
    assert by_endpoint["tcp://127.0.0.1/c"]["config"] == [2]
    assert by_endpoint["tcp://127.0.0.1/c"]["override"] == [1]
    assert by_endpoint["tcp://127.0.0.1/c"]["effective"] == [1]
    assert by_endpoint["tcp://127.0.0.1/a"]["effective"] == [2]
