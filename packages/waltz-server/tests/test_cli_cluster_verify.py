"""``waltz cluster verify``: every kind of finding.

The metadata kinds are made for real in a local coordination root (the files the
command reads) and found by the command (``--metadata-only``: no storage node or
server to contact). The kinds that need a storage node or a server to say something a
healthy cluster never says (a replica ahead of the committed mark, a quorum missing
it, inverted low-water marks, an unreadable replica) are checked on the collected
facts directly (:func:`waltz_server.cluster_check.check` is a pure function; the
collection itself is tested on a running cluster in test_cli_cluster_live.py)."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from waltz_api.cluster import (
    ClusterConfig,
    PartitionAssignment,
    PartitionStoreMetadata,
    ReplicaAssignments,
    ServerInfo,
    coordination_from_uri,
    encode_replica_assignments,
)
from waltz_api.contracts.coordination import Coordination
from waltz_api.features import MAX_FEATURE_LEVEL
from waltz_api.types import ReplicaId, ReplicaState
from waltz_server.cli import main
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.cluster_check import (
    NOTE,
    PROBLEM,
    ClusterFacts,
    StorageReport,
    check,
    replica_progress,
)

KEY = uuid.UUID("6c1f0d5e-2f43-4d0a-9b8e-0a1b2c3d4e5f")
NODES = ["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"]


# -- metadata kinds, through the command ----------------------------------------------------


def _verify(uri: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(
        main, ["cluster", "verify", "--coordination", uri, "--metadata-only", "--json"]
    )
    return result.exit_code, json.loads(result.stdout)


def _kinds(report: dict[str, Any], severity: str = "problems") -> set[tuple[str, str]]:
    return {(f["kind"], f["subject"]) for f in report[severity]}


async def _prepare(coordination: Coordination) -> None:
    meta = ClusterAdmin(coordination)
    await meta.create_cluster(
        num_partitions=4, num_replicas=2, storage_nodes=NODES, cluster_key=KEY
    )
    await meta.register_server(1, "tcp://127.0.0.1:6001")
    # partition 0: owned by the live server 1 (healthy); 1: owned by server 9, gone;
    # 2: by server 1 at another endpoint; 3: never assigned
    for partition, server, endpoint in (
        (0, 1, "tcp://127.0.0.1:6001"),
        (1, 9, "tcp://127.0.0.1:6009"),
        (2, 1, "tcp://127.0.0.1:6666"),
    ):
        current = await meta.partition_assignment(partition)
        await meta.assign_partition(partition, server, endpoint, expected_version=current.version)

    # partition 1: a replica state at a session the partition never had, and one on
    # a node that is not a member; a store generation ahead of the assignment
    def broken(store: PartitionStoreMetadata) -> PartitionStoreMetadata:
        ghost = ReplicaState(ReplicaId(1, "127.0.0.1:7999"), 0)
        ahead = ReplicaState(ReplicaId(1, store.replicas[0].replica_id.storage_node), 5)
        return replace(store.with_replica(ghost).with_replica(ahead), generation=7)

    await meta.update_store_metadata(1, broken)
    # partition 0 started a session over a replica set the assignment no longer has
    await meta.update_store_metadata(0, lambda s: replace(s, generation=1, session_id=0))
    # the assignment: partition 3 loses its replicas, a node lists partition 12
    found = await coordination.get("/store/assignment")
    assert found is not None
    assignments = await meta.replica_assignments()
    storage = {n: tuple(p for p in parts if p != 3) for n, parts in assignments.storage.items()}
    storage[NODES[0]] = (*storage[NODES[0]], 12)
    storage[NODES[1]] = tuple(p for p in storage[NODES[1]] if p != 0)
    storage["127.0.0.1:7004"] = (0,)
    await coordination.set(
        "/store/assignment",
        encode_replica_assignments(ReplicaAssignments(2, storage)),
        expected_version=found.version,
    )


async def test_verify_reports_each_metadata_problem(tmp_path: Path) -> None:
    uri = f"local://{tmp_path}?root=/waltz"
    coordination = coordination_from_uri(uri)
    await coordination.start()
    try:  # the session holds server 1's registration while the commands run
        await _prepare(coordination)
        code, report = await asyncio.to_thread(_verify, uri)
        human = await asyncio.to_thread(
            CliRunner().invoke,
            main,
            ["cluster", "verify", "--coordination", uri, "--metadata-only"],
        )
    finally:
        await coordination.close()
    assert code == 1 and report["ok"] is False
    problems = _kinds(report)
    assert problems == {
        ("assignments", f"storage node {NODES[0]}"),  # partition 12 does not exist
        ("dead-owner", "partition 1"),
        ("generation", "partition 1"),
        ("session", "partition 1"),
        ("unknown-node", "partition 1"),
        ("owner-endpoint", "partition 2"),
        ("unassigned", "partition 3"),
        ("no-replicas", "partition 3"),
    }, report["problems"]
    notes = _kinds(report, "notes")
    assert ("replica-set-pending", "partition 0") in notes
    pending = next(f for f in report["notes"] if f["kind"] == "replica-set-pending")
    assert "add 127.0.0.1:7004" in pending["message"] and f"drop {NODES[1]}" in pending["message"]
    assert human.exit_code == 1
    assert "PROBLEM: partition 3: has no replica on any storage node" in human.stdout
    assert "PROBLEM: partition 1: is assigned to server 9 (generation 1), which is not live" in (
        human.stdout
    )
    # two replica states of partition 1 are at sessions it never had: 9 findings
    assert len(report["problems"]) == 9
    assert human.stdout.splitlines()[-1] == "9 problem(s) found"


def test_verify_of_a_fresh_cluster_without_servers(tmp_path: Path) -> None:
    uri = f"local://{tmp_path}?root=/fresh"
    created = CliRunner().invoke(
        main,
        ["cluster", "create", "--coordination", uri, "--partitions", "2", "--replicas", "2"]
        + [a for n in NODES for a in ("--storage", n)],
    )
    assert created.exit_code == 0, created.output
    code, report = _verify(uri)
    assert code == 1 and _kinds(report) == {("no-servers", "cluster")}
    assert _kinds(report, "notes") == set()  # 2 replicas each, spread round robin


# -- the kinds that need storage nodes and servers, on collected facts ------------------------


def _facts(
    *,
    marks: tuple[int, int] = (10, 10),
    maxes: tuple[int, int, int] = (10, 10, 10),
    sessions: tuple[int, int, int] = (3, 3, 3),
) -> ClusterFacts:
    """A healthy 1-partition, 3-replica cluster at store session 3, owned by server 1;
    ``maxes`` and ``sessions`` are what the three nodes report."""
    replicas = tuple(ReplicaState(ReplicaId(0, n), 3) for n in NODES)
    store = PartitionStoreMetadata(0, generation=2, session_id=3, replicas=replicas)
    storage = {
        node: StorageReport(
            node,
            f"tcp://{node}",
            cluster_key=str(KEY),
            num_partitions=1,
            partitions={
                0: {
                    "partition_id": 0,
                    "max_transaction_id": max_id,
                    "session_info": {
                        "session_id": session,
                        "low_water_mark": 4,
                        "local_low_water_mark": 4,
                    },
                    "available": True,
                    "error": None,
                }
            },
        )
        for node, max_id, session in zip(NODES, maxes, sessions, strict=True)
    }
    return ClusterFacts(
        config=ClusterConfig(KEY, 1, 3),
        assignments=ReplicaAssignments(3, {n: (0,) for n in NODES}),
        store={0: store},
        store_after={0: store},
        owners={0: PartitionAssignment(0, 1, "tcp://127.0.0.1:6001", 2)},
        servers=[ServerInfo(1, "tcp://127.0.0.1:6001")],
        storage=storage,
        high_water_marks={0: marks},
    )


def _found(facts: ClusterFacts) -> set[tuple[str, str]]:
    return {(f.severity, f.kind) for f in check(facts)}


def test_a_healthy_cluster_has_no_finding() -> None:
    assert check(_facts()) == []
    (row,) = replica_progress(_facts())
    assert row["high_water_mark"] == 10
    assert [
        (r["max_transaction_id"], r["behind"], r["in_store_session"]) for r in row["replicas"]
    ] == [(10, 0, True)] * 3


def test_a_replica_behind_is_a_note_and_a_missing_quorum_a_problem() -> None:
    assert _found(_facts(maxes=(10, 10, 7))) == {(NOTE, "behind")}
    findings = check(_facts(maxes=(10, 7, 7)))
    assert {(f.severity, f.kind) for f in findings} == {(NOTE, "behind"), (PROBLEM, "quorum")}
    quorum = next(f for f in findings if f.kind == "quorum")
    assert "only 1 replica(s)" in quorum.message and "a quorum is 2" in quorum.message
    # marks read before and after: a replica below the first mark is behind, one above
    # the second holds uncommitted records
    assert _found(_facts(marks=(10, 12), maxes=(12, 12, 11))) == set()
    assert _found(_facts(marks=(10, 10), maxes=(11, 10, 10))) == {(PROBLEM, "ahead")}


def test_a_replica_left_out_of_the_store_session_is_a_note() -> None:
    facts = _facts()
    store = facts.store[0]
    behind = ReplicaState(ReplicaId(0, NODES[2]), 1, 8)
    facts.store[0] = facts.store_after[0] = store.with_replica(behind)
    (finding,) = check(facts)
    assert (finding.severity, finding.kind, finding.subject) == (
        NOTE,
        "not-in-session",
        "partition 0",
    )
    assert f"replica on {NODES[2]} is not part of store session 3" in finding.message
    (row,) = replica_progress(facts)
    assert [r["in_store_session"] for r in row["replicas"]] == [True, True, False]


def test_session_and_low_water_mark_inconsistencies() -> None:
    assert _found(_facts(sessions=(3, 3, 4))) == {(PROBLEM, "session")}
    facts = _facts()
    assert facts.storage is not None
    info = facts.storage[NODES[0]].partitions[0]["session_info"]
    info["local_low_water_mark"] = 6  # above the session's low-water mark 4
    assert _found(facts) == {(PROBLEM, "low-water-mark")}
    info["local_low_water_mark"] = 4
    info["low_water_mark"] = 11  # the session started above what is committed now
    assert _found(facts) == {(PROBLEM, "low-water-mark")}


def test_unavailable_unreadable_and_unhosted_replicas() -> None:
    facts = _facts()
    assert facts.storage is not None
    facts.storage[NODES[0]].partitions[0]["available"] = False
    facts.storage[NODES[1]].partitions[0].update(
        error="bad segment", max_transaction_id=None, session_info=None
    )
    facts.storage[NODES[2]].partitions = {}
    assert _found(facts) == {
        (PROBLEM, "unavailable"),
        (PROBLEM, "replica-error"),
        (PROBLEM, "not-hosted"),
        (PROBLEM, "quorum"),
    }


def test_left_over_data_on_a_node_is_a_note() -> None:
    facts = _facts()
    assert facts.storage is not None
    row = dict(facts.storage[NODES[0]].partitions[0], partition_id=5)
    facts.storage[NODES[0]].partitions[5] = row
    (finding,) = check(facts)
    assert (finding.severity, finding.kind) == (NOTE, "unassigned-data")
    assert "hosts partition 5, which is not assigned to it" in finding.message


def test_an_owner_that_does_not_answer() -> None:
    facts = _facts()
    facts.high_water_marks = {}
    facts.server_errors = {0: "no answer from tcp://127.0.0.1:6001 within 5 s"}
    findings = check(facts)
    assert [(f.kind, f.subject) for f in findings] == [("high-water-mark", "partition 0")]
    assert "did not answer" in str(findings[0])
    (row,) = replica_progress(facts)
    assert row["high_water_mark"] is None and row["replicas"][0]["behind"] is None


@pytest.mark.parametrize("missing", ["config", "assignments"])
def test_missing_config_or_assignments(missing: str) -> None:
    facts = _facts()
    if missing == "config":
        facts = ClusterFacts(config_error="no Waltz cluster at this coordination root")
        assert [(f.kind, f.message) for f in check(facts)] == [
            ("config", "no Waltz cluster at this coordination root")
        ]
    else:
        facts.assignments = None
        facts.assignments_error = "the cluster metadata has no /store/assignment"
        assert ("problem", "assignments") in _found(facts)


# -- feature levels (issue 32) ------------------------------------------------------------------


def test_processes_below_the_cluster_feature_level() -> None:
    """Each storage node or live server that cannot work at the recorded level is one
    problem naming it, its level, the cluster's and what to do (a node able to but not
    told yet: a note)."""
    facts = _facts()
    assert check(facts) == []  # a cluster at level 1, processes of 0.1.0: nothing to say
    facts.feature_level = 2
    storage = facts.storage
    assert storage is not None
    _old, untold, current = (storage[n] for n in NODES)
    current.feature_level = current.max_feature_level = 2
    untold.max_feature_level = 2  # supports it, still writes at 1
    facts.servers = [ServerInfo(1, "tcp://127.0.0.1:6001", (), 2), ServerInfo(4, "tcp://h:4")]
    by_subject = {f.subject: f for f in check(facts) if f.kind == "feature-level"}
    assert set(by_subject) == {f"storage node {NODES[0]}", f"storage node {NODES[1]}", "server 4"}
    assert [f.severity for f in by_subject.values()].count(PROBLEM) == 2
    assert by_subject[f"storage node {NODES[1]}"].severity == NOTE  # told as servers connect
    assert str(by_subject[f"storage node {NODES[0]}"]).startswith(
        f"storage node {NODES[0]}: supports feature level 1 at most, below the cluster's 2: "
    )
    assert "upgrade it to a release that supports level 2" in str(
        by_subject[f"storage node {NODES[0]}"]
    )
    assert str(by_subject[f"storage node {NODES[1]}"]) == (
        f"storage node {NODES[1]}: writes at feature level 1, below the cluster's 2: not "
        "told the level yet (each server tells it when it connects to it); "
        "`waltz cluster features --to 2` tells it now"
    )
    assert str(by_subject["server 4"]).startswith(
        "server 4: supports feature level 1 at most, below the cluster's 2: it works at "
        "level 1 (an older release); stop it and start it on a release that supports level 2"
    )


async def test_verify_exits_1_for_a_server_below_the_level(tmp_path: Path) -> None:
    uri = f"local://{tmp_path}?root=/levels"
    coordination = coordination_from_uri(uri)
    await coordination.start()
    try:
        meta = ClusterAdmin(coordination)
        await meta.create_cluster(num_partitions=1, num_replicas=1, storage_nodes=NODES[:1])
        await meta.register_server(1, "tcp://127.0.0.1:6001")
        current = await meta.partition_assignment(0)
        await meta.assign_partition(0, 1, "tcp://127.0.0.1:6001", expected_version=current.version)
        # a server of 0.1.0 registers (no level: 1), reading no level
        old = b'{"format":1,"type":"server","server_id":2,"endpoint":"tcp://127.0.0.1:6002"}'
        await coordination.create("/servers/2", old, ephemeral=True)
        code, report = await asyncio.to_thread(_verify, uri)
        human = await asyncio.to_thread(
            CliRunner().invoke,
            main,
            ["cluster", "verify", "--coordination", uri, "--metadata-only"],
        )
    finally:
        await coordination.close()
    assert code == 1 and _kinds(report) == {("feature-level", "server 2")}, report
    assert human.exit_code == 1
    lines = [line for line in human.stdout.splitlines() if "feature level" in line]
    top = MAX_FEATURE_LEVEL  # what create_cluster records
    assert lines == [
        f"PROBLEM: server 2: supports feature level 1 at most, below the cluster's {top}: it "
        "works at level 1 (an older release); stop it and start it on a release that supports "
        f"level {top}"
    ]
