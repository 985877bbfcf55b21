"""``waltz cluster`` (show --replicas, verify, delete, membership) and ``waltz client``
errors against one real running cluster shared by the module: ``waltz dev``'s cluster
(local coordination in a SQLite file, 3 fs storage nodes and 1 server as child
processes, ZeroMQ on loopback), plus a 4th storage node process for the membership
commands. The commands run in-process (click's runner) to save process start-ups.

Other coordination roots in the same SQLite file, pointing at the same storage nodes,
give ``verify`` real inconsistencies to find without disturbing the running cluster."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from waltz_api.ports import free_port
from waltz_dev.dev import STORAGE_READY, Child, DevCluster
from waltz_server.cli import main

pytestmark = [pytest.mark.system, pytest.mark.timeout(240)]


@dataclass
class Live:
    dev: DevCluster
    uri: str
    key: str
    nodes: list[str]
    data_dir: Path

    def root(self, name: str) -> str:
        """Another coordination root in the same SQLite file."""
        return self.uri.replace("root=/waltz", f"root=/{name}")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    data_dir = tmp_path_factory.mktemp("live") / "dev"
    dev = DevCluster(data_dir, partitions=2, session_timeout=5.0)
    try:
        asyncio.run(dev.start())
        info = dev.info()
        nodes = [e.removeprefix("tcp://") for e in info["storage_nodes"]]
        yield Live(dev, info["coordination"], info["cluster_key"], nodes, data_dir)
    finally:
        asyncio.run(dev.stop())


def waltz(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def one_error_line(result: Result, code: int = 1) -> str:
    """The command failed (exit ``code``) with exactly one line on stderr; that line."""
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in result.output
    return lines[0]


def as_json(result: Result) -> Any:
    assert result.exit_code in (0, 1), result.output
    return json.loads(result.stdout)


def append(live: Live, partition: int, *data: str) -> None:
    args = [a for d in data for a in ("--data", d)]
    result = waltz(
        "client", "append", "--coordination", live.uri, "--partition", str(partition), *args
    )
    assert result.exit_code == 0, result.output


def high_water_mark(live: Live, partition: int) -> int:
    result = waltz(
        "client", "high-water-mark", "--coordination", live.uri, "--partition", str(partition)
    )
    assert result.exit_code == 0, result.output
    return int(result.stdout)


def progress(live: Live, partition: int) -> dict[str, Any]:
    shown = as_json(waltz("cluster", "show", "--coordination", live.uri, "--replicas", "--json"))
    row: dict[str, Any] = shown["replica_progress"][partition]
    return row


def create_root(
    live: Live, name: str, *, partitions: int, key: str | None, nodes: list[str]
) -> str:
    uri = live.root(f"{name}-{uuid.uuid4().hex[:6]}")
    args = ["cluster", "create", "--coordination", uri, "--partitions", str(partitions)]
    args += ["--replicas", str(len(nodes)), *[a for n in nodes for a in ("--storage", n)]]
    result = waltz(*args, *(["--cluster-key", key] if key else []))
    assert result.exit_code == 0, result.output
    return uri


# -- show, verify -----------------------------------------------------------------------------


def test_show_and_verify_a_healthy_running_cluster(live: Live) -> None:
    append(live, 1, "one", "two", "three")
    hwm = high_water_mark(live, 1)
    assert hwm >= 2
    shown = as_json(waltz("cluster", "show", "--coordination", live.uri, "--json"))
    assert shown["cluster_key"] == live.key and sorted(shown["storage"]) == sorted(live.nodes)
    (server,) = shown["servers"]
    assert [p["server_id"] for p in shown["partition_state"]] == [server["server_id"]] * 2
    assert all(
        p["generation"] >= 1 and p["store_session_id"] >= 0 for p in shown["partition_state"]
    )

    row = progress(live, 1)
    assert row["high_water_mark"] == hwm
    assert sorted(r["storage"] for r in row["replicas"]) == sorted(live.nodes)
    assert all(r["max_transaction_id"] == hwm and r["behind"] == 0 for r in row["replicas"])
    human = waltz("cluster", "show", "--coordination", live.uri, "--replicas")
    assert human.exit_code == 0, human.output
    assert f"{live.nodes[0]}: {hwm}" in human.stdout

    verified = waltz("cluster", "verify", "--coordination", live.uri)
    assert verified.exit_code == 0, verified.output
    assert "checked 3 storage node(s), 2 high-water mark(s)" in verified.stdout
    assert verified.stdout.splitlines()[-1] == "OK: no problem found"
    report = as_json(waltz("cluster", "verify", "--coordination", live.uri, "--json"))
    assert report["ok"] is True and report["problems"] == [] and report["notes"] == []
    assert report["storage_nodes_checked"] == sorted(live.nodes)
    assert report["replica_progress"][1]["high_water_mark"] == hwm


def test_storage_admin_commands_on_the_live_nodes(live: Live) -> None:
    append(live, 1, "for-storage")
    hwm = high_water_mark(live, 1)
    for node in live.nodes:
        endpoint = ["--endpoint", f"tcp://{node}"]
        rows = as_json(waltz("storage", "list", *endpoint, "--json"))
        by_id = {row["partition_id"]: row for row in rows}
        assert sorted(by_id) == [0, 1] and by_id[1]["max_transaction_id"] == hwm
        assert by_id[1]["available"] is True and by_id[1]["session_info"]["session_id"] >= 0
        max_id = waltz("storage", "max-transaction-id", "1", *endpoint)
        assert max_id.exit_code == 0 and max_id.stdout.strip() == str(hwm)
        stats = as_json(waltz("storage", "stats", *endpoint, "--output", "json"))
        counters = {row["partition_id"]: row for row in stats["partitions"]}
        assert counters[1]["records_appended"] >= 1
    first = ["--endpoint", f"tcp://{live.nodes[0]}"]
    assert "out of range" in one_error_line(waltz("storage", "max-transaction-id", "7", *first))
    wrong_key = waltz(
        "storage", "availability", "1", "unavailable", *first, "--cluster-key", str(uuid.uuid4())
    )
    assert "does not match" in one_error_line(wrong_key)


def kinds(report: dict[str, Any], severity: str = "problems") -> set[tuple[str, str]]:
    return {(f["kind"], f["subject"]) for f in report[severity]}


def test_verify_finds_nodes_of_another_cluster_an_unreachable_node_and_no_server(
    live: Live,
) -> None:
    ghost = f"127.0.0.1:{free_port()}"
    uri = create_root(live, "other", partitions=2, key=None, nodes=[*live.nodes, ghost])
    result = waltz("cluster", "verify", "--coordination", uri, "--timeout", "2", "--json")
    assert result.exit_code == 1
    report = as_json(result)
    assert report["ok"] is False
    found = kinds(report)
    for node in live.nodes:
        assert ("cluster-key", f"storage node {node}") in found
    assert ("unreachable", f"storage node {ghost}") in found
    assert ("no-servers", "cluster") in found
    human = waltz("cluster", "verify", "--coordination", uri, "--timeout", "2")
    assert human.exit_code == 1
    assert f"PROBLEM: storage node {live.nodes[0]}: was opened with cluster key {live.key}" in (
        human.stdout
    )
    assert human.stdout.splitlines()[-1] == f"{len(report['problems'])} problem(s) found"
    # the metadata alone is consistent (no server is a problem of its own)
    metadata = as_json(
        waltz("cluster", "verify", "--coordination", uri, "--metadata-only", "--json")
    )
    assert kinds(metadata) == {("no-servers", "cluster")}
    # a storage node of another cluster is refused as a member
    refused = waltz("cluster", "add-storage-node", "--coordination", uri, live.nodes[0])
    assert f"belongs to cluster {live.key}" in one_error_line(refused)


def test_verify_finds_sessions_the_metadata_never_issued_and_missing_partitions(
    live: Live,
) -> None:
    # the cluster's own key and nodes, but fresh metadata with one more partition: like
    # metadata restored from a copy older than the data
    uri = create_root(live, "stale", partitions=3, key=live.key, nodes=live.nodes)
    report = as_json(waltz("cluster", "verify", "--coordination", uri, "--json"))
    assert report["ok"] is False
    found = kinds(report)
    for node in live.nodes:
        assert ("num-partitions", f"storage node {node}") in found
        assert ("not-hosted", f"storage node {node}") in found
    sessions = [f for f in report["problems"] if f["kind"] == "session"]
    assert {f["subject"] for f in sessions} == {"partition 0", "partition 1"}
    assert len(sessions) == 6 and "newer than the metadata's -1" in sessions[0]["message"]


def test_verify_and_show_errors_are_one_line(live: Live, tmp_path: Path) -> None:
    empty = f"local://{tmp_path}?root=/nothing"
    assert "waltz cluster create" in one_error_line(
        waltz("cluster", "verify", "--coordination", empty)
    )
    assert "valid choices" in one_error_line(
        waltz("cluster", "verify", "--coordination", "nosuch://x")
    )
    bad = waltz("cluster", "verify", "--coordination", live.uri, "--transport", "carrier-pigeon")
    assert "--transport" in one_error_line(bad)
    template = waltz("cluster", "show", "--coordination", live.uri, "--storage-endpoint", "tcp://x")
    assert "must contain {}" in one_error_line(template)
    option = waltz("cluster", "verify", "--coordination", live.uri, "--transport-option", "x")
    assert "KEY=VALUE" in one_error_line(option)


def test_client_commands_report_a_wrong_cluster_in_one_line(live: Live, tmp_path: Path) -> None:
    empty = live.root("nothing")  # a root of the cluster's coordination store, empty
    for command in ("high-water-mark", "tail"):
        line = one_error_line(waltz("client", command, "--coordination", empty))
        assert "no Waltz cluster at this coordination root" in line
    line = one_error_line(waltz("client", "append", "--coordination", empty, "--data", "x"))
    assert "no Waltz cluster" in line
    # a local location that does not exist is not made: refused, naming it
    missing = tmp_path / "mistyped"
    line = one_error_line(waltz("client", "tail", "--coordination", f"local://{missing}"))
    assert f"{missing} does not exist" in line and not missing.exists()
    line = one_error_line(waltz("client", "high-water-mark", "--coordination", "zk:/"))
    assert "zk" in line
    line = one_error_line(
        waltz("client", "append", "--coordination", live.uri, "--partition", "7", "--data", "x")
    )
    assert "partition 7 does not exist" in line


def test_delete_is_guarded_on_a_running_cluster(live: Live) -> None:
    wrong = waltz(
        "cluster", "delete", "--coordination", live.uri, "--cluster-key", str(uuid.uuid4())
    )
    assert "refusing to delete" in one_error_line(wrong)
    busy = waltz("cluster", "delete", "--coordination", live.uri, "--cluster-key", live.key)
    assert "server(s) are registered" in one_error_line(busy)
    assert as_json(waltz("cluster", "show", "--coordination", live.uri, "--json"))[
        "cluster_key"
    ] == (live.key)
    # a cluster without servers goes; a second delete says there is nothing to delete
    uri = create_root(live, "doomed", partitions=1, key=None, nodes=live.nodes[:1])
    key = as_json(waltz("cluster", "show", "--coordination", uri, "--json"))["cluster_key"]
    deleted = waltz("cluster", "delete", "--coordination", uri, "--cluster-key", key)
    assert deleted.exit_code == 0 and f"deleted cluster {key}" in deleted.stdout
    assert "no Waltz cluster" in one_error_line(
        waltz("cluster", "delete", "--coordination", uri, "--cluster-key", key)
    )


# -- membership -------------------------------------------------------------------------------


@pytest.fixture
def fourth_node(live: Live) -> Iterator[str]:
    """A 4th storage node process of the live cluster, hosting nothing yet."""
    port = free_port()
    directory = live.data_dir / "storage-extra"
    config = live.data_dir / "storage-extra.toml"
    config.write_text(
        "\n".join(
            [
                'log_level = "INFO"',
                "[storage]",
                f"data_dir = {json.dumps(str(directory))}",
                'engine = "fs"',
                f'cluster_key = "{live.key}"',
                "num_partitions = 2",
                "partitions = []",
                "[transport]",
                'plugin = "zmq"',
                f'endpoint = "tcp://127.0.0.1:{port}"',
            ]
        )
        + "\n"
    )
    command = ["storage", "--config", str(config)]
    child = Child("extra storage node", command, live.data_dir / "extra.log", STORAGE_READY)
    child.start()
    try:
        asyncio.run(child.wait_ready(time.monotonic() + 60))
        yield f"127.0.0.1:{port}"
    finally:
        asyncio.run(child.stop())


def records_on_disk(storage_dir: Path, partition: int = 0) -> list[tuple[int, str]]:
    """(transaction id, the rest of its `waltz storage dump-segment` line but the offset)
    of every record in a storage directory's segments of ``partition``."""
    records = []
    for segment in sorted((storage_dir / str(partition)).glob("*.seg")):
        dumped = waltz("storage", "dump-segment", str(segment))
        assert dumped.exit_code == 0, dumped.output
        for line in dumped.stdout.splitlines():
            words = line.split()
            if len(words) > 2 and words[1].startswith("offset="):
                records.append((int(words[0]), " ".join(words[2:])))
    return records


def wait_for(what: str, condition: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_add_a_storage_node_and_a_replica_that_catches_up_then_remove_them(
    live: Live, fourth_node: str
) -> None:
    new = fourth_node
    uri = ["--coordination", live.uri]
    added = waltz("cluster", "add-storage-node", *uri, new, "--group", "1")
    assert added.exit_code == 0 and f"storage node {new} added (group 1)" in added.stdout
    again = waltz("cluster", "add-storage-node", *uri, new, "--group", "1")
    assert again.exit_code == 0 and "member already" in again.stdout
    other_group = waltz("cluster", "add-storage-node", *uri, new, "--group", "2")
    assert "already in group 1" in one_error_line(other_group)
    shown = as_json(waltz("cluster", "show", *uri, "--json"))
    assert shown["storage"][new] == [] and shown["groups"][new] == 1
    human = waltz("cluster", "show", *uri)
    assert f"  {new} (group 1): partitions (none)" in human.stdout.splitlines()
    notes = as_json(waltz("cluster", "verify", *uri, "--json"))
    assert notes["ok"] is True and ("idle-node", f"storage node {new}") in kinds(notes, "notes")

    append(live, 0, *(f"before-{i}" for i in range(5)))
    before = high_water_mark(live, 0)
    result = waltz("cluster", "add-replica", *uri, "0", new, "--wait", "90")
    assert result.exit_code == 0, result.output
    assert f"partition 0: replica added on {new}" in result.stdout
    assert f"partition 0: replica on {new} caught up" in result.stdout
    row = progress(live, 0)
    mine = next(r for r in row["replicas"] if r["storage"] == new)
    assert mine["in_store_session"] and mine["max_transaction_id"] >= before
    # it keeps up with new writes, as a member of the quorum
    append(live, 0, "after-1", "after-2")
    after = high_water_mark(live, 0)
    assert after == before + 2
    wait_for(
        "the new replica to hold the new transactions",
        lambda: (
            next(r for r in progress(live, 0)["replicas"] if r["storage"] == new)[
                "max_transaction_id"
            ]
            == after
        ),
    )
    report = as_json(waltz("cluster", "verify", *uri, "--json"))
    assert report["ok"] is True, report["problems"]
    assert ("replica-count", "partition 0") in kinds(report, "notes")
    # the copy is the log itself: the same ids, headers, request ids and checksums
    copied = records_on_disk(live.data_dir / "storage-extra")
    assert [r[0] for r in copied] == list(range(after + 1))
    assert copied == records_on_disk(live.data_dir / "storage-0")
    same = waltz("cluster", "add-replica", *uri, "0", new)
    assert same.exit_code == 0 and "holds a replica already" in same.stdout

    # errors: unknown partition and node; a node holding replicas stays without --force
    assert "partition 9 does not exist" in one_error_line(
        waltz("cluster", "add-replica", *uri, "9", new)
    )
    assert "not a member" in one_error_line(
        waltz("cluster", "add-replica", *uri, "0", "127.0.0.1:9")
    )
    assert "not a member" in one_error_line(
        waltz("cluster", "remove-replica", *uri, "0", "127.0.0.1:9")
    )
    assert "host:port" in one_error_line(waltz("cluster", "add-replica", *uri, "0", "nonsense"))
    assert "still holds replicas" in one_error_line(
        waltz("cluster", "remove-storage-node", *uri, new)
    )

    removed = waltz("cluster", "remove-replica", *uri, "0", new)
    assert removed.exit_code == 0 and f"replica on {new} removed" in removed.stdout
    twice = waltz("cluster", "remove-replica", *uri, "0", new)
    assert twice.exit_code == 0 and "nothing to do" in twice.stdout
    gone = waltz("cluster", "remove-storage-node", *uri, new)
    assert gone.exit_code == 0 and f"storage node {new} removed" in gone.stdout
    assert "not part of the cluster" in one_error_line(
        waltz("cluster", "remove-storage-node", *uri, new)
    )
    assert new not in as_json(waltz("cluster", "show", *uri, "--json"))["storage"]
    # the partition still takes writes on its three replicas; the owner drops the replica
    append(live, 0, "after-removal")
    assert high_water_mark(live, 0) == after + 1
    final = wait_for(
        "the owner to leave the removed replica out of its store session",
        lambda: (
            (r := as_json(waltz("cluster", "verify", *uri, "--json")))["ok"]
            and ("replica-set-pending", "partition 0") not in kinds(r, "notes")
            and r
        ),
    )
    assert final["problems"] == []


def test_add_storage_node_checks_the_node(live: Live) -> None:
    uri = ["--coordination", live.uri]
    down = f"127.0.0.1:{free_port()}"
    line = one_error_line(waltz("cluster", "add-storage-node", *uri, down, "--timeout", "0.5"), 4)
    assert "refused the connection" in line
    assert down not in as_json(waltz("cluster", "show", *uri, "--json"))["storage"]
    # --no-check trusts the operator: the node is then reported by verify
    added = waltz("cluster", "add-storage-node", *uri, down, "--no-check")
    assert added.exit_code == 0, added.output
    try:
        report = as_json(waltz("cluster", "verify", *uri, "--timeout", "0.5", "--json"))
        assert ("unreachable", f"storage node {down}") in kinds(report)
        # a replica needs its node up (to host the partition): refused, nothing changed
        line = one_error_line(
            waltz("cluster", "add-replica", *uri, "0", down, "--timeout", "0.5"), 4
        )
        assert "refused the connection" in line
        assert as_json(waltz("cluster", "show", *uri, "--json"))["storage"][down] == []
    finally:
        removed = waltz("cluster", "remove-storage-node", *uri, down)
        assert removed.exit_code == 0, removed.output
    assert "host:port" in one_error_line(waltz("cluster", "add-storage-node", *uri, "x:y"))


def test_membership_needs_a_cluster(tmp_path: Path) -> None:
    empty = ["--coordination", f"local://{tmp_path}?root=/none"]
    for args in (
        ["add-storage-node", "127.0.0.1:7001", "--no-check"],
        ["remove-storage-node", "127.0.0.1:7001"],
        ["add-replica", "0", "127.0.0.1:7001"],
        ["remove-replica", "0", "127.0.0.1:7001"],
    ):
        assert "no Waltz cluster" in one_error_line(waltz("cluster", *args, *empty))
