"""The etcd plugin against a real 3-member etcd cluster."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from waltz_api.contracts.coordination import SessionState, Versioned
from waltz_api.errors import (
    BadVersionError,
    ConfigError,
    CoordinationError,
    CoordinationUnavailableError,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    SessionLostError,
)
from waltz_api.hookspecs import PluginKind
from waltz_api.plugins import PluginRegistry
from waltz_conformance.servers.etcd import EtcdCluster, free_ports
from waltz_coord_etcd import EtcdCoordination, parse_connect

pytestmark = [pytest.mark.system, pytest.mark.timeout(120)]

ClientFactory = Callable[..., Awaitable[EtcdCoordination]]


async def eventually(check: Callable[[], bool], timeout: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or check}")
        await asyncio.sleep(0.05)


def test_parse_connect() -> None:
    target = parse_connect("etcd://127.0.0.1:1,localhost:2/waltz/x/")
    assert target.endpoints == ("http://127.0.0.1:1", "http://localhost:2")
    assert target.root == "/waltz/x"
    assert parse_connect("h").endpoints == ("http://h:2379",)
    assert parse_connect("etcd://h:5").root == ""
    for bad in ("zk://h:1/x", "etcd:///x", "etcd://h:notaport/x", "etcd://h:70000/x"):
        with pytest.raises(ConfigError):
            parse_connect(bad)
    with pytest.raises(ConfigError, match="session_timeout"):
        EtcdCoordination("etcd://h:1/x", {"session_timeout": "soon"})


def test_registered_through_the_waltz_entry_point_group() -> None:
    registry = PluginRegistry()
    descriptor = registry.resolve(PluginKind.COORDINATION, "etcd://127.0.0.1:2379/w")
    assert descriptor.name == "etcd"
    client = descriptor.factory("etcd://127.0.0.1:2379/w", {})
    assert isinstance(client, EtcdCoordination)


async def test_create_get_set_delete_children(new_client: ClientFactory) -> None:
    client = await new_client()
    assert await client.get("/a") is None
    version = await client.create("/a/b", b"one")
    assert await client.get("/a/b") == Versioned(b"one", version)
    assert await client.get("/a") == Versioned(
        b"", (await client.get("/a") or Versioned(b"", -1)).version
    )
    with pytest.raises(NodeExistsError):
        await client.create("/a/b")
    with pytest.raises(NoNodeError):
        await client.create("/x/y", make_parents=False)
    newer = await client.set("/a/b", b"two", expected_version=version)
    assert newer > version
    with pytest.raises(BadVersionError):
        await client.set("/a/b", b"three", expected_version=version)
    with pytest.raises(NoNodeError):
        await client.set("/nope", b"")
    await client.create("/a/c")
    assert await client.children("/a") == ["b", "c"]
    assert await client.children("/") == ["a"]
    assert await client.children("/missing") == []
    with pytest.raises(NotEmptyError):
        await client.delete("/a")
    with pytest.raises(BadVersionError):
        await client.delete("/a/b", expected_version=version)
    await client.delete("/a/b", expected_version=newer)
    with pytest.raises(NoNodeError):
        await client.delete("/a/b", expected_version=newer)
    await client.delete("/a/b")  # absent, unversioned: a no-op
    # A re-created path never reuses a version a CAS could confuse with the old one.
    recreated = await client.create("/a/b", b"again")
    assert recreated > newer
    await client.delete("/a", recursive=True)
    assert await client.children("/") == []
    with pytest.raises(CoordinationError, match="starting with '/'"):
        await client.get("relative")


async def test_cas_race_exactly_one_winner(new_client: ClientFactory) -> None:
    clients = [await new_client() for _ in range(3)]
    version = await clients[0].create("/fence", b"0")
    for round_number in range(15):

        async def attempt(client: EtcdCoordination, value: bytes, expected: int) -> int | None:
            try:
                return await client.set("/fence", value, expected_version=expected)
            except BadVersionError:
                return None

        results = await asyncio.gather(
            *(attempt(c, f"{round_number}-{i}".encode(), version) for i, c in enumerate(clients))
        )
        winners = [r for r in results if r is not None]
        assert len(winners) == 1, results
        version = winners[0]
        current = await clients[1].get("/fence")
        assert current is not None and current.version == version


async def test_counters_strictly_increase_and_never_repeat(new_client: ClientFactory) -> None:
    clients = [await new_client() for _ in range(3)]

    async def take(client: EtcdCoordination) -> list[int]:
        return [await client.increment("/ids") for _ in range(15)]

    taken = await asyncio.gather(*(take(c) for c in clients))
    for values in taken:
        assert values == sorted(values) and len(set(values)) == len(values)
    everything = [v for values in taken for v in values]
    assert sorted(everything) == list(range(1, 46))


async def test_lease_revoke_removes_ephemeral_and_reports_lost(
    etcd_cluster: EtcdCluster, new_client: ClientFactory
) -> None:
    owner = await new_client()
    observer = await new_client()
    await owner.create("/servers/1", b"me", ephemeral=True)
    await owner.create("/servers/keep", b"persistent")
    seen: list[list[str]] = []
    await observer.watch_children("/servers", seen.append)
    assert seen == [["1", "keep"]]
    states: list[SessionState] = []
    owner.add_session_listener(states.append)
    lost_session = owner.session_id
    etcd_cluster.revoke_lease(lost_session)
    await eventually(lambda: seen[-1] == ["keep"], what="the ephemeral entry to vanish")
    await eventually(lambda: states == [SessionState.LOST], what="LOST")
    # LOST is final for a client: it changes nothing any more.
    with pytest.raises(SessionLostError):
        await owner.create("/servers/1", b"zombie", ephemeral=True)
    with pytest.raises(SessionLostError):
        await owner.get("/servers/keep")
    assert owner.session_id == lost_session
    successor = await new_client()
    assert successor.session_id != lost_session
    await successor.create("/servers/1", b"me again", ephemeral=True)
    await eventually(lambda: seen[-1] == ["1", "keep"], what="re-registration")


async def test_ephemeral_create_with_a_revoked_lease_reports_lost(
    etcd_cluster: EtcdCluster, new_client: ClientFactory
) -> None:
    owner = await new_client(session_timeout=60)
    states: list[SessionState] = []
    owner.add_session_listener(states.append)
    etcd_cluster.revoke_lease(owner.session_id)
    # Before the keep-alive notices, the create itself finds the lease gone.
    with pytest.raises(SessionLostError):
        await owner.create("/e", b"", ephemeral=True)
    assert states == [SessionState.LOST]
    assert owner.session_state is SessionState.LOST


async def test_close_deletes_ephemeral_promptly(new_client: ClientFactory) -> None:
    owner = await new_client(session_timeout=60)
    observer = await new_client()
    await owner.create("/e", b"", ephemeral=True)
    with pytest.raises(CoordinationError, match="ephemeral"):
        await owner.create("/e/child")
    await owner.set("/e", b"changed")  # a set keeps the entry ephemeral
    await owner.close()
    assert owner.session_state is SessionState.LOST
    # Not after the 60 s TTL: close revokes the lease.
    assert await observer.get("/e") is None


async def test_watch_sees_every_change_and_the_final_state(new_client: ClientFactory) -> None:
    writer = await new_client()
    watcher = await new_client()
    seen: list[Versioned | None] = []

    async def on_change(state: Versioned | None) -> None:
        seen.append(state)

    await watcher.watch("/w", on_change)
    assert seen == [None]
    versions = [await writer.create("/w", b"0")]
    for i in range(1, 30):
        versions.append(await writer.set("/w", str(i).encode()))
    await writer.delete("/w")
    await eventually(lambda: seen[-1] is None and len(seen) > 1, what="the delete")
    delivered = [s.version for s in seen if s is not None]
    assert delivered == sorted(delivered) and set(delivered) <= set(versions)
    final = await writer.create("/w", b"final")
    await eventually(lambda: seen[-1] == Versioned(b"final", final), what="the final state")


async def test_leader_killed_client_keeps_working(
    etcd_cluster: EtcdCluster, new_client: ClientFactory, root: str
) -> None:
    leader = etcd_cluster.leader_index()
    order = [leader] + [i for i in range(len(etcd_cluster.members)) if i != leader]
    uri = "etcd://" + ",".join(etcd_cluster.members[i].endpoint for i in order) + root
    client = await new_client(uri)  # both talk to the leader first
    watcher = await new_client(uri)
    seen: list[list[str]] = []
    await watcher.watch_children("/m", seen.append)
    await client.create("/m/before", b"")
    await eventually(lambda: seen[-1] == ["before"])
    etcd_cluster.kill_member(leader)
    try:
        # Reads fail over at once; a write racing the election may fail ambiguously
        # (it is never retried blindly), so let the other two elect a leader first.
        assert await client.get("/m/before") is not None
        # A create during the election succeeds or is reported UNKNOWN, never a
        # NodeExistsError (which a blind retry of an applied create would raise).
        try:
            await client.create("/m/during", b"")
            created_during = True
        except CoordinationUnavailableError:
            created_during = False
        await asyncio.to_thread(etcd_cluster.wait_healthy, 30)
        assert etcd_cluster.leader_index() != leader
        for i in range(10):
            await client.create(f"/m/after-{i}", b"")
        assert await client.increment("/m-counter") == 1
        names = await client.children("/m")
        if created_during:
            assert "during" in names
        expected = sorted(["before", *[f"after-{i}" for i in range(10)], "during"])
        assert names == [n for n in expected if n in names] and len(names) >= 11
        await eventually(lambda: seen[-1] == names, what="the watch to resume on a live member")
        # SUSPENDED is allowed during the election (a keep-alive may time out).
        await eventually(lambda: client.session_state is SessionState.CONNECTED, what="CONNECTED")
        await client.create("/m/eph", b"", ephemeral=True)
    finally:
        etcd_cluster.restart_member(leader)
    assert await client.get("/m/eph") is not None


async def test_suspended_while_unreachable_then_connected(
    etcd_cluster: EtcdCluster, new_client: ClientFactory, root: str
) -> None:
    lone = etcd_cluster.members[2]
    client = await new_client(f"etcd://{lone.endpoint}{root}", session_timeout=30)
    states: list[SessionState] = []
    client.add_session_listener(states.append)
    etcd_cluster.kill_member(2)
    try:
        await eventually(lambda: SessionState.SUSPENDED in states, what="SUSPENDED")
    finally:
        etcd_cluster.restart_member(2)
    await eventually(lambda: client.session_state is SessionState.CONNECTED, what="CONNECTED")
    assert SessionState.LOST not in states  # the lease outlived the outage
    await client.create("/back", b"", ephemeral=True)


def test_harness_stops_every_member_by_pid(tmp_path: Path) -> None:
    cluster = EtcdCluster(tmp_path, size=1)
    cluster.start()
    try:
        pids = [m.process.pid for m in cluster.members if m.process is not None]
        assert len(pids) == 1 and cluster.leader_index() == 0
    finally:
        cluster.stop()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped: the pid no longer exists
    assert not any(m.running for m in cluster.members)


async def test_start_without_a_reachable_member_fails_in_time() -> None:
    port = free_ports(1)[0]  # nothing listens there
    client = EtcdCoordination(f"etcd://127.0.0.1:{port}/x", {"request_timeout": 1.5})
    started = time.monotonic()
    with pytest.raises(CoordinationUnavailableError, match="did not answer"):
        await client.start()
    assert time.monotonic() - started < 10
    with pytest.raises(CoordinationError, match="not started"):
        await client.get("/a")
