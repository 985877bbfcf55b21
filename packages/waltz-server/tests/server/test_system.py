"""The whole system as real processes: a coordination service (ZooKeeper, etcd, or the
embedded local store), three `waltz storage` nodes (fs engine, real fsync) and two
`waltz server`s over ZeroMQ. Writers append while a storage node
and then a server are killed with SIGKILL; every acknowledged transaction must
survive, the feed must stay dense and duplicate-free, and nothing else appears.

A transaction counts as acknowledged when the feed delivered it to its writer
(the commit notification of Waltz)."""

from __future__ import annotations

import asyncio
import itertools
import socket
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from waltz_api import wire
from waltz_api.cluster import ClusterMetadata, coordination_from_uri
from waltz_api.contracts.transport import Transport
from waltz_api.errors import WaltzError
from waltz_api.messages import (
    AppendRequest,
    ErrorResponse,
    FeedData,
    FlushRequest,
    FlushResponse,
    MountRequest,
    MountResponse,
    MountStatus,
    RangeReadRequest,
    RangeReadResponse,
)
from waltz_api.plugins import get_registry
from waltz_api.types import LockRequest, Record, ReqId
from waltz_server.server.testing import RawClient, ServerProcess
from waltz_server.storage_node import StorageClient
from waltz_server.storage_node.testing import StorageNodeProcess

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.timeout(300)]

PARTITIONS = 2


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def zmq() -> Transport:
    transport: Transport = get_registry().get("transport", "zmq").factory({})
    return transport


@dataclass
class System:
    uri: str
    key: uuid.UUID
    storage: list[StorageNodeProcess]
    servers: list[ServerProcess]
    transport: Transport
    metadata: ClusterMetadata


def coordination_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh cluster root on the coordination service the test is parametrized with:
    a real ZooKeeper, a real 3-member etcd cluster, or the embedded ``local`` store."""
    root = f"/waltz-{uuid.uuid4().hex[:8]}"
    if request.param == "zk":
        server = request.getfixturevalue("zookeeper_server")
        uri: str = server.uri(root)
        return uri
    if request.param == "etcd":
        cluster = request.getfixturevalue("etcd_cluster")
        uri = cluster.uri(root)
        return uri
    directory = tmp_path / "coordination"
    directory.mkdir()
    return f"local://{directory}?root={root}"


@pytest.fixture(params=["zk", "etcd", "local"])
async def system(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[System]:
    uri = coordination_uri(request, tmp_path)
    # a killed server's registration expires after this many seconds
    session_timeout = 4
    key = uuid.uuid4()
    ports = [free_port() for _ in range(3)]
    coordination = coordination_from_uri(uri, {"session_timeout": session_timeout})
    await coordination.start()
    metadata = ClusterMetadata(coordination)
    await metadata.create_cluster(
        num_partitions=PARTITIONS,
        num_replicas=3,
        storage_nodes=[f"127.0.0.1:{p}" for p in ports],
        cluster_key=key,
    )
    storage = []
    for i, port in enumerate(ports):
        config = tmp_path / f"storage{i}.toml"
        config.write_text(
            "\n".join(
                [
                    'log_level = "INFO"',
                    "[storage]",
                    f'data_dir = "{tmp_path / f"data{i}"}"',
                    'engine = "fs"',
                    f'cluster_key = "{key}"',
                    f"num_partitions = {PARTITIONS}",
                    f"partitions = {list(range(PARTITIONS))}",
                    "[transport]",
                    'plugin = "zmq"',
                    f'endpoint = "tcp://127.0.0.1:{port}"',
                ]
            )
            + "\n"
        )
        storage.append(
            StorageNodeProcess(config, f"tcp://127.0.0.1:{port}", tmp_path / f"storage{i}.log")
        )
    servers = []
    for i in range(2):
        config = tmp_path / f"server{i}.toml"
        config.write_text(
            "\n".join(
                [
                    'log_level = "INFO"',
                    "[coordination]",
                    f'uri = "{uri}"',
                    "[coordination.options]",
                    f"session_timeout = {session_timeout}",
                    "[transport]",
                    'plugin = "zmq"',
                    f'endpoint = "tcp://127.0.0.1:{free_port()}"',
                    'storage_endpoint = "tcp://{}"',
                    "[server]",
                    'lock_table = "hwm-array"',
                ]
            )
            + "\n"
        )
        servers.append(ServerProcess(config, tmp_path / f"server{i}.log"))
    transport = zmq()
    try:
        for node in storage:
            node.start()
        for node in storage:
            await node.wait_ready(transport)
        for server in servers:
            server.start()
        for server in servers:
            await server.wait_ready()
        yield System(uri, key, storage, servers, transport, metadata)
    finally:
        for server in servers:
            server.kill()
        for node in storage:
            node.kill()
        await transport.close()
        await coordination.close()


@dataclass
class Writer:
    """Appends to one partition at its current owner, reconnecting after faults."""

    system: System
    partition: int
    client_id: int
    sent: dict[ReqId, bytes] = field(default_factory=dict)
    feed: list[ReqId] = field(default_factory=list)
    """The feed of the partition, in order: feed[i] is transaction i's request id."""
    reconnects: int = 0
    reasons: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    _seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _net: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    @property
    def acknowledged(self) -> set[ReqId]:
        return {r for r in self.feed if r.client_id == self.client_id}

    def _consume(self, client: RawClient) -> None:
        messages = list(client.received)
        client.received.clear()
        for message in messages:
            if isinstance(message, FeedData):
                assert message.transaction_id == len(self.feed), "the feed skipped or repeated"
                self.feed.append(message.req_id)
            elif isinstance(message, ErrorResponse):
                raise WaltzError(f"server refused: {message.code.name} {message.message}")

    async def run(self) -> None:
        while not self.stop.is_set():
            client: RawClient | None = None
            try:
                owner = (await self.system.metadata.partition_assignment(self.partition)).value
                if owner.server_id < 0:
                    await asyncio.sleep(0.2)
                    continue
                client = await RawClient.connect(
                    self.system.transport, owner.endpoint, f"client:{self.client_id}", timeout=5
                )
                generation = owner.generation
                await client.send(
                    MountRequest(self.rid(generation), len(self.feed) - 1, next(self._net))
                )
                response = (await client.wait(MountResponse, timeout=30))[0]
                if response.status is not MountStatus.READY:
                    raise WaltzError(f"mount answered {response.status.name}")
                self._consume(client)
                while not self.stop.is_set():
                    for _ in range(20):
                        rid = self.rid(generation)
                        data = f"p{self.partition}-c{self.client_id}-{rid.seq_num}".encode()
                        self.sent[rid] = data
                        await client.send(
                            AppendRequest(rid, -1, LockRequest(), 1, data, wire.checksum(data))
                        )
                    flushes = client.counts[FlushResponse]
                    await client.send(FlushRequest(self.rid(generation)))
                    await client.wait(FlushResponse, flushes + 1, timeout=30)
                    self._consume(client)
                await self._drain(client, generation)
            except (WaltzError, TimeoutError, OSError) as exc:
                self.reconnects += 1
                self.reasons.append(f"{type(exc).__name__}: {exc}"[:200])
                await asyncio.sleep(0.3)
                if self.reconnects > 200:
                    raise AssertionError(f"writer {self.partition} keeps failing: {exc}") from exc
            finally:
                if client is not None:
                    await client.close()

    async def _drain(self, client: RawClient, generation: int) -> None:
        """Until the feed delivered everything the partition committed."""
        flushes = client.counts[FlushResponse]
        await client.send(FlushRequest(self.rid(generation)))
        mark = (await client.wait(FlushResponse, flushes + 1, timeout=30))[-1].transaction_id
        for _ in range(600):
            self._consume(client)
            if len(self.feed) - 1 >= mark:
                return
            await client.changed(0.05)
        raise AssertionError("the feed never reached the flushed high-water mark")

    def rid(self, generation: int) -> ReqId:
        return ReqId(self.client_id, generation, self.partition, next(self._seq))


async def owner_of(system: System, partition: int) -> tuple[int, str, int]:
    owner = (await system.metadata.partition_assignment(partition)).value
    return owner.server_id, owner.endpoint, owner.generation


async def wait_for(
    predicate: object, timeout: float, what: str, writers: list[Writer] | None = None
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if await predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0.1)
    state = [
        (w.partition, len(w.acknowledged), w.reconnects, w.reasons[-5:]) for w in writers or []
    ]
    raise AssertionError(f"timed out waiting for {what}: {state}")


async def test_kill_a_storage_node_and_a_server_while_appending(system: System) -> None:
    async def assigned() -> bool:
        owners = [(await owner_of(system, p))[0] for p in range(PARTITIONS)]
        return all(owner >= 0 for owner in owners)

    await wait_for(assigned, 60, "the partitions to be assigned")
    writers = [Writer(system, p, 100 + p) for p in range(PARTITIONS)]
    tasks = [asyncio.create_task(w.run()) for w in writers]
    try:

        async def progress(counts: list[int]) -> bool:
            for task in tasks:
                if task.done():
                    task.result()
            return all(len(w.acknowledged) >= c for w, c in zip(writers, counts, strict=True))

        def more(count: int) -> list[int]:
            return [len(w.acknowledged) + count for w in writers]

        first = more(100)
        await wait_for(lambda: progress(first), 60, "first acknowledgements", writers)
        # a storage node crashes: the survivors are a majority
        system.storage[1].kill()
        target = more(100)
        await wait_for(lambda: progress(target), 60, "progress without a storage node", writers)
        # the server owning partition 0 crashes: its partitions move to the other one
        victim_id, victim_endpoint, generation = await owner_of(system, 0)
        for server in system.servers:
            if f"server {victim_id} ready on {victim_endpoint}" in server.output():
                server.kill()
                break
        else:
            raise AssertionError("could not find the owner of partition 0 among the processes")

        async def moved() -> bool:
            server_id, _, new_generation = await owner_of(system, 0)
            return server_id not in (victim_id, -1) and new_generation > generation

        await wait_for(moved, 60, "partition 0 to move")
        # the storage node comes back (recovery catches it up in a later session)
        system.storage[1].start()
        await system.storage[1].wait_ready(system.transport)
        target = more(100)
        await wait_for(lambda: progress(target), 90, "progress after the server died", writers)
    finally:
        for writer in writers:
            writer.stop.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    # the committed log of each partition, read in bulk from its current owner
    for writer in writers:
        _, endpoint, generation = await owner_of(system, writer.partition)
        client = await RawClient.connect(system.transport, endpoint, "checker")
        records: list[Record] = []
        while True:
            request = RangeReadRequest(
                ReqId(999, generation, writer.partition, len(records)), len(records), 500, 1 << 20
            )
            count = client.counts[RangeReadResponse]
            await client.send(request)
            response = (await client.wait(RangeReadResponse, count + 1))[-1]
            records.extend(response.records)
            if not response.records or len(records) > response.high_water_mark:
                break
        await client.close()
        assert [r.transaction_id for r in records] == list(range(len(records)))
        log_ids = [r.req_id for r in records]
        # invariant 6: the feed is exactly the committed log, in order
        assert writer.feed == log_ids[: len(writer.feed)]
        # invariant 2: no submission committed twice
        assert len(set(log_ids)) == len(log_ids)
        # invariant 1: every acknowledged transaction is there with its data
        by_id = {r.req_id: r.data for r in records}
        for rid in writer.acknowledged:
            assert by_id[rid] == writer.sent[rid]
        # nothing appears that was not submitted
        assert set(log_ids) <= set(writer.sent)
    # partition 0 moved: its writer had to find the new owner
    assert writers[0].reconnects >= 1, "the server kill never reached the writer"
    # invariant 3, on the disks: stop the servers, then every replica's log is a
    # prefix of the longest (a huge session id reads anything; nobody writes after)
    for server in system.servers:
        server.terminate()
    for partition in range(PARTITIONS):
        logs = []
        for node in system.storage:
            storage = await StorageClient.connect(system.transport, node.endpoint)
            try:
                await storage.open(system.key, PARTITIONS)
                log: list[Record] = []
                while True:
                    batch = await storage.records(10**9, partition, len(log), 1000)
                    if not batch:
                        break
                    log.extend(batch)
            finally:
                await storage.close()
            logs.append(log)
        longest = max(logs, key=len)
        for log in logs:
            assert log == longest[: len(log)], "replicas forked"
        # the committed log is on a majority of the disks
        committed = len(writers[partition].feed)
        assert sum(1 for log in logs if len(log) >= committed) >= 2
