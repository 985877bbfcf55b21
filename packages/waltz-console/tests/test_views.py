"""The views over metadata and probes, rates and percentiles, events, paging: pure."""

from __future__ import annotations

import math
import uuid
from typing import Any

import pytest

from waltz_api.cluster import (
    ClusterConfig,
    PartitionAssignment,
    PartitionStoreMetadata,
    ReplicaAssignments,
    ServerInfo,
)
from waltz_api.errors import ConfigError
from waltz_console.collector import parse_metrics
from waltz_console.events import derive_events
from waltz_console.views import (
    MetaState,
    Probes,
    Series,
    Trackers,
    build,
    histogram_quantile,
    page,
    parse_int,
    redact_uri,
)

NODES = ("10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000")


def _meta(owners: dict[int, int], sessions: dict[int, int] | None = None) -> MetaState:
    servers = {1: ServerInfo(1, "tcp://s1:1", (0,)), 2: ServerInfo(2, "tcp://s2:1")}
    return MetaState(
        uri="zk://z/waltz",
        config=ClusterConfig(uuid.UUID(int=7), 3, 2),
        assignments=ReplicaAssignments(
            2, {NODES[0]: (0, 1, 2), NODES[1]: (0, 2), NODES[2]: (1,)}, {NODES[2]: 1}
        ),
        servers={sid: s for sid, s in servers.items() if sid in owners.values() or sid == 1},
        owners={
            p: PartitionAssignment(p, sid, f"tcp://s{sid}:1", 3 + sid) for p, sid in owners.items()
        },
        store={p: PartitionStoreMetadata(p, 1, (sessions or {}).get(p, 4)) for p in range(3)},
        overrides={"tcp://s2:1": (2,)},
    )


def _server_status(sid: int, rows: list[dict[str, Any]], leader: bool = False) -> dict[str, Any]:
    return {
        "role": "server",
        "server_id": sid,
        "endpoint": f"tcp://s{sid}:1",
        "leader": leader,
        "connected_clients": 2,
        "partitions": rows,
    }


def _row(pid: int, hwm: int, **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "partition": pid,
        "generation": 4,
        "state": "writable",
        "high_water_mark": hwm,
        "session_id": 4,
        "low_water_mark": 2,
        "writable_replicas": [NODES[0]],
        "acknowledged": {NODES[0]: hwm},
        "lock_failures": 0,
        "clients": [{"client": "client:9", "position": hwm - 3}],
    }
    row.update(extra)
    return row


def _probes(hwm: int, *, locks: int = 0, buckets: str = "") -> Probes:
    storage = {
        "role": "storage",
        "endpoint": f"tcp://{NODES[0]}",
        "serving": True,
        "disk": {"used": 10, "free": 20, "size": 40},
        "partitions": [{"partition": 0, "max_transaction_id": hwm - 1, "low_water_mark": 2}],
    }
    return Probes(
        status={
            "http://s1": _server_status(1, [_row(0, hwm, lock_failures=locks)], leader=True),
            "http://n1": storage,
        },
        metrics={"http://s1": parse_metrics(buckets), "http://n1": {}},
        errors={"http://n2": "ConnectionRefusedError: refused"},
    )


def test_views_join_metadata_and_status() -> None:
    meta = _meta({0: 1, 1: 1, 2: 2})
    del meta.servers[2]
    snap = build(meta, _probes(10), Trackers(), 0.0)
    p0 = snap.partition(0)
    assert p0 is not None
    assert (p0["owner"], p0["generation"], p0["high_water_mark"]) == (1, 4, 10)
    assert (p0["state"], p0["session_id"], p0["low_water_mark"]) == ("writable", 4, 2)
    by_node = {r["node"]: r for r in p0["replicas"]}
    assert set(by_node) == {NODES[0], NODES[1]}
    assert by_node[NODES[0]] == {
        "node": NODES[0],
        "max_transaction_id": 9,
        "acknowledged": 10,
        "writable": True,
        "lag": 0,
    }
    assert by_node[NODES[1]]["max_transaction_id"] is None
    assert snap.clients == [
        {"partition": 0, "client": "client:9", "position": 7, "lag": 3, "server_id": 1}
    ]
    # partition 2's owner (server 2) is not alive: no status, shown as without a live server
    p2 = snap.partition(2)
    assert p2 is not None and p2["owner"] == 2 and not p2["owner_alive"]
    assert p2["high_water_mark"] is None and p2["state"] is None
    assert snap.cluster["unowned"] == 1
    servers = {s["server_id"]: s for s in snap.servers}
    assert servers[1]["leader"] and servers[1]["partitions"] == [0, 1]
    assert servers[1]["preferred_partitions"] == [0]
    assert servers[1]["preferred_source"] == "config"
    nodes = {s["node"]: s for s in snap.storage}
    assert nodes[NODES[0]]["up"] and nodes[NODES[0]]["disk_free"] == 20
    assert nodes[NODES[0]]["hosted"] == [0]
    assert nodes[NODES[1]]["up"] is None  # no HTTP endpoint answered for it
    assert nodes[NODES[2]]["group"] == 1
    assert snap.cluster["probe_errors"] == {"http://n2": "ConnectionRefusedError: refused"}


def _latency(counts: list[int]) -> str:
    bounds = ["0.001", "0.01", "0.1", "+Inf"]
    return "\n".join(
        f'waltz_server_commit_latency_seconds_bucket{{le="{le}",partition="0"}} {c}.0'
        for le, c in zip(bounds, counts, strict=True)
    )


def test_rates_and_percentiles_over_the_window() -> None:
    trackers = Trackers()
    meta = _meta({0: 1, 1: 1, 2: 1})
    build(meta, _probes(10, locks=0, buckets=_latency([0, 0, 0, 0])), trackers, 100.0)
    snap = build(meta, _probes(30, locks=4, buckets=_latency([50, 90, 100, 100])), trackers, 102.0)
    p0 = snap.partition(0)
    assert p0 is not None
    assert p0["commit_rate"] == 10.0  # 20 transactions in 2 s
    assert p0["lock_failure_rate"] == 2.0
    assert snap.cluster["commit_rate"] == 10.0
    # p50 = 50th of 100 observations: the top of the first bucket; p99 inside the third
    assert p0["commit_p50_ms"] == pytest.approx(1.0)
    assert p0["commit_p99_ms"] == pytest.approx(91.0)


def test_commit_latency_stays_shown_between_metrics_reads() -> None:
    """Issue 29: "Commit p50/p99 shows "-" for both after fresh commits". The status is read
    every second and ``/metrics`` every 5 s: a refresh between two reads reuses the last
    one, and the percentiles cover the reads of the last minute (timed by when they were
    read), so commits stay shown after the next reads find no new ones."""
    trackers = Trackers()
    meta = _meta({0: 1, 1: 1, 2: 1})

    def refresh(now: float, read_at: float, counts: list[int]) -> Any:
        probes = _probes(10, buckets=_latency(counts))
        probes.metrics_read = dict.fromkeys(probes.metrics, read_at)
        return build(meta, probes, trackers, now)

    refresh(100.0, 100.0, [0, 0, 0, 0])
    for now in (101.0, 102.0, 103.0, 104.0):
        refresh(now, 100.0, [0, 0, 0, 0])
    shown = []
    # 10 commits before the read at 105; then reads at 110, 115, ... find nothing new
    for now in range(105, 175):
        read_at = float(now - now % 5)
        snap = refresh(float(now), read_at, [5, 9, 10, 10])
        p0 = snap.partition(0)
        assert p0 is not None
        shown.append((now, p0["commit_p99_ms"], snap.cluster["commit_p99_ms"]))
    for now, p99, cluster_p99 in shown:
        if now < 165:  # the read at 105 is within the last minute of reads
            assert p99 == pytest.approx(91.0), now
            assert cluster_p99 == pytest.approx(91.0), now
        else:
            assert p99 is None and cluster_p99 is None, now  # no commit in the last minute


def test_the_cluster_latency_merges_the_partitions_histograms() -> None:
    trackers = Trackers()
    meta = _meta({0: 1, 1: 1, 2: 1})
    two = "\n".join(
        f'waltz_server_commit_latency_seconds_bucket{{le="{le}",partition="{p}"}} {c}.0'
        for p, counts in ((0, (0, 0, 0)), (1, (0, 0, 0)))
        for le, c in zip(("0.001", "0.01", "+Inf"), counts, strict=True)
    )
    rows = [_row(0, 10), _row(1, 10)]
    probes = _probes(10, buckets=two)
    probes.status["http://s1"] = _server_status(1, rows, leader=True)
    build(meta, probes, trackers, 100.0)
    after = two.replace('le="0.001",partition="0"} 0', 'le="0.001",partition="0"} 50')
    after = after.replace('le="0.01",partition="0"} 0', 'le="0.01",partition="0"} 50')
    after = after.replace('le="+Inf",partition="0"} 0', 'le="+Inf",partition="0"} 50')
    after = after.replace('le="0.01",partition="1"} 0', 'le="0.01",partition="1"} 50')
    after = after.replace('le="+Inf",partition="1"} 0', 'le="+Inf",partition="1"} 50')
    probes = _probes(10, buckets=after)
    probes.status["http://s1"] = _server_status(1, rows, leader=True)
    snap = build(meta, probes, trackers, 105.0)
    # 50 commits under 1 ms on partition 0, 50 from 1 to 10 ms on partition 1
    assert snap.cluster["commit_p50_ms"] == pytest.approx(1.0)
    assert snap.cluster["commit_p99_ms"] == pytest.approx(9.82)


def test_a_histogram_that_appears_with_the_first_commit_counts_it() -> None:
    """A partition's latency histogram has no series before its first commit: once the
    server's metrics were read without it, its first buckets are observations."""
    trackers = Trackers()
    meta = _meta({0: 1, 1: 1, 2: 1})
    build(meta, _probes(10), trackers, 100.0)  # metrics read, no histogram for partition 0
    first = build(meta, _probes(11, buckets=_latency([1, 1, 1, 1])), trackers, 101.0)
    p0 = first.partition(0)
    assert p0 is not None and p0["commit_p99_ms"] == pytest.approx(0.99)
    # without an earlier read of the server's metrics, history is not taken for the window
    fresh = build(meta, _probes(11, buckets=_latency([1, 1, 1, 1])), Trackers(), 101.0)
    p0 = fresh.partition(0)
    assert p0 is not None and p0["commit_p99_ms"] is None


def test_a_counter_that_restarts_is_not_a_negative_rate() -> None:
    series = Series()
    series.add(0.0, 100)
    series.add(1.0, 110)
    series.add(2.0, 3)  # the partition moved: a new counter
    series.add(3.0, 7)
    assert series.rate() == 4.0


def test_histogram_quantile() -> None:
    assert histogram_quantile(0.5, None) is None
    assert histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None
    buckets = [(0.1, 10.0), (0.2, 20.0), (math.inf, 20.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.15)
    # everything above the last finite bound: that bound is the answer
    assert histogram_quantile(0.99, [(0.1, 0.0), (math.inf, 5.0)]) == pytest.approx(0.1)


def test_failover_new_session_recovery_and_membership_events() -> None:
    before = build(_meta({0: 1, 1: 1, 2: 2}), _probes(10), Trackers(), 0.0)
    meta = _meta({0: 2, 1: 1, 2: 2}, sessions={0: 5})
    meta.servers = {2: ServerInfo(2, "tcp://s2:1")}  # server 1 died
    meta.owners[0] = PartitionAssignment(0, 2, "tcp://s2:1", 6)
    assert meta.assignments is not None
    meta.assignments = ReplicaAssignments(
        2, {NODES[0]: (0, 1, 2), NODES[1]: (2,), NODES[2]: (0, 1)}
    )
    probes = Probes(
        status={
            "http://s2": _server_status(
                2, [_row(0, 10, state="recovering", session_id=5)], leader=True
            )
        }
    )
    after = build(meta, probes, Trackers(), 1.0)
    events = derive_events(before, after)
    kinds = [(e.kind, e.partition) for e in events]
    assert ("membership", None) in kinds  # server 1 left
    assert ("failover", 0) in kinds
    assert ("store_session", 0) in kinds
    assert any(e.message == "server 1 left (tcp://s1:1)" for e in events)
    assert any(e.message == "server 2 leads the cluster manager" for e in events)
    assert any(e.message == f"partition 0: replica added on {NODES[2]}" for e in events)
    assert any(e.message == f"partition 0: replica on {NODES[1]} removed" for e in events)
    assert any(e.kind == "storage_down" and NODES[0] in e.message for e in events)
    failover = next(e for e in events if e.kind == "failover")
    assert failover.message == "partition 0 failed over from server 1 to server 2 (generation 6)"

    probes.status["http://s2"]["partitions"][0]["state"] = "writable"
    recovered = build(meta, probes, Trackers(), 2.0)
    assert [(e.kind, e.partition) for e in derive_events(after, recovered)] == [("recovery", 0)]
    assert derive_events(None, recovered) == []
    assert derive_events(recovered, recovered) == []


def test_a_move_away_from_a_silent_server_is_a_failover() -> None:
    """A killed server stops answering at once; its registration expires and its
    partitions move seconds later, maybe before the console sees it leave."""
    meta = _meta({0: 1, 1: 1, 2: 1})
    meta.servers[2] = ServerInfo(2, "tcp://s2:1")
    probes = _probes(10)
    before = build(meta, probes, Trackers(), 0.0)
    moved = _meta({0: 2, 1: 1, 2: 1})
    moved.servers[2] = ServerInfo(2, "tcp://s2:1")
    moved.owners[0] = PartitionAssignment(0, 2, "tcp://s2:1", 6)
    quiet = Probes(silent_servers={1})
    events = derive_events(before, build(moved, quiet, Trackers(), 1.0))
    (event,) = [e for e in events if e.partition == 0]
    assert event.kind == "failover"
    assert [e.message for e in events if e.kind == "server_down"] == [
        "server 1 stopped answering; its partitions move when its coordination session expires"
    ]
    # a planned move (the old owner still answers) is not a failover
    events = derive_events(before, build(moved, probes, Trackers(), 1.0))
    (event,) = [e for e in events if e.partition == 0]
    assert not [e for e in events if e.kind == "server_down"]
    assert event.kind == "moved"
    assert event.message == "partition 0 moved from server 1 to server 2 (generation 6)"


def test_fenced_requests_are_an_event() -> None:
    meta = _meta({0: 1, 1: 1, 2: 1})

    def probes(fenced: int) -> Probes:
        p = _probes(10)
        p.metrics["http://n1"] = parse_metrics(
            f'waltz_storage_fenced_requests_total{{partition="0"}} {fenced}.0\n'
        )
        return p

    trackers = Trackers()
    before = build(meta, probes(1), trackers, 0.0)
    after = build(meta, probes(3), trackers, 1.0)
    (event,) = derive_events(before, after)
    assert event.kind == "fenced"
    assert "refused 2 request(s)" in event.message


def test_parse_metrics_keeps_only_what_is_wanted() -> None:
    text = "\n".join(
        [
            "# HELP waltz_server_commit_latency_seconds x",
            'waltz_server_commit_latency_seconds_bucket{le="0.5",partition="3"} 7.0',
            'waltz_server_commit_latency_seconds_count{partition="3"} 7.0',
            'waltz_storage_fenced_requests_total{partition="1"} 2.0',
            'waltz_storage_fsync_latency_seconds_bucket{le="+Inf"} 4.0',
            "garbage line",
        ]
    )
    found = parse_metrics(text)
    assert found == {
        "waltz_server_commit_latency_seconds_bucket": [({"le": "0.5", "partition": "3"}, 7.0)],
        "waltz_storage_fenced_requests_total": [({"partition": "1"}, 2.0)],
        "waltz_storage_fsync_latency_seconds_bucket": [({"le": "+Inf"}, 4.0)],
    }


def test_paging_a_thousand_partitions() -> None:
    rows = [{"partition": i, "owner": i % 3, "state": "writable"} for i in range(1000)]
    first = page(rows, offset=0, limit=50)
    assert first["total"] == 1000 and len(first["rows"]) == 50
    last = page(rows, offset=990, limit=50)
    assert [r["partition"] for r in last["rows"]] == list(range(990, 1000))
    assert page(rows, offset=2000, limit=50)["rows"] == []
    # a number matches a field exactly, a word anywhere
    exact = page(rows, query="7", fields=("partition",))
    assert [r["partition"] for r in exact["rows"]] == [7]
    assert page(rows, query="writ", fields=("state",))["total"] == 1000
    with pytest.raises(ConfigError, match="limit must be from 1 to 500"):
        page(rows, limit=501)
    with pytest.raises(ConfigError, match="offset must be at least 0"):
        page(rows, offset=-1)


def test_a_password_in_the_coordination_uri_is_not_shown() -> None:
    assert (
        redact_uri("etcd://ops:secret@10.0.0.2:2379/waltz") == "etcd://ops:***@10.0.0.2:2379/waltz"
    )
    assert redact_uri("zk://10.0.0.2:2181/waltz") == "zk://10.0.0.2:2181/waltz"
    assert (
        redact_uri("zk://h:2181/w?username=ops&password=s3cret&tls_key_password=k&tls=true")
        == "zk://h:2181/w?username=ops&password=***&tls_key_password=***&tls=true"
    )
    assert redact_uri("local:///var/lib/waltz?root=/waltz") == "local:///var/lib/waltz?root=/waltz"
    meta = _meta({0: 1, 1: 1, 2: 1})
    meta.uri = "etcd://ops:secret@h:2379/w"
    assert (
        build(meta, Probes(), Trackers(), 0.0).cluster["coordination"] == "etcd://ops:***@h:2379/w"
    )


def test_parse_int_says_what_is_wrong() -> None:
    assert parse_int("12", "start") == 12
    assert parse_int(None, "start", default=3) == 3
    with pytest.raises(ConfigError, match="start must be a whole number, got 'x'"):
        parse_int("x", "start")
    with pytest.raises(ConfigError, match="start must be at least 0, got -4"):
        parse_int("-4", "start")
    with pytest.raises(ConfigError, match="partition is required"):
        parse_int("", "partition")


def test_replicas_clients_acl_and_archive_rounds_are_events() -> None:
    """Issue 29: the time line showed only the coordination connect after commits, a
    failover and client connects. It names replicas leaving and rejoining a store
    session, clients connecting and leaving, ACL changes and archive rounds."""
    from waltz_api.access import AccessControl, Permission
    from waltz_api.cluster import ArchiveMark

    meta = _meta({0: 1, 1: 1, 2: 1})
    key = "k" * 40
    before = build(meta, _probes(10), Trackers(), 0.0)
    probes = _probes(12)
    row = probes.status["http://s1"]["partitions"][0]
    row["writable_replicas"] = [NODES[0], NODES[1]]
    row["clients"] = [{"client": "client:10", "position": 12}]
    meta.acl = AccessControl(enforced=True).granted(key, [2], Permission.WRITE, name="billing")
    meta.archive[0] = ArchiveMark(0, mark=8, archived_bytes=4096)
    after = build(meta, probes, Trackers(), 1.0)
    messages = [(e.kind, e.message, e.partition) for e in derive_events(before, after)]
    assert messages == [
        ("replica_rejoined", f"partition 0: the replica on {NODES[1]} rejoined store session 4", 0),
        ("archive", "partition 0: an archive round archived through transaction 8 "
         "(4096 bytes in the archive)", 0),
        ("client_connected", "client client:10 connected to partition 0 (feed position 12)", 0),
        ("client_left", "client client:9 left partition 0", 0),
        ("acl", "ACL enforced: clients need a grant for each partition", None),
        ("acl", "ACL: key billing (kkkkkkkk...) granted write on partition 2", 2),
    ]  # fmt: skip
    # the replica leaves again, the grant changes, the next round; the same clients
    probes = _probes(14)
    row = probes.status["http://s1"]["partitions"][0]
    row["clients"] = [{"client": "client:10", "position": 14}]
    meta.acl = meta.acl.revoked(key, [2], Permission.WRITE)
    meta.archive[0] = ArchiveMark(0, mark=12, archived_bytes=8192)
    later = build(meta, probes, Trackers(), 2.0)
    messages = [(e.kind, e.message) for e in derive_events(after, later)]
    assert messages == [
        ("replica_left", f"partition 0: the replica on {NODES[1]} left store session 4 "
         "(it stopped answering or fell behind; it catches up to rejoin)"),
        ("archive", "partition 0: an archive round archived through transaction 12 "
         "(8192 bytes in the archive)"),
        ("acl", "ACL: key billing (kkkkkkkk...) holds read on partition 2 (was write)"),
    ]  # fmt: skip


def test_many_clients_at_once_are_one_event() -> None:
    meta = _meta({0: 1, 1: 1, 2: 1})
    before = build(meta, _probes(10), Trackers(), 0.0)
    probes = _probes(10)
    probes.status["http://s1"]["partitions"][0]["clients"] = [
        {"client": f"client:{i}", "position": 10} for i in range(100, 130)
    ]
    after = build(meta, probes, Trackers(), 1.0)
    assert [(e.kind, e.message) for e in derive_events(before, after)] == [
        ("clients", "30 client(s) connected, 1 left")
    ]
