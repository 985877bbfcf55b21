"""Failover without the coordination session timeout: the failure detector and the
leadership rule (pure, exact), the peer monitor over the memory transport, and cluster
managers that move a silent server's partitions (and replace a silent leader) while its
registration still lingers in the coordination service."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from waltz_api import wire
from waltz_api.cluster import LeaderRecord
from waltz_api.contracts.transport import Connection, Listener
from waltz_api.errors import BadVersionError, ConfigError, TransportError, WaltzError
from waltz_api.messages import PeerPing, PeerPong
from waltz_conformance.reference.coordination import MemoryCoordination, MemoryCoordinationService
from waltz_conformance.reference.transport import MemoryTransport
from waltz_conformance.suites.coordination import eventually
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.server.cluster_manager import ClusterManager
from waltz_server.server.liveness import (
    Changes,
    FailureDetector,
    Leadership,
    LivenessConfig,
    decide_leadership,
)
from waltz_server.server.peers import PeerMonitor
from waltz_server.server.server import WaltzServer
from waltz_server.server.testing import RawClient

pytestmark = pytest.mark.timeout(120)

# -- the failure detector (pure) ----------------------------------------------------------------


def test_silence_accrues_per_tick_and_suspicion_starts_at_the_threshold() -> None:
    detector = FailureDetector(suspect_after=1.0, max_step=0.2)
    detector.track("a")
    assert detector.tick(10.0) == Changes()  # the first tick only sets the clock
    for step in range(1, 10):
        assert detector.tick(10.0 + step * 0.1) == Changes()
    assert detector.silence("a") == pytest.approx(0.9)
    assert detector.tick(11.0) == Changes(suspected=frozenset({"a"}))
    assert detector.suspects == {"a"} and detector.is_suspected("a")
    assert detector.tick(11.1) == Changes()  # reported once
    assert detector.heard("a", 11.1) == Changes(cleared=frozenset({"a"}))
    assert detector.suspects == frozenset() and detector.silence("a") == 0
    assert detector.heard("a", 11.1) == Changes()
    assert detector.heard("unknown", 11.1) == Changes()


def test_a_late_tick_adds_at_most_max_step() -> None:
    """This server's own stall (a pause, a starved loop) never counts as the peers'
    silence: a tick 5 s late adds 0.2 s."""
    detector = FailureDetector(suspect_after=1.0, max_step=0.2)
    detector.track(1)
    detector.tick(0.0)
    assert detector.tick(5.0) == Changes()
    assert detector.silence(1) == pytest.approx(0.2)
    assert detector.tick(4.0) == Changes()  # a clock that went back adds nothing
    assert detector.silence(1) == pytest.approx(0.2)


def test_tracking_starts_silence_at_zero_and_untrack_forgets() -> None:
    detector = FailureDetector(suspect_after=0.3, max_step=0.2)
    detector.tick(0.0)
    detector.track(1)
    detector.tick(0.2)
    detector.track(2)
    detector.track(1)  # already tracked: unchanged
    assert detector.tick(0.4) == Changes(suspected=frozenset({1}))
    assert detector.silence(2) == pytest.approx(0.2)
    detector.untrack(1)
    assert detector.tracked == {2} and detector.suspects == frozenset()


def _pauses(answers_until: float, resumes_at: float, interval: float = 0.1) -> list[float]:
    """Pong times of a peer pinged every ``interval`` that stops answering at
    ``answers_until`` and answers every ping sent meanwhile at ``resumes_at``."""
    times = []
    for k in range(1, 100):
        sent = k * interval
        if sent <= answers_until:
            times.append(sent + 0.002)
        elif sent <= resumes_at:
            times.append(resumes_at + 0.002)
        else:
            times.append(sent + 0.002)
    return sorted(times)


@pytest.mark.parametrize("pause", [0.5, 1.0, 1.25])
def test_the_default_timings_keep_a_pause_of_a_second_and_a_quarter(pause: float) -> None:
    """At the defaults (pings every 0.1 s, suspect after 1.5 s), a peer paused for up to
    1.25 s (a 1 s pause with a quarter second to spare for a busy machine) is never
    suspected, wherever the pause falls between two pings."""
    config = LivenessConfig()
    for offset in range(10):
        start = 2.0 + offset * 0.01
        detector = FailureDetector.from_config(config)
        detector.track("peer")
        pongs = _pauses(start, start + pause)
        suspected = False
        for tick in range(1, 100):
            now = tick * config.heartbeat_interval + 0.05
            while pongs and pongs[0] <= now:
                detector.heard("peer", pongs.pop(0))
            suspected |= bool(detector.tick(now).suspected)
        assert not suspected, (pause, offset)


def test_a_dead_peer_is_suspected_within_suspect_after_plus_one_tick() -> None:
    config = LivenessConfig()
    detector = FailureDetector.from_config(config)
    detector.track("peer")
    last_pong = 3.0
    detector.tick(0.0)
    now = 0.0
    suspected_at = None
    while now < 10:
        now += config.heartbeat_interval
        if now <= last_pong:
            detector.heard("peer", now)
        if detector.tick(now).suspected:
            suspected_at = now
            break
    assert suspected_at is not None
    assert config.suspect_after <= suspected_at - last_pong + 1e-9
    assert suspected_at - last_pong <= config.suspect_after + config.heartbeat_interval


def test_liveness_config_is_validated() -> None:
    assert LivenessConfig().renew_interval == pytest.approx(1.5 / 4)
    assert LivenessConfig().max_step == pytest.approx(0.2)
    with pytest.raises(ConfigError, match="four heartbeat intervals") as caught:
        LivenessConfig(heartbeat_interval=0.5, suspect_after=1.0)
    assert caught.value.key == "server.peer_suspect_after"
    with pytest.raises(ConfigError, match="positive"):
        LivenessConfig(heartbeat_interval=0)


# -- the leadership rule (pure) -----------------------------------------------------------------

F, L, C, T = Leadership.FOLLOW, Leadership.LEAD, Leadership.CLAIM, Leadership.TAKE_OVER


@pytest.mark.parametrize(
    ("me", "registered", "suspects", "holder", "silent", "expected"),
    [
        # no record yet: the lowest registered server this one does not suspect claims it
        (1, [1, 2], [], None, True, C),
        (2, [1, 2], [], None, True, F),
        (2, [1, 2], [1], None, True, C),
        # the holder leads; the others follow while it is fine
        (1, [1, 2], [2], 1, True, L),
        (2, [1, 2], [], 1, True, F),
        (3, [1, 2, 3], [], 2, True, F),  # not the lowest id: stable all the same
        # suspected, but its record was renewed lately: it is alive (a cut between servers)
        (2, [1, 2], [1], 1, False, F),
        # suspected and silent: the lowest server this one does not suspect takes over
        (2, [1, 2], [1], 1, True, T),
        (3, [1, 2, 3], [1], 1, True, F),  # 2 is fine and lower: 2 acts
        (3, [1, 2, 3], [1, 2], 1, True, T),
        # gone from the registrations: taken over at once, renewals or not
        (2, [2, 3], [], 1, False, T),
        (3, [2, 3], [], 1, False, F),
        # a server not registered (yet, or any more) does nothing
        (4, [1, 2], [], None, True, F),
        (4, [1, 2], [], 4, True, F),
    ],
)
def test_decide_leadership(  # noqa: PLR0917 (the parametrized table's columns)
    me: int,
    registered: list[int],
    suspects: list[int],
    holder: int | None,
    silent: bool,
    expected: Leadership,
) -> None:
    assert decide_leadership(me, registered, suspects, holder, silent) is expected


def test_at_most_one_follower_acts_when_all_agree() -> None:
    """Whatever the registrations and holder, followers that suspect the same servers
    never both decide to claim or take over."""
    ids = [1, 2, 3, 4]
    for holder in [None, *ids]:
        for size in range(len(ids) + 1):
            for suspects in itertools.combinations(ids, size):
                acting = [
                    me
                    for me in ids
                    if me not in suspects
                    and decide_leadership(me, ids, set(suspects), holder, True) in (C, T)
                ]
                assert len(acting) <= 1, (holder, suspects, acting)


# -- a ping responder for the tests -------------------------------------------------------------


@dataclass
class Responder:
    """A stand-in server: answers pings with ``server_id()`` unless ``silent``, and never
    answers pings from the servers in ``deaf_to`` (a cut between two servers)."""

    transport: MemoryTransport
    endpoint: str
    server_id: int = -1
    silent: bool = False
    deaf_to: set[int] = field(default_factory=set)
    listener: Listener | None = None

    async def start(self) -> None:
        self.listener = await self.transport.listen(self.endpoint, self._serve)

    async def _serve(self, conn: Connection) -> None:
        protocol = wire.ProtocolConnection(wire.Role.ACCEPTOR, sender="responder")
        with contextlib.suppress(TransportError, WaltzError):
            protocol.receive_frame(await conn.recv())
            await conn.send(protocol.send(protocol.hello_response()))
            while True:
                message = protocol.receive_frame(await conn.recv())
                if not isinstance(message, PeerPing) or self.silent:
                    continue
                if message.server_id not in self.deaf_to:
                    await conn.send(protocol.send(PeerPong(message.seq_num, self.server_id)))


FAST = LivenessConfig(heartbeat_interval=0.05, suspect_after=0.5)


async def test_peer_monitor_suspects_a_silent_peer_and_clears_it_when_it_answers() -> None:
    name = uuid.uuid4().hex[:8]
    transport = MemoryTransport()
    peer = Responder(MemoryTransport(), f"memory://peer-{name}", server_id=5)
    await peer.start()
    changes: list[frozenset[int]] = []
    monitor = PeerMonitor(transport, FAST)
    monitor.on_change = lambda: changes.append(monitor.suspects)
    monitor.set_identity(1)
    monitor.set_peers({1: "memory://me", 5: peer.endpoint})
    assert monitor.peers == {5: peer.endpoint}  # never itself
    await monitor.start()
    try:
        await eventually(lambda: monitor.pings_answered >= 3, 10, "pongs")
        assert monitor.suspects == frozenset()
        peer.silent = True
        loop = asyncio.get_running_loop()
        silent_from = loop.time()
        await eventually(lambda: monitor.suspects == {5}, 10, "the silent peer suspected")
        assert loop.time() - silent_from >= FAST.suspect_after - FAST.heartbeat_interval
        peer.silent = False
        await eventually(lambda: monitor.suspects == frozenset(), 10, "the peer cleared")
        assert changes == [frozenset({5}), frozenset()]
        # a restarted server at the same endpoint (another id) is not the old one
        peer.server_id = 6
        await eventually(lambda: monitor.suspects == {5}, 10, "an impostor's pongs ignored")
        monitor.set_peers({})
        assert monitor.suspects == frozenset() and monitor.peers == {}
    finally:
        await monitor.close()
        await transport.close()
        await peer.transport.close()


async def test_a_waltz_server_answers_pings_with_its_current_id() -> None:
    transport = MemoryTransport()
    server = WaltzServer(
        transport=transport,
        endpoint=f"memory://server-{uuid.uuid4().hex[:8]}",
        coordination=MemoryCoordination(MemoryCoordinationService(), "/x"),
        connector=_no_replicas,
    )
    await server.start()
    client_transport = MemoryTransport()
    try:
        client = await RawClient.connect(client_transport, server.endpoint, "server:3")
        await client.send(PeerPing(7, 3))
        assert (await client.wait(PeerPong, timeout=10))[0] == PeerPong(7, -1)
        server.identity = lambda: 12
        await client.send(PeerPing(8, 3))
        assert (await client.wait(PeerPong, 2, timeout=10))[-1] == PeerPong(8, 12)
        assert server.connections == []  # a probing server is not a client
        await client.close()
    finally:
        await server.close()
        await transport.close()
        await client_transport.close()


async def _no_replicas(storage_node: str, partition_id: int, session_id: int) -> object:
    raise AssertionError("no storage in this test")


# -- cluster managers watching each other ---------------------------------------------------------


@dataclass
class Node:
    manager: ClusterManager
    responder: Responder
    monitor: PeerMonitor
    frozen: bool = False

    @property
    def server_id(self) -> int:
        return self.manager.server_id

    async def freeze(self) -> None:
        """As SIGSTOP or kill -9 before the session timeout: it answers nothing and acts
        no more, but its coordination session (and registration) stays."""
        self.frozen = True
        self.responder.silent = True
        manager = self.manager
        for task in (manager._leader_task, manager._renew_task, manager._peers_task):
            if task is not None:
                task.cancel()
        await self.monitor.close()


@dataclass
class Cluster:
    service: MemoryCoordinationService
    root: str
    admin: ClusterAdmin
    nodes: list[Node] = field(default_factory=list)
    transports: list[MemoryTransport] = field(default_factory=list)

    async def add(self, name: str) -> Node:
        transport = MemoryTransport()
        self.transports.append(transport)
        endpoint = f"memory://{name}-{uuid.uuid4().hex[:8]}"
        responder = Responder(transport, endpoint)
        await responder.start()
        monitor = PeerMonitor(transport, FAST)
        manager = ClusterManager(
            lambda: MemoryCoordination(self.service, self.root), endpoint, peers=monitor
        )
        responder.server_id = -1
        node = Node(manager, responder, monitor)
        self.nodes.append(node)
        await manager.start()
        responder.server_id = manager.server_id
        return node

    async def owners(self) -> dict[int, int]:
        return {a.partition_id: a.server_id for a in await self.admin.partition_assignments()}

    async def generations(self) -> dict[int, int]:
        return {a.partition_id: a.generation for a in await self.admin.partition_assignments()}

    async def registered(self) -> set[int]:
        return {s.server_id for s in await self.admin.servers()}


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    service = MemoryCoordinationService()
    root = f"/failover-{uuid.uuid4().hex[:8]}"
    admin_client = MemoryCoordination(service, root)
    await admin_client.start()
    admin = ClusterAdmin(admin_client)
    await admin.create_cluster(num_partitions=4, num_replicas=1, storage_nodes=["127.0.0.1:7001"])
    made = Cluster(service, root, admin)
    try:
        yield made
    finally:
        for node in made.nodes:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(node.manager.stop(), 10)
        for transport in made.transports:
            await transport.close()
        await admin_client.close()


async def balanced(cluster: Cluster, nodes: list[Node]) -> bool:
    owners = await cluster.owners()
    ids = {n.server_id for n in nodes}
    if set(owners.values()) - ids:
        return False
    loads = [sum(1 for o in owners.values() if o == i) for i in ids]
    return max(loads) - min(loads) <= 1


async def test_a_silent_follower_loses_its_partitions_while_still_registered(
    cluster: Cluster,
) -> None:
    a = await cluster.add("a")
    b = await cluster.add("b")
    await eventually(lambda: balanced(cluster, [a, b]), 10, "a and b share")
    assert a.manager.is_leader and a.manager.leader_id == a.server_id
    before = await cluster.generations()
    b_had = [p for p, o in (await cluster.owners()).items() if o == b.server_id]
    loop = asyncio.get_running_loop()
    frozen_at = loop.time()
    await b.freeze()
    await eventually(lambda: balanced(cluster, [a]), 10, "b's partitions moved to a")
    took = loop.time() - frozen_at
    assert FAST.suspect_after - FAST.heartbeat_interval <= took <= FAST.suspect_after + 1.0
    # not the session timeout: b is still registered
    assert b.server_id in await cluster.registered()
    after = await cluster.generations()
    assert all(after[p] == before[p] + 1 for p in b_had)
    assert a.manager.suspects == {b.server_id}


@pytest.mark.parametrize("servers", [2, 3])
async def test_a_silent_leader_is_replaced_and_its_partitions_move(
    cluster: Cluster, servers: int
) -> None:
    """The followers knew the leader from their registration on (no later change of
    the registrations told them about it)."""
    nodes = [await cluster.add(name) for name in "abc"[:servers]]
    a, b, rest = nodes[0], nodes[1], nodes[2:]
    await eventually(lambda: balanced(cluster, nodes), 10, "the servers share")
    assert a.manager.is_leader
    record = await cluster.admin.leader()
    assert record is not None and record.value == LeaderRecord(a.server_id, 1, 0)
    await a.freeze()
    await eventually(lambda: b.manager.is_leader, 10, "b takes the leadership over")
    await eventually(lambda: balanced(cluster, nodes[1:]), 10, "a's partitions moved")
    record = await cluster.admin.leader()
    assert record is not None and record.value.server_id == b.server_id
    assert record.value.term == 2
    assert not any(n.manager.is_leader for n in rest)
    assert a.server_id in await cluster.registered()


async def test_a_short_silence_moves_nothing(cluster: Cluster) -> None:
    a = await cluster.add("a")
    b = await cluster.add("b")
    await eventually(lambda: balanced(cluster, [a, b]), 10, "a and b share")
    before = await cluster.generations()
    for _ in range(3):
        b.responder.silent = True
        await asyncio.sleep(FAST.suspect_after * 0.6)
        b.responder.silent = False
        await asyncio.sleep(FAST.suspect_after)
    assert await cluster.generations() == before
    assert a.manager.suspects == frozenset()


async def test_a_follower_that_answers_again_gets_its_share_back(cluster: Cluster) -> None:
    a = await cluster.add("a")
    b = await cluster.add("b")
    await eventually(lambda: balanced(cluster, [a, b]), 10, "a and b share")
    b.responder.silent = True
    await eventually(lambda: balanced(cluster, [a]), 10, "b's partitions moved to a")
    b.responder.silent = False
    await eventually(lambda: balanced(cluster, [a, b]), 10, "b gets its share back")
    assert a.manager.suspects == frozenset()


@pytest.mark.parametrize("follower_first", [False, True])
async def test_a_cut_between_two_live_servers_keeps_one_leader(
    cluster: Cluster, follower_first: bool
) -> None:
    """a and b cannot hear each other but both reach the coordination service. Both
    suspect the other at about the same time; whichever wins the leader record's CAS
    (the leader renewing, or the follower taking over) keeps it: its renewals keep the
    other from taking it back, and it serves every partition. No flapping. With
    ``follower_first`` the follower stops hearing the leader a while before the leader
    stops hearing it: the follower takes over, and the old leader must not take the
    leadership back."""
    a = await cluster.add("a")
    b = await cluster.add("b")
    nodes = [a, b]
    await eventually(lambda: balanced(cluster, nodes), 10, "a and b share")
    a.responder.deaf_to.add(b.server_id)  # b no longer hears a
    if follower_first:
        await asyncio.sleep(FAST.suspect_after * 0.6)
    b.responder.deaf_to.add(a.server_id)

    async def one_leader_holds_everything() -> bool:
        record = await cluster.admin.leader()
        if record is None:
            return False
        holder = [n for n in nodes if n.server_id == record.value.server_id]
        return bool(holder) and await balanced(cluster, holder)

    await eventually(one_leader_holds_everything, 10, "one leader serving everything")
    record = await cluster.admin.leader()
    assert record is not None
    leader = next(n for n in nodes if n.server_id == record.value.server_id)
    other = b if leader is a else a
    if follower_first:
        assert leader is b and record.value.term == 2
    generations = await cluster.generations()
    await asyncio.sleep(FAST.suspect_after * 4)
    later = await cluster.admin.leader()
    assert later is not None and later.value.server_id == leader.server_id
    assert later.value.term == record.value.term, "the leadership flapped"
    assert later.value.renewals > record.value.renewals, "the leader does not renew"
    assert await cluster.generations() == generations, "partitions flapped"
    assert leader.manager.is_leader and not other.manager.is_leader
    # healed: the other answers again and gets its share; the renewals stop
    a.responder.deaf_to.clear()
    b.responder.deaf_to.clear()
    await eventually(lambda: balanced(cluster, nodes), 10, "both share again")
    await asyncio.sleep(FAST.renew_interval * 2)
    renewals = (await cluster.admin.leader()).value.renewals  # type: ignore[union-attr]
    await asyncio.sleep(FAST.renew_interval * 3)
    assert (await cluster.admin.leader()).value.renewals == renewals  # type: ignore[union-attr]


async def test_the_leader_record_is_changed_only_by_compare_and_set(cluster: Cluster) -> None:
    admin = cluster.admin
    assert await admin.leader() is None
    claimed = await admin.claim_leadership(3)
    assert claimed.value == LeaderRecord(3, 1, 0)
    with pytest.raises(BadVersionError):
        await admin.claim_leadership(4)
    taken = await admin.set_leader(LeaderRecord(4, 2), expected_version=claimed.version)
    with pytest.raises(BadVersionError):
        await admin.set_leader(LeaderRecord(5, 2), expected_version=claimed.version)
    assert await admin.leader() == taken
