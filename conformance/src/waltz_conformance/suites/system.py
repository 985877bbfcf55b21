"""The system conformance suite: a whole cluster (N storage nodes, M servers) built from
a plugin combination (coordination, transport, storage engine, lock table), checked
against the safety invariants of DESIGN.md section 5 through the raw client protocol.

A combination is run by subclassing :class:`SystemSuite` and providing a
class-scoped ``harness`` fixture (one cluster serves every test of the class;
the tests leave it running and healthy), e.g. at module level::

    @pytest_asyncio.fixture(scope="class", loop_scope="class")
    async def harness(tmp_path_factory):
        harness = SystemHarness(name="mine", coordination_uri=..., transport="zmq",
                                storage_engine="fs", processes=True,
                                workdir=tmp_path_factory.mktemp("mine"))
        await harness.start()
        yield harness
        await harness.close()

    class TestMine(SystemSuite):
        pass

With ``processes=True`` every storage node and server is a real child process
(``waltz storage`` / ``waltz server``), killed with SIGKILL and restarted by
pid, and the harness declares the capability ``"processes"``. Otherwise they
run in the test's event loop: a storage node "crash" drops its transport
without a goodbye, a server "kill" drops its connections the same way and
stops its tasks (a graceful deregistration, so its partitions move at once).

The suite needs the Waltz server package (``waltz_server``): it is the system
under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import shutil
import socket
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from waltz_api import wire
from waltz_api.cluster import ClusterMetadata, coordination_from_uri
from waltz_api.contracts.coordination import Coordination
from waltz_api.contracts.transport import Transport
from waltz_api.errors import SessionFencedError, StorageError, WaltzError
from waltz_api.messages import (
    AppendRequest,
    ErrorCode,
    ErrorResponse,
    FeedData,
    FlushRequest,
    FlushResponse,
    HighWaterMarkRequest,
    HighWaterMarkResponse,
    LockFailure,
    Message,
    MountRequest,
    MountResponse,
    MountStatus,
    RangeReadRequest,
    RangeReadResponse,
)
from waltz_api.plugins import get_registry
from waltz_api.types import Lock, LockMode, LockRequest, Record, ReqId
from waltz_conformance.harness import Harness, requires, skip_unless_capable
from waltz_server.server.testing import RawClient, ServerProcess
from waltz_server.storage_node.client import StorageClient
from waltz_server.storage_node.testing import StorageNodeProcess, make_record

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

PROCESSES = "processes"
"""Capability: storage nodes and servers are real processes (kill -9, restart by pid)."""

VOTER_SWEEP = "voter_sweep"
"""Capability: the harness may build extra clusters of 1, 2, 4 and 5 storage nodes
(about a minute with real processes). The voting logic does not depend on the
plugin combination, so a suite run may declare it for one combination only."""

RECOVERY_CASES = "recovery_cases"
"""Capability: run the expensive recovery cases (undecidable wait, recovery after a
failed recovery, a wiped replica, idempotency, replicas added, removed and replaced;
about half a minute each with real processes). They exercise the server's recovery,
which does not depend on the plugin combination: a suite run may declare this for the
in-process combination and one combination of processes, and the others run the
representative rest (feed, locking, fencing, faults while appending)."""

TIMEOUT = 90.0
RANGE_READ_TIMEOUT = 15.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _toml(config: dict[str, Any]) -> str:
    """A TOML document of ``config`` (tables of str, int, float, bool, lists and tables)."""

    def value(item: Any) -> str:
        if isinstance(item, bool):
            return "true" if item else "false"
        if isinstance(item, int | float):
            return repr(item)
        if isinstance(item, str):
            return '"' + item.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(item, list):
            return "[" + ", ".join(value(v) for v in item) + "]"
        raise TypeError(f"cannot write {item!r} as TOML")

    lines: list[str] = []

    def table(prefix: str, mapping: dict[str, Any]) -> None:
        scalars = {k: v for k, v in mapping.items() if not isinstance(v, dict)}
        tables = {k: v for k, v in mapping.items() if isinstance(v, dict)}
        if prefix:
            lines.append(f"[{prefix}]")
        lines.extend(f"{k} = {value(v)}" for k, v in scalars.items())
        for key, sub in tables.items():
            table(f"{prefix}.{key}" if prefix else key, sub)

    table("", config)
    return "\n".join(lines) + "\n"


class _Member(ABC):
    """One storage node or server of the harness, in a process or in the loop."""

    @abstractmethod
    async def start(self) -> None:
        """Start (or restart) the member."""

    @abstractmethod
    async def kill(self) -> None:
        """Stop it abruptly (kill -9 for a process)."""

    @property
    @abstractmethod
    def alive(self) -> bool:
        """True while it runs."""


@dataclass
class _StorageProcess(_Member):
    process: StorageNodeProcess
    transport: Transport

    async def start(self) -> None:
        self.process.start()
        await self.process.wait_ready(self.transport, timeout=60)

    async def kill(self) -> None:
        self.process.kill()

    @property
    def alive(self) -> bool:
        return self.process.process is not None and self.process.process.poll() is None


@dataclass
class _StorageInLoop(_Member):
    config: dict[str, Any]
    node: Any = None

    async def start(self) -> None:
        from waltz_server.storage_node.config import load_storage_config
        from waltz_server.storage_node.main import start_node

        self.node = await start_node(load_storage_config(None, overrides=self.config))

    async def kill(self) -> None:
        if self.node is None:
            return
        node, self.node = self.node, None
        crash = getattr(node.transport, "simulate_crash", None)
        if crash is not None:
            crash()
        await node.close()
        await node.transport.close()

    @property
    def alive(self) -> bool:
        return self.node is not None


@dataclass
class _ServerProcess(_Member):
    process: ServerProcess

    async def start(self) -> None:
        self.process.start()
        await self.process.wait_ready(timeout=60)

    async def kill(self) -> None:
        self.process.kill()

    @property
    def alive(self) -> bool:
        return self.process.running

    def server_id(self) -> int | None:
        found = re.findall(r"server (\d+) ready on", self.process.output())
        return int(found[-1]) if found and self.alive else None


@dataclass
class _ServerInLoop(_Member):
    config: dict[str, Any]
    running: Any = None

    async def start(self) -> None:
        from waltz_server.server.config import load_server_config
        from waltz_server.server.main import start_server

        self.running = await start_server(load_server_config(None, overrides=self.config))

    async def kill(self) -> None:
        if self.running is not None:
            running, self.running = self.running, None
            # its connections drop without a goodbye, then its tasks stop (and its
            # registration goes: partitions move without waiting for the session timeout)
            crash = getattr(running.transport, "simulate_crash", None)
            if crash is not None:
                crash()
            await running.stop()

    @property
    def alive(self) -> bool:
        return self.running is not None

    def server_id(self) -> int | None:
        return None if self.running is None else int(self.running.manager.server_id)


@dataclass
class SystemHarness(Harness):
    """A cluster of ``num_storage_nodes`` storage nodes and ``num_servers`` servers."""

    coordination_uri: str = ""
    transport: str = "memory"
    storage_engine: str = "memory"
    lock_table: str = "hwm-array"
    processes: bool = False
    workdir: Path | None = None
    num_storage_nodes: int = 3
    num_servers: int = 2
    num_partitions: int = 2
    session_timeout: float = 4.0
    cluster_key: uuid.UUID = field(default_factory=uuid.uuid4)
    client_transport: Transport | None = None
    metadata: ClusterMetadata | None = None
    storage_nodes: list[str] = field(default_factory=list)
    """Each storage node's host:port name in the cluster metadata."""
    storage: list[_Member] = field(default_factory=list)
    servers: list[_Member] = field(default_factory=list)
    coordination: Coordination | None = None
    """The harness's own client of the coordination service."""
    _locations: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.processes:
            self.capabilities = self.capabilities | {PROCESSES}
            if self.workdir is None:
                raise ValueError("a harness of real processes needs a workdir")

    def storage_endpoint(self, index: int) -> str:
        scheme = "memory" if self.transport == "memory" else "tcp"
        return f"{scheme}://{self.storage_nodes[index]}"

    def _server_endpoint(self, index: int) -> str:
        if self.transport == "memory":
            return f"memory://server-{self.cluster_key.hex[:8]}-{index}"
        return f"tcp://127.0.0.1:{_free_port()}"

    def _storage_name(self, index: int) -> str:
        if self.transport == "memory":
            return f"sn-{self.cluster_key.hex[:8]}-{index}:{5500 + index}"
        return f"127.0.0.1:{_free_port()}"

    def _make_storage(self, index: int) -> _Member:
        """The member for storage node ``index`` (its name already in ``storage_nodes``)."""
        tag = self.cluster_key.hex[:8]
        data_dir = str(self.workdir / f"data{index}") if self.workdir else f"system-{tag}-{index}"
        self._locations.append(data_dir)
        config: dict[str, Any] = {
            "log_level": "INFO",
            "storage": {
                "data_dir": data_dir,
                "engine": self.storage_engine,
                "cluster_key": str(self.cluster_key),
                "num_partitions": self.num_partitions,
                "partitions": list(range(self.num_partitions)),
            },
            "transport": {"plugin": self.transport, "endpoint": self.storage_endpoint(index)},
        }
        if self.processes:
            assert self.workdir is not None and self.client_transport is not None
            path = self.workdir / f"storage{index}.toml"
            path.write_text(_toml(config))
            process = StorageNodeProcess(
                path, self.storage_endpoint(index), self.workdir / f"storage{index}.log"
            )
            return _StorageProcess(process, self.client_transport)
        return _StorageInLoop(config)

    async def start(self) -> None:
        self.storage_nodes = [self._storage_name(i) for i in range(self.num_storage_nodes)]
        options = {"session_timeout": self.session_timeout}
        self.coordination = coordination_from_uri(self.coordination_uri, options)
        await self.coordination.start()
        self.metadata = ClusterMetadata(self.coordination)
        await self.metadata.create_cluster(
            num_partitions=self.num_partitions,
            num_replicas=self.num_storage_nodes,
            storage_nodes=self.storage_nodes,
            cluster_key=self.cluster_key,
        )
        self.client_transport = get_registry().get("transport", self.transport).factory({})
        assert self.client_transport is not None
        for i in range(self.num_storage_nodes):
            self.storage.append(self._make_storage(i))
        scheme = "memory" if self.transport == "memory" else "tcp"
        for i in range(self.num_servers):
            config = {
                "log_level": "INFO",
                "coordination": {"uri": self.coordination_uri, "options": options},
                "transport": {
                    "plugin": self.transport,
                    "endpoint": self._server_endpoint(i),
                    "storage_endpoint": f"{scheme}://{{}}",
                },
                "server": {"lock_table": self.lock_table},
            }
            if self.processes:
                assert self.workdir is not None
                path = self.workdir / f"server{i}.toml"
                path.write_text(_toml(config))
                self.servers.append(
                    _ServerProcess(ServerProcess(path, self.workdir / f"server{i}.log"))
                )
            else:
                self.servers.append(_ServerInLoop(config))
        try:
            # processes start in parallel (each is a Python interpreter's start-up)
            await _start_all(self.storage)
            await _start_all(self.servers)
            await self.wait_assigned()
        except BaseException:
            await self.close()
            raise

    def sibling(self, suffix: str, **changes: Any) -> SystemHarness:
        """A new, not yet started cluster of the same plugin combination (its own
        coordination root and cluster key), e.g. with another number of storage nodes."""
        workdir = None
        if self.workdir is not None:
            workdir = self.workdir / suffix
            workdir.mkdir()
        settings: dict[str, Any] = {
            "name": f"{self.name}-{suffix}",
            "coordination_uri": f"{self.coordination_uri}-{suffix}",
            "transport": self.transport,
            "storage_engine": self.storage_engine,
            "lock_table": self.lock_table,
            "processes": self.processes,
            "workdir": workdir,
            "num_storage_nodes": self.num_storage_nodes,
            "num_servers": self.num_servers,
            "num_partitions": self.num_partitions,
            "session_timeout": self.session_timeout,
        }
        settings.update(changes)
        return SystemHarness(**settings)

    async def close(self) -> None:
        """Stop every member (by pid for processes), also after a failed start."""
        for member in [*self.servers, *self.storage]:
            with contextlib.suppress(Exception):
                await member.kill()
        if self.client_transport is not None:
            await self.client_transport.close()
        if self.coordination is not None:
            await self.coordination.close()
        if self.storage_engine == "memory":
            from waltz_conformance.reference.storage import forget

            for location in self._locations:
                forget(location)

    # -- the cluster's state --------------------------------------------------------

    async def owner(self, partition: int) -> tuple[int, str, int]:
        """The partition's owner: (server id, endpoint, generation); id -1 if none."""
        assert self.metadata is not None
        owner = (await self.metadata.partition_assignment(partition)).value
        return owner.server_id, owner.endpoint, owner.generation

    async def session_id(self, partition: int) -> int:
        """The partition's current store session id (from the coordination service)."""
        assert self.metadata is not None
        return (await self.metadata.store_metadata(partition)).value.session_id

    async def wait_assigned(self, timeout: float = TIMEOUT) -> None:
        async def assigned() -> bool:
            owners = [(await self.owner(p))[0] for p in range(self.num_partitions)]
            return all(owner >= 0 for owner in owners)

        await wait_for(assigned, timeout, "every partition to be assigned")

    def server_index(self, server_id: int) -> int:
        for index, member in enumerate(self.servers):
            assert isinstance(member, _ServerProcess | _ServerInLoop)
            if member.server_id() == server_id:
                return index
        raise AssertionError(f"no running server has id {server_id}")

    # -- faults ---------------------------------------------------------------------

    async def kill_storage_node(self, index: int) -> None:
        await self.storage[index].kill()

    async def restart_storage_node(self, index: int) -> None:
        await self.storage[index].start()

    def wipe_storage(self, index: int) -> None:
        """Lose everything a killed storage node stored (its disk replaced)."""
        assert not self.storage[index].alive, "wipe a killed storage node only"
        location = self._locations[index]
        if self.storage_engine == "memory":
            from waltz_conformance.reference.storage import forget

            forget(location)
        else:
            shutil.rmtree(location, ignore_errors=True)

    def backup_storage(self, index: int) -> Path:
        """Copy a killed storage node's data directory (an offline backup); requires
        ``processes`` (real files)."""
        assert self.processes and self.workdir is not None, "backups need real files"
        assert not self.storage[index].alive, "back up a killed storage node only"
        backup = self.workdir / f"backup{index}-{uuid.uuid4().hex[:6]}"
        shutil.copytree(self._locations[index], backup)
        return backup

    def restore_storage(self, index: int, backup: Path) -> None:
        """Replace a killed storage node's data directory with ``backup``."""
        assert not self.storage[index].alive, "restore a killed storage node only"
        shutil.rmtree(self._locations[index], ignore_errors=True)
        shutil.copytree(backup, self._locations[index])

    async def kill_server(self, index: int) -> None:
        await self.servers[index].kill()

    async def restart_server(self, index: int) -> None:
        await self.servers[index].start()

    # -- membership changes ---------------------------------------------------------

    async def add_storage_node(self) -> int:
        """Start one more (empty) storage node and make it known to the cluster, holding
        no replica yet; returns its index (beyond the first ``num_storage_nodes``)."""
        assert self.metadata is not None
        index = len(self.storage)
        self.storage_nodes.append(self._storage_name(index))
        member = self._make_storage(index)
        self.storage.append(member)
        await member.start()
        await self.metadata.add_storage_node(self.storage_nodes[index])
        return index

    async def add_replica(self, partition: int, index: int) -> None:
        assert self.metadata is not None
        await self.metadata.add_replica(partition, self.storage_nodes[index])

    async def remove_replica(self, partition: int, index: int) -> None:
        assert self.metadata is not None
        await self.metadata.remove_replica(partition, self.storage_nodes[index])

    async def remove_storage_node(self, index: int) -> None:
        """Forget an added storage node (holding no replica any more) and stop it."""
        assert self.metadata is not None
        await self.metadata.remove_storage_node(self.storage_nodes[index])
        await self.storage[index].kill()

    async def replica_indexes(self, partition: int) -> list[int]:
        """The storage nodes (indexes) holding ``partition`` in the replica assignments."""
        assert self.metadata is not None
        names = (await self.metadata.replica_assignments()).replicas_of(partition)
        return [self.storage_nodes.index(name) for name in names]

    async def wait_replica_set(self, partition: int, timeout: float = TIMEOUT) -> None:
        """Until a store session over the assigned replica set of ``partition`` has
        started (its replica states in the store metadata name exactly those nodes)."""
        assert self.metadata is not None
        metadata = self.metadata

        async def follows() -> bool:
            wanted = sorted(self.storage_nodes[i] for i in await self.replica_indexes(partition))
            stored = (await metadata.store_metadata(partition)).value
            return sorted(r.replica_id.storage_node for r in stored.replicas) == wanted

        await wait_for(follows, timeout, f"a store session over the new replicas of {partition}")

    # -- clients --------------------------------------------------------------------

    async def storage_client(self, index: int) -> StorageClient:
        assert self.client_transport is not None
        client = await StorageClient.connect(
            self.client_transport, self.storage_endpoint(index), sender="conformance", timeout=10
        )
        try:
            await client.open(self.cluster_key, self.num_partitions)
        except BaseException:
            await client.close()
            raise
        return client

    async def replica_log(self, index: int, partition: int) -> list[Record]:
        """Every record on one storage node's replica of ``partition``.

        Read with the session id the replica itself holds, never a newer one: every
        storage request fences, so a checker's read with the current session id would
        record it on a replica that session has not recovered yet, and the
        recovery would then take a replica restored from an old backup for one
        that took part in the session (the detection compares session ids)."""
        for _ in range(20):
            client = await self.storage_client(index)
            try:
                session = await _held_session(client, partition)
                records: list[Record] = []
                while True:
                    batch = await client.records(session, partition, len(records), 1000)
                    if not batch:
                        return records
                    records.extend(batch)
            except SessionFencedError:
                await asyncio.sleep(0.2)  # a newer session reached it meanwhile: read again
            finally:
                await client.close()
        raise AssertionError(f"could not read replica {index} of partition {partition}")


async def _held_session(client: StorageClient, partition: int) -> int:
    """The store session id a replica holds (asked with session 0, which every replica
    past its first session refuses, naming its own; 0 when it holds none above 0)."""
    try:
        await client.max_transaction_id(0, partition)
    except SessionFencedError as exc:
        return exc.highest_session_id
    return 0


async def _start_all(members: Sequence[_Member]) -> None:
    """Start ``members`` concurrently; every start is awaited even when one fails."""
    await _gather_all(m.start() for m in members)


async def _gather_all(work: Iterable[Awaitable[None]]) -> None:
    """Await ``work`` concurrently; every one is awaited even when one fails, then the
    first failure is raised."""
    results = await asyncio.gather(*work, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


async def wait_for(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if await check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


_client_ids = itertools.count(1000)


class PartitionClient:
    """A raw protocol client mounted on the current owner of one partition."""

    def __init__(self, harness: SystemHarness, partition: int, client_id: int) -> None:
        self.harness = harness
        self.partition = partition
        self.client_id = client_id
        self.raw: RawClient | None = None
        self.generation = -1
        self._seq = itertools.count(1)
        self._net = itertools.count(1)

    @classmethod
    async def connect(
        cls, harness: SystemHarness, partition: int, client_hwm: int = -1
    ) -> PartitionClient:
        client = cls(harness, partition, next(_client_ids))
        await client.mount(client_hwm)
        return client

    async def mount(self, client_hwm: int) -> None:
        assert self.harness.client_transport is not None
        server_id, endpoint, generation = await self.harness.owner(self.partition)
        if server_id < 0:
            raise WaltzError(f"partition {self.partition} has no owner")
        self.raw = await RawClient.connect(
            self.harness.client_transport, endpoint, f"client:{self.client_id}", timeout=10
        )
        self.generation = generation
        await self.raw.send(MountRequest(self.rid(), client_hwm, next(self._net)))
        response = (await self.raw.wait(MountResponse, timeout=TIMEOUT))[0]
        if response.status is not MountStatus.READY:
            raise WaltzError(f"mount answered {response.status.name}")

    def rid(self, generation: int | None = None) -> ReqId:
        generation = self.generation if generation is None else generation
        return ReqId(self.client_id, generation, self.partition, next(self._seq))

    async def append(
        self,
        data: bytes,
        client_hwm: int,
        locks: Sequence[Lock] = (),
        generation: int | None = None,
    ) -> ReqId:
        assert self.raw is not None
        rid = self.rid(generation)
        request = AppendRequest(
            rid, client_hwm, LockRequest.from_locks(locks), 0, data, wire.checksum(data)
        )
        await self.raw.send(request)
        return rid

    async def flush(self) -> int:
        """The partition's high-water mark once every earlier append is decided."""
        assert self.raw is not None
        count = self.raw.counts[FlushResponse]
        await self.raw.send(FlushRequest(self.rid()))
        return (await self.raw.wait(FlushResponse, count + 1, timeout=TIMEOUT))[-1].transaction_id

    def lock_failures(self) -> dict[ReqId, int]:
        assert self.raw is not None
        return {f.req_id: f.transaction_id for f in self.raw.of(LockFailure)}

    def errors(self) -> list[ErrorResponse]:
        assert self.raw is not None
        return self.raw.of(ErrorResponse)

    async def feed_until(self, transaction_id: int) -> list[FeedData]:
        """The feed received so far, once it reached ``transaction_id``."""
        assert self.raw is not None
        for _ in range(int(TIMEOUT / 0.05)):
            feed = self.raw.of(FeedData)
            if feed and feed[-1].transaction_id >= transaction_id:
                return feed
            if transaction_id < 0:
                return feed
            await self.raw.changed(0.05)
        raise AssertionError(f"the feed never reached transaction {transaction_id}")

    async def committed(self, rid: ReqId, hwm: int) -> int | None:
        """The transaction id ``rid`` committed as (None if it did not), from the feed."""
        for data in await self.feed_until(hwm):
            if data.req_id == rid:
                return data.transaction_id
        return None

    async def close(self) -> None:
        if self.raw is not None:
            await self.raw.close()


async def read_log(harness: SystemHarness, partition: int) -> list[Record]:
    """The committed log of ``partition``, in bulk from its current owner (asked again
    when the partition moves meanwhile)."""
    failures: list[str] = []
    for _ in range(20):
        try:
            return await _read_log_once(harness, partition)
        except (WaltzError, TimeoutError, OSError) as exc:
            failures.append(f"{type(exc).__name__}: {exc}"[:200])
            await asyncio.sleep(0.5)
    raise AssertionError(f"could not read the log of partition {partition}: {failures[-3:]}")


async def _read_log_once(harness: SystemHarness, partition: int) -> list[Record]:
    assert harness.client_transport is not None
    _, endpoint, generation = await harness.owner(partition)
    client = await RawClient.connect(harness.client_transport, endpoint, "checker")
    try:
        records: list[Record] = []
        loop = asyncio.get_running_loop()
        for _ in range(100_000):
            request = RangeReadRequest(
                ReqId(999, generation, partition, len(records)), len(records), 500, 1 << 20
            )
            count, errors = client.counts[RangeReadResponse], client.counts[ErrorResponse]
            await client.send(request)
            # bounded well below TIMEOUT: a read sent to an owner that just lost the
            # partition is not answered, and the retry asks the new owner
            deadline = loop.time() + RANGE_READ_TIMEOUT
            next_check = loop.time() + 1.0
            while client.counts[RangeReadResponse] == count:
                if client.counts[ErrorResponse] > errors:
                    raise WaltzError(f"range read refused: {client.of(ErrorResponse)[-1]}")
                if client.closed or loop.time() > deadline:
                    raise WaltzError("no answer to a range read")
                if loop.time() > next_check:  # moved meanwhile: ask the new owner now
                    next_check = loop.time() + 1.0
                    if (await harness.owner(partition))[2] != generation:
                        raise WaltzError(f"partition {partition} moved during a range read")
                await client.changed(0.1)
            response = client.of(RangeReadResponse)[-1]
            records.extend(response.records)
            if not response.records or len(records) > response.high_water_mark:
                break
        return records
    finally:
        await client.close()


@dataclass
class Writer:
    """Appends to one partition at its current owner, reconnecting after faults.

    A transaction counts as acknowledged once the feed delivered it to its writer
    (the commit notification of Waltz). The writer's feed starts at the partition's
    high-water mark when it first connects (``base``): a test pays for what it
    writes, not for the log earlier tests left. Rounds of appends are paced
    (``pace`` seconds apart) so a fast in-process cluster does not grow logs that
    every later check reads whole."""

    harness: SystemHarness
    partition: int
    client_id: int = field(default_factory=lambda: next(_client_ids))
    sent: dict[ReqId, bytes] = field(default_factory=dict)
    feed: list[ReqId] = field(default_factory=list)
    """The feed of the partition from ``base + 1``, in order: feed[i] is transaction
    ``base + 1 + i``'s request id."""
    base: int | None = None
    """The partition's high-water mark before this writer's feed (None: not yet known)."""
    pace: float = 0.02
    reconnects: int = 0
    reasons: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    _seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _net: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    @property
    def acknowledged(self) -> set[ReqId]:
        return {r for r in self.feed if r.client_id == self.client_id}

    @property
    def first(self) -> int:
        """The first transaction id of the feed."""
        return (-1 if self.base is None else self.base) + 1

    @property
    def last(self) -> int:
        """The last transaction id the feed delivered (``base`` when none yet)."""
        return self.first + len(self.feed) - 1

    def _consume(self, client: RawClient) -> None:
        messages = list(client.received)
        client.received.clear()
        for message in messages:
            if isinstance(message, FeedData):
                assert message.transaction_id == self.last + 1, "the feed skipped or repeated"
                self.feed.append(message.req_id)
            elif isinstance(message, ErrorResponse):
                raise WaltzError(f"server refused: {message.code.name} {message.message}")

    async def _wait(self, client: RawClient, kind: type[M], count: int, generation: int) -> list[M]:
        """``client.wait`` (30 s at most), giving up early when the partition moved
        meanwhile: its old owner no longer answers, the new one will."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30.0
        while True:
            try:
                return await client.wait(kind, count, timeout=1.0)
            except TimeoutError:
                if loop.time() > deadline:
                    raise
            _, _, now = await self.harness.owner(self.partition)
            if now != generation:
                raise WaltzError(f"partition {self.partition} moved (generation {now})")

    async def _find_base(self, client: RawClient, generation: int) -> None:
        count = client.counts[HighWaterMarkResponse]
        await client.send(HighWaterMarkRequest(self.rid(generation)))
        response = (await self._wait(client, HighWaterMarkResponse, count + 1, generation))[-1]
        self.base = response.transaction_id
        client.received.clear()

    async def run(self) -> None:
        while not self.stop.is_set():
            client: RawClient | None = None
            try:
                server_id, endpoint, generation = await self.harness.owner(self.partition)
                if server_id < 0:
                    await asyncio.sleep(0.2)
                    continue
                assert self.harness.client_transport is not None
                client = await RawClient.connect(
                    self.harness.client_transport, endpoint, f"client:{self.client_id}", timeout=5
                )
                if self.base is None:
                    await self._find_base(client, generation)
                await client.send(MountRequest(self.rid(generation), self.last, next(self._net)))
                response = (await self._wait(client, MountResponse, 1, generation))[0]
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
                    await self._wait(client, FlushResponse, flushes + 1, generation)
                    self._consume(client)
                    if self.pace > 0:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self.stop.wait(), self.pace)
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
        mark = (await self._wait(client, FlushResponse, flushes + 1, generation))[-1].transaction_id
        for _ in range(600):
            self._consume(client)
            if self.last >= mark:
                return
            await client.changed(0.05)
        raise AssertionError("the feed never reached the flushed high-water mark")

    def rid(self, generation: int) -> ReqId:
        return ReqId(self.client_id, generation, self.partition, next(self._seq))


class Writers:
    """A writer per partition, run as tasks; ``progress`` waits for acknowledgements."""

    def __init__(self, harness: SystemHarness) -> None:
        self.harness = harness
        self.writers = [Writer(harness, p) for p in range(harness.num_partitions)]
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self.tasks = [asyncio.create_task(w.run()) for w in self.writers]

    async def progress(self, count: int, timeout: float, what: str) -> None:
        targets = [len(w.acknowledged) + count for w in self.writers]

        async def reached() -> bool:
            for task in self.tasks:
                if task.done():
                    task.result()
            return all(len(w.acknowledged) >= t for w, t in zip(self.writers, targets, strict=True))

        try:
            await wait_for(reached, timeout, what)
        except AssertionError as exc:
            state = [(w.partition, len(w.acknowledged), w.reasons[-3:]) for w in self.writers]
            raise AssertionError(f"{exc}: {state}") from None

    async def stop(self) -> None:
        for writer in self.writers:
            writer.stop.set()
        results = await asyncio.wait_for(
            asyncio.gather(*self.tasks, return_exceptions=True), TIMEOUT
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def check_invariants(harness: SystemHarness, writers: Sequence[Writer]) -> None:
    """Invariants 1, 2, 3 and 6 for the writers' partitions, from the owner's log and
    from every live replica's storage."""
    for writer in writers:
        records = await read_log(harness, writer.partition)
        assert [r.transaction_id for r in records] == list(range(len(records))), "ids not dense"
        log_ids = [r.req_id for r in records]
        # 6: the feed is exactly the committed log, in order
        assert writer.feed == log_ids[writer.first : writer.last + 1]
        # 2: no submission committed twice
        assert len(set(log_ids)) == len(log_ids), "a submission committed twice"
        # 1: every acknowledged transaction is there with its data
        by_id = {r.req_id: r.data for r in records}
        for rid in writer.acknowledged:
            assert by_id.get(rid) == writer.sent[rid], f"acknowledged {rid} lost"
        # nothing of this writer appears that it did not submit
        mine = {r for r in log_ids if r.client_id == writer.client_id}
        assert mine <= set(writer.sent), "a transaction nobody submitted"
        await check_no_fork(harness, writer.partition, committed=writer.last + 1)


async def check_no_fork(harness: SystemHarness, partition: int, committed: int) -> None:
    """3: every live replica's log is a prefix of the longest (lagging replicas catch up
    later), and the committed prefix is on a majority of the assigned replicas."""
    replicas = await harness.replica_indexes(partition)
    logs = [await harness.replica_log(i, partition) for i in replicas if harness.storage[i].alive]
    longest = max(logs, key=len)
    for replica in logs:
        assert replica == longest[: len(replica)], "replicas forked"
    assert sum(1 for replica in logs if len(replica) >= committed) > len(replicas) // 2


async def check_replicas_converge(harness: SystemHarness, partitions: Sequence[int]) -> None:
    """Once writes stopped: every live replica of each partition ends exactly equal to
    the committed log (identical committed prefixes, no dirty record beyond the
    resolved high-water mark on any replica), waiting (bounded) for catch-up."""
    for partition in partitions:
        committed = await read_log(harness, partition)
        replicas = await harness.replica_indexes(partition)
        lengths: dict[int, int] = {}

        async def equal(
            partition: int = partition,
            committed: list[Record] = committed,
            lengths: dict[int, int] = lengths,
            replicas: list[int] = replicas,
        ) -> bool:
            same = True
            for index in replicas:
                if not harness.storage[index].alive:
                    continue
                replica = await harness.replica_log(index, partition)
                lengths[index] = len(replica)
                assert replica[: len(committed)] == committed[: len(replica)], (
                    f"replica {index} of partition {partition} differs from the committed log"
                )
                same = same and replica == committed
            return same

        try:
            await wait_for(equal, TIMEOUT, f"the replicas of partition {partition} to converge")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: committed {len(committed)}, replicas {lengths}") from None


async def fenced_everywhere(harness: SystemHarness, partition: int, old_session: int) -> None:
    """Every storage node refuses a write of store session ``old_session``; waits
    (bounded) for replicas the new session has not reached yet."""
    for index in range(harness.num_storage_nodes):

        async def refuses(index: int = index) -> bool:
            client = await harness.storage_client(index)
            try:
                # a no-op if accepted (nothing lies beyond a huge id): a safe probe
                await client.truncate(old_session, partition, 10**12)
                return False
            except SessionFencedError:
                return True
            except StorageError:
                return False
            finally:
                await client.close()

        await wait_for(refuses, TIMEOUT, f"storage node {index} to fence session {old_session}")
        client = await harness.storage_client(index)
        try:
            with pytest.raises(SessionFencedError):
                await client.append(old_session, partition, [make_record(partition, 10**6)])
        finally:
            await client.close()


class LockingSuite:
    """The feed and locking tests alone (cheap: no fault), e.g. to run them once more
    with another lock table plugin. :class:`SystemSuite` includes them."""

    pytestmark = pytest.mark.asyncio(loop_scope="class")

    @pytest.fixture(autouse=True)
    def _capabilities(self, request: pytest.FixtureRequest, harness: SystemHarness) -> None:
        skip_unless_capable(request, harness)

    # -- 6: the feed ---------------------------------------------------------------

    async def test_feed_delivers_every_committed_transaction_once_in_order(
        self, harness: SystemHarness
    ) -> None:
        writer = await PartitionClient.connect(harness, 0)
        try:
            start = await writer.flush()
            sent = [await writer.append(b"feed-%d" % i, -1) for i in range(30)]
            end = await writer.flush()
            assert end == start + 30
            for from_hwm in (start, start + 10, -1):
                reader = await PartitionClient.connect(harness, 0, client_hwm=from_hwm)
                try:
                    feed = await reader.feed_until(end)
                    ids = [f.transaction_id for f in feed]
                    assert ids == list(range(from_hwm + 1, end + 1)), f"from {from_hwm}"
                    assert [f.req_id for f in feed[-30 + max(0, from_hwm - start) :]] == sent[
                        max(0, from_hwm - start) :
                    ]
                finally:
                    await reader.close()
            log = await read_log(harness, 0)
            assert [r.req_id for r in log[start + 1 : end + 1]] == sent
            assert [r.data for r in log[start + 1 : end + 1]] == [b"feed-%d" % i for i in range(30)]
        finally:
            await writer.close()

    # -- 5: locking ----------------------------------------------------------------

    async def test_overlapping_write_locks_on_the_same_hwm_exactly_one_commits(
        self, harness: SystemHarness
    ) -> None:
        first = await PartitionClient.connect(harness, 0)
        second = await PartitionClient.connect(harness, 0)
        try:
            hwm = await first.flush()
            for round_ in range(5):
                name = f"account-{uuid.uuid4().hex[:6]}"
                a = await first.append(b"a", hwm, [Lock(name, round_), Lock("other-a", round_)])
                b = await second.append(b"b", hwm, [Lock(name, round_), Lock("other-b", round_)])
                new_hwm = max(await first.flush(), await second.flush())
                committed = {rid: await first.committed(rid, new_hwm) for rid in (a, b)}
                winners = [rid for rid, tid in committed.items() if tid is not None]
                assert len(winners) == 1, f"round {round_}: {committed}"
                loser = b if winners[0] == a else a
                failures = (first if loser == a else second).lock_failures()
                assert failures.get(loser) == committed[winners[0]], "LockFailure id"
                hwm = new_hwm
        finally:
            await first.close()
            await second.close()

    async def test_read_lock_fails_after_the_entity_changed(self, harness: SystemHarness) -> None:
        client = await PartitionClient.connect(harness, 1)
        try:
            before = await client.flush()
            entity = Lock(f"item-{uuid.uuid4().hex[:6]}", 7)
            read = Lock(entity.name, entity.id, LockMode.READ)
            changed = await client.append(b"change", before, [entity])
            hwm = await client.flush()
            changed_at = await client.committed(changed, hwm)
            assert changed_at == hwm
            stale = await client.append(b"stale-read", before, [read])
            fresh = await client.append(b"fresh-read", changed_at, [read])
            hwm = await client.flush()
            assert await client.committed(stale, hwm) is None
            assert client.lock_failures().get(stale) == changed_at
            assert await client.committed(fresh, hwm) == changed_at + 1
        finally:
            await client.close()

    async def test_append_locks_never_fail_but_fail_later_read_and_write_checks(
        self, harness: SystemHarness
    ) -> None:
        client = await PartitionClient.connect(harness, 1)
        try:
            before = await client.flush()
            name = f"log-{uuid.uuid4().hex[:6]}"
            appended = [
                await client.append(b"app-%d" % i, before, [Lock(name, 1, LockMode.APPEND)])
                for i in range(3)
            ]
            hwm = await client.flush()
            ids = [await client.committed(rid, hwm) for rid in appended]
            assert ids == [before + 1, before + 2, before + 3]
            last = before + 3
            write = await client.append(b"w", before, [Lock(name, 1)])
            read = await client.append(b"r", last - 1, [Lock(name, 1, LockMode.READ)])
            read_ok = await client.append(b"r-ok", last, [Lock(name, 1, LockMode.READ)])
            hwm = await client.flush()
            failures = client.lock_failures()
            assert failures.get(write) == last and failures.get(read) == last
            assert await client.committed(read_ok, hwm) == last + 1
        finally:
            await client.close()


class SystemSuite(LockingSuite):
    """Tests against one cluster (the class-scoped ``harness`` fixture); they run in
    order and each leaves the cluster serving every partition."""

    # -- 4: fencing by generation --------------------------------------------------

    async def test_an_append_with_a_stale_generation_is_refused(
        self, harness: SystemHarness
    ) -> None:
        client = await PartitionClient.connect(harness, 0)
        try:
            before = await client.flush()
            await client.append(b"stale", -1, generation=client.generation - 1)
            assert await client.flush() == before
            errors = client.errors()
            assert [e.code for e in errors] == [ErrorCode.STALE_GENERATION]
            assert not any(r.data == b"stale" for r in await read_log(harness, 0))
        finally:
            await client.close()

    async def test_a_forced_new_store_session_fences_the_running_one(
        self, harness: SystemHarness
    ) -> None:
        """Another writer takes the next store session id (by compare-and-set, as a new
        owner would) and reaches every storage node: the running session's writes fail
        everywhere; its server notices, starts a newer session, and loses nothing."""
        from waltz_server.server.store_metadata import begin_store_session

        writers = Writers(harness)
        writers.start()
        try:
            await writers.progress(30, TIMEOUT, "first acknowledgements")
            _, _, generation = await harness.owner(0)
            old_session = await harness.session_id(0)
            assert harness.coordination is not None
            forced = (await begin_store_session(harness.coordination, 0, generation)).value
            assert forced.session_id > old_session
            for index in range(harness.num_storage_nodes):
                client = await harness.storage_client(index)
                # any request of a newer session fences the older ones (fenced itself
                # when the server's next session reached this node first)
                try:
                    with contextlib.suppress(SessionFencedError):
                        await client.max_transaction_id(forced.session_id, 0)
                finally:
                    await client.close()
            await fenced_everywhere(harness, 0, old_session)
            await writers.progress(50, TIMEOUT, "progress after the forced session")
            assert await harness.session_id(0) > forced.session_id
            await writers.stop()
        except BaseException:
            await writers.cancel()
            raise
        await check_invariants(harness, writers.writers)

    # -- 1, 3: faults while appending ------------------------------------------------

    async def test_a_storage_node_killed_while_appending_loses_nothing_acknowledged(
        self, harness: SystemHarness
    ) -> None:
        writers = Writers(harness)
        writers.start()
        victim = harness.num_storage_nodes - 1
        try:
            await writers.progress(50, TIMEOUT, "first acknowledgements")
            await harness.kill_storage_node(victim)
            await writers.progress(100, TIMEOUT, "progress with a minority of storage down")
            await writers.stop()
        except BaseException:
            await writers.cancel()
            raise
        finally:
            if not harness.storage[victim].alive:
                await harness.restart_storage_node(victim)
        await check_invariants(harness, writers.writers)

    @requires(PROCESSES)
    async def test_every_storage_node_killed_at_once_keeps_every_acknowledged_transaction(
        self, harness: SystemHarness
    ) -> None:
        """kill -9 of all storage nodes while appending (a power cut): acknowledged means
        on a majority's disk, so all of it is there after the restart."""
        writers = Writers(harness)
        writers.start()
        try:
            await writers.progress(50, TIMEOUT, "first acknowledgements")
            for index in range(harness.num_storage_nodes):
                await harness.kill_storage_node(index)
            acknowledged = [set(w.acknowledged) for w in writers.writers]
            await _start_all(harness.storage[: harness.num_storage_nodes])
            await writers.progress(50, TIMEOUT, "progress after the restart")
            await writers.stop()
        except BaseException:
            await writers.cancel()
            raise
        finally:
            for index, member in enumerate(harness.storage):
                if not member.alive:
                    await harness.restart_storage_node(index)
        for writer, before in zip(writers.writers, acknowledged, strict=True):
            assert before <= writer.acknowledged
        await check_invariants(harness, writers.writers)

    async def test_a_server_killed_while_appending_moves_its_partitions_and_is_fenced(
        self, harness: SystemHarness
    ) -> None:
        """A storage node is down when the owner of partition 0 dies: the new owner
        recovers from the remaining majority, and the node rejoins afterwards."""
        writers = Writers(harness)
        writers.start()
        victim = -1
        down = 1
        try:
            await writers.progress(50, TIMEOUT, "first acknowledgements")
            await harness.kill_storage_node(down)
            await writers.progress(50, TIMEOUT, "progress without a storage node")
            server_id, _, generation = await harness.owner(0)
            old_session = await harness.session_id(0)
            victim = harness.server_index(server_id)
            await harness.kill_server(victim)

            async def moved() -> bool:
                new_id, _, new_generation = await harness.owner(0)
                return new_id not in (server_id, -1) and new_generation > generation

            await wait_for(moved, TIMEOUT, "partition 0 to move")
            await harness.restart_storage_node(down)
            await writers.progress(100, TIMEOUT, "progress after the server died")
            assert await harness.session_id(0) > old_session
            await writers.stop()
        except BaseException:
            await writers.cancel()
            raise
        finally:
            if not harness.storage[down].alive:
                await harness.restart_storage_node(down)
            if victim >= 0 and not harness.servers[victim].alive:
                await harness.restart_server(victim)
        assert writers.writers[0].reconnects >= 1, "the server kill never reached the writer"
        await check_invariants(harness, writers.writers)
        # 4: the old session can write on no storage node, also after they restart
        await fenced_everywhere(harness, 0, old_session)
        for index in range(harness.num_storage_nodes):
            await harness.kill_storage_node(index)
        await _start_all(harness.storage[: harness.num_storage_nodes])
        await fenced_everywhere(harness, 0, old_session)
        # and the cluster serves again, with everything acknowledged still there
        after = Writers(harness)
        after.start()
        try:
            await after.progress(20, TIMEOUT, "progress after the storage restarts")
            await after.stop()
        except BaseException:
            await after.cancel()
            raise
        await check_invariants(harness, [*writers.writers, *after.writers])

    # -- the original's recovery cases, on the harness's storage nodes ---------------
    # (exact vote counts over preloaded logs are covered by waltz-server's fake-node
    # tests)

    @requires(VOTER_SWEEP)
    async def test_one_to_five_voters_recover_without_losing_anything(
        self, harness: SystemHarness
    ) -> None:
        """Clusters of 1, 2, 4 and 5 storage nodes (one server, one partition): voters killed
        while appending force recoveries; with a majority left it resolves at once,
        otherwise it waits for them; nothing acknowledged is lost, replicas converge."""
        # 3: the suite's own cluster, in the tests below. The clusters run
        # concurrently: most of each one's time is waiting (fault detection, retries).
        await _gather_all(_voters(harness, count) for count in (1, 2, 4, 5))

    @requires(RECOVERY_CASES)
    async def test_recovery_waits_while_undecidable_then_resolves(
        self, harness: SystemHarness
    ) -> None:
        """A majority of replicas unavailable: the recovery cannot decide the
        high-water mark and waits (nothing commits, and the lone replica may hold
        records nobody acknowledged); each replica back lets it resolve, and the
        dirty records are truncated."""
        writers = Writers(harness)
        writers.start()
        down = [1, 2]
        try:
            await writers.progress(30, TIMEOUT, "first acknowledgements")
            for index in down:
                await harness.kill_storage_node(index)
            await asyncio.sleep(1.5)  # commits made before the kill reach the feed
            stalled = [len(w.acknowledged) for w in writers.writers]
            await asyncio.sleep(3.0)
            assert [len(w.acknowledged) for w in writers.writers] == stalled, (
                "a transaction committed without a majority of replicas"
            )
            await harness.restart_storage_node(down[0])
            await writers.progress(30, TIMEOUT, "progress once a majority is back")
            await harness.restart_storage_node(down[1])
            await writers.progress(30, TIMEOUT, "progress with every replica back")
            await writers.stop()
        except BaseException:
            await writers.cancel()
            raise
        finally:
            for index in down:
                if not harness.storage[index].alive:
                    await harness.restart_storage_node(index)
        await check_invariants(harness, writers.writers)
        await check_replicas_converge(harness, range(harness.num_partitions))

    @requires(RECOVERY_CASES)
    async def test_recovery_after_a_failed_recovery_keeps_every_acknowledged_transaction(
        self, harness: SystemHarness
    ) -> None:
        """The owner's recovery stalls (a majority of replicas down) and the owner dies;
        the next owner's recovery is interrupted by a storage node kill; the one after
        completes with every acknowledged transaction and nothing else. (Node 0, the
        only replica that may hold records nobody acknowledged, stays up: a replica
        with such a tail that misses the recovery is the restored-older-storage case,
        not covered here.)"""
        writers = Writers(harness)
        writers.start()
        victim = -1
        down = [1, 2]
        try:
            await writers.progress(30, TIMEOUT, "first acknowledgements")
            server_id, _, generation = await harness.owner(0)
            old_session = await harness.session_id(0)
            for index in down:
                await harness.kill_storage_node(index)
            await asyncio.sleep(1.0)  # the owner's new session is recovering, undecided
            victim = harness.server_index(server_id)
            await harness.kill_server(victim)

            async def moved() -> bool:
                new_id, _, new_generation = await harness.owner(0)
                return new_id not in (server_id, -1) and new_generation > generation

            await wait_for(moved, TIMEOUT, "partition 0 to move")
            await harness.restart_storage_node(down[0])
            # the new owner's recovery, interrupted by the loss of a voter (one that
            # holds no record beyond the committed log: node 0, which may, votes)
            await harness.kill_storage_node(down[0])
            await asyncio.sleep(0.5)
            await harness.restart_storage_node(down[0])
            await harness.restart_storage_node(down[1])
            await writers.progress(50, TIMEOUT, "progress after the recoveries")
            assert await harness.session_id(0) > old_session
            await writers.stop()
            # checked before the victim's restart moves partitions again
            await check_invariants(harness, writers.writers)
            await check_replicas_converge(harness, range(harness.num_partitions))
        except BaseException:
            await writers.cancel()
            raise
        finally:
            for index, member in enumerate(harness.storage):
                if not member.alive:
                    await harness.restart_storage_node(index)
            if victim >= 0 and not harness.servers[victim].alive:
                await harness.restart_server(victim)
        await harness.wait_assigned()

    @requires(RECOVERY_CASES)
    async def test_a_wiped_replica_is_caught_up_from_its_low_water_mark(
        self, harness: SystemHarness
    ) -> None:
        """Inconsistent storage: a replica loses its data (its disk replaced) and comes
        back empty while appends go on; the next sessions catch it up to the committed
        log, and nothing acknowledged is lost."""
        writers = Writers(harness)
        writers.start()
        wiped = 1
        try:
            await writers.progress(30, TIMEOUT, "first acknowledgements")
            await harness.kill_storage_node(wiped)
            harness.wipe_storage(wiped)
            await harness.restart_storage_node(wiped)
            await writers.progress(30, TIMEOUT, "progress after the wipe")
            await writers.stop()
        except BaseException:
            await writers.cancel()
            raise
        finally:
            if not harness.storage[wiped].alive:
                await harness.restart_storage_node(wiped)
        await check_invariants(harness, writers.writers)
        await check_replicas_converge(harness, range(harness.num_partitions))

    @requires(RECOVERY_CASES)
    async def test_recovery_is_idempotent(self, harness: SystemHarness) -> None:
        """With nothing written, recoveries by two successive owners (and a storage
        node restart) change nothing committed and nothing stored."""
        partitions = range(harness.num_partitions)
        await check_replicas_converge(harness, partitions)
        committed = [await read_log(harness, p) for p in partitions]
        stored = [
            [await harness.replica_log(i, p) for i in range(harness.num_storage_nodes)]
            for p in partitions
        ]
        for round_ in range(2):
            old_session = await harness.session_id(0)
            if round_ == 0:  # a new owner's recovery
                server_id, _, generation = await harness.owner(0)
                victim = harness.server_index(server_id)
                await harness.kill_server(victim)
                try:

                    async def moved(
                        server_id: int = server_id, generation: int = generation
                    ) -> bool:
                        new_id, _, new_generation = await harness.owner(0)
                        return new_id not in (server_id, -1) and new_generation > generation

                    await wait_for(moved, TIMEOUT, "partition 0 to move")
                    assert [await read_log(harness, p) for p in partitions] == committed
                finally:
                    await harness.restart_server(victim)
                await harness.wait_assigned()
            else:  # the same owner's recovery, forced by a storage node leaving
                await harness.kill_storage_node(2)
                await harness.restart_storage_node(2)
            assert [await read_log(harness, p) for p in partitions] == committed
            assert await harness.session_id(0) > old_session
            for p in partitions:
                assert [
                    await harness.replica_log(i, p) for i in range(harness.num_storage_nodes)
                ] == stored[p], f"recovery changed the stored log of partition {p}"
        await check_replicas_converge(harness, partitions)
        # every replica's last session started at the unchanged high-water mark
        session = await harness.session_id(0)
        for index in range(harness.num_storage_nodes):
            client = await harness.storage_client(index)
            try:
                info = await client.last_session_info(session, 0)
            finally:
                await client.close()
            assert info.low_water_mark == len(committed[0]) - 1, f"replica {index}: {info}"

    @requires(RECOVERY_CASES)
    async def test_a_voter_killed_during_the_new_owners_recovery_loses_nothing(
        self, harness: SystemHarness
    ) -> None:
        """The owner of partition 0 dies while appending, and storage node 0 (a voter
        that may hold records nobody acknowledged) dies as soon as the partition moved
        (while the new owner recovers, or just after): recovery completes with the
        remaining majority; node 0 comes back, is
        truncated to the resolved mark and caught up; nothing acknowledged is lost."""
        writers = Writers(harness)
        writers.start()
        victim = -1
        voter = 0
        try:
            await writers.progress(30, TIMEOUT, "first acknowledgements")
            server_id, _, generation = await harness.owner(0)
            victim = harness.server_index(server_id)
            await harness.kill_server(victim)

            async def moved() -> bool:
                new_id, _, new_generation = await harness.owner(0)
                return new_id not in (server_id, -1) and new_generation > generation

            await wait_for(moved, TIMEOUT, "partition 0 to move")
            await harness.kill_storage_node(voter)
            await writers.progress(30, TIMEOUT, "progress without the voter")
            await harness.restart_storage_node(voter)
            await writers.progress(30, TIMEOUT, "progress with the voter back")
            await writers.stop()
            await check_invariants(harness, writers.writers)
            await check_replicas_converge(harness, range(harness.num_partitions))
        except BaseException:
            await writers.cancel()
            raise
        finally:
            if not harness.storage[voter].alive:
                await harness.restart_storage_node(voter)
            if victim >= 0 and not harness.servers[victim].alive:
                await harness.restart_server(victim)
        await harness.wait_assigned()

    @requires(PROCESSES, RECOVERY_CASES)
    async def test_a_replica_restored_from_an_older_backup_is_truncated_and_caught_up(
        self, harness: SystemHarness
    ) -> None:
        """Inconsistent storage: a storage node's data is restored from an older backup
        (taken while it was down, so it may hold records the cluster never committed,
        and lacks everything since). The storage is older than the metadata says: it
        is truncated to its own low-water mark before anything reads it, and caught
        up; every read returns the committed records."""
        writers = Writers(harness)
        writers.start()
        restored = 0
        try:
            await writers.progress(30, TIMEOUT, "first acknowledgements")
            await harness.kill_storage_node(restored)
            backup = harness.backup_storage(restored)
            await harness.restart_storage_node(restored)
            await writers.progress(50, TIMEOUT, "progress after the backup")
            await harness.kill_storage_node(restored)
            harness.restore_storage(restored, backup)
            await harness.restart_storage_node(restored)
            await writers.progress(50, TIMEOUT, "progress after the restore")
            await writers.stop()
        except BaseException:
            await writers.cancel()
            raise
        finally:
            if not harness.storage[restored].alive:
                await harness.restart_storage_node(restored)
        await check_invariants(harness, writers.writers)
        await check_replicas_converge(harness, range(harness.num_partitions))

    # -- replicas added, removed, replaced (membership changes) -------------------------

    @requires(RECOVERY_CASES)
    async def test_a_replica_added_under_load_converges_to_the_committed_log(
        self, harness: SystemHarness
    ) -> None:
        """A new storage node gets a replica of every partition while appends go on: a new
        store session takes it in, it is caught up in the background, and it ends equal
        to the committed log; nothing acknowledged is lost, nothing duplicated."""
        partitions = range(harness.num_partitions)
        writers = Writers(harness)
        writers.start()
        added = -1
        try:
            await writers.progress(30, TIMEOUT, "first acknowledgements")
            added = await harness.add_storage_node()
            for partition in partitions:
                await harness.add_replica(partition, added)
            await writers.progress(30, TIMEOUT, "progress while the replica is added")
            for partition in partitions:
                await harness.wait_replica_set(partition)
            await writers.progress(30, TIMEOUT, "progress with the added replica")
            await writers.stop()
        except BaseException:
            await writers.cancel()
            raise
        finally:
            if added < 0:
                await harness.wait_assigned()
        try:
            await check_invariants(harness, writers.writers)
            await check_replicas_converge(harness, partitions)
            for partition in partitions:
                assert added in await harness.replica_indexes(partition)
        finally:
            await _retire_added(harness, added)

    @requires(RECOVERY_CASES)
    async def test_a_removed_replica_is_no_longer_written(self, harness: SystemHarness) -> None:
        """A replica of every partition is removed while appends go on: writes continue
        on the others and never reach it again (its data stays); added back, it is
        caught up to the committed log."""
        partitions = range(harness.num_partitions)
        removed = harness.num_storage_nodes - 1
        writers = Writers(harness)
        writers.start()
        try:
            await writers.progress(30, TIMEOUT, "first acknowledgements")
            for partition in partitions:
                await harness.remove_replica(partition, removed)
            for partition in partitions:
                await harness.wait_replica_set(partition)
            left = [len(await harness.replica_log(removed, p)) for p in partitions]
            await writers.progress(50, TIMEOUT, "progress without the removed replica")
            await writers.stop()
        except BaseException:
            await writers.cancel()
            await _restore_replica(harness, removed)
            raise
        try:
            assert [len(await harness.replica_log(removed, p)) for p in partitions] == left, (
                "a removed replica was written"
            )
            await check_invariants(harness, writers.writers)
            await check_replicas_converge(harness, partitions)
        finally:
            await _restore_replica(harness, removed)
        await check_replicas_converge(harness, partitions)

    @requires(RECOVERY_CASES)
    async def test_a_replaced_replica_is_caught_up_and_the_old_one_no_longer_written(
        self, harness: SystemHarness
    ) -> None:
        """Replace a replica under load: add one on a new storage node, then remove the
        old; the new one converges to the committed log, the old one is not written."""
        partitions = range(harness.num_partitions)
        old = 1
        writers = Writers(harness)
        writers.start()
        added = -1
        try:
            await writers.progress(30, TIMEOUT, "first acknowledgements")
            added = await harness.add_storage_node()
            for partition in partitions:
                await harness.add_replica(partition, added)
                await harness.remove_replica(partition, old)
            for partition in partitions:
                await harness.wait_replica_set(partition)
            left = [len(await harness.replica_log(old, p)) for p in partitions]
            await writers.progress(50, TIMEOUT, "progress on the new replica set")
            await writers.stop()
        except BaseException:
            await writers.cancel()
            await _restore_replica(harness, old)
            await _retire_added(harness, added)
            raise
        try:
            assert [len(await harness.replica_log(old, p)) for p in partitions] == left, (
                "the replaced replica was written"
            )
            await check_invariants(harness, writers.writers)
            await check_replicas_converge(harness, partitions)
        finally:
            await _restore_replica(harness, old)
            await _retire_added(harness, added)
        await check_replicas_converge(harness, partitions)


async def _voters(harness: SystemHarness, count: int) -> None:
    """One cluster of ``count`` storage nodes (one server, one partition): voters killed
    while appending, then back; nothing acknowledged lost, the replicas converge."""
    cluster = harness.sibling(
        f"voters{count}", num_storage_nodes=count, num_servers=1, num_partitions=1
    )
    await cluster.start()
    try:
        writers = Writers(cluster)
        writers.start()
        killed = list(range(max(1, (count - 1) // 2)))
        try:
            await writers.progress(20, TIMEOUT, f"{count} voters: acknowledgements")
            for index in killed:
                await cluster.kill_storage_node(index)
            if len(killed) <= (count - 1) // 2:
                await writers.progress(20, TIMEOUT, f"{count} voters: with a minority down")
            await _start_all([cluster.storage[index] for index in killed])
            await writers.progress(20, TIMEOUT, f"{count} voters: every voter back")
            await writers.stop()
        except BaseException:
            await writers.cancel()
            raise
        await _start_all([cluster.storage[i] for i in killed if not cluster.storage[i].alive])
        await check_invariants(cluster, writers.writers)
        await check_replicas_converge(cluster, [0])
    finally:
        await cluster.close()


async def _restore_replica(harness: SystemHarness, index: int) -> None:
    """Give storage node ``index`` its replica of every partition back (idempotent)."""
    for partition in range(harness.num_partitions):
        await harness.add_replica(partition, index)
    for partition in range(harness.num_partitions):
        await harness.wait_replica_set(partition)


async def _retire_added(harness: SystemHarness, index: int) -> None:
    """Remove an added storage node's replicas and the node (the suite's cluster goes
    back to its original replicas for the next tests)."""
    if index < 0:
        return
    assert harness.metadata is not None
    name = harness.storage_nodes[index]
    held = (await harness.metadata.replica_assignments()).partitions_of(name)
    for partition in held:
        await harness.remove_replica(partition, index)
    for partition in range(harness.num_partitions):
        await harness.wait_replica_set(partition)
    await harness.remove_storage_node(index)
