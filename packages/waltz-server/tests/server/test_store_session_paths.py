"""A store session's paths at their edges (issue 28: the survivors of the mutation
sample of ``server/store_session.py``, docs/simulation.md). Reads that fall out of the
window to the replicas' storage: the record at the high-water mark, a replica failing
a read, every replica failing for a while, a catch-up whose sources fail; range reads
served from the window while storage hangs; ``drain`` with nothing pending and with
nothing able to commit; a replica refusing connects, a fenced write, a session still
recovering; a replica rejoining with an archive mark (a hole at the mark, a log past
it)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from fakes import FakeReplicaConnection, FakeStorageNode
from test_repair import DamagedConnection, DamagedNode, scribble
from test_store import NODES, TIMEOUT, Cluster, P, append_many, cluster, wait_until

from waltz_api.capabilities import PREFIX, REPAIR
from waltz_api.errors import SessionFencedError, StorageError, StoreSessionClosedError
from waltz_api.types import Record
from waltz_server.server.store import StoreConfig, StorePartition
from waltz_server.server.store_session import StoreSession

__all__ = ["cluster"]  # the fixture, re-exported for pytest
A, B, C = NODES


async def committed_store(cluster: Cluster, count: int, **config: object) -> StorePartition:
    """A store whose session committed ``count`` records of 20 bytes and more, with a
    window of 1 KiB: the first records are read from the replicas' storage."""
    store = cluster.store(max_window_bytes=1024, **config)
    await store.start()
    futures = await append_many(store, count, b"r" * 20)
    ids = await asyncio.wait_for(asyncio.gather(*futures), TIMEOUT)
    assert ids == list(range(count))
    return store


def open_session(store: StorePartition) -> StoreSession:
    session = store.session
    assert session is not None and session.low_water_mark == -1
    return session


@dataclass
class Reads:
    """Every read of a replica's storage, counted per node; ``refuse`` says (per node,
    read by read) whether it fails with a storage error."""

    count: Counter[str] = field(default_factory=Counter)
    refuse: Callable[[str], bool] = lambda node: False


@pytest.fixture
def reads() -> Iterator[Reads]:
    state = Reads()
    original = FakeReplicaConnection.read_records

    async def read_records(
        self: FakeReplicaConnection, start: int, max_records: int, max_bytes: int
    ) -> list[Record]:
        state.count[self.node.name] += 1
        if state.refuse(self.node.name):
            raise StorageError(f"test: {self.node.name} refuses the read")
        return await original(self, start, max_records, max_bytes)

    FakeReplicaConnection.read_records = read_records  # type: ignore[method-assign]
    try:
        yield state
    finally:
        FakeReplicaConnection.read_records = original  # type: ignore[method-assign]


async def test_a_read_from_storage_ends_at_the_high_water_mark_inclusive(
    cluster: Cluster, reads: Reads
) -> None:
    store = await committed_store(cluster, 200)
    try:
        session = open_session(store)
        assert session.high_water_mark == 199
        records = await store.read_committed(0, 1000, 1 << 20)
        assert [r.transaction_id for r in records] == list(range(200))
        assert sum(reads.count.values()) == 1  # from storage
    finally:
        await store.close()


async def test_a_read_tries_each_failing_replica_once_while_another_is_left(
    cluster: Cluster, reads: Reads
) -> None:
    """A and B refuse every read, C serves them: each read asks A and B at most once
    (whatever order the random choice of a source takes), and C once."""
    store = await committed_store(cluster, 200)
    try:
        session = open_session(store)
        reads.refuse = lambda node: node != C
        for _ in range(30):
            reads.count = counter = Counter[str]()
            records = await store.read_committed(0, 50, 1 << 20)
            assert [r.transaction_id for r in records] == list(range(50))
            assert counter[C] == 1 and counter[A] <= 1 and counter[B] <= 1, counter
        assert store.session is session and store.sessions_started == 1
    finally:
        await store.close()


async def test_a_read_every_replica_fails_for_a_while_retries_them_at_a_measured_pace(
    cluster: Cluster, reads: Reads
) -> None:
    """Every replica refuses reads for half a second: the read tries each once, then
    tries them all again after a pause (0.1 s), not at once and not never (it would
    fail at its deadline), and returns the records once they serve again."""
    store = await committed_store(cluster, 200)
    try:
        open_session(store)
        loop = asyncio.get_running_loop()
        until = loop.time() + 0.5
        reads.refuse = lambda node: loop.time() < until
        reads.count = counter = Counter[str]()
        records = await store.read_committed(0, 50, 1 << 20)
        assert [r.transaction_id for r in records] == list(range(50))
        assert loop.time() >= until
        # each round asks the three replicas once and the next round comes 0.1 s later
        # at the earliest: at most 6 rounds in 0.5 s, however slow the machine
        assert 3 < sum(counter.values()) <= 3 * 6 + 1, counter
    finally:
        await store.close()


async def test_range_reads_of_the_window_need_no_storage(cluster: Cluster) -> None:
    """Committed records a writer still lacks stay in the window: a range read of them
    is served from it, and returns while every storage node hangs. A range read of one
    record returns that record, from the window or from storage."""
    store = await committed_store(cluster, 200)
    lagging, hung = asyncio.Event(), asyncio.Event()
    try:
        session = open_session(store)
        cluster.nodes[C].hold = lagging  # C acknowledges nothing more: the window keeps
        more = await append_many(store, 5, b"w")  # what A and B commit
        assert await asyncio.wait_for(asyncio.gather(*more), TIMEOUT) == list(range(200, 205))
        for name in (A, B):
            cluster.nodes[name].hold = hung
        block = await asyncio.wait_for(store.read_committed_block(200, 10, 1 << 20), TIMEOUT)
        assert [r.transaction_id for r in block] == [200, 201, 202, 203, 204]
        one = await asyncio.wait_for(session.read_committed_block(204, 1, 1 << 20), TIMEOUT)
        assert [r.transaction_id for r in one] == [204]
        hung.set()
        one = await asyncio.wait_for(session.read_committed_block(0, 1, 1 << 20), TIMEOUT)
        assert [r.transaction_id for r in one] == [0]
    finally:
        lagging.set()
        hung.set()
        await store.close()


async def test_drain_returns_at_once_when_everything_committed(cluster: Cluster) -> None:
    store = await committed_store(cluster, 20)
    try:
        session = open_session(store)
        loop = asyncio.get_running_loop()
        started = loop.time()
        # nothing pending: it returns without waiting (a wait would last the 4 s)
        await asyncio.wait_for(session.drain(timeout=4.0), TIMEOUT)
        assert loop.time() - started < 2.0
        assert not session.done
    finally:
        await store.close()


async def test_drain_gives_up_at_its_deadline_when_nothing_can_commit(cluster: Cluster) -> None:
    """Two of three storage nodes hang: the appends pending cannot commit, and drain
    returns at its deadline (with them pending), not later."""
    store = await committed_store(cluster, 20)
    hold = asyncio.Event()
    try:
        session = open_session(store)
        for name in (A, B):
            cluster.nodes[name].hold = hold
        pending = await append_many(store, 5, b"p")
        await asyncio.wait_for(session.drain(timeout=0.2), TIMEOUT)
        assert not any(f.done() for f in pending)
        assert session.high_water_mark == 19
    finally:
        hold.set()
        await store.close()


async def test_a_catch_up_whose_sources_fail_retries_at_a_measured_pace(
    cluster: Cluster, reads: Reads
) -> None:
    """C comes back behind the window while A and B refuse reads for half a second:
    its catch-up asks a source, waits (0.1 s), asks again, and is caught up once they
    serve again; not a retry loop without a pause."""
    cluster.nodes[C].crash()
    store = await committed_store(cluster, 200)
    try:
        session = open_session(store)
        loop = asyncio.get_running_loop()
        refusals: list[float] = []

        def refuse(node: str) -> bool:
            if refusals and loop.time() >= refusals[0] + 0.5:
                return False
            refusals.append(loop.time())
            return True

        reads.refuse = refuse
        cluster.nodes[C].restart()
        await wait_until(lambda: len(cluster.nodes[C].log(P)) == 200, "c was caught up")
        assert C in session.writable_replicas and store.sessions_started == 1
        # one refused read, then one each 0.1 s at the earliest, however slow the machine
        assert 1 <= len(refusals) <= 5 + 2, len(refusals)
    finally:
        await store.close()


class RefusingNode(FakeStorageNode):
    """A storage node that answers connects with a storage error (its partition not
    hosted yet, say) until ``hosting`` is set."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.hosting = asyncio.Event()
        self.refused = 0

    async def connect(self, partition_id: int, session_id: int) -> FakeReplicaConnection:
        if not self.hosting.is_set():
            self.refused += 1
            raise StorageError(f"test: {self.name} does not host partition {partition_id} yet")
        return await super().connect(partition_id, session_id)


async def test_a_replica_refusing_to_connect_with_a_storage_error_is_retried(
    cluster: Cluster,
) -> None:
    """A storage error answering a connect is the replica's problem: the session
    commits with the two others, retries it, and it joins once it accepts."""
    refusing = RefusingNode(C)
    cluster.nodes[C] = refusing
    store = cluster.store()
    await store.start()
    try:
        await wait_until(lambda: refusing.refused >= 3, "c was asked again")
        session = await store.wait_ready(TIMEOUT)
        assert store.sessions_started == 1  # the refusals did not end it
        ids = await asyncio.wait_for(asyncio.gather(*await append_many(store, 10, b"s")), TIMEOUT)
        assert ids == list(range(10))
        assert not session.done and sorted(session.writable_replicas) == [A, B]
        refusing.hosting.set()
        await wait_until(lambda: len(refusing.log(P)) == 10, "c joined and was caught up")
        assert store.session is session and store.sessions_started == 1
    finally:
        await store.close()


async def test_a_fenced_write_ends_the_session_with_the_fence_as_its_error(
    cluster: Cluster,
) -> None:
    """A newer store session fenced the replicas' storage: the first write refused as
    fenced ends this session, its error that fence (not a replica left and retried)."""
    store = await committed_store(cluster, 10)
    try:
        session = open_session(store)
        for node in cluster.nodes.values():
            node.partition(P).highest_session_id = session.session_id + 1
        late = await append_many(store, 3, b"late")
        await asyncio.wait_for(session.wait_done(), TIMEOUT)
        assert isinstance(session.error, SessionFencedError), repr(session.error)
        outcome = await asyncio.gather(*late, return_exceptions=True)
        assert all(isinstance(o, StoreSessionClosedError) for o in outcome), outcome
        for node in cluster.nodes.values():
            assert len(node.log(P)) == 10
    finally:
        await store.close()


async def test_a_session_still_recovering_would_assign_the_id_after_its_mark(
    cluster: Cluster,
) -> None:
    """Before recovery decides the opening mark, a session's next id is the one after
    its high-water mark (-1: id 0), and a drain has nothing to wait for."""
    hold = asyncio.Event()
    for node in cluster.nodes.values():
        node.hold = hold  # recovery waits for the replicas' answers
    store = cluster.store()
    await store.start()
    try:
        await wait_until(lambda: store.session is not None, "a session started")
        session = store.session
        assert session is not None and not store.ready
        assert (session.high_water_mark, session.next_transaction_id) == (-1, 0)
        assert session.writable_replicas == [] and session.acknowledged_marks() == {}
        await asyncio.wait_for(session.drain(timeout=4.0), TIMEOUT)
        hold.set()
        ready = await store.wait_ready(TIMEOUT)
        assert ready is session and session.next_transaction_id == 0
    finally:
        hold.set()
        await store.close()


class Link:
    """An archive link whose mark the test sets (``ArchiveLink``); nothing is read from
    the archive: the test reads nothing at or below the mark."""

    def __init__(self) -> None:
        self.mark = -1

    async def refresh(self) -> int:
        return self.mark

    async def read(self, start: int, max_records: int, max_bytes: int) -> list[Record]:
        raise AssertionError(f"test: nothing is read from the archive ({start})")


class PrefixNode(DamagedNode):
    """A damaged node that deletes its archived prefix (capabilities REPAIR and
    PREFIX): reads below ``log_start`` are refused, holes there dropped."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.log_start = 0

    async def connect(self, partition_id: int, session_id: int) -> FakeReplicaConnection:
        if not self.online:
            return await FakeStorageNode.connect(self, partition_id, session_id)
        await asyncio.sleep(0)
        connection = PrefixConnection(self, partition_id, session_id)
        self.connections.append(connection)
        return connection


class PrefixConnection(DamagedConnection):
    node: PrefixNode
    capabilities = frozenset({REPAIR, PREFIX})

    async def prune(self, through: int) -> int:
        await self._enter()
        node = self.node
        node.log_start = max(node.log_start, through + 1)
        node.missing = [(max(f, through + 1), last) for f, last in node.missing if last > through]
        return node.log_start

    async def read_records(self, start: int, max_records: int, max_bytes: int) -> list[Record]:
        if start < self.node.log_start:
            raise StorageError(f"test: {self.node.name} deleted its records below {start}")
        return await super().read_records(start, max_records, max_bytes)


async def archived_cluster(
    cluster: Cluster,
) -> tuple[dict[str, PrefixNode], Link, StorePartition]:
    """A, B and C committed 0..49 and C crashed; then A and B committed 50..59 and
    deleted what the archive holds (the mark: 29). C holds 0..49, all of it."""
    nodes = {name: PrefixNode(name) for name in NODES}
    cluster.nodes.clear()
    cluster.nodes.update(nodes)
    link = Link()
    store = StorePartition(
        partition_id=P,
        generation=1,
        coordination=cluster.coordination,
        replica_nodes=sorted(nodes),
        connector=cluster.connector,
        config=StoreConfig(retry_initial=0.001, retry_max=0.02),
        rng=random.Random(0),
        archive=link,
    )
    await store.start()
    ids = await asyncio.wait_for(asyncio.gather(*await append_many(store, 50, b"a")), TIMEOUT)
    assert ids == list(range(50))
    await wait_until(lambda: all(len(n.log(P)) == 50 for n in nodes.values()), "all hold 0..49")
    nodes[C].crash()
    more = await asyncio.wait_for(asyncio.gather(*await append_many(store, 10, b"b")), TIMEOUT)
    assert more == list(range(50, 60))
    link.mark = 29
    await store.prune(29)
    assert (nodes[A].log_start, nodes[B].log_start, nodes[C].log_start) == (30, 30, 0)
    return nodes, link, store


async def test_a_hole_starting_at_the_archive_mark_is_dropped_not_repaired(
    cluster: Cluster,
) -> None:
    """C comes back having lost 29..35 to damage: 29 is archived and the writers
    deleted it, so C deletes its prefix through the mark (the hole's first id included)
    and only 30..35 is copied from the writers before it rejoins."""
    nodes, _, store = await archived_cluster(cluster)
    try:
        session = open_session(store)
        scribble(nodes[C], 29, 35)
        nodes[C].damage(29, 35)
        nodes[C].restart()
        await wait_until(
            lambda: not nodes[C].missing and len(nodes[C].log(P)) == 60, "c repaired, caught up"
        )
        assert nodes[C].repaired == [(30, 35)] and nodes[C].log_start == 30
        assert nodes[C].log(P)[30:] == nodes[A].log(P)[30:]
        assert store.session is session and store.sessions_started == 1
    finally:
        await store.close()


async def test_a_replica_rejoining_past_the_archive_mark_keeps_its_log(cluster: Cluster) -> None:
    """C comes back holding 0..49, past the mark: it rejoins at 49 and keeps its log;
    deleting archived records is the writers' prune, bounded by what each acknowledged,
    not the rejoin's."""
    nodes, _, store = await archived_cluster(cluster)
    try:
        session = open_session(store)
        nodes[C].restart()
        await wait_until(lambda: len(nodes[C].log(P)) == 60, "c rejoined and caught up")
        assert C in session.writable_replicas and nodes[C].log_start == 0
        await store.prune(29)
        assert nodes[C].log_start == 30
    finally:
        await store.close()
