"""The system harness: one cluster of a plugin combination (coordination, transport,
storage engine, lock table), its faults (kill and restart members, wipe, back up and
restore storage), its membership changes, and reads of its state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import shutil
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from waltz_api.backoff import Backoff
from waltz_api.capabilities import PROCESSES
from waltz_api.cluster import coordination_from_uri
from waltz_api.config import toml_document
from waltz_api.contracts.coordination import Coordination, SessionState
from waltz_api.contracts.transport import Transport
from waltz_api.errors import SessionFencedError, StorageError, TransportError
from waltz_api.features import MAX_FEATURE_LEVEL
from waltz_api.plugins import get_registry
from waltz_api.ports import free_port
from waltz_api.storage_client import StorageClient
from waltz_api.types import Record, SessionInfo
from waltz_conformance.harness import Harness
from waltz_conformance.suites.system.members import (
    Member,
    ServerInLoop,
    ServerProcessMember,
    StorageInLoop,
    StorageProcessMember,
)
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.server.testing import ServerProcess
from waltz_storage_node.testing import StorageNodeProcess

log = logging.getLogger(__name__)

TIMEOUT = 90.0
RANGE_READ_TIMEOUT = 15.0


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
    server_settings: dict[str, Any] = field(default_factory=dict)
    """Extra keys of every server's ``[server]`` table (e.g. its ``archive``)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Every storage node's engine options (``[storage.options]``)."""
    storage_settings: dict[str, Any] = field(default_factory=dict)
    """Extra keys of every storage node's ``[storage]`` table (e.g. its ``scrub``)."""
    before_servers: Callable[[SystemHarness], Awaitable[None]] | None = None
    """Run by :meth:`start` once the cluster exists and its storage nodes run, before
    any server starts (e.g. ``waltz archive restore`` into the new cluster)."""
    feature_level: int | None = None
    """The cluster's feature level at creation (None: the highest this code supports)."""
    client_transport: Transport | None = None
    metadata: ClusterAdmin | None = None
    storage_nodes: list[str] = field(default_factory=list)
    """Each storage node's host:port name in the cluster metadata."""
    storage: list[Member] = field(default_factory=list)
    servers: list[Member] = field(default_factory=list)
    coordination: Coordination | None = None
    """The harness's own client of the coordination service."""
    retired: set[int] = field(default_factory=set)
    """Storage nodes (indexes) removed from the cluster: :meth:`heal` leaves them down."""
    _locations: list[str] = field(default_factory=list)
    _reconnecting: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.processes:
            self.capabilities = self.capabilities | {PROCESSES}
            if self.workdir is None:
                raise ValueError("a harness of real processes needs a workdir")

    @classmethod
    def of_processes(cls, workdir: Path, name: str, **settings: Any) -> Self:
        """A cluster of real processes (``waltz storage`` on the fs engine, ``waltz
        server``), ZeroMQ, the embedded ``local`` coordination in ``workdir/coordination``
        under a root of its own, three storage nodes and one partition; ``settings`` set
        any other field (e.g. ``num_servers``, ``server_settings``; ``processes=False``:
        the same members in this event loop). Not started."""
        coordination = workdir / "coordination"
        coordination.mkdir()
        fields: dict[str, Any] = {
            "name": name,
            "coordination_uri": f"local://{coordination}?root=/waltz-{uuid.uuid4().hex[:8]}",
            "transport": "zmq",
            "storage_engine": "fs",
            "processes": True,
            "workdir": workdir,
            "num_storage_nodes": 3,
            "num_partitions": 1,
        }
        return cls(**{**fields, **settings})

    def storage_endpoint(self, index: int) -> str:
        scheme = "memory" if self.transport == "memory" else "tcp"
        return f"{scheme}://{self.storage_nodes[index]}"

    def _server_endpoint(self, index: int) -> str:
        if self.transport == "memory":
            return f"memory://server-{self.cluster_key.hex[:8]}-{index}"
        return f"tcp://127.0.0.1:{free_port()}"

    def _storage_name(self, index: int) -> str:
        if self.transport == "memory":
            return f"sn-{self.cluster_key.hex[:8]}-{index}:{5500 + index}"
        return f"127.0.0.1:{free_port()}"

    def _make_storage(self, index: int) -> Member:
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
                "options": dict(self.storage_options),
                **self.storage_settings,
            },
            "transport": {"plugin": self.transport, "endpoint": self.storage_endpoint(index)},
        }
        if self.processes:
            assert self.workdir is not None and self.client_transport is not None
            path = self.workdir / f"storage{index}.toml"
            path.write_text(toml_document(config))
            process = StorageNodeProcess(
                path, self.storage_endpoint(index), self.workdir / f"storage{index}.log"
            )
            return StorageProcessMember(process, self.client_transport)
        return StorageInLoop(config)

    async def start(self) -> None:
        self.storage_nodes = [self._storage_name(i) for i in range(self.num_storage_nodes)]
        options = {"session_timeout": self.session_timeout}
        await self._connect_coordination()
        assert self.metadata is not None
        await self.metadata.create_cluster(
            num_partitions=self.num_partitions,
            num_replicas=self.num_storage_nodes,
            storage_nodes=self.storage_nodes,
            cluster_key=self.cluster_key,
            feature_level=self.feature_level or MAX_FEATURE_LEVEL,
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
                "server": {"lock_table": self.lock_table, **self.server_settings},
            }
            if self.processes:
                assert self.workdir is not None
                path = self.workdir / f"server{i}.toml"
                path.write_text(toml_document(config))
                self.servers.append(
                    ServerProcessMember(ServerProcess(path, self.workdir / f"server{i}.log"))
                )
            else:
                self.servers.append(ServerInLoop(config))
        try:
            # processes start in parallel (each is a Python interpreter's start-up)
            await start_all(self.storage)
            if self.before_servers is not None:
                await self.before_servers(self)
            await start_all(self.servers)
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
            "server_settings": self.server_settings,
            "storage_options": self.storage_options,
            "storage_settings": self.storage_settings,
        }
        settings.update(changes)
        return SystemHarness(**settings)

    async def _connect_coordination(self) -> None:
        """The harness's own coordination client. Should its session be lost (a test
        that stalls the coordination service longer than the session timeout), the
        next one replaces it: one test fails, not every later test of the class."""
        client = coordination_from_uri(
            self.coordination_uri, {"session_timeout": self.session_timeout}
        )
        await client.start()
        loop = asyncio.get_running_loop()

        def on_state(state: SessionState) -> None:
            if state is SessionState.LOST and self.coordination is client:
                loop.call_soon_threadsafe(self._reconnect_soon, client)

        client.add_session_listener(on_state)
        self.coordination, self.metadata = client, ClusterAdmin(client)

    def _reconnect_soon(self, lost: Coordination) -> None:
        if self.coordination is not lost or self._reconnecting is not None:
            return
        log.warning("the harness's coordination session was lost; starting a new client")
        self._reconnecting = asyncio.get_running_loop().create_task(self._reconnect(lost))

    async def _reconnect(self, lost: Coordination) -> None:
        try:
            with contextlib.suppress(Exception):
                await lost.close()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + TIMEOUT
            backoff = Backoff(0.05, 1.0, random.Random(self.name))
            while True:
                try:
                    await self._connect_coordination()
                    return
                except Exception as exc:  # the service may still be stalled: retry
                    if loop.time() >= deadline:
                        raise
                    log.warning("harness coordination reconnect failed, retrying: %s", exc)
                    await backoff.sleep()
        finally:
            self._reconnecting = None

    async def close(self) -> None:
        """Stop every member (by pid for processes), also after a failed start."""
        for member in [*self.servers, *self.storage]:
            with contextlib.suppress(Exception):
                await member.kill()
        if self.client_transport is not None:
            await self.client_transport.close()
        if self._reconnecting is not None:
            self._reconnecting.cancel()
            await asyncio.gather(self._reconnecting, return_exceptions=True)
        if self.coordination is not None:
            await self.coordination.close()
        if self.storage_engine == "memory":
            from waltz_conformance.reference.storage import forget

            for location in self._locations:
                forget(location)

    # -- the cluster's state --------------------------------------------------------

    async def coordination_ready(self) -> ClusterAdmin:
        """The harness's metadata client, once a replacement of a lost one is up."""
        if self.coordination is not None and self.coordination.session_state is SessionState.LOST:
            self._reconnect_soon(self.coordination)
        if self._reconnecting is not None:
            await asyncio.shield(self._reconnecting)
        assert self.metadata is not None
        return self.metadata

    async def owner(self, partition: int) -> tuple[int, str, int]:
        """The partition's owner: (server id, endpoint, generation); id -1 if none."""
        await self.coordination_ready()
        assert self.metadata is not None
        owner = (await self.metadata.partition_assignment(partition)).value
        return owner.server_id, owner.endpoint, owner.generation

    async def session_id(self, partition: int) -> int:
        """The partition's current store session id (from the coordination service)."""
        await self.coordination_ready()
        assert self.metadata is not None
        return (await self.metadata.store_metadata(partition)).value.session_id

    async def wait_assigned(self, timeout: float = TIMEOUT) -> None:
        async def assigned() -> bool:
            owners = [(await self.owner(p))[0] for p in range(self.num_partitions)]
            return all(owner >= 0 for owner in owners)

        await wait_for(assigned, timeout, "every partition to be assigned")

    def server_index(self, server_id: int) -> int:
        for index, member in enumerate(self.servers):
            assert isinstance(member, ServerProcessMember | ServerInLoop)
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

    async def kill_owner(self, partition: int) -> int:
        """Kill the server owning ``partition`` and wait (bounded) until the partition
        moved to another server with a newer generation; returns the killed server's
        index (:meth:`heal` restarts it)."""
        server_id, _, generation = await self.owner(partition)
        victim = self.server_index(server_id)
        await self.kill_server(victim)
        await self.wait_moved(partition, server_id, generation)
        return victim

    async def wait_moved(
        self, partition: int, server_id: int, generation: int, timeout: float = TIMEOUT
    ) -> None:
        """Until ``partition`` is owned by a server other than ``server_id`` with a
        generation above ``generation``."""

        async def moved() -> bool:
            new_id, _, new_generation = await self.owner(partition)
            return new_id not in (server_id, -1) and new_generation > generation

        await wait_for(moved, timeout, f"partition {partition} to move")

    async def heal(self) -> None:
        """Restart every killed storage node (except those removed from the cluster) and
        every killed server, concurrently."""
        await start_all(
            [m for i, m in enumerate(self.storage) if not m.alive and i not in self.retired]
        )
        restarted = [m for m in self.servers if not m.alive]
        await start_all(restarted)
        if restarted:
            await self.wait_balanced()

    async def wait_balanced(self, timeout: float = TIMEOUT) -> None:
        """Until every partition is owned by a live server and, with at least as many
        partitions as servers, every live server owns one: a restarted server takes
        partitions over shortly after it registers, so a test that starts before that
        would see them move under it."""

        async def balanced() -> bool:
            live = {
                m.server_id()
                for m in self.servers
                if m.alive and isinstance(m, ServerProcessMember | ServerInLoop)
            }
            owners = [(await self.owner(p))[0] for p in range(self.num_partitions)]
            if any(owner not in live for owner in owners):
                return False
            return self.num_partitions < len(live) or live <= set(owners)

        await wait_for(balanced, timeout, "the partitions to be balanced over the servers")

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
        self.retired.add(index)
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

    async def replica_end(self, index: int, partition: int) -> int:
        """The log end (highest transaction id) of one storage node's replica of
        ``partition``, asked with the store session the replica holds."""
        client = await self.storage_client(index)
        try:
            try:
                return await client.max_transaction_id(0, partition)
            except SessionFencedError as exc:
                return await client.max_transaction_id(exc.highest_session_id, partition)
        finally:
            await client.close()

    async def replica_missing(self, index: int, partition: int) -> tuple[int, int] | None:
        """The lowest range of one storage node's replica of ``partition`` lost to damage
        (None: none), asked with the store session the replica holds."""
        client = await self.storage_client(index)
        try:
            return await client.missing_range(await _held_session(client, partition), partition)
        finally:
            await client.close()

    async def replica_logs(self, partition: int) -> list[list[Record]]:
        """Every record of each storage node's replica of ``partition``, in the order of
        :attr:`storage` (see :meth:`replica_view`)."""
        return [await self.replica_log(i, partition) for i in range(len(self.storage))]

    async def wait_held(
        self, partition: int, transaction_id: int, timeout: float = TIMEOUT
    ) -> None:
        """Until every storage node's replica of ``partition`` holds ``transaction_id``."""

        async def held() -> bool:
            logs = await self.replica_logs(partition)
            return all(len(log) > transaction_id for log in logs)

        await wait_for(held, timeout, f"every replica of {partition} to hold {transaction_id}")

    async def replica_log(self, index: int, partition: int) -> list[Record]:
        """Every record on one storage node's replica of ``partition`` (see
        :meth:`replica_view`)."""
        return (await self.replica_view(index, partition))[1]

    async def replica_view(self, index: int, partition: int) -> tuple[SessionInfo, list[Record]]:
        """The session info and every record of one storage node's replica of ``partition``.

        Read with the session id the replica itself holds, never a newer one: every
        storage request fences, so a checker's read with the current session id would
        record it on a replica that session has not recovered yet, and the
        recovery would then take a replica restored from an old backup for one
        that took part in the session (the detection compares session ids).

        Read again (until TIMEOUT) when a newer session reached the replica meanwhile,
        and when the node restarted or did not answer during the read: a restarted
        listener answers the previous connection "unknown connection"."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TIMEOUT
        failure = "no attempt"
        while loop.time() < deadline:
            try:
                client = await self.storage_client(index)
            except (StorageError, TransportError, TimeoutError, OSError) as exc:
                failure = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.2)
                continue
            try:
                session = await _held_session(client, partition)
                info = await client.last_session_info(session, partition)
                records: list[Record] = []
                while True:
                    batch = await client.records(session, partition, len(records), 1000)
                    if not batch:
                        return info, records
                    records.extend(batch)
            except (StorageError, TransportError, TimeoutError, OSError) as exc:
                # fenced by a newer session, or the node restarted or did not answer
                failure = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.2)
            finally:
                await client.close()
        raise AssertionError(
            f"could not read replica {index} of partition {partition} within {TIMEOUT:.0f}s "
            f"(last: {failure})"
        )


async def _held_session(client: StorageClient, partition: int) -> int:
    """The store session id a replica holds (asked with session 0, which every replica
    past its first session refuses, naming its own; 0 when it holds none above 0)."""
    try:
        await client.max_transaction_id(0, partition)
    except SessionFencedError as exc:
        return exc.highest_session_id
    return 0


async def start_all(members: Sequence[Member]) -> None:
    """Start ``members`` concurrently; every start is awaited even when one fails."""
    await gather_all(m.start() for m in members)


async def gather_all(work: Iterable[Awaitable[None]]) -> None:
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
