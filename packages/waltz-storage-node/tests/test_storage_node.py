"""The storage node in-process: the memory reference transport, over the memory and fs engines.

These exercise the node's protocol logic (every request type, the open
handshake, fencing, admin, pipelining, malformed frames) quickly; the
subprocess tests (test_storage_node_process.py) run the same node for real:
`waltz storage --config`, ZeroMQ, the fs engine, kill -9.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import waltz_api
from waltz_api import wire
from waltz_api.contracts.storage import StorageEngine
from waltz_api.contracts.transport import Transport
from waltz_api.errors import (
    ChecksumError,
    ClusterKeyMismatchError,
    ConnectionClosedError,
    PartitionClosedError,
    PartitionNotFoundError,
    ProtocolError,
    SessionFencedError,
    StorageAppendError,
    StorageError,
)
from waltz_api.messages import (
    ErrorCode,
    FailureResponse,
    MaxTransactionIdRequest,
    MaxTransactionIdResponse,
    StorageAppendRequest,
    StorageOpenRequest,
    SuccessResponse,
)
from waltz_api.plugins import get_registry
from waltz_api.storage_failures import StorageNotOpenError, StorageRequestError
from waltz_api.types import LOST_SESSION, SessionInfo
from waltz_conformance.records import make_record, make_records
from waltz_storage_fs.engine import FsStorageEngine
from waltz_storage_node import StorageAdminClient, StorageClient, StorageNode

pytestmark = pytest.mark.timeout(60)

CLUSTER_KEY = uuid.UUID("5b1c3d7e-0a4f-4c1e-9a51-3d2b8f6e7c90")
NUM_PARTITIONS = 8

_names = itertools.count()


async def _open_engine(location: str, engine_name: str = "memory") -> StorageEngine:
    engine_class: Any = get_registry().get("storage", engine_name).factory
    engine: StorageEngine = await engine_class.open(
        location, cluster_key=CLUSTER_KEY, num_partitions=NUM_PARTITIONS
    )
    return engine


def _transport() -> Transport:
    transport: Transport = get_registry().get("transport", "memory").factory({})
    return transport


class NodeFixture:
    def __init__(self, location: str, engine_name: str = "memory") -> None:
        self.location = location
        self.engine_name = engine_name
        self.node: StorageNode | None = None
        self.server_transport: Transport | None = None
        self.client_transport = _transport()
        self.clients: list[StorageClient] = []
        self.endpoint = ""

    async def start(self, hosted: range | list[int] = range(4)) -> StorageNode:
        engine = await _open_engine(self.location, self.engine_name)
        for partition_id in hosted:
            await engine.add_partition(partition_id)
        self.server_transport = _transport()
        self.node = StorageNode(
            engine, self.server_transport, f"memory://storage-node-{next(_names)}-{uuid.uuid4()}"
        )
        await self.node.start()
        self.endpoint = self.node.endpoint
        return self.node

    async def stop_node(self) -> None:
        if self.node is not None:
            await self.node.close()
            self.node = None
        if self.server_transport is not None:
            await self.server_transport.close()
            self.server_transport = None

    async def client(self, *, open_storage: bool = True) -> StorageClient:
        client = await StorageClient.connect(self.client_transport, self.endpoint, sender="test")
        self.clients.append(client)
        if open_storage:
            await client.open(CLUSTER_KEY, NUM_PARTITIONS)
        return client

    async def admin(self) -> StorageAdminClient:
        client = await StorageAdminClient.connect(self.client_transport, self.endpoint)
        self.clients.append(client.client)
        return client

    async def close(self) -> None:
        for client in self.clients:
            await client.close()
        await self.stop_node()
        await self.client_transport.close()
        if self.engine_name == "memory":
            from waltz_conformance.reference.storage import forget

            forget(self.location)


@pytest.fixture(params=["memory", "fs"])
async def fx(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[NodeFixture]:
    """A node on the memory transport, over the memory engine and the fs engine
    (real files in a temporary directory)."""
    engine_name: str = request.param
    location = (
        f"memory-storage-{uuid.uuid4()}" if engine_name == "memory" else str(tmp_path / "data")
    )
    fixture = NodeFixture(location, engine_name)
    await fixture.start()
    try:
        yield fixture
    finally:
        await fixture.close()


async def test_every_request_type(fx: NodeFixture) -> None:
    c = await fx.client()
    s, p = 1, 0
    assert await c.last_session_info(s, p) == SessionInfo(-1, -1, -1)
    assert await c.max_transaction_id(s, p) == -1
    assert await c.record(s, p, 0) is None
    assert await c.record_header(s, p, 0) is None

    records = make_records(0, 5, partition_id=p, size=100)
    await c.append(s, p, records[:3])
    await c.append(s, p, records[3:])
    await c.append(s, p, [])  # an empty append is a no-op success
    assert await c.max_transaction_id(s, p) == 4
    assert await c.record(s, p, 2) == records[2]
    assert await c.record_header(s, p, 3) == records[3].record_header
    assert await c.record(s, p, 5) is None
    assert await c.record_headers(s, p, 1, 3) == [r.record_header for r in records[1:4]]
    assert await c.record_headers(s, p, 3, 100) == [r.record_header for r in records[3:]]
    assert await c.records(s, p, 0, 100) == records
    assert await c.records(s, p, 1, 2) == records[1:3]
    # max_bytes bounds the data, but at least one record comes back
    assert await c.records(s, p, 0, 100, max_bytes=150) == records[:1]
    assert await c.records(s, p, 9, 10) == []

    await c.truncate(s, p, 2)
    assert await c.max_transaction_id(s, p) == 2
    assert await c.records(s, p, 0, 100) == records[:3]
    await c.truncate(s, p, 10)  # above the max: a no-op
    assert await c.max_transaction_id(s, p) == 2

    # the low-water mark must not be below the max transaction id: truncate first
    with pytest.raises(StorageRequestError, match="truncate"):
        await c.set_low_water_mark(s, p, 1)
    # a replica behind the cluster: local low-water mark = its own max id
    await c.set_low_water_mark(s, p, 7)
    assert await c.last_session_info(s, p) == SessionInfo(1, 7, 2, 1)
    await c.truncate(s, p, -1)
    assert await c.max_transaction_id(s, p) == -1
    await c.set_low_water_mark(s, p, -1)
    assert await c.last_session_info(s, p) == SessionInfo(1, -1, -1, 1)


async def test_bad_arguments_are_refused_clearly(fx: NodeFixture) -> None:
    c = await fx.client()
    with pytest.raises(StorageRequestError, match="session id -1"):
        await c.max_transaction_id(-1, 0)
    with pytest.raises(StorageRequestError, match="max_records"):
        await c.record_headers(1, 0, 0, -5)
    with pytest.raises(StorageRequestError, match="truncate after transaction id -3"):
        await c.truncate(1, 0, -3)
    # ids that do not continue the log
    with pytest.raises(StorageAppendError):
        await c.append(1, 0, [make_record(3, partition_id=0)])
    assert await c.max_transaction_id(1, 0) == -1
    # a partition this node does not host, and one the cluster does not have
    with pytest.raises(PartitionNotFoundError, match="add-partition"):
        await c.max_transaction_id(1, 6)
    with pytest.raises(PartitionNotFoundError):
        await c.max_transaction_id(1, 1000)


async def test_open_checks_the_cluster_key_and_gates_the_connection(fx: NodeFixture) -> None:
    c = await fx.client(open_storage=False)
    with pytest.raises(StorageNotOpenError, match="StorageOpenRequest"):
        await c.max_transaction_id(1, 0)
    with pytest.raises(ClusterKeyMismatchError, match="does not match"):
        await c.open(uuid.uuid4(), NUM_PARTITIONS)
    # the code on the wire is CLUSTER_KEY_MISMATCH, and the connection stays unopened
    raw = await c.request(
        StorageOpenRequest(-1, c.next_seq_num(), -1, uuid.uuid4(), NUM_PARTITIONS)
    )
    assert isinstance(raw, FailureResponse) and raw.code is ErrorCode.CLUSTER_KEY_MISMATCH
    with pytest.raises(ClusterKeyMismatchError, match="number of partitions"):
        await c.open(CLUSTER_KEY, NUM_PARTITIONS + 1)
    with pytest.raises(StorageNotOpenError):
        await c.append(1, 0, [make_record(0, partition_id=0)])
    assert await (await fx.client()).max_transaction_id(1, 0) == -1  # nothing was appended
    await c.open(CLUSTER_KEY, NUM_PARTITIONS)
    await c.append(1, 0, [make_record(0, partition_id=0)])
    assert await c.max_transaction_id(1, 0) == 0


async def test_fencing_by_store_session(fx: NodeFixture) -> None:
    old = await fx.client()
    new = await fx.client()
    p = 1
    await old.append(5, p, make_records(0, 2, partition_id=p))
    # a newer session's first request, even a read, fences the older one; the partition
    # had no marks and no records when session 5 raised its fence: it holds nothing it
    # acknowledged (LOST_SESSION), never a clean replica of session 5 (a wiped disk)
    assert await new.last_session_info(7, p) == SessionInfo(5, -1, -1, LOST_SESSION)
    with pytest.raises(SessionFencedError) as fenced:
        await old.append(5, p, [make_record(2, partition_id=p)])
    assert fenced.value.highest_session_id == 7
    raw = await old.request(MaxTransactionIdRequest(5, old.next_seq_num(), p))
    assert isinstance(raw, FailureResponse)
    assert raw.code is ErrorCode.FENCED and raw.highest_session_id == 7
    assert await new.max_transaction_id(7, p) == 1
    await new.truncate(7, p, 0)
    await new.set_low_water_mark(7, p, 0)
    await new.append(7, p, [make_record(1, partition_id=p)])
    assert await new.last_session_info(7, p) == SessionInfo(7, 0, 0, 7)
    # the fence is per partition: session 5 still owns partition 2
    await old.append(5, 2, [make_record(0, partition_id=2)])
    # and an old session cannot sneak back on a new connection
    again = await fx.client()
    with pytest.raises(SessionFencedError):
        await again.records(6, p, 0, 10)
    stats = (await (await fx.admin()).command("stats"))["partitions"]
    assert [row["fenced"] for row in stats if row["partition_id"] == p] == [3]


async def test_fence_survives_reopening_the_storage(fx: NodeFixture) -> None:
    c = await fx.client()
    await c.append(3, 0, [make_record(0, partition_id=0)])
    await c.max_transaction_id(9, 0)  # session 9 is recorded before it is served
    await fx.stop_node()
    await fx.start(hosted=[])  # reopen the same storage: partitions are already there
    c2 = await fx.client()
    with pytest.raises(SessionFencedError) as fenced:
        await c2.append(3, 0, [make_record(1, partition_id=0)])
    assert fenced.value.highest_session_id == 9
    assert await c2.last_session_info(9, 0) == SessionInfo(9, -1, -1, LOST_SESSION)


async def test_availability_survives_a_restart(fx: NodeFixture) -> None:
    admin = await fx.admin()
    result = await admin.command(
        "set_availability", partition_id=2, available=False, cluster_key=str(CLUSTER_KEY)
    )
    assert result["persisted"] is True
    await fx.stop_node()
    await fx.start(hosted=[])
    c = await fx.client()
    with pytest.raises(PartitionClosedError, match="unavailable"):
        await c.max_transaction_id(1, 2)
    assert await c.max_transaction_id(1, 1) == -1
    admin = await fx.admin()
    assert not {p.partition_id: p for p in await admin.list_partitions()}[2].available
    await admin.set_availability(2, True, CLUSTER_KEY)
    await fx.stop_node()
    await fx.start(hosted=[])
    assert await (await fx.client()).max_transaction_id(1, 2) == -1


async def test_a_damaged_replica_reports_its_hole_and_takes_a_repair(tmp_path: Path) -> None:
    """The fs engine found a damaged middle segment at start-up: the node reports the
    hole (MissingRange), refuses to start a session there (SetLowWaterMark) and splices
    the records a peer sends (Repair)."""
    from waltz_storage_fs import tools

    fx = NodeFixture(str(tmp_path / "data"), "fs")
    await fx.start(hosted=[0])
    try:
        c = await fx.client()
        assert await c.missing_range(1, 0) is None
        for first in range(0, 30, 3):
            await c.append(1, 0, make_records(first, 3))
        await c.set_low_water_mark(1, 0, 29)
        await fx.stop_node()
        path, _, end = tools.find_record(fx.location, 0, 10)
        raw = bytearray(path.read_bytes())
        raw[end - 10] ^= 1  # a flipped bit in record 10's data
        path.write_bytes(bytes(raw))
        (path.parent / path.name.replace(".seg", ".idx")).unlink()
        await fx.start(hosted=[])
        c = await fx.client()
        assert await c.max_transaction_id(2, 0) == 29
        assert await c.missing_range(2, 0) == (10, 10)
        with pytest.raises(StorageError, match="transaction 10"):
            await c.record(2, 0, 10)
        with pytest.raises(StorageRequestError, match=r"lacks transactions 10\.\.10"):
            await c.set_low_water_mark(2, 0, 29)
        with pytest.raises(StorageAppendError, match="lowest missing range"):
            await c.repair(2, 0, make_records(11, 1))
        await c.repair(2, 0, make_records(10, 1))
        assert await c.missing_range(2, 0) is None
        assert await c.records(2, 0, 0, 100) == make_records(0, 30)
        await c.set_low_water_mark(2, 0, 29)
        listed = (await (await fx.admin()).list_partitions_raw())[0]
        assert listed["missing_ranges"] == []
    finally:
        await fx.close()


async def test_pipelined_appends_are_ordered_and_batched(fx: NodeFixture) -> None:
    c = await fx.client()
    p = 2
    records = make_records(0, 200, partition_id=p)
    # 200 appends in flight at once, one record each, in order
    await asyncio.gather(*(c.append(1, p, [r]) for r in records))
    assert await c.records(1, p, 0, 1000) == records
    admin = await fx.admin()
    stats = {row["partition_id"]: row for row in (await admin.command("stats"))["partitions"]}
    assert stats[p]["append_requests"] == 200 and stats[p]["records_appended"] == 200
    # queued appends were merged: fewer engine appends (flushes) than requests
    assert stats[p]["engine_appends"] < 200
    # a gap in the middle of a pipeline refuses that one append only
    seq = [
        make_record(200, partition_id=p),
        make_record(201, partition_id=p),
        make_record(205, partition_id=p),
        make_record(202, partition_id=p),
    ]
    results = await asyncio.gather(*(c.append(1, p, [r]) for r in seq), return_exceptions=True)
    assert results[0] is None and results[1] is None and results[3] is None
    assert isinstance(results[2], StorageAppendError)
    assert await c.max_transaction_id(1, p) == 202
    # a merged batch that does not continue the log: each of its appends is refused
    # on its own (nothing stored), and the next good one goes through
    seq = [
        make_record(205, partition_id=p),
        make_record(206, partition_id=p),
        make_record(203, partition_id=p),
    ]
    results = await asyncio.gather(*(c.append(1, p, [r]) for r in seq), return_exceptions=True)
    assert isinstance(results[0], StorageAppendError)
    assert isinstance(results[1], StorageAppendError)
    assert results[2] is None
    assert await c.records(1, p, 200, 10) == make_records(200, 4, partition_id=p)


async def test_many_partitions_concurrently(fx: NodeFixture) -> None:
    admin = await fx.admin()
    for partition_id in range(4, NUM_PARTITIONS):
        await admin.add_partition(partition_id, CLUSTER_KEY)
    clients = [await fx.client(), await fx.client()]

    async def writer(partition_id: int) -> None:
        client = clients[partition_id % 2]
        for start in range(0, 60, 6):
            await asyncio.gather(
                *(
                    client.append(
                        1, partition_id, [make_record(start + i, partition_id=partition_id)]
                    )
                    for i in range(6)
                )
            )

    await asyncio.gather(*(writer(p) for p in range(NUM_PARTITIONS)))
    for p in range(NUM_PARTITIONS):
        assert await clients[0].records(1, p, 0, 100) == make_records(0, 60, partition_id=p)


async def test_admin_commands(fx: NodeFixture) -> None:
    admin = await fx.admin()
    c = await fx.client()
    await c.append(4, 0, make_records(0, 3, partition_id=0))
    await c.set_low_water_mark(4, 0, 2)

    info = await admin.info()
    assert info["cluster_key"] == str(CLUSTER_KEY)
    assert info["num_partitions"] == NUM_PARTITIONS
    assert info["partitions"] == [0, 1, 2, 3]
    assert info["version"] == waltz_api.__version__  # beside its levels (waltz cluster features)
    assert {"feature_level", "max_feature_level"} <= set(info)
    listed = {p.partition_id: p for p in await admin.list_partitions()}
    assert sorted(listed) == [0, 1, 2, 3]
    assert listed[0].max_transaction_id == 2
    assert listed[0].session_info == SessionInfo(4, 2, 2, 4)
    assert listed[1].max_transaction_id == -1 and listed[1].available
    assert await admin.max_transaction_id(0) == 2

    await admin.add_partition(5, CLUSTER_KEY)
    await admin.add_partition(5, CLUSTER_KEY)  # idempotent
    await c.append(1, 5, [make_record(0, partition_id=5)])
    assert await admin.max_transaction_id(5) == 0
    await admin.remove_partition(5, CLUSTER_KEY)
    assert [p.partition_id for p in await admin.list_partitions()] == [0, 1, 2, 3]
    with pytest.raises(PartitionNotFoundError):
        await c.max_transaction_id(1, 5)
    await admin.add_partition(5, CLUSTER_KEY)  # back, empty: its data was deleted
    assert await c.max_transaction_id(1, 5) == -1

    await admin.set_availability(1, False, CLUSTER_KEY)
    assert not {p.partition_id: p for p in await admin.list_partitions()}[1].available
    with pytest.raises(PartitionClosedError, match="unavailable"):
        await c.append(1, 1, [make_record(0, partition_id=1)])
    await c.append(1, 2, [make_record(0, partition_id=2)])  # other partitions are untouched
    await admin.set_availability(1, True, CLUSTER_KEY)
    await c.append(1, 1, [make_record(0, partition_id=1)])

    # mutating commands need the right cluster key; bad arguments are named
    with pytest.raises(StorageError, match="does not match"):
        await admin.add_partition(6, uuid.uuid4())
    with pytest.raises(StorageError, match="cluster key"):
        await admin.command("remove_partition", partition_id=0)
    with pytest.raises(StorageError, match="out of range"):
        await admin.add_partition(NUM_PARTITIONS, CLUSTER_KEY)
    with pytest.raises(StorageError, match="unknown admin command 'nope'"):
        await admin.command("nope")
    with pytest.raises(StorageError, match="available must be"):
        await admin.command(
            "set_availability", partition_id=1, available="no", cluster_key=str(CLUSTER_KEY)
        )
    assert [p.partition_id for p in await admin.list_partitions()] == [0, 1, 2, 3, 5]


async def test_malformed_frames_close_only_that_connection(fx: NodeFixture) -> None:
    good = await fx.client()
    await good.append(1, 0, [make_record(0, partition_id=0)])

    # a connection that sends garbage after the handshake
    conn = await fx.client_transport.connect(fx.endpoint)
    protocol = wire.ProtocolConnection(wire.Role.INITIATOR, sender="fuzz")
    await conn.send(protocol.start_handshake())
    protocol.receive_frame(await conn.recv())
    await conn.send(b"\x39\x01\x00garbage")
    reply = wire.decode(await asyncio.wait_for(conn.recv(), 10))
    assert isinstance(reply, FailureResponse)
    assert reply.code is ErrorCode.BAD_REQUEST and reply.seq_num == -1
    assert "malformed" in reply.message
    with pytest.raises(ConnectionClosedError):
        await asyncio.wait_for(conn.recv(), 10)

    # a connection whose first frame is not Hello
    conn2 = await fx.client_transport.connect(fx.endpoint)
    await conn2.send(wire.encode(StorageOpenRequest(-1, 1, -1, CLUSTER_KEY, NUM_PARTITIONS)))
    reply2 = wire.decode(await asyncio.wait_for(conn2.recv(), 10))
    assert isinstance(reply2, FailureResponse) and "handshake" in reply2.message
    with pytest.raises(ConnectionClosedError):
        await asyncio.wait_for(conn2.recv(), 10)

    # a truncated append: the client sees the refusal, then the closed connection
    victim = await fx.client()
    frame = wire.encode(StorageAppendRequest(1, 99, 0, (make_record(1, partition_id=0),)))
    await victim.conn.send(frame[:-3])
    await asyncio.sleep(0.05)
    with pytest.raises((ProtocolError, ConnectionClosedError)):
        await victim.max_transaction_id(1, 0)

    # the well-behaved connection never noticed
    await good.append(1, 0, [make_record(1, partition_id=0)])
    assert await good.max_transaction_id(1, 0) == 1


async def test_no_common_protocol_version(fx: NodeFixture) -> None:
    conn = await fx.client_transport.connect(fx.endpoint)
    from waltz_api.messages import Hello, HelloResponse

    await conn.send(wire.encode(Hello((99,), "future-client")))
    reply = wire.decode(await asyncio.wait_for(conn.recv(), 10))
    assert reply == HelloResponse(0)
    with pytest.raises(ConnectionClosedError):
        await asyncio.wait_for(conn.recv(), 10)


async def test_raw_responses_match_requests_by_seq_num(fx: NodeFixture) -> None:
    c = await fx.client()
    first = c.request(StorageAppendRequest(1, 1000, 3, (make_record(0, partition_id=3),)))
    second = c.request(MaxTransactionIdRequest(1, 1001, 3))
    a, b = await asyncio.gather(first, second)
    assert a == SuccessResponse(1, 1000, 3)
    assert b == MaxTransactionIdResponse(1, 1001, 3, 0)


async def test_start_append_posts_at_once_and_settles_like_append(fx: NodeFixture) -> None:
    """The store session's append: posted before it returns (so in order), a future of
    None on success, the FailureResponse's error otherwise, StorageError after its
    timeout, the connection's error once it failed; nothing is left pending."""
    c = await fx.client()
    p = 3
    records = make_records(0, 50, partition_id=p)
    futures = [c.start_append(1, p, [r]) for r in records]
    assert await asyncio.gather(*futures) == [None] * 50
    assert await c.records(1, p, 0, 100) == records
    # a newer session fences this one: the future raises what append raises
    await (await fx.client()).last_session_info(2, p)
    with pytest.raises(SessionFencedError) as fenced:
        await c.start_append(1, p, [make_record(50, partition_id=p)])
    assert fenced.value.highest_session_id == 2
    with pytest.raises(StorageAppendError):  # a gap: refused, nothing stored
        await c.start_append(2, p, [make_record(60, partition_id=p)])
    assert not c._pending and not c._started
    # no response in time: StorageError, and the late response is dropped quietly
    worker = fx.node.worker_of(p) if fx.node is not None else None
    assert worker is not None
    gate = asyncio.Event()
    blocked = asyncio.ensure_future(worker.run_in_order(gate.wait))
    late = c.start_append(2, p, [make_record(50, partition_id=p)], timeout=0.05)
    with pytest.raises(StorageError, match="no response"):
        await late
    gate.set()
    await blocked
    assert await c.max_transaction_id(2, p) == 50
    assert not c._pending and not c._started
    # the connection fails: pending ones fail with it, later ones at once
    gate = asyncio.Event()
    blocked = asyncio.ensure_future(worker.run_in_order(gate.wait))
    pending = c.start_append(2, p, [make_record(51, partition_id=p)])
    await c.close()
    with pytest.raises(ConnectionClosedError):
        await pending
    with pytest.raises(ConnectionClosedError):
        await c.start_append(2, p, [make_record(52, partition_id=p)])
    assert not c._pending and not c._started
    gate.set()
    await blocked


async def test_a_peer_that_stops_reading_holds_its_partition_only_until_it_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Responses are bounded per connection (back pressure); when the non-reading
    peer goes away, the partition's worker is released and serves others."""
    from waltz_conformance.reference.storage import MemoryStorageEngine, forget
    from waltz_storage_node import node as node_module

    monkeypatch.setattr(node_module, "OUTBOX_FRAMES", 4)
    location = f"memory-storage-{uuid.uuid4()}"
    engine = await MemoryStorageEngine.open(
        location, cluster_key=CLUSTER_KEY, num_partitions=NUM_PARTITIONS
    )
    await engine.add_partition(0)
    registry = get_registry()
    server_transport = _transport()
    client_transport = _transport()
    # the stalled peer's receive buffer (on its side) holds very little
    stall_transport: Transport = registry.get("transport", "memory").factory({"buffer_bytes": 128})
    node = StorageNode(engine, server_transport, f"memory://stall-{uuid.uuid4()}")
    await node.start()
    good = await StorageClient.connect(client_transport, node.endpoint)
    try:
        await good.open(CLUSTER_KEY, NUM_PARTITIONS)
        stalled = await stall_transport.connect(node.endpoint)
        protocol = wire.ProtocolConnection(wire.Role.INITIATOR, sender="stall")
        await stalled.send(protocol.start_handshake())
        protocol.receive_frame(await stalled.recv())
        await stalled.send(protocol.send(StorageOpenRequest(-1, 0, -1, CLUSTER_KEY, 8)))
        await stalled.send_many(
            [protocol.send(MaxTransactionIdRequest(1, q, 0)) for q in range(1, 60)]
        )
        waiting = asyncio.create_task(good.max_transaction_id(1, 0))
        await asyncio.sleep(0.5)
        assert not waiting.done(), "the stalled peer's responses should hold partition 0"
        await stalled.close()
        assert await asyncio.wait_for(waiting, 10) == -1
        await good.append(1, 0, [make_record(0, partition_id=0)])
    finally:
        await good.close()
        await node.close()
        await server_transport.close()
        await client_transport.close()
        await stall_transport.close()
        forget(location)


async def test_replica_connector_speaks_for_one_session_and_partition(fx: NodeFixture) -> None:
    from waltz_server.server.storage_client import replica_connector

    connect = replica_connector(fx.client_transport, CLUSTER_KEY, NUM_PARTITIONS, sender="server:9")
    replica = await connect(fx.endpoint, 3, 4)
    newer = await connect(fx.endpoint, 3, 6)
    try:
        assert replica.storage_node == fx.endpoint
        assert await replica.last_session_info() == SessionInfo(-1, -1, -1)
        await replica.append(make_records(0, 4, partition_id=3))
        assert await replica.max_transaction_id() == 3
        assert await replica.read_records(1, 10, 1 << 20) == make_records(1, 3, partition_id=3)
        assert await replica.read_headers(2, 10) == [
            r.record_header for r in make_records(2, 2, partition_id=3)
        ]
        assert await newer.last_session_info() == SessionInfo(4, -1, -1, LOST_SESSION)
        with pytest.raises(SessionFencedError):
            await replica.append([make_record(4, partition_id=3)])
        await newer.truncate(1)
        await newer.set_low_water_mark(1)
        assert await newer.last_session_info() == SessionInfo(6, 1, 1, 6)
    finally:
        await replica.close()
        await newer.close()
    assert replica.client.closed and newer.client.closed

    wrong = replica_connector(fx.client_transport, uuid.uuid4(), NUM_PARTITIONS)
    with pytest.raises(ClusterKeyMismatchError):
        await wrong(fx.endpoint, 3, 7)


async def test_connection_pool_shares_one_connection_per_node(fx: NodeFixture) -> None:
    from waltz_server.server.storage_client import StorageConnectionPool

    pool = StorageConnectionPool(fx.client_transport, CLUSTER_KEY, NUM_PARTITIONS)
    try:
        replicas = await asyncio.gather(*(pool.connect(fx.endpoint, p, 2) for p in range(4)))
        assert len({id(r.client) for r in replicas}) == 1
        await asyncio.gather(
            *(r.append(make_records(0, 5, partition_id=r.partition_id)) for r in replicas)
        )
        for r in replicas:
            assert await r.max_transaction_id() == 4
            await r.close()  # a shared connection outlives its replicas
        assert not replicas[0].client.closed

        # a broken connection fails its replicas; the next connect makes a new one
        await replicas[0].client.conn.close()
        with pytest.raises(ConnectionClosedError):
            for _ in range(50):  # the reader notices the close
                await replicas[0].max_transaction_id()
                await asyncio.sleep(0.01)
        fresh = await pool.connect(fx.endpoint, 0, 3)
        assert fresh.client is not replicas[0].client
        assert await fresh.max_transaction_id() == 4
    finally:
        await pool.close()
    with pytest.raises(ConnectionClosedError):
        await pool.connect(fx.endpoint, 0, 3)


async def test_a_connection_without_hello_is_closed_after_the_handshake_timeout(
    fx: NodeFixture,
) -> None:
    assert fx.node is not None
    fx.node.handshake_timeout = 0.2
    conn = await fx.client_transport.connect(fx.endpoint)
    with pytest.raises(ConnectionClosedError):
        await asyncio.wait_for(conn.recv(), 10)
    good = await fx.client()  # others connect as usual
    assert await good.max_transaction_id(1, 0) == -1


async def test_nothing_of_an_older_session_is_written_once_a_newer_one_arrived(
    fx: NodeFixture,
) -> None:
    """An old writer streams appends while a new session's first request lands in
    the middle: the old session's acknowledged appends are exactly a prefix of the
    log, every later one is FENCED, and nothing after the fence is stored."""
    old = await fx.client()
    new = await fx.client()
    p = 0
    records = make_records(0, 300, partition_id=p)

    writing = asyncio.Event()

    async def old_writer() -> list[BaseException | None]:
        results: list[BaseException | None] = []
        for start in range(0, len(records), 10):  # waves of 10 pipelined appends
            wave = records[start : start + 10]
            results += await asyncio.gather(
                *(old.append(5, p, [r]) for r in wave), return_exceptions=True
            )
            if start >= 30:
                writing.set()
        return results

    writer = asyncio.create_task(old_writer())
    await asyncio.wait_for(writing.wait(), 10)
    info = await new.last_session_info(6, p)
    results = await writer
    acked = [i for i, r in enumerate(results) if r is None]
    refused = [r for r in results if r is not None]
    assert acked == list(range(len(acked))), "the acknowledged appends are a prefix"
    assert refused, "the new session arrived before the old writer finished"
    assert all(isinstance(r, SessionFencedError) for r in refused)
    assert all(r.highest_session_id == 6 for r in refused if isinstance(r, SessionFencedError))
    assert info.session_id == 5
    assert await new.max_transaction_id(6, p) == len(acked) - 1
    assert await new.records(6, p, 0, 1000) == records[: len(acked)]


async def test_partition_queue_is_bounded_in_bytes() -> None:
    from waltz_storage_node.partition import PartitionWorker

    location = f"memory-storage-{uuid.uuid4()}"
    engine = await _open_engine(location)
    await engine.add_partition(0)
    worker = PartitionWorker(engine, 0, queue_size=100, queue_bytes=100)
    worker.start()
    replies: list[object] = []

    async def reply(message: object) -> None:
        replies.append(message)

    release = asyncio.Event()
    try:
        blocked = asyncio.create_task(worker.run_in_order(release.wait))
        await asyncio.sleep(0.01)  # the worker is inside the blocking action
        first = asyncio.create_task(worker.submit(MaxTransactionIdRequest(1, 1, 0), reply, 60))
        second = asyncio.create_task(worker.submit(MaxTransactionIdRequest(1, 2, 0), reply, 60))
        await asyncio.sleep(0.05)
        assert first.done() and not second.done(), "120 bytes do not fit in 100"
        assert worker.queued == 1
        release.set()
        await asyncio.wait_for(asyncio.gather(blocked, second), 10)
        for _ in range(100):
            if len(replies) == 2:
                break
            await asyncio.sleep(0.01)
        assert replies == [
            MaxTransactionIdResponse(1, 1, 0, -1),
            MaxTransactionIdResponse(1, 2, 0, -1),
        ]
    finally:
        release.set()
        await worker.stop()
        await engine.close()
        from waltz_conformance.reference.storage import forget

        forget(location)


async def test_a_corrupted_record_is_refused_by_the_engine_and_nothing_is_stored(
    fx: NodeFixture,
) -> None:
    """The node leaves an append's checksums to its storage engine (checked once on this
    hop): a record whose data does not match its CRC-32C is refused with CHECKSUM,
    nothing of its request is stored, and the connection serves on."""
    c = await fx.client()
    await c.append(1, 0, [make_record(0, partition_id=0)])
    good = make_record(1, partition_id=0)
    corrupt = dataclasses.replace(make_record(2, partition_id=0), data=b"flipped bits")
    with pytest.raises(ChecksumError):
        await c.append(1, 0, [good, corrupt])
    assert await c.max_transaction_id(1, 0) == 0
    await c.append(1, 0, [good, make_record(2, partition_id=0)])
    assert await c.max_transaction_id(1, 0) == 2


async def test_a_replica_deletes_its_archived_prefix_when_its_session_asks(
    fx: NodeFixture,
) -> None:
    """``prune`` (an admin command the store session's owner sends once the records are
    archived) deletes whole segments up to the asked id, fenced like a request; reads
    below the new start are refused as archived; past the log's end the log continues
    after the asked id (a replica started at the archive mark)."""
    from waltz_server.server.storage_client import replica_connector

    await fx.stop_node()
    engine: StorageEngine
    if fx.engine_name == "fs":  # small segments: the prefix is deleted in whole segments
        engine = await FsStorageEngine.open(fx.location, options={"segment_size": 600})
    else:
        engine = await _open_engine(fx.location, fx.engine_name)
    fx.server_transport = _transport()
    fx.node = StorageNode(engine, fx.server_transport, f"memory://prune-{uuid.uuid4()}")
    await fx.node.start()
    fx.endpoint = fx.node.endpoint
    connect = replica_connector(fx.client_transport, CLUSTER_KEY, NUM_PARTITIONS, sender="server")
    replica = await connect(fx.endpoint, 1, 5)
    admin = await fx.admin()
    try:
        for first in range(0, 60, 6):
            await replica.append(make_records(first, 6, partition_id=1))
        before = await replica.local_log()
        assert (before.log_start, before.max_transaction_id) == (0, 59)
        assert before.extents[0].first == 0 and before.extents[-1].last == 59
        start = await replica.prune(30)
        assert 0 < start <= 31 if fx.engine_name == "fs" else start == 31
        after = await admin.local_log(1)
        assert after.log_start == start and after.max_transaction_id == 59
        if fx.engine_name == "fs":
            assert after.local_bytes < before.local_bytes
        with pytest.raises(StorageError, match="archived"):
            await replica.read_records(start - 1, 5, 1 << 20)
        assert await replica.read_records(start, 100, 1 << 20) == make_records(
            start, 60 - start, partition_id=1
        )
        # an older session cannot delete anything
        newer = await connect(fx.endpoint, 1, 6)
        assert await newer.max_transaction_id() == 59
        with pytest.raises(StorageError, match="fenced"):
            await replica.prune(50)
        assert (await admin.local_log(1)).log_start == start
        # past the end: the log continues after the archive mark
        assert await newer.prune(99) == 100
        assert await newer.max_transaction_id() == 99
        await newer.append([make_record(100, partition_id=1)])
        assert await newer.read_records(100, 5, 1 << 20) == [make_record(100, partition_id=1)]
        with pytest.raises(StorageError, match="cluster key"):
            await admin.prune(1, 100, 6, uuid.uuid4())
        await newer.close()
    finally:
        await replica.close()
