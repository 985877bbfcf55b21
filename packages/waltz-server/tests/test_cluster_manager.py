"""The cluster manager: the assignment function, and servers following the assignment on the
memory reference coordination and on a real ZooKeeper (sessions expired for real)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waltz_api.cluster import NO_SERVER, PartitionAssignment, ServerInfo, coordination_from_uri
from waltz_api.contracts.coordination import Coordination, SessionState
from waltz_api.errors import (
    BadVersionError,
    ClusterNotFoundError,
    ConfigError,
    CoordinationUnavailableError,
)
from waltz_conformance.reference.coordination import MemoryCoordination, MemoryCoordinationService
from waltz_conformance.suites.coordination import eventually
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.observability import ServerMetrics, new_registry
from waltz_server.server.cluster_manager import (
    ClusterManager,
    LossReason,
    PartitionEvent,
    PartitionGained,
    PartitionLost,
    compute_assignment,
)

pytestmark = pytest.mark.timeout(120)

NODES = ["127.0.0.1:7001", "127.0.0.1:7002"]
CONVERGE = 30.0


# -- the assignment function ---------------------------------------------------------------------


def _servers(*ids: int, prefs: Mapping[int, Sequence[int]] | None = None) -> list[ServerInfo]:
    prefs = prefs or {}
    return [ServerInfo(i, f"tcp://s{i}", tuple(prefs.get(i, ()))) for i in ids]


def _loads(target: dict[int, int]) -> dict[int, int]:
    loads: dict[int, int] = {}
    for owner in target.values():
        loads[owner] = loads.get(owner, 0) + 1
    return loads


def test_assignment_one_two_three_servers_balanced() -> None:
    assert compute_assignment(7, _servers(4), {}) == dict.fromkeys(range(7), 4)
    two = compute_assignment(7, _servers(1, 2), {})
    assert sorted(_loads(two).values()) == [3, 4]
    three = compute_assignment(7, _servers(1, 2, 3), {})
    assert sorted(_loads(three).values()) == [2, 2, 3]
    assert set(three) == set(range(7))
    assert compute_assignment(5, [], {1: 3}) == {}


def test_assignment_moves_as_little_as_possible() -> None:
    before = compute_assignment(6, _servers(1, 2), {})
    # A third server takes exactly its share; nothing else moves.
    after = compute_assignment(6, _servers(1, 2, 3), before)
    moved = [p for p in range(6) if after[p] != before[p]]
    assert len(moved) == 2 and all(after[p] == 3 for p in moved)
    # Server 1 dies: only its partitions move.
    later = compute_assignment(6, _servers(2, 3), after)
    assert [p for p in range(6) if later[p] != after[p]] == [p for p in range(6) if after[p] == 1]
    assert sorted(_loads(later).values()) == [3, 3]
    # Recomputing a settled assignment changes nothing (no generation bump).
    assert compute_assignment(6, _servers(2, 3), later) == later


def test_assignment_preferred_partitions() -> None:
    servers = _servers(1, 2, 3, prefs={3: [0, 1, 2, 3], 2: [3, 5]})
    target = compute_assignment(8, servers, dict.fromkeys(range(8), 1))
    assert [target[p] for p in (0, 1, 2)] == [3, 3, 3]
    assert target[3] == 2 and target[5] == 2  # 2 and 3 both prefer 3: the lower id wins
    # The others are balanced among the servers below the level the preferences set.
    loads = _loads(target)
    assert loads[3] == 3 and loads[1] + loads[2] == 5 and abs(loads[1] - loads[2]) <= 1
    # Unknown partitions in preferences are ignored here (the manager refuses them at start).
    assert compute_assignment(2, _servers(1, prefs={1: [9]}), {}) == {0: 1, 1: 1}


@settings(max_examples=300, deadline=None)
@given(
    num_partitions=st.integers(0, 24),
    ids=st.sets(st.integers(1, 30), min_size=1, max_size=6),
    prefs=st.dictionaries(st.integers(1, 30), st.lists(st.integers(0, 30), max_size=6)),
    current=st.dictionaries(st.integers(0, 23), st.integers(-1, 30)),
)
def test_assignment_properties(
    num_partitions: int,
    ids: set[int],
    prefs: dict[int, list[int]],
    current: dict[int, int],
) -> None:
    servers = _servers(*sorted(ids), prefs=prefs)
    target = compute_assignment(num_partitions, servers, current)
    # Every partition is assigned, to a live server.
    assert set(target) == set(range(num_partitions))
    assert set(target.values()) <= ids
    # Preferences of live servers are honoured (lowest id first).
    preferred_by: dict[int, int] = {}
    for server_id in sorted(ids):
        for p in prefs.get(server_id, []):
            if p < num_partitions:
                preferred_by.setdefault(p, server_id)
    assert all(target[p] == owner for p, owner in preferred_by.items())
    # Servers taking unpreferred partitions differ by at most one, and no server holds
    # two fewer than one that took unpreferred partitions (it would have taken one).
    loads = {s: 0 for s in ids}
    for owner in target.values():
        loads[owner] += 1
    pinned = {s: sum(1 for o in preferred_by.values() if o == s) for s in ids}
    takers = [s for s in ids if loads[s] > pinned[s]]
    if takers:
        high = max(loads[s] for s in takers)
        assert high - min(loads[s] for s in takers) <= 1
        assert all(loads[s] >= high - 1 for s in ids)
    # Stable: recomputing from the result moves nothing.
    assert compute_assignment(num_partitions, servers, target) == target


# -- backends ---------------------------------------------------------------------------------


class SuspendableCoordination(MemoryCoordination):
    """The memory reference with a switch to make its session SUSPENDED, as a dropped
    connection does (the reference has no connection to drop)."""

    def set_session_state(self, state: SessionState) -> None:
        assert self._tracker is not None
        self._tracker.set_state(state)


@dataclass
class Backend:
    name: str
    factory: Callable[[], Coordination]
    expire: Callable[[Coordination], object]
    admin: ClusterAdmin
    managers: list[ClusterManager] = field(default_factory=list)

    async def expire_session(self, client: Coordination) -> None:
        result = self.expire(client)
        if asyncio.iscoroutine(result):
            await result

    async def create(self, partitions: int) -> None:
        await self.admin.create_cluster(
            num_partitions=partitions, num_replicas=2, storage_nodes=NODES
        )

    async def manager(
        self,
        name: str,
        *,
        preferred: Sequence[int] = (),
        start: bool = True,
        factory: Callable[[], Coordination] | None = None,
    ) -> ClusterManager:
        manager = ClusterManager(
            factory or self.factory, f"tcp://127.0.0.1/{name}", preferred_partitions=preferred
        )
        self.managers.append(manager)
        if start:
            await manager.start()
        return manager


@pytest.fixture(params=["memory", "zk", "etcd", "local"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    root = f"/cluster-manager-tests/{uuid.uuid4().hex[:10]}"
    clients: list[Coordination] = []
    if request.param == "memory":
        service = MemoryCoordinationService()

        def new() -> Coordination:
            return SuspendableCoordination(service, root)

        def expire(client: Coordination) -> object:
            service.expire_session(client.session_id)
            return None
    elif request.param == "zk":
        from waltz_coord_zk import ZooKeeperCoordination
        from waltz_coord_zk.conformance import harness as conformance_harness

        server = request.getfixturevalue("zookeeper_server")
        harness = conformance_harness({"server": server, "session_timeout": 4.0})

        def new() -> Coordination:
            return ZooKeeperCoordination(server.connect_string, root, session_timeout=4.0)

        def expire(client: Coordination) -> object:
            return harness.expire_session(client)
    elif request.param == "etcd":
        from waltz_coord_etcd.conformance import harness as etcd_harness

        cluster = request.getfixturevalue("etcd_cluster")
        cluster.ensure_all_running()
        etcd = etcd_harness({"cluster": cluster, "session_timeout": 4.0})

        def new() -> Coordination:
            return coordination_from_uri(cluster.uri(root), {"session_timeout": 4.0})

        def expire(client: Coordination) -> object:
            return etcd.expire_session(client)
    else:
        from waltz_coord_local.conformance import harness as local_harness

        local = local_harness({"location": tmp_path, "session_timeout": 3.0})

        def new() -> Coordination:
            return coordination_from_uri(local.client_uri(root), {"session_timeout": 3.0})

        def expire(client: Coordination) -> object:
            return local.expire_session(client)

    admin_client = new()
    clients.append(admin_client)
    await admin_client.start()
    backend = Backend(request.param, new, expire, ClusterAdmin(admin_client))
    try:
        yield backend
    finally:
        for manager in backend.managers:
            await asyncio.wait_for(manager.stop(), 30)
        for client in clients:
            await client.close()


# -- helpers ------------------------------------------------------------------------------------


def drain(manager: ClusterManager) -> list[PartitionEvent]:
    events: list[PartitionEvent] = []
    while not manager.events.empty():
        events.append(manager.events.get_nowait())
    return events


async def assignments(backend: Backend) -> dict[int, PartitionAssignment]:
    return {a.partition_id: a for a in await backend.admin.partition_assignments()}


async def converged(
    backend: Backend, managers: Sequence[ClusterManager], partitions: int, balanced: bool = True
) -> bool:
    """Every partition assigned to exactly one of ``managers``, which holds it at the
    generation in the metadata; no two managers hold the same partition."""
    if not all(m.registered for m in managers):
        return False
    stored = await assignments(backend)
    held: dict[int, int] = {}
    for manager in managers:
        for partition, generation in manager.owned.items():
            if partition in held:
                return False  # held twice
            held[partition] = manager.server_id
            if stored[partition].server_id != manager.server_id:
                return False
            if stored[partition].generation != generation:
                return False
    if set(held) != set(range(partitions)):
        return False
    # Settled: the leader would move nothing.
    owners = {p: a.server_id for p, a in stored.items()}
    if compute_assignment(partitions, await backend.admin.servers(), owners) != owners:
        return False
    if balanced:
        loads = [len(m.owned) for m in managers]
        return max(loads) - min(loads) <= 1
    return True


async def wait_converged(
    backend: Backend, managers: Sequence[ClusterManager], partitions: int, balanced: bool = True
) -> dict[int, PartitionAssignment]:
    await eventually(
        lambda: converged(backend, managers, partitions, balanced),
        CONVERGE,
        f"{len(managers)} servers to converge on {partitions} partitions",
        interval=0.05,
    )
    return await assignments(backend)


# -- the manager --------------------------------------------------------------------------------


async def test_one_server_takes_every_partition(backend: Backend) -> None:
    await backend.create(4)
    a = await backend.manager("a")
    stored = await wait_converged(backend, [a], 4)
    assert a.is_leader
    assert all(s.generation == 1 and s.endpoint == "tcp://127.0.0.1/a" for s in stored.values())
    events = drain(a)
    assert sorted(events, key=lambda e: e.partition_id) == [
        PartitionGained(p, 1, a.server_id) for p in range(4)
    ]
    assert [s.server_id for s in await backend.admin.servers()] == [a.server_id]


async def test_three_servers_share_and_generations_bump_only_on_moves(backend: Backend) -> None:
    await backend.create(7)
    a = await backend.manager("a")
    await wait_converged(backend, [a], 7)
    # Read what a was told (its gains): events coalesce, so a partition gained and lost
    # before the consumer looked would yield nothing at all.
    assert sorted(e.partition_id for e in drain(a)) == list(range(7))
    b = await backend.manager("b")
    before = await assignments(backend)
    after = await wait_converged(backend, [a, b], 7)
    for p in range(7):
        moved = after[p].server_id != before[p].server_id
        assert after[p].generation == before[p].generation + (1 if moved else 0)
    moved_to_b = [p for p in range(7) if after[p].server_id == b.server_id]
    assert len(moved_to_b) == 3
    # a lost exactly what b gained, at the generation it held them.
    lost = [e for e in drain(a) if isinstance(e, PartitionLost)]
    assert sorted(e.partition_id for e in lost) == moved_to_b
    assert all(e.reason is LossReason.MOVED and e.generation == 1 for e in lost)
    assert sorted(e.partition_id for e in drain(b)) == moved_to_b

    c = await backend.manager("c")
    final = await wait_converged(backend, [a, b, c], 7)
    assert sorted(len(m.owned) for m in (a, b, c)) == [2, 2, 3]
    assert a.is_leader and not b.is_leader and not c.is_leader
    # Quiet: with nothing changing, nothing is reassigned.
    await asyncio.sleep(0.5)
    assert await assignments(backend) == final


async def test_expired_session_moves_partitions_and_server_comes_back(backend: Backend) -> None:
    await backend.create(6)
    a = await backend.manager("a")
    b = await backend.manager("b")
    c = await backend.manager("c")
    before = await wait_converged(backend, [a, b, c], 6)
    drain(b)
    b_held = dict(b.owned)
    old_b_id = b.server_id
    client = b.coordination
    assert client is not None
    await backend.expire_session(client)
    # b drops everything at once, then comes back under a new id.
    await eventually(lambda: b.registrations == 2, CONVERGE, "b registers again")
    first = drain(b)
    # Every partition b held is lost first, once, at the generation it held. The reason
    # is the lost session, or a move when the leader's reassignment (made as soon as b's
    # registration vanished) reached b before the news of its session (etcd may do that).
    lost = first[: len(b_held)]
    assert all(isinstance(e, PartitionLost) and e.server_id == old_b_id for e in lost)
    assert {e.partition_id: e.generation for e in lost} == b_held
    reasons = {e.reason for e in lost if isinstance(e, PartitionLost)}
    assert reasons <= {LossReason.SESSION_LOST, LossReason.MOVED}
    if backend.name in ("memory", "zk"):  # the session news comes first there
        assert reasons == {LossReason.SESSION_LOST}
    assert b.server_id > old_b_id
    after = await wait_converged(backend, [a, b, c], 6)
    for p in range(6):
        if before[p].server_id == old_b_id:
            # moved away from the dead b, maybe back to the new b: two bumps at most
            assert after[p].generation in (before[p].generation + 1, before[p].generation + 2)
        elif after[p].server_id == before[p].server_id:
            assert after[p].generation == before[p].generation
        else:
            assert after[p].generation == before[p].generation + 1
    assert old_b_id not in [s.server_id for s in await backend.admin.servers()]


async def test_leader_death_moves_leadership(backend: Backend) -> None:
    await backend.create(5)
    a = await backend.manager("a")
    b = await backend.manager("b")
    c = await backend.manager("c")
    await wait_converged(backend, [a, b, c], 5)
    assert a.is_leader
    old_a = a.server_id
    a_had = set(a.owned)
    client = a.coordination
    assert client is not None
    # The leader's session expires (as when its process dies): b leads and moves a's
    # partitions; a comes back under a higher id, as a follower.
    await backend.expire_session(client)
    await eventually(lambda: b.is_leader, CONVERGE, "b leads after a died")
    await eventually(lambda: a.registrations == 2, CONVERGE, "a registers again")
    stored = await wait_converged(backend, [a, b, c], 5)
    assert a.server_id > old_a and not a.is_leader and not c.is_leader
    assert all(stored[p].server_id != old_a for p in a_had)
    # A graceful stop of the leader hands leadership on too.
    await b.stop()
    await eventually(lambda: c.is_leader, CONVERGE, "c leads after b stopped")
    stored = await wait_converged(backend, [a, c], 5)
    assert {s.server_id for s in stored.values()} == {a.server_id, c.server_id}


async def test_preferred_partitions(backend: Backend) -> None:
    await backend.create(6)
    a = await backend.manager("a")
    b = await backend.manager("b")
    await wait_converged(backend, [a, b], 6)
    c = await backend.manager("c", preferred=[4, 5, 0])
    await wait_converged(backend, [a, b, c], 6, balanced=False)
    assert set(c.owned) == {0, 4, 5}
    assert sorted([len(a.owned), len(b.owned)]) == [1, 2]
    await c.stop()
    await wait_converged(backend, [a, b], 6)
    d = await backend.manager("d", preferred=[4, 5, 0])
    await wait_converged(backend, [a, b, d], 6, balanced=False)
    assert set(d.owned) == {0, 4, 5}
    # Preferences outnumbering the fair share are still honoured, the rest balanced.
    e = await backend.manager("e", preferred=[1, 2, 3])
    await wait_converged(backend, [a, b, d, e], 6, balanced=False)
    assert set(e.owned) == {1, 2, 3} and set(d.owned) == {0, 4, 5}
    assert a.owned == {} and b.owned == {}


async def test_start_errors(backend: Backend) -> None:
    lone = await backend.manager("lone", start=False)
    with pytest.raises(ClusterNotFoundError, match="waltz cluster create"):
        await lone.start()
    assert lone.coordination is None
    await backend.create(3)
    bad = await backend.manager("bad", preferred=[2, 3], start=False)
    with pytest.raises(ConfigError, match=r"preferred partitions \[3\] do not exist"):
        await bad.start()
    with pytest.raises(ConfigError, match="non-negative"):
        ClusterManager(backend.factory, "tcp://x", preferred_partitions=[-1])
    with pytest.raises(ConfigError, match="endpoint"):
        ClusterManager(backend.factory, " ")
    assert await backend.admin.servers() == []


async def test_event_handler_gets_events_in_order(backend: Backend) -> None:
    await backend.create(3)
    seen: list[PartitionEvent] = []

    async def handler(event: PartitionEvent) -> None:
        await asyncio.sleep(0)  # a handler that yields, as opening a partition does
        seen.append(event)

    metrics = ServerMetrics(new_registry(process_metrics=False))
    manager = ClusterManager(
        backend.factory, "tcp://127.0.0.1/h", on_event=handler, metrics=metrics
    )
    backend.managers.append(manager)
    await manager.start()
    await eventually(lambda: len(seen) == 3, CONVERGE, "three gains")
    assert metrics.registry.get_sample_value("waltz_server_partitions_owned") == 3
    assert (
        metrics.registry.get_sample_value("waltz_cluster_assignment_changes_total") == 3
    )  # it led: three generation bumps
    server_id = manager.server_id
    await manager.stop()
    assert metrics.registry.get_sample_value("waltz_server_partitions_owned") == 0
    assert seen[:3] == [PartitionGained(p, 1, server_id) for p in range(3)]
    assert seen[3:] == [PartitionLost(p, 1, server_id, LossReason.STOPPED) for p in range(3)]


@pytest.mark.parametrize("backend", ["memory"], indirect=True)  # it has the switch
async def test_suspended_session_makes_no_assignment_and_gains_nothing(backend: Backend) -> None:
    await backend.create(4)
    a = await backend.manager("a")
    await wait_converged(backend, [a], 4)
    a_client = a.coordination
    assert isinstance(a_client, SuspendableCoordination)
    a_client.set_session_state(SessionState.SUSPENDED)
    await eventually(lambda: not a.is_leader, 5, "a stops leading while suspended")
    b = await backend.manager("b")
    await asyncio.sleep(0.5)
    # The suspended leader assigned nothing to b.
    stored = await assignments(backend)
    assert {s.server_id for s in stored.values()} == {a.server_id}
    assert all(s.generation == 1 for s in stored.values())
    assert b.owned == {}
    a_client.set_session_state(SessionState.CONNECTED)
    await wait_converged(backend, [a, b], 4)

    # A suspended follower defers its gains until it reconnects, and loses what moves.
    b_client = b.coordination
    assert isinstance(b_client, SuspendableCoordination)
    b_client.set_session_state(SessionState.SUSPENDED)
    c = await backend.manager("c", preferred=[0, 1, 2, 3])
    await eventually(lambda: set(c.owned) == {0, 1, 2, 3}, CONVERGE, "c takes its preferred")
    await eventually(lambda: b.owned == {}, CONVERGE, "suspended b loses what moved")
    await c.stop()

    async def reassigned_to_a_and_b() -> bool:
        stored = await assignments(backend)
        owners = {s.server_id for s in stored.values()}
        return owners == {a.server_id, b.server_id}

    await eventually(reassigned_to_a_and_b, CONVERGE, "c's partitions go to a and b")
    await asyncio.sleep(0.3)
    assert b.owned == {}, "a suspended server gained a partition"
    b_client.set_session_state(SessionState.CONNECTED)
    await wait_converged(backend, [a, b], 4)


async def test_no_partition_held_twice_under_churn(backend: Backend) -> None:
    """Servers join, die (session expiry) and leave while a checker samples what each
    holds: once converged, every partition is held by exactly one live server."""
    await backend.create(8)
    managers = [await backend.manager(f"s{i}") for i in range(3)]
    await wait_converged(backend, managers, 8)
    for round_ in range(2):
        victim = managers[round_]
        client = victim.coordination
        assert client is not None
        await backend.expire_session(client)
        managers.append(await backend.manager(f"n{round_}"))
        await eventually(
            functools.partial(lambda v: v.registrations == 2, victim), CONVERGE, "re-registered"
        )
        await wait_converged(backend, managers, 8)
    # Every live registration owns what it holds; the dead ids own nothing.
    live = {s.server_id for s in await backend.admin.servers()}
    assert live == {m.server_id for m in managers}
    stored = await assignments(backend)
    assert all(s.server_id in live and s.server_id != NO_SERVER for s in stored.values())


async def test_killed_server_process_loses_its_partitions(zookeeper_server: object) -> None:
    """A server process killed with SIGKILL stops heartbeating: once ZooKeeper expires its
    session, the leader moves its partitions (generation + 1) to the live servers."""
    from waltz_conformance.servers.zookeeper import ZooKeeperServer
    from waltz_coord_zk import ZooKeeperCoordination

    assert isinstance(zookeeper_server, ZooKeeperServer)
    root = f"/cluster-manager-kill/{uuid.uuid4().hex[:10]}"
    session_timeout = 2.0

    def new() -> Coordination:
        return ZooKeeperCoordination(
            zookeeper_server.connect_string, root, session_timeout=session_timeout
        )

    admin_client = new()
    await admin_client.start()
    backend = Backend("zk", new, lambda c: None, ClusterAdmin(admin_client))
    worker: asyncio.subprocess.Process | None = None
    try:
        await backend.create(6)
        a = await backend.manager("a")
        b = await backend.manager("b")
        await wait_converged(backend, [a, b], 6)
        uri = f"{zookeeper_server.uri(root)}?session_timeout={session_timeout}"
        worker = await asyncio.create_subprocess_exec(
            sys.executable,
            str(Path(__file__).with_name("cluster_manager_worker.py")),
            uri,
            "tcp://worker",
            stdout=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL,
        )
        assert worker.stdout is not None
        line = (await asyncio.wait_for(worker.stdout.readline(), 60)).decode()
        assert line.startswith("registered "), line
        worker_id = int(line.split()[1])

        async def worker_holds_its_share() -> bool:
            stored = await assignments(backend)
            return sum(1 for s in stored.values() if s.server_id == worker_id) == 2

        await eventually(worker_holds_its_share, CONVERGE, "the worker process gets 2 partitions")
        for _ in range(2):  # and it reports the gains
            event = (await asyncio.wait_for(worker.stdout.readline(), 30)).decode()
            assert event.startswith("gained "), event
        before = await assignments(backend)
        os.kill(worker.pid, signal.SIGKILL)
        await asyncio.wait_for(worker.wait(), 30)
        killed_at = time.monotonic()
        after = await wait_converged(backend, [a, b], 6)
        elapsed = time.monotonic() - killed_at
        for p in range(6):
            if before[p].server_id == worker_id:
                assert after[p].generation == before[p].generation + 1
                assert after[p].server_id in (a.server_id, b.server_id)
            else:
                assert after[p] == before[p]
        # Expiry takes the session timeout; moving takes little more.
        assert elapsed < session_timeout + 15, elapsed
    finally:
        if worker is not None and worker.returncode is None:
            os.kill(worker.pid, signal.SIGKILL)
            await asyncio.wait_for(worker.wait(), 30)
        for manager in backend.managers:
            await asyncio.wait_for(manager.stop(), 30)
        await admin_client.close()


async def test_deleted_registration_counts_as_a_lost_session(backend: Backend) -> None:
    """A server whose registration vanishes while its client still looks connected (an
    entry deleted by hand, an etcd lease revoked) drops everything and registers anew."""
    await backend.create(3)
    a = await backend.manager("a")
    await wait_converged(backend, [a], 3)
    old = a.server_id
    drain(a)
    await backend.admin.unregister_server(old)
    await eventually(lambda: a.registrations == 2, CONVERGE, "a registers again")
    await wait_converged(backend, [a], 3)
    assert a.server_id > old
    events = drain(a)
    lost = [e for e in events if isinstance(e, PartitionLost)]
    assert sorted(e.partition_id for e in lost) == [0, 1, 2]
    assert all(e.server_id == old and e.generation == 1 for e in lost)
    gained = [e for e in events if isinstance(e, PartitionGained)]
    assert sorted((e.partition_id, e.generation) for e in gained) == [(0, 2), (1, 2), (2, 2)]


@pytest.mark.timeout(300)
async def test_zookeeper_outage_within_the_session_timeout_moves_nothing(
    zookeeper_server: object,
) -> None:
    """ZooKeeper killed and restarted (its sessions survive, as in production): every
    server is SUSPENDED meanwhile (no leader), then carries on with the same partitions at
    the same generations: no event, no move."""
    from waltz_conformance.servers.zookeeper import ZooKeeperServer
    from waltz_coord_zk import ZooKeeperCoordination

    assert isinstance(zookeeper_server, ZooKeeperServer)
    root = f"/cluster-manager-outage/{uuid.uuid4().hex[:10]}"

    def new() -> Coordination:
        # a session timeout well above the outage even on a loaded machine (the JVM's
        # restart took long enough under two CPU burners that a 40 s session expired)
        return ZooKeeperCoordination(zookeeper_server.connect_string, root, session_timeout=120.0)

    admin_client = new()
    await admin_client.start()
    backend = Backend("zk", new, lambda c: None, ClusterAdmin(admin_client))
    try:
        await backend.create(4)
        a = await backend.manager("a")
        b = await backend.manager("b")
        before = await wait_converged(backend, [a, b], 4)
        held = (a.owned, b.owned)
        drain(a)
        drain(b)

        def state(m: ClusterManager) -> SessionState | None:
            client = m.coordination
            return None if client is None else client.session_state

        await asyncio.to_thread(zookeeper_server.kill)
        try:
            await eventually(
                lambda: state(a) is SessionState.SUSPENDED and state(b) is SessionState.SUSPENDED,
                30,
                "both sessions suspended",
            )
            assert not a.is_leader
        finally:
            await asyncio.to_thread(zookeeper_server.start)
        await eventually(
            lambda: state(a) is SessionState.CONNECTED and state(b) is SessionState.CONNECTED,
            120,
            "both sessions back",
        )
        await eventually(lambda: a.is_leader, CONVERGE, "a leads again")
        after = await wait_converged(backend, [a, b], 4)
        assert after == before
        assert (a.owned, b.owned) == held
        assert drain(a) == [] and drain(b) == []
        assert a.registrations == 1 and b.registrations == 1
    finally:
        if not zookeeper_server.running:
            await asyncio.to_thread(zookeeper_server.start)
        for manager in backend.managers:
            await asyncio.wait_for(manager.stop(), 30)
        await admin_client.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_membership_changes_keep_the_invariants(seed: int) -> None:
    """A seeded random run on the memory reference: servers join (some with preferences),
    stop, or lose their session. After each change has settled: every partition is held
    by exactly one live server at the generation in the metadata; a partition whose owner
    did not change kept its generation; one whose owner changed has a newer one."""
    rng = random.Random(seed)
    service = MemoryCoordinationService()
    root = f"/random-{seed}"
    admin_client = MemoryCoordination(service, root)
    await admin_client.start()
    backend = Backend(
        "memory",
        lambda: MemoryCoordination(service, root),
        lambda c: service.expire_session(c.session_id),
        ClusterAdmin(admin_client),
    )
    partitions = 10
    try:
        await backend.create(partitions)
        live = [await backend.manager("first")]
        before = await wait_converged(backend, live, partitions, balanced=False)
        for step in range(12):
            action = rng.choice(["join", "join", "stop", "expire"] if len(live) > 1 else ["join"])
            if action == "join":
                preferred = rng.sample(range(partitions), rng.choice([0, 0, 1, 2]))
                live.append(await backend.manager(f"s{step}", preferred=preferred))
            elif action == "stop":
                await live.pop(rng.randrange(len(live))).stop()
            else:
                victim = live[rng.randrange(len(live))]
                client = victim.coordination
                assert client is not None
                registrations = victim.registrations
                await backend.expire_session(client)
                await eventually(
                    lambda v=victim, r=registrations: v.registrations == r + 1,  # type: ignore[misc]
                    CONVERGE,
                    "the expired server registers again",
                )
            after = await wait_converged(backend, live, partitions, balanced=False)
            for p in range(partitions):
                if after[p].server_id == before[p].server_id:
                    assert after[p].generation == before[p].generation, (step, action, p)
                else:
                    assert after[p].generation > before[p].generation, (step, action, p)
            before = after
    finally:
        for manager in backend.managers:
            await manager.stop()
        await admin_client.close()


# -- bounded, coalescing events -------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2])
def test_partition_events_coalesce_and_stay_bounded(seed: int) -> None:
    """Thousands of random gains and losses with a consumer that reads now and then: never
    more than two pending events per partition; every event the consumer reads is valid
    for what it was told before (a loss ends exactly the gain it got, with the reason of
    the first loss since); once drained, it holds exactly what the manager holds."""
    from waltz_server.server.cluster_manager import PartitionEvents

    rng = random.Random(seed)
    partitions = 16
    events = PartitionEvents()
    held: dict[int, tuple[int, int]] = {}
    generation = dict.fromkeys(range(partitions), 0)
    told: dict[int, tuple[int, int]] = {}
    first_loss: dict[int, LossReason] = {}  # the first loss since the consumer's last gain

    def consume(limit: int) -> None:
        for _ in range(limit):
            if events.empty():
                return
            event = events.get_nowait()
            p = event.partition_id
            if isinstance(event, PartitionLost):
                assert told.pop(p) == (event.generation, event.server_id)
                assert event.reason is first_loss.pop(p)
            else:
                assert p not in told and held[p] == (event.generation, event.server_id)
                told[p] = (event.generation, event.server_id)

    for _ in range(5000):
        p = rng.randrange(partitions)
        if p in held:
            reason = rng.choice(list(LossReason))
            gen, sid = held.pop(p)
            events.put(PartitionLost(p, gen, sid, reason))
            if p in told:
                first_loss.setdefault(p, reason)
        else:
            generation[p] += 1
            held[p] = (generation[p], rng.choice([1, 2]))
            events.put(PartitionGained(p, *held[p]))
        # A gain straight after a loss of the same holding ends the old holding for good.
        if p in told and held.get(p) == told[p]:
            first_loss.pop(p, None)
        assert events.qsize() <= 2 * partitions
        if rng.random() < 0.05:
            consume(rng.randrange(1, 6))
    consume(10 * partitions)
    assert events.empty() and told == held
    assert events.peak <= 2 * partitions
    with pytest.raises(asyncio.QueueEmpty):
        events.get_nowait()


@pytest.mark.parametrize("backend", ["local"], indirect=True)
async def test_assignment_burst_is_coalesced(backend: Backend) -> None:
    """Hundreds of assignment changes while one server's consumer does not read and
    another's is blocked in its handler: what waits stays within two events per
    partition, and once read, both hold exactly the final assignment."""
    partitions = 6
    await backend.create(partitions)
    a = await backend.manager("a")  # the leader; nobody reads its events
    await wait_converged(backend, [a], partitions)
    release = asyncio.Event()
    b_view: dict[int, int] = {}
    b_seen: list[PartitionEvent] = []

    async def blocked(event: PartitionEvent) -> None:
        await release.wait()
        b_seen.append(event)
        if isinstance(event, PartitionGained):
            assert event.partition_id not in b_view
            b_view[event.partition_id] = event.generation
        else:
            assert b_view.pop(event.partition_id) == event.generation

    b = ClusterManager(backend.factory, "tcp://127.0.0.1/b", on_event=blocked)
    backend.managers.append(b)
    await b.start()
    await wait_converged(backend, [a, b], partitions)
    # The burst: the partitions are thrown to a server that does not exist, over and over;
    # the leader gives each back at once (a generation bump per write).
    writes = 0
    for round_ in range(25):
        for p in range(partitions):
            stored = await backend.admin.partition_assignment(p)
            with contextlib.suppress(BadVersionError):
                await backend.admin.assign_partition(
                    p, 10_000 + round_, "tcp://nowhere", expected_version=stored.version
                )
                writes += 1
            assert a.events.qsize() <= 2 * partitions and b.events.qsize() <= 2 * partitions
    assert writes >= partitions * 10
    final = await wait_converged(backend, [a, b], partitions)
    assert any(s.generation > 20 for s in final.values())
    assert a.events.peak <= 2 * partitions and b.events.peak <= 2 * partitions
    # a reads now: the net effect per partition, at most a loss and a gain.
    a_view: dict[int, int] = {}
    per_partition: dict[int, int] = {}
    for event in drain(a):
        per_partition[event.partition_id] = per_partition.get(event.partition_id, 0) + 1
        if isinstance(event, PartitionGained):
            a_view[event.partition_id] = event.generation
        else:
            a_view.pop(event.partition_id, None)
    assert max(per_partition.values()) <= 2
    assert (
        a_view
        == a.owned
        == {p: s.generation for p, s in final.items() if s.server_id == a.server_id}
    )
    # b's handler goes on: it ends up with exactly what b holds, in few events.
    release.set()
    await eventually(lambda: b_view == b.owned, CONVERGE, "b's handler catches up")
    assert b_view == {p: s.generation for p, s in final.items() if s.server_id == b.server_id}
    assert len(b_seen) <= 4 * partitions


async def test_start_rides_out_a_coordination_service_that_restarts() -> None:
    """Registering lost mid-way (a ZooKeeper restart at a server's start: ConnectionLoss,
    seen by `waltz chaos`) is retried until ``start_timeout``; a server exited instead."""
    service = MemoryCoordinationService()
    root = f"/cluster-manager-tests/{uuid.uuid4().hex[:10]}"
    admin_client = MemoryCoordination(service, root)
    await admin_client.start()
    await ClusterAdmin(admin_client).create_cluster(
        num_partitions=2, num_replicas=2, storage_nodes=NODES
    )
    attempts = 0

    class Restarting(MemoryCoordination):
        async def start(self) -> None:
            nonlocal attempts
            attempts += 1
            if attempts <= 2:
                raise CoordinationUnavailableError("ConnectionLoss (the service restarts)")
            await super().start()

    manager = ClusterManager(
        lambda: Restarting(service, root),
        "tcp://127.0.0.1/restarting",
        retry_delay=0.01,
        max_retry_delay=0.05,
        rng=random.Random(1),
    )
    try:
        await asyncio.wait_for(manager.start(), CONVERGE)
        assert attempts == 3 and manager.server_id != NO_SERVER
    finally:
        await manager.stop()
    # a service that stays away: start fails once start_timeout has passed
    down = ClusterManager(
        lambda: Restarting(service, root),
        "tcp://127.0.0.1/down",
        retry_delay=0.01,
        max_retry_delay=0.05,
        start_timeout=0.3,
        rng=random.Random(2),
    )
    attempts = -1000
    started = time.monotonic()
    with pytest.raises(CoordinationUnavailableError, match="ConnectionLoss"):
        await down.start()
    assert 0.2 < time.monotonic() - started < CONVERGE
    await admin_client.close()
