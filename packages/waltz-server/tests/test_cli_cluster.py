"""``waltz cluster create`` / ``show`` in separate processes against a real ZooKeeper, a
real etcd and the embedded local service, and in-process against the memory reference."""

from __future__ import annotations

import json
import uuid

import pytest
from click.testing import CliRunner
from process_support import waltz

from waltz_conformance.servers.zookeeper import ZooKeeperServer
from waltz_server.cli import main

NODES = ["127.0.0.1:7001", "127.0.0.1:7002,127.0.0.1:7003"]


def _create(uri: str, partitions: int, replicas: int, *storage: str) -> list[str]:
    """The arguments of ``waltz cluster create``, a ``--storage`` for each of ``storage``."""
    nodes = [arg for node in storage for arg in ("--storage", node)]
    return [
        *("cluster", "create", "--coordination", uri),
        *("--partitions", str(partitions), "--replicas", str(replicas), *nodes),
    ]


@pytest.fixture(params=["zk", "etcd", "local"])
def service_uri(request: pytest.FixtureRequest) -> str:
    """A fresh root on a real coordination service, as a URI."""
    root = f"/cli-{uuid.uuid4().hex[:8]}"
    if request.param == "zk":
        server: ZooKeeperServer = request.getfixturevalue("zookeeper_server")
        return server.uri(root)
    if request.param == "local":
        return f"local://{request.getfixturevalue('tmp_path')}?root={root}"
    cluster = request.getfixturevalue("etcd_cluster")
    cluster.ensure_all_running()
    uri: str = cluster.uri(root)
    return uri


@pytest.mark.system
def test_create_show_and_refuse(service_uri: str) -> None:
    uri = service_uri
    key = str(uuid.uuid4())
    created = waltz(*_create(uri, 3, 2, *NODES), "--cluster-key", key)
    assert created.returncode == 0, created.stderr
    assert key in created.stdout

    # the rest in-process (each process pays the plugins' import)
    shown = CliRunner().invoke(main, ["cluster", "show", "--coordination", uri, "--json"])
    assert shown.exit_code == 0, shown.output
    summary = json.loads(shown.stdout)
    assert summary["cluster_key"] == key
    assert summary["partitions"] == 3 and summary["replicas"] == 2
    assert sorted(summary["storage"]) == ["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"]
    assert sum(len(p) for p in summary["storage"].values()) == 6
    assert [p["generation"] for p in summary["partition_state"]] == [0, 0, 0]

    human = CliRunner().invoke(main, ["cluster", "show", "--coordination", uri])
    assert human.exit_code == 0 and f"cluster key: {key}" in human.output

    again = CliRunner().invoke(main, _create(uri, 5, 1, *NODES))
    assert again.exit_code == 1
    assert "already exists" in again.stderr and key in again.stderr
    assert "Traceback" not in again.stderr
    still = CliRunner().invoke(main, ["cluster", "show", "--coordination", uri, "--json"])
    assert json.loads(still.output)["cluster_key"] == key
    assert json.loads(still.output)["partitions"] == 3


@pytest.mark.system
def test_show_without_cluster_and_unreachable_service(zookeeper_server: ZooKeeperServer) -> None:
    empty = zookeeper_server.uri(f"/empty-{uuid.uuid4().hex[:8]}")
    runner = CliRunner()
    result = runner.invoke(main, ["cluster", "show", "--coordination", empty])
    assert result.exit_code == 1
    assert "waltz cluster create" in result.output
    unknown = runner.invoke(main, ["cluster", "show", "--coordination", "nosuch://x/y"])
    assert unknown.exit_code == 1 and "valid choices" in unknown.output
    down = runner.invoke(
        main,
        ["cluster", "show", "--coordination", "zk://127.0.0.1:1/x?connect_timeout=2"],
    )
    assert down.exit_code == 4 and "refused the connection" in down.output, down.output


def test_create_in_process_on_memory_and_bad_input() -> None:
    runner = CliRunner()
    uri = f"memory://cli-{uuid.uuid4().hex[:8]}/waltz"
    ok = runner.invoke(main, _create(uri, 2, 1, "127.0.0.1:7001"))
    assert ok.exit_code == 0, ok.output
    refused = runner.invoke(main, _create(uri, 2, 1, "127.0.0.1:7001"))
    assert refused.exit_code == 1 and "already exists" in refused.output
    too_many = runner.invoke(main, _create(f"{uri}-2", 2, 3, "127.0.0.1:7001"))
    assert too_many.exit_code == 1 and "storage nodes" in too_many.output
    bad_node = runner.invoke(main, _create(f"{uri}-3", 2, 1, "localhost"))
    assert bad_node.exit_code == 1 and "host:port" in bad_node.output
    shown = runner.invoke(main, ["cluster", "show", "--coordination", uri, "--json"])
    assert shown.exit_code == 0 and json.loads(shown.output)["partitions"] == 2


def test_delete_then_create_again_in_process() -> None:
    runner = CliRunner()
    uri = f"memory://cli-delete-{uuid.uuid4().hex[:8]}/waltz"
    assert runner.invoke(main, _create(uri, 1, 1, "127.0.0.1:7001")).exit_code == 0
    key = json.loads(
        runner.invoke(main, ["cluster", "show", "--coordination", uri, "--json"]).output
    )["cluster_key"]
    wrong = runner.invoke(
        main, ["cluster", "delete", "--coordination", uri, "--cluster-key", str(uuid.uuid4())]
    )
    assert wrong.exit_code == 1 and "refusing" in wrong.output
    deleted = runner.invoke(
        main, ["cluster", "delete", "--coordination", uri, "--cluster-key", key]
    )
    assert deleted.exit_code == 0, deleted.output
    gone = runner.invoke(main, ["cluster", "show", "--coordination", uri])
    assert gone.exit_code == 1 and "waltz cluster create" in gone.output
    again = runner.invoke(main, _create(uri, 1, 1, "127.0.0.1:7002"))
    assert again.exit_code == 0, again.output


def test_create_again_with_the_same_key_and_shape_does_nothing() -> None:
    runner = CliRunner()
    uri = f"memory://cli-again-{uuid.uuid4().hex[:8]}/waltz"
    key = str(uuid.uuid4())
    same = [*_create(uri, 2, 1, "127.0.0.1:7001"), "--cluster-key", key]
    first = runner.invoke(main, same)
    assert first.exit_code == 0 and f"created cluster {key}" in first.stdout
    again = runner.invoke(main, same)
    assert again.exit_code == 0, again.output
    assert f"cluster {key} exists already" in again.stdout and "nothing to do" in again.stdout
    for different in (
        [*_create(uri, 3, 1, "127.0.0.1:7001"), "--cluster-key", key],
        [*_create(uri, 2, 1, "127.0.0.1:7001"), "--cluster-key", str(uuid.uuid4())],
        _create(uri, 2, 1, "127.0.0.1:7001"),  # a new random key: another cluster
    ):
        refused = runner.invoke(main, different)
        assert refused.exit_code == 1, refused.output
        (line,) = refused.stderr.strip().splitlines()
        assert line.startswith("error: a cluster already exists") and key in line
